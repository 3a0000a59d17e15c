"""The troubleshooting matrix (docs/troubleshooting.md): every mistake gets one line, a non-zero
exit and no loss of what is already on disk. Each case runs the script's main() in this process (run_here), or its
parser for a flag's value; test_an_error_is_one_line_in_a_launch launches each entry point as a user does and checks
the line and the exit status there. Where several processes, the launcher, wandb's service or a memory limit is the
point, the case launches (the slow tier)."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib
import importlib.util
import io
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from shared.errors import PrintableLines, RecipeError

from conftest import (
    ROOT,
    assert_bitwise_equal,
    hooked,
    launch,
    ok,
    printed_once_and_last,
    read_json,
    read_jsonl,
    run_here,
    weights,
)
from tiny_data import CLASSES, cifar_binary_dataset, image_splits, imagefolder_dataset, text_dataset

RECIPES = ["cifar_cnn", "resnet18_fmnist", "deep_mlp_ckpt"]
SHORT = ("--batch_size", "8", "--max_steps", "4", "--log_every", "1", "--tracker", "none")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return cifar_binary_dataset(tmp_path_factory.mktemp("err") / "data", sizes={"train": 64, "test": 20})


def one_line(result, *needles, status=1) -> str:
    """`python recipes/...`: exactly one line on stderr, no traceback, the expected exit status."""
    assert result.returncode == status, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def snapshot(folder: Path) -> dict:
    """Hash of every file under `folder`: what must survive a failed run."""
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ each entry point, launched
@pytest.mark.parametrize("entry, args, needle", [
    ("cifar_cnn", ["--data", "someone/not-cached"], "the Hugging Face hub could not provide it"),
    ("resnet18_fmnist", ["--data", "missing_folder"], "--data missing_folder: no such folder"),
    ("deep_mlp_ckpt", ["--data", "./data/missing"], "--data ./data/missing: no such folder"),
    # (the pretrained file is read first: without one cached here, it is what the line names; --weights none)
    ("finetune", ["--data", "my_photos", "--weights", "none"], "--data my_photos: no such folder"),
    ("predict", ["--weights", "nothing.safetensors", "--recipe", "cifar_cnn", "--evaluate"], "nothing.safetensors"),
])
def test_an_error_is_one_line_in_a_launch(env, tmp_path, entry, args, needle):
    """`accelerate launch` (-q, as the README gives it) or `python` of each entry point, as a user runs it: one line,
    exit status 1. (HF_HUB_OFFLINE answers like a machine without network, minus 20 s of retries.)"""
    offline = dict(env, HF_HUB_OFFLINE="1")
    if entry == "predict":
        result = subprocess.run([sys.executable, "recipes/predict.py", *args], cwd=ROOT, env=offline,
                                capture_output=True, text=True, timeout=300)
    else:
        result = launch(offline, entry, *args, "--tracker", "none", "--output_dir", str(tmp_path / "run"),
                        config="cpu", launcher_args=("-q",))
    one_line(result, needle)
    assert not (tmp_path / "run").exists()  # a start that fails leaves no folder


def fake_torchvision(folder: Path, version: str = "0.28.0+cu130") -> Path:
    """A torchvision whose compiled operators do not load with this torch, as a CUDA build's do not beside a CPU
    torch: `import torchvision` fails as theirs does."""
    package = folder / "torchvision"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    (package / "version.py").write_text(f"__version__ = '{version}'\ngit_version = '0'\n")
    (package / "_C.so").write_bytes(b"not a library of this torch")
    return package


def test_a_torchvision_built_for_another_torch_is_one_line_naming_the_pair(tmp_path, monkeypatch):
    """Said up front by check_launch (torchvision_mismatch), and where an import of it failed (finetune.py's, at its
    start) by failures.explain: only for an error raised inside torchvision, and only where its operators do not
    load."""
    from shared.failures import explain
    from shared.reinstall import torchvision_mismatch

    assert torchvision_mismatch() is None  # the pair installed here: its operators load
    package = fake_torchvision(tmp_path)
    monkeypatch.setitem(sys.modules, "torchvision", type(sys)("torchvision"))  # what find_spec reads first
    sys.modules["torchvision"].__spec__ = importlib.util.spec_from_file_location("torchvision", package / "__init__.py")
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    line = ("torchvision 0.28.0+cu130 was not built for torch 2.13.0+cpu: its compiled operators (_C.so) do not load; "
            "install the torchvision built for it: pip uninstall -y torchvision && pip install torch==2.13.0 "
            "torchvision --index-url https://download.pytorch.org/whl/cpu")
    assert torchvision_mismatch() == line
    init = package / "__init__.py"
    with pytest.raises(RuntimeError) as failed:  # as `import torchvision` fails: inside the package
        exec(compile(init.read_text(), str(init), "exec"), {})
    assert explain(failed.value) == line
    assert explain(RuntimeError("operator torchvision::nms does not exist")) is None  # raised elsewhere: code's
    monkeypatch.setattr(torch, "__version__", "2.13.0")  # PyPI's build: no index of its own to name
    assert torchvision_mismatch().endswith("for torch 2.13.0: its compiled operators (_C.so) do not load; install the "
                                           "torchvision built for it: pip uninstall -y torchvision && pip install "
                                           "torch==2.13.0 torchvision")


@pytest.mark.slow  # launched: the import it stops fails in the process
@pytest.mark.parametrize("recipe", ["finetune", "cifar_cnn", "predict"])
def test_a_launch_with_a_torchvision_built_for_another_torch_is_one_line(env, tmp_path, recipe):
    """finetune.py imports torchvision at its start, the others when a decode resizes or a recipe is loaded: the line
    comes before either, and no run folder is made."""
    fake_torchvision(tmp_path / "site")
    variables = dict(env, PYTHONPATH=str(tmp_path / "site"), HF_HUB_OFFLINE="1")
    if recipe == "predict":
        args = ["--weights", str(tmp_path / "model.safetensors"), "--images", str(tmp_path), "--recipe", "cifar_cnn"]
        result = subprocess.run([sys.executable, "recipes/predict.py", *args], cwd=ROOT, env=variables,
                                capture_output=True, text=True, timeout=300)
    else:
        result = launch(variables, recipe, "--synthetic", "--tracker", "none", "--output_dir", str(tmp_path / "run"),
                        config="cpu", launcher_args=("-q",))
    one_line(result, "torchvision 0.28.0+cu130 was not built for torch", "its compiled operators (_C.so) do not load")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("recipe", [*RECIPES, "finetune", "predict"])
def test_a_mistyped_flag_is_named_with_the_flag_it_was_meant_to_be(capsys, recipe):
    flag, meant = ("--weigths", "--weights") if recipe == "predict" else ("--max_step", "--max_steps")
    assert f"unrecognized arguments: {flag} 5: did you mean {meant}? (see --help)" in flag_error(capsys, recipe, flag,
                                                                                                 "5")
    assert flag_error(capsys, recipe, "--bogus", "1").endswith("unrecognized arguments: --bogus 1 (see --help)")
    if recipe == "finetune":  # renamed: a fraction of --lr, not a rate
        assert "did you mean --backbone_lr_scale?" in flag_error(capsys, recipe, "--backbone_lr", "1e-4")
    # A value without its flag (`predict.py --weights RUN photos/`): said so, or the flag it was meant for
    assert flag_error(capsys, recipe, "photos/").endswith(
        "unrecognized arguments: photos/: a value follows its flag, as in --name VALUE (see --help)")
    assert flag_error(capsys, recipe, "data").endswith("unrecognized arguments: data: did you mean --data? "
                                                       "(see --help)")


# The scripts of benchmarks/ (on sys.path: conftest.py) and tools/, not the modules they import
SCRIPTS = sorted(f"tools.{path.stem}" if path.parent.name == "tools" else path.stem
                 for path in [*(ROOT / "tools").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
                 if 'if __name__ == "__main__":' in path.read_text())


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_benchmark_and_tool_refuses_a_flag_it_does_not_know(monkeypatch, capsys, name):
    """Before it measures or writes anything: step_cost.py (parse_known_args, for the recipe's flags after --worker)
    and cpu_fallback.py (no parser) ran their whole measurement with a mistyped flag left out."""
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--nonsense"])
    with pytest.raises(SystemExit) as stopped:
        importlib.import_module(name).main()
    assert stopped.value.code == 2 and "error: " in capsys.readouterr().err


def flag_error(capsys, recipe: str, *args: str) -> str:
    """The line `python recipes/<recipe>.py args` prints for a bad flag, from parse_config of the recipe's Config in
    this process (its Config.parse; deep_mlp_sweep calls it directly): the same parser, which test_unknown_flag runs
    in a process of each recipe (one line, exit status 2)."""
    from shared.config import parse_config

    with pytest.raises(SystemExit) as stopped:
        parse_config(importlib.import_module(f"recipes.{recipe}").Config, list(args))
    lines = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("args, needle", [
    (("--batch_size", "0"), "--batch_size must be > 0, got 0"),
    (("--lr", "-0.1"), "--lr must be > 0, got -0.1"),
    (("--grad_accum", "0"), "--grad_accum must be > 0, got 0"),
    (("--epochs", "many"), "argument --epochs: invalid int value: 'many'"),
    (("--tracker", "mlflow"), "argument --tracker: invalid choice: 'mlflow'"),
    (("--max_grad_norm", "0"), "--max_grad_norm must be > 0, got 0.0"),
    (("--ema", "1"), "--ema is the average's decay per step, between 0 and 1 (e.g. 0.99); got 1.0"),
    (("--momentum", "9"), "--momentum must be below 1 (e.g. 0.9), got 9.0"),  # 0.9 mistyped: it said "lower --lr"
    # 5e-4 mistyped: a NaN loss at step 10, whose line said "lower --lr", which diverged as well
    (("--weight_decay", "5e4"), "--weight_decay must be below 1 (e.g. 0.0005), got 50000.0"),
    (("--erase", "1.5"), "--erase is a share of the images, from 0 to 1, got 1.5"),
])
def test_flag_of_the_wrong_type_or_out_of_range(capsys, args, needle):
    assert needle in flag_error(capsys, "resnet18_fmnist", *args)


@pytest.mark.parametrize("recipe, args, needle", [
    ("predict", ("--weights", "w.safetensors"), "pass --weights PATH and either --images FOLDER or --evaluate"),
    ("predict", ("--weights", "w.safetensors", "--images", "photos", "--evaluate"),
     "pass --weights PATH and either --images FOLDER or --evaluate"),
    ("predict", ("--weights", "w.safetensors", "--evaluate", "--top_k", "0"),
     "--top_k and --batch_size must be > 0, got 0 and 256"),
    ("finetune", ("--weights", "IMAGENET1K_V2"), "--weights IMAGENET1K_V2: resnet18 has IMAGENET1K_V1, DEFAULT or "
                                                 "none"),  # it said DEFAULT twice
    ("deep_mlp_ckpt", ("--dropout", "1"), "--dropout must be in [0, 1), got 1.0"),
    ("deep_mlp_sweep", ("--batch", "0"), "--batch and --repeats must be > 0, got 0 and 3"),
    ("deep_mlp_sweep", ("--segments", "2,73"), "--segments takes comma-separated counts from 1 to 72, got '2,73'"),
    ("deep_mlp_sweep", ("--seed", "-1"), "--seed must be from 0 to 2**32 - 1, got -1"),  # NumPy's traceback
], ids=["predict with neither", "predict with both", "predict --top_k", "finetune --weights", "mlp --dropout",
        "sweep --batch", "sweep --segments", "sweep --seed"])
def test_a_flag_value_the_other_scripts_cannot_use_is_one_line(capsys, recipe, args, needle):
    assert flag_error(capsys, recipe, *args).endswith(f"error: {needle} (see --help)")


@pytest.mark.parametrize("recipe, flag", [("cifar_cnn", "--data"), ("cifar_cnn", "--resume"),
                                          ("finetune", "--output_dir"), ("predict", "--data")])
def test_an_empty_value_is_refused_not_read_as_the_working_folder(capsys, recipe, flag):
    """`--data "$DATA"` with DATA unset: an empty --data read the working folder as the dataset (every image below
    it), and an empty --resume started a new run; predict.py's --images, empty by default, stays its own check."""
    args = ("--weights", "w.safetensors", "--evaluate") if recipe == "predict" else ()
    assert flag_error(capsys, recipe, *args, flag, "").endswith(
        f"error: {flag} is empty (an unset shell variable?): pass a value, or leave the flag out (see --help)")
    assert importlib.import_module("recipes.predict").Config.parse(["--weights", "w", "--evaluate"]).images == ""


@pytest.mark.parametrize("flag", [("--output", "metrics.json"), ("--overwrite",)])
def test_predict_evaluate_refuses_the_flags_of_images_instead_of_ignoring_them(capsys, flag):
    """--output and --overwrite name the CSV of --images: with --evaluate, which prints its JSON line and writes no
    file, they were ignored unsaid (`--evaluate --output metrics.json` wrote nothing)."""
    assert flag_error(capsys, "predict", "--weights", "w.safetensors", "--evaluate", *flag).endswith(
        "error: --evaluate prints one JSON line and writes no file: leave out --output and --overwrite (see --help)")


@pytest.mark.parametrize("segments, needle", [("0", "--segments must be > 0, got 0"),
                                              ("73", "--segments must be at most 72, one per layer; got 73")])
def test_segments_out_of_range(capsys, segments, needle):
    assert needle in flag_error(capsys, "deep_mlp_ckpt", "--segments", segments)


def test_the_mlp_refuses_channels_last_instead_of_ignoring_it(capsys):
    assert "--channels_last is a layout for convolutions; this MLP has none: leave it out" in flag_error(
        capsys, "deep_mlp_ckpt", "--channels_last")


def test_fp16_on_a_cpu(data, tmp_path):
    """fp16.yaml sets ACCELERATE_MIXED_PRECISION=fp16, which accelerate takes on a CPU without autocasting there."""
    result = run_here("cifar_cnn", "--data", data, "--output_dir", tmp_path / "run",
                      env={"ACCELERATE_MIXED_PRECISION": "fp16"})
    one_line(result, "error: fp16 mixed precision needs a GPU", "bf16.yaml")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("variable, value", [("USE_FSDP", "true"), ("USE_DEEPSPEED", "true"),
                                             ("DYNAMO_BACKEND", "INDUCTOR")])
def test_an_accelerate_config_the_recipes_do_not_follow_is_one_line(data, tmp_path, variable, value):
    """What accelerate launch sets from a config (`accelerate config`'s default config, used by a launch without
    --config_file): FSDP's plugin ended in a RuntimeError traceback on a CPU, and the recipes' EMA, CUDA graph and
    checkpoints are written for DDP; accelerate's dynamo wrapped the model, and model.safetensors named every weight
    `_orig_mod.<name>`."""
    result = run_here("cifar_cnn", "--data", data, "--output_dir", tmp_path / "run",
                      env={f"ACCELERATE_{variable}": value})
    one_line(result, f"error: the accelerate config sets ACCELERATE_{variable}={value}: these recipes train with DDP "
             "and compile with --compile", "--config_file accelerate_configs/2gpu.yaml")
    assert not (tmp_path / "run").exists()


def test_accelerate_configs_set_what_the_recipes_follow(data, tmp_path):
    """As accelerate launch sets them from the project's own configs: no dynamo, no FSDP."""
    ok(run_here("cifar_cnn", "--data", data, "--output_dir", tmp_path / "run", "--max_steps", "1", "--batch_size",
                "4", "--tracker", "none", env={"ACCELERATE_DYNAMO_BACKEND": "NO", "ACCELERATE_USE_FSDP": "false"}))


@pytest.mark.slow  # two processes
def test_more_processes_than_gpus_on_a_cpu_machine(env, data, tmp_path):
    # 2gpu.yaml without GPUs and without ACCELERATE_USE_CPU: accelerate 1.x would start two runs.
    result = launch(env, "cifar_cnn", "--data", str(data), "--output_dir", str(tmp_path / "run"), config="2gpu")
    assert result.returncode != 0
    printed_once_and_last(result.stderr, "error: 2 processes were launched but no GPUs were found")
    assert "ACCELERATE_USE_CPU=true" in result.stderr and 'recipes/cifar_cnn.py", line' not in result.stderr
    assert not (tmp_path / "run").exists()


def test_more_processes_per_machine_than_gpus(monkeypatch):
    from shared.errors import RecipeError
    from shared.launch import check_launch

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(RecipeError, match="starts 8 processes on this machine but it has 2 GPU"):
        check_launch()


@pytest.mark.parametrize("under_torchrun", [False, True])
def test_a_signal_before_the_first_step_ends_the_process_in_one_line(monkeypatch, capfd, under_torchrun):
    """From the launch's check to the run's own stop (StopOnSignals), a SIGTERM or SIGHUP ended the process at once,
    with no line, leaving the run folder its start made (tests/test_stops.py runs it). Now it exits, with a line, but
    under torchrun, which stops every process with a SIGTERM when one fails and names that failure in its report: a
    line of theirs would tell the user to run the same command again. The first signal decides: the others are
    ignored from then on, as the exit's cleanup runs."""
    import signal

    from shared.launch import STOPS, check_launch, stopped_before_the_first_step

    before = {signum: signal.getsignal(signum) for signum in STOPS}
    check_launch()
    for signum in STOPS:  # one ignored from the start (nohup, a shell's `&`) stays ignored
        assert signal.getsignal(signum) == (
            signal.SIG_IGN if before[signum] == signal.SIG_IGN else stopped_before_the_first_step), signum
    if under_torchrun:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "a stand-in for torchrun's")
    capfd.readouterr()
    with pytest.raises(SystemExit) as stop:
        stopped_before_the_first_step(signal.SIGTERM, None)
    assert stop.value.code == 143 and capfd.readouterr().err == ("" if under_torchrun else (
        "stopped by SIGTERM before there was anything to save (a training run saves a checkpoint from its first step "
        "on, predict.py its CSV once every image is read): run the same command again\n"))
    assert [signal.getsignal(signum) for signum in STOPS] == [signal.SIG_IGN] * 3
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C's line is one_line_errors' (tests/test_stops.py)
        stopped_before_the_first_step(signal.SIGINT, None)
    assert [signal.getsignal(signum) for signum in STOPS] == [signal.SIG_IGN] * 3


@pytest.mark.slow  # a process group of 2 processes
def test_the_process_group_waits_30_minutes_on_every_backend(tmp_path):
    """torch's NCCL default is 10 minutes: a machine's first decode that took longer (one process decodes, the others
    wait in a barrier) ended a multi-GPU run in NCCL's watchdog timeout. check_launch starts the group with gloo's 30
    minutes on every backend, as transformers' Trainer and Ray Train start theirs. Shown with gloo, whose default is 30
    minutes too: the group takes check_launch's value, here set to 7 minutes."""
    from datetime import timedelta

    from shared import launch

    assert launch.PROCESS_GROUP_TIMEOUT == timedelta(minutes=30)
    script = tmp_path / "group.py"
    script.write_text("import sys\n"
                      f"sys.path.insert(0, {str(ROOT)!r})\n"
                      "from datetime import timedelta\n"
                      "import torch\n"
                      "from shared import launch\n"
                      "launch.PROCESS_GROUP_TIMEOUT = timedelta(minutes=7)\n"
                      "launch.check_launch()\n"
                      "group = torch.distributed.distributed_c10d._get_default_group()  # private: this test only\n"
                      "print(group._get_backend(torch.device('cpu')).options._timeout, flush=True)\n")
    environment = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(script)], capture_output=True, text=True, env=environment, timeout=300)
    # each process's line (the two may interleave)
    assert result.returncode == 0 and result.stdout.count("0:07:00") == 2, result.stdout + result.stderr


def test_accelerate_launch_cpu_of_several_processes_says_it_starts_one(monkeypatch, capsys):
    """`accelerate launch --cpu --num_processes 2`, `--cpu` with 2gpu.yaml, or `--num_processes 2` with a config of one
    process (cpu.yaml, bf16.yaml: distributed_type NO) starts one process, unsaid but for "1 process(es)" in the run's
    first line: accelerate's simple launcher, which starts one and sets MASTER_ADDR for an mpirun. torchrun (a config
    of several) sets TORCHELASTIC_RUN_ID, and its one process is what was asked."""
    from shared import launch

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    cases = ((["accelerate", "launch", "--cpu", "--num_processes", "2"], True, False, True),
             (["accelerate", "launch", "--cpu"], False, False, False),  # one process, as asked
             (["accelerate", "launch", "--num_processes", "2", "--config_file", "cpu.yaml"], True, False, True),
             (["accelerate", "launch", "--num_processes", "1", "--multi_gpu"], True, True, False),  # torchrun's one
             (None, True, False, False))  # not started by accelerate launch: a MASTER_ADDR left in the shell
    for command, master, torchrun, warned in cases:
        monkeypatch.setattr(launch, "launcher_command", lambda command=command: command)
        if master:
            monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        if torchrun:
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
        launch.check_launch()
        monkeypatch.delenv("MASTER_ADDR", raising=False)
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        printed = capsys.readouterr().out
        assert ("warning: accelerate launch started one process, whatever --num_processes asks: --cpu, or a config "
                "of one process (cpu.yaml, 1gpu.yaml, bf16.yaml), takes its launcher of one" in printed) == warned, (
            command, printed)


def test_a_python_that_cannot_keep_torchs_compiled_code_is_told_how(monkeypatch, capsys, tmp_path):
    """The GPU image sets PYTHONDONTWRITEBYTECODE and holds no .pyc of torch, so each process compiled torch's Python
    again, unsaid: the README's GPU line took 22-25 s from the command on one H200, 13-15 s once they were kept.
    sys.pycache_prefix points Python's compiled copies at an empty folder here, as where none was kept."""
    import os

    from shared.launch import check_launch

    torch_folder, access = Path(torch.__file__).parent, os.access
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path))
    cases = ((True, True, "to keep it, unset PYTHONDONTWRITEBYTECODE\n"),
             (True, False, "to keep it, unset PYTHONDONTWRITEBYTECODE and export PYTHONPYCACHEPREFIX=~/.cache/pycache"),
             (False, False, "to keep it, export PYTHONPYCACHEPREFIX=~/.cache/pycache\n"),
             (False, True, None))  # Python may write the copy: nothing known to say
    for dont_write, writable, said in cases:
        monkeypatch.setattr(sys, "dont_write_bytecode", dont_write)
        monkeypatch.setattr(os, "access", lambda path, mode, w=writable: w if Path(path) == torch_folder
                            else access(path, mode))
        check_launch()
        printed = capsys.readouterr().out
        assert (said in printed if said else "compiles torch's Python code again" not in printed), (dont_write, printed)
    cached = Path(importlib.util.cache_from_source(torch.__file__))  # under tmp_path: a copy is kept
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"")
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    check_launch()
    assert "compiles torch's Python code again" not in capsys.readouterr().out


# ------------------------------------------------------------------ data
def test_local_data_path_missing(env, tmp_path):
    one_line(run_here("cifar_cnn", "--data", str(tmp_path / "nope"), "--tracker", "none"),
             "no such folder", "--synthetic")


def test_synthetic_with_a_data_folder_is_one_line_not_a_run_on_generated_images(env, data, tmp_path):
    """The README's first run (--synthetic) given your --data folder trained on generated images all the same, the
    folder unused, said only by the run's first line."""
    result = run_here("cifar_cnn", "--synthetic", "--data", str(data), "--output_dir", str(tmp_path / "run"), *SHORT)
    one_line(result, f"error: --synthetic generates its images, so --data {data}, found on this machine, would be "
             "left unused: leave out --synthetic to train on it")
    assert not any((tmp_path / "run").iterdir())  # nothing trained or written (a process's exit removes the folder)


@pytest.mark.parametrize("name", ["train.parquet", "photos.zip"])
def test_a_file_passed_as_data_is_named_as_a_file(tmp_path, name):
    """--data train.parquet, one file of a dataset instead of its folder, said "cannot list the folders under
    train.parquet (Not a directory): move the files nearer the root", which is not the cause. A download's archive
    (photos.zip) is named as one to extract."""
    from shared.data import find_source

    file = tmp_path / name
    file.write_bytes(b"PAR1")
    with pytest.raises(RecipeError, match=rf"--data \S+/{re.escape(name)} is a file, not a folder \(an archive\? "
                                          r"extract it\): pass the folder of the dataset's files"):
        find_source(str(file))


def test_a_bare_name_that_is_no_folder_is_one_line_not_a_hub_lookup(env):
    # A hub lookup of a local name would fall back to a stale cache of another folder with that name when offline.
    result = run_here("cifar_cnn", "--data", "my_photos", "--tracker", "none")
    one_line(result, f"--data my_photos: no such folder (looked for {ROOT / 'my_photos'})", "hub ids are owner/name")
    assert "hub" not in result.stdout


def test_dataset_without_an_image_column(env, tmp_path):
    one_line(run_here("cifar_cnn", "--data", str(text_dataset(tmp_path / "text")), "--tracker", "none"),
             "no image column", "text (Value)")


def test_dataset_without_a_label_column(env, tmp_path):
    splits = image_splits().remove_columns("label")
    splits.save_to_disk(str(tmp_path / "unlabelled"))
    one_line(run_here("cifar_cnn", "--data", str(tmp_path / "unlabelled"), "--tracker", "none"),
             "no label column")
    # A competition's layout: train/<class>/ and a test/ of unlabelled images. Images at two depths: datasets drops
    # every label, and the line said to put each class in a folder, as train/ already was.
    photos = imagefolder_dataset(tmp_path / "photos", sizes={"train": 8, "test": 4})
    for image in list((photos / "test").glob("*/*.png")):
        image.rename(photos / "test" / f"{image.parent.name}-{image.name}")
    one_line(run_here("cifar_cnn", "--data", str(photos), "--tracker", "none"), "no label column",
             "or a split of unlabelled images, as a competition's test/, gives none: move it out")
    # Class names as strings (a table made with pandas): the line names the call that makes them a ClassLabel
    named = image_splits().cast_column("label", datasets.Value("string"))
    named.save_to_disk(str(tmp_path / "named"))
    one_line(run_here("cifar_cnn", "--data", str(tmp_path / "named"), "--tracker", "none"), "label (Value)",
             "dataset.cast_column('label', datasets.ClassLabel(names=[")
    # What the line says, done (not datasets' class_encode_column: it numbers each split's own names)
    named.cast_column("label", datasets.ClassLabel(names=CLASSES[:10])).save_to_disk(str(tmp_path / "encoded"))
    ok(run_here("cifar_cnn", "--data", str(tmp_path / "encoded"), "--max_steps", "2", "--batch_size", "4",
                "--tracker", "none", "--output_dir", str(tmp_path / "run")))


def test_images_with_16_bit_pixels(env, tmp_path):
    # Other sizes and colour modes are converted (tests/test_real_images.py); 16-bit pixels are not:
    # squeezing them into 8 bits would clip them or guess a range.
    pixels = (np.arange(32 * 32, dtype=np.uint16).reshape(32, 32) * 60)
    splits = image_splits()
    features = datasets.Features({"img": datasets.Image(), "label": splits["train"].features["label"]})
    for name, split in splits.items():
        images = [Image.fromarray(pixels)] * len(split)
        splits[name] = datasets.Dataset.from_dict({"img": images, "label": split["label"]}, features=features)
    splits.save_to_disk(str(tmp_path / "d"))
    one_line(run_here("cifar_cnn", "--data", str(tmp_path / "d"), "--tracker", "none"),
             "has I;16 pixels", "scale the images to 8-bit L or RGB")


def test_labels_outside_the_class_range(env, tmp_path):
    splits = image_splits()
    splits["train"] = splits["train"].map(lambda example, i: {"label": -1 if i == 5 else example["label"]},
                                          with_indices=True)
    splits.save_to_disk(str(tmp_path / "d"))
    one_line(run_here("cifar_cnn", "--data", str(tmp_path / "d"), "--tracker", "none"),
             "labels outside 0..9", "(e.g. -1)")


@pytest.mark.parametrize("labels, needle", [
    ([0, 1, None, 1], "'train' image 2 has no label"),  # ended in a TypeError's traceback, counting the classes
    ([-1, -1, -1, -1], "its 'label' column holds no label of 0 or more (e.g. -1): number the classes from 0"),
], ids=["a missing label", "every label -1"])
def test_an_integer_label_column_with_a_missing_or_negative_label_is_one_line(env, tmp_path, labels, needle):
    features = datasets.Features({"img": datasets.Image(), "label": datasets.Value("int64")})
    image = Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8))
    datasets.DatasetDict(
        train=datasets.Dataset.from_dict({"img": [image] * 4, "label": labels}, features=features),
        test=datasets.Dataset.from_dict({"img": [image] * 2, "label": [0, 1]}, features=features),
    ).save_to_disk(str(tmp_path / "d"))
    one_line(run_here("cifar_cnn", "--data", str(tmp_path / "d"), "--tracker", "none"), needle)


def pathlib_raises_for_a_name_too_long() -> bool:
    try:
        Path("x" * 300).exists()
    except OSError:
        return True
    return False


@pytest.mark.parametrize("script, args, without_an_error", [
    ("cifar_cnn", ("--data", "x" * 5000), ("error: --data xxxxx", ": no such folder (looked for ")),
    ("cifar_cnn", ("--synthetic", "--output_dir", "x" * 300), ("error: cannot write to xxxxx", "(File name too long)")),
    ("cifar_cnn", ("--synthetic", "--init_from", "x" * 300), ("error: --init_from xxxxx", ": no such file or folder")),
    ("cifar_cnn", ("--synthetic", "--resume", "x" * 300), ("error: --resume xxxxx", ": no such folder")),
    ("predict", ("--weights", "x" * 300, "--images", "."), ("error: --weights xxxxx", ": no such file or folder"))],
    ids=["--data", "--output_dir", "--init_from", "--resume", "predict --weights"])
def test_a_path_too_long_for_the_system_is_one_line(tmp_path, script, args, without_an_error):
    """A name over 255 bytes in a path a flag gives: os.stat's OSError (File name too long) was a traceback. From
    Python 3.14, pathlib's exists() and is_dir() answer False for it instead of raising: the flag's own check then says
    what it found, in one line too (`without_an_error`)."""
    untracked = () if script == "predict" else ("--tracker", "none")
    needles = ("error: a path is too long for this system (File name too long: xxxxx", "...): pass a shorter one")
    one_line(run_here(script, *args, *untracked, cwd=tmp_path),
             *(needles if pathlib_raises_for_a_name_too_long() else without_an_error))
    assert not [path for path in tmp_path.rglob("*") if not path.is_dir()]  # no file written (runs/ is made first)


def test_a_hub_id_that_huggingface_hub_refuses_is_one_line_with_its_reason(tmp_path):
    """'foo/bar.' has the form of a hub id, which huggingface_hub refuses before any lookup (HFValidationError, a
    ValueError): it was a traceback."""
    import huggingface_hub

    if huggingface_hub.constants.HF_HUB_OFFLINE:  # offline, datasets looks nothing up, and refuses no id
        pytest.skip("HF_HUB_OFFLINE is set: the id is never validated")
    one_line(run_here("cifar_cnn", "--data", "foo/bar.", "--tracker", "none", cwd=tmp_path),
             "--data foo/bar.: not a local folder, and the Hugging Face hub could not provide it (HFValidationError: "
             "Repo id must use alphanumeric chars")


def test_empty_split(env, tmp_path):
    # datasets itself refuses to load an empty split from parquet; its reason is passed on.
    folder = tmp_path / "d"
    folder.mkdir()
    splits = image_splits()
    splits["train"].to_parquet(str(folder / "train.parquet"))
    splits["test"].select([]).to_parquet(str(folder / "test.parquet"))
    one_line(run_here("cifar_cnn", "--data", str(folder), "--tracker", "none"),
             "could not read a dataset", '"test" corresponds to no data', "with examples in every split")


def test_empty_split_that_loads():
    # A dataset that does load with an empty split (from the hub, or built in memory).
    from shared.data import pick_splits
    from shared.errors import RecipeError

    splits = image_splits()
    splits["test"] = splits["test"].select([])
    with pytest.raises(RecipeError, match="the 'test' split of hub/x is empty"):
        pick_splits(splits, "hub/x")


def test_a_dataset_without_a_train_split_names_the_splits_it_has(env, tmp_path):
    splits = image_splits()
    datasets.DatasetDict(training=splits["train"], test=splits["test"]).save_to_disk(str(tmp_path / "d"))
    one_line(run_here("cifar_cnn", "--data", str(tmp_path / "d"), "--tracker", "none"),
             f"{tmp_path / 'd'} has no 'train' split (splits: training, test): name the training split 'train'")


# ------------------------------------------------------------------ outputs and checkpoints
def test_output_dir_not_writable(env, data, tmp_path):
    """A path through a file, or a file itself: its "(File exists)" read as a run folder already there. The default
    folder too, through a file named runs. The line says how a run in a folder that cannot be written (a read-only
    filesystem) continues: from its checkpoint, into a writable --output_dir."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    for output_dir, reason in ((blocker / "run", "Not a directory"), (blocker, "File exists")):
        one_line(run_here("cifar_cnn", "--data", str(data), "--output_dir", str(output_dir), *SHORT),
                 f"cannot write to {output_dir} ({reason}): pass --output_dir a writable folder, not a file or a "
                 "path inside one (a run there: --resume its newest checkpoint)")
    assert blocker.read_text() == "not a folder"
    (tmp_path / "runs").write_text("mine")  # without --output_dir: runs/<recipe>-<time>, through a file
    one_line(run_here("cifar_cnn", "--data", str(data), *SHORT, cwd=tmp_path), "cannot write to runs/cifar_cnn-",
             "(Not a directory): pass --output_dir a writable folder")
    assert (tmp_path / "runs").read_text() == "mine"


def test_a_run_on_a_read_only_filesystem_continues_from_its_checkpoint_into_a_writable_folder(env, data, tmp_path):
    """--resume latest of a run folder on a read-only filesystem (a snapshot, an archive mounted) said "pass
    --output_dir a writable folder", which --resume latest cannot take, and not what continues the run: its checkpoint
    given to --resume, with a new --output_dir. The line says so, and the run continues so."""
    run_here("cifar_cnn", "--data", str(data), "--output_dir", str(tmp_path / "source" / "run"), *SHORT)
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    with mounted(read_only, "--bind", str(tmp_path / "source")):
        # read-only by a remount: util-linux before 2.27 left a bind mount given ro writable
        subprocess.run(["mount", "-o", "remount,bind,ro", str(read_only)], check=True)
        run = read_only / "run"
        one_line(run_here("cifar_cnn", "--output_dir", str(run), "--resume", "latest", "--max_steps", "6"),
                 f"cannot write to {run} (Read-only file system): pass --output_dir a writable folder, not a file or "
                 "a path inside one (a run there: --resume its newest checkpoint)")
        continued = tmp_path / "continued"
        result = run_here("cifar_cnn", "--resume", str(run / "checkpoints" / "step_4"), "--output_dir",
                          str(continued), "--max_steps", "6")
        assert result.returncode == 0, result.stderr[-3000:]
        assert read_json(continued / "summary.json")["steps"] == 6


@contextlib.contextmanager
def mounted(where: Path, *how: str):
    """`mount *how where` for the block, unmounted after it, failed or not; skipped where no mount can be made here
    (root can)."""
    mount = subprocess.run(["mount", *how, str(where)], capture_output=True, text=True)
    if mount.returncode:
        pytest.skip(f"cannot mount {how[-1]} here (root can): {mount.stderr.strip()}")
    try:
        yield where
    finally:
        # A test's weights (safetensors' load_file maps the file) may be garbage that the collector has not freed yet:
        # a mapping of model.safetensors left the tmpfs busy, its umount refused (Python 3.13.0, at every run)
        gc.collect()
        subprocess.run(["umount", str(where)], check=True)


@pytest.fixture(scope="module")
def finished(env, data, tmp_path_factory):
    run = tmp_path_factory.mktemp("finished") / "run"
    ok(run_here("cifar_cnn", "--data", data, "--output_dir", run, *SHORT, "--checkpoint_every", "2"))
    return run


@pytest.mark.parametrize("mistake, needle", [
    (("--data", "no_such_folder"), "--data no_such_folder: no such folder"),
    (("--batch_size", "4096"), "training images make no full step of 4096"),  # found after the data is decoded
], ids=["data", "batch"])
def test_overwrite_with_a_mistake_leaves_the_run_it_would_replace(env, data, finished, tmp_path, mistake, needle):
    """--overwrite deleted the run's files as the run folder was opened, before the data and the flags were checked:
    a mistyped --data then left neither the old run nor a new one. A good one deletes predict.py's predictions of the
    replaced weights (beside the new ones they read as theirs), and no file of yours with such a name."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    (run / "predictions-photos.csv").write_text("path,class,confidence,top_3\r\na.png,cat,0.9,cat 0.9\r\n")
    (run / "predictions-mine.csv").write_text("my notes\n")
    before = snapshot(run)
    one_line(run_here("cifar_cnn", "--data", str(data), "--output_dir", str(run), *SHORT, "--overwrite", *mistake),
             needle)
    assert snapshot(run) == before
    ok(run_here("cifar_cnn", "--data", str(data), "--output_dir", str(run), *SHORT, "--overwrite"))
    assert snapshot(run) != before and not (run / "checkpoints" / "step_2").exists()  # the replaced run's, gone
    assert not (run / "predictions-photos.csv").exists() and (run / "predictions-mine.csv").read_text() == "my notes\n"


def test_output_dir_already_holding_a_run(env, data, finished):
    before = snapshot(finished)
    one_line(run_here("cifar_cnn", "--data", str(data), "--output_dir", str(finished), *SHORT),
             "already holds a run", "--resume latest", "--overwrite")
    assert snapshot(finished) == before


def test_a_run_stopped_after_its_last_checkpoint_is_finished_by_a_resume(env, data, finished, tmp_path):
    """Killed after the checkpoint of its last step, during the final evaluation or while writing its weights: the
    resume evaluates and writes them (it was refused as "already finished", and the run had no weights)."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    for name in ("model.safetensors", "summary.json", "curves.png", "confusion_matrix.png"):
        (run / name).unlink(missing_ok=True)
    args = ("--data", str(data), "--output_dir", str(run), *SHORT, "--resume", "latest")
    result = ok(run_here("cifar_cnn", *args))
    assert "its last step (4), the run stopped before writing its final files (weights, summary, pictures)" in (
        result.stdout)
    assert_bitwise_equal(weights(run), weights(finished))
    assert read_json(run / "summary.json")["eval_acc"] == read_json(finished / "summary.json")["eval_acc"]
    assert [row["step"] for row in read_jsonl(run / "metrics.jsonl") if "eval_acc" in row] == [4]  # logged once
    one_line(run_here("cifar_cnn", *args), "already finished its 4 steps", "raise --max_steps")


def test_an_extended_run_logs_the_evaluation_at_its_checkpoint_once(env, data, tmp_path):
    """The checkpoint falls on an epoch's last step (8 steps of 8 images in 64), before that epoch's evaluation; the
    resumed run evaluates there again, and metrics.jsonl keeps one row of it (it held 8, 8 and 16)."""
    run = tmp_path / "run"
    args = ("--data", str(data), "--output_dir", str(run), *SHORT, "--checkpoint_every", "4")
    ok(run_here("cifar_cnn", *args, "--max_steps", "8"))
    ok(run_here("cifar_cnn", *args, "--max_steps", "16", "--resume", "latest"))
    rows = read_jsonl(run / "metrics.jsonl")
    assert [row["step"] for row in rows if "eval_acc" in row] == [8, 16]
    assert [row["step"] for row in rows if "train_loss" in row] == list(range(1, 17))


def test_corrupt_truncated_checkpoint(env, data, finished, tmp_path):
    broken = tmp_path / "run"
    shutil.copytree(finished, broken)
    optimizer = broken / "checkpoints" / "step_2" / "optimizer.bin"
    optimizer.write_bytes(optimizer.read_bytes()[:500])
    before = snapshot(broken)
    one_line(run_here("cifar_cnn", "--data", str(data), "--output_dir", str(broken), *SHORT,
                    "--resume", str(optimizer.parent)),
             "optimizer.bin' is damaged or holds a pickle that is refused (not an archive torch.save wrote): resume "
             "from another checkpoint")
    assert snapshot(broken) == before


@pytest.mark.parametrize("damaged", ["model.safetensors", "optimizer.bin"])
def test_a_damaged_newest_checkpoint_names_the_one_before_it(env, data, finished, tmp_path, damaged):
    """Emptied, as a crash or a copy cut short leaves a file: the line gives the command's flag for the checkpoint
    before it (the weights file's line said "resume with the recipe and flags that wrote it", the wrong fix)."""
    broken = tmp_path / "run"
    shutil.copytree(finished, broken)
    (broken / "checkpoints" / "step_4" / damaged).write_bytes(b"")
    before = snapshot(broken)
    one_line(run_here("cifar_cnn", "--data", str(data), "--output_dir", str(broken), *SHORT, "--max_steps", "6",
                      "--resume", "latest"),
             f"step_4/{damaged}' is damaged" if damaged == "optimizer.bin" else "step_4 cannot be loaded into this run",
             f": resume from the one before it: --resume {broken / 'checkpoints' / 'step_2'}")
    assert snapshot(broken) == before


def test_a_checkpoint_written_under_the_other_numpy_major_version_resumes(env, data, finished, tmp_path):
    """Its random states name NumPy's array rebuilder as numpy.core.multiarray._reconstruct (NumPy 1.x) or
    numpy._core.multiarray._reconstruct (2.x), and accelerate allowed only this NumPy's: a run moved between machines
    was refused as corrupt (tried both ways, NumPy 2.4.6 and 1.26.4). Rewritten here with the other name, in torch's
    format before 1.6 (one plain pickle, no checksum to mend); the resume ends on the untouched copy's weights."""
    import numpy as np

    reference, moved = tmp_path / "reference", tmp_path / "moved"
    shutil.copytree(finished, reference)
    shutil.copytree(finished, moved)
    states = moved / "checkpoints" / "step_4" / "random_states_0.pkl"
    names = [b"numpy._core.multiarray", b"numpy.core.multiarray"]  # this NumPy's first
    if int(np.__version__.split(".")[0]) < 2:
        names.reverse()
    torch.save(torch.load(states, weights_only=False), states, _use_new_zipfile_serialization=False)
    assert names[0] in states.read_bytes()
    states.write_bytes(states.read_bytes().replace(names[0], names[1]))
    for run in (reference, moved):
        ok(run_here("cifar_cnn", "--data", str(data), "--output_dir", str(run), *SHORT, "--max_steps", "6",
                    "--resume", "latest"))
    assert_bitwise_equal(weights(moved), weights(reference))


def test_checkpoint_from_another_recipe(env, data, finished, tmp_path):
    """Its config.json names the recipe that wrote it; copied without one, its weights do not fit."""
    args = ("--data", str(data), "--output_dir", str(tmp_path / "run"), *SHORT, "--resume")
    checkpoint = finished / "checkpoints" / "step_4"
    one_line(run_here("deep_mlp_ckpt", *args, str(checkpoint)), status=2, *(
        f"{checkpoint / 'config.json'} is a run of cifar_cnn, not of deep_mlp_ckpt: resume it with the recipe",))
    shutil.copytree(checkpoint, tmp_path / "copied" / "step_4", ignore=shutil.ignore_patterns("config.json"))
    one_line(run_here("deep_mlp_ckpt", *args, str(tmp_path / "copied" / "step_4")), "cannot be loaded into this run",
             "Missing key(s) in state_dict")


@pytest.mark.parametrize("flag, cause", [
    (("--no-batch_norm",), "Missing key(s) in state_dict: \"0.bias\""),
    # accelerate's count of the objects registered for its checkpoints: an EMA is one more. The line said "resume from
    # the one before it", which has no EMA either.
    (("--ema", "0.9"), "Number of custom checkpoints in folder "),
], ids=["batch_norm", "ema"])
def test_a_checkpoint_that_does_not_fit_a_flag_changed_with_resume_names_the_flag(env, data, finished, tmp_path, flag,
                                                                                 cause):
    """--no-batch_norm given with --resume: the line was torch's missing and unexpected keys alone, not their cause."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    before = snapshot(run)
    changed = "batch_norm True -> False" if flag[0] == "--no-batch_norm" else "ema None -> 0.9"
    one_line(run_here("cifar_cnn", "--data", str(data), "--output_dir", str(run), *SHORT, *flag,
                      "--resume", str(run / "checkpoints" / "step_2")),
             f"step_2 cannot be loaded into this run (RuntimeError: {cause}",
             f"; changed since it: {changed}): resume with the recipe and flags that wrote it")
    assert snapshot(run) == before


def test_the_flags_a_synthetic_run_did_not_change_are_not_named(env, tmp_path):
    """A --synthetic run records its data as "SYNTHETIC data": the line listed `data 'SYNTHETIC data' ->
    'uoft-cs/cifar10'` too, the default of the --data flag such a run leaves unused, as if the data had changed."""
    run = tmp_path / "run"
    ok(run_here("cifar_cnn", "--synthetic", "--output_dir", run, *SHORT, "--max_steps", "2"))
    line = one_line(run_here("cifar_cnn", "--output_dir", run, "--no-batch_norm", "--resume", "latest"))
    assert line.endswith("; changed since it: batch_norm True -> False): resume with the recipe and flags that wrote "
                         "it, or from another checkpoint"), line


def test_resume_asking_for_fewer_steps_than_done(env, data, finished):
    """The flag to raise is the one that sets the run's length: its --max_steps, which wins over --epochs (a user who
    had raised --epochs was asked to raise --max_steps or --epochs), else --epochs."""
    before = snapshot(finished)
    args = ("--data", str(data), "--output_dir", str(finished), *SHORT, "--resume", "latest")
    one_line(run_here("cifar_cnn", *args, "--max_steps", "3"),
             "step_4 is at step 4, past the 3 steps asked for: raise --max_steps (its 3 wins over --epochs), or resume "
             "from an earlier checkpoint")
    one_line(run_here("cifar_cnn", *args, "--epochs", "50"),
             "already finished its 4 steps: raise --max_steps (its 4 wins over --epochs) to train on")
    assert snapshot(finished) == before


def test_a_finished_run_of_epochs_is_asked_for_more_epochs(env, data, tmp_path):
    run = tmp_path / "run"
    ok(run_here("cifar_cnn", "--data", data, "--output_dir", run, "--batch_size", "32", "--epochs", "1", "--tracker",
                "none"))
    one_line(run_here("cifar_cnn", "--output_dir", run, "--resume", "latest"),
             f"{run} already finished its 2 steps: raise --epochs to train on")


def test_resume_given_the_run_folder_names_the_command_that_continues_it(env, data, finished):
    """The run's folder where a checkpoint is expected, or the folder of its checkpoints (which read as 'not a
    checkpoint folder'): the line gives the flags that continue it; a checkpoint that does not exist: that it does
    not."""
    before = snapshot(finished)
    one_line(run_here("cifar_cnn", "--data", str(data), *SHORT, "--resume", str(finished)),
             f"--resume {finished}: a run folder: continue it with --resume latest --output_dir {finished}")
    one_line(run_here("cifar_cnn", "--data", str(data), *SHORT, "--resume", str(finished / "checkpoints")),
             f"--resume {finished / 'checkpoints'}: its run's checkpoints: continue the run with --resume latest "
             f"--output_dir {finished}")
    # A checkpoint that is not there (a step mistyped, or pruned) was "not a checkpoint folder (expected
    # checkpoints/step_<N> of a run)", though it was named just so
    one_line(run_here("cifar_cnn", "--data", str(data), *SHORT, "--resume", str(finished / "checkpoints" / "step_9")),
             f"--resume {finished / 'checkpoints' / 'step_9'}: no such folder: pass a checkpoint that exists")
    assert snapshot(finished) == before


def test_resume_given_the_folder_of_the_runs_says_to_pass_the_run_s_own(env, data, finished):
    """`--resume latest --output_dir runs`: the line said only 'pass a new or empty --output_dir', where a new one
    holds nothing to continue."""
    one_line(run_here("cifar_cnn", "--data", str(data), *SHORT, "--output_dir", str(finished.parent), "--resume",
                      "latest"), f"--resume latest: no run in {finished.parent}", "pass the run's folder", status=2)
    # and a new run there: the same folder is no place for one
    one_line(run_here("cifar_cnn", "--data", str(data), *SHORT, "--output_dir", str(finished.parent)),
             "holds files but no run of these recipes", "or to continue a run, its own folder (runs/cifar_cnn-<time>)")


def test_a_start_killed_before_its_config_json_is_started_again_by_the_same_command(env, data, tmp_path):
    """A kill -9 in the second between wandb's start and config.json left the folder holding only wandb/; the same
    command then refused it as "holds files but no run of these recipes". Now it starts there, and wandb/ is kept."""
    run = tmp_path / "run"
    left = run / "wandb" / "offline-run-20261204_183734-54c9d136" / "logs" / "debug.log"  # as the kill left it
    left.parent.mkdir(parents=True)
    left.write_text("wandb's log\n")
    ok(run_here("cifar_cnn", "--data", str(data), *SHORT, "--output_dir", str(run)))
    assert read_json(run / "summary.json")["steps"] == 4 and left.read_text() == "wandb's log\n"
    # beside anything else, wandb/ is no sign of a start: the folder is still refused, untouched
    other = tmp_path / "other"
    (other / "wandb").mkdir(parents=True)
    (other / "notes.txt").write_text("mine\n")
    one_line(run_here("cifar_cnn", "--data", str(data), *SHORT, "--output_dir", str(other)),
             "holds files but no run of these recipes")
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt", "wandb"]
    # and a wandb/ that is a link to elsewhere is one, refused: nothing is written through it
    linked, elsewhere = tmp_path / "linked", tmp_path / "elsewhere"
    elsewhere.mkdir()
    linked.mkdir()
    (linked / "wandb").symlink_to(elsewhere, target_is_directory=True)
    one_line(run_here("cifar_cnn", "--data", str(data), *SHORT, "--output_dir", str(linked)), "is a symbolic link")
    assert not any(elsewhere.iterdir()) and os.listdir(linked) == ["wandb"]


def test_checkpoint_that_counts_batches(env, data, finished, tmp_path):
    """A checkpoint of the recipes before they kept the epoch's position in samples."""
    old = tmp_path / "run"
    shutil.copytree(finished, old)
    progress = old / "checkpoints" / "step_2" / "custom_checkpoint_0.pkl"
    state = torch.load(progress, weights_only=True)
    state["batches_seen"] = state.pop("samples_into_epoch") // 8
    torch.save(state, progress)
    one_line(run_here("cifar_cnn", "--data", str(data), "--output_dir", str(old), *SHORT,
                    "--resume", str(progress.parent)), "counts its place in the epoch in batches")


def test_resume_without_a_checkpoint(env, data, tmp_path):
    # No run at all (another working folder than the run's, a mistyped name): no data read, no hub fetched
    one_line(run_here("cifar_cnn", "--output_dir", str(tmp_path / "new"), *SHORT, "--resume", "latest"),
             "--resume latest: no run in", "pass the run's folder, as a full path or from the folder", status=2)
    # A run killed before its first checkpoint: its folder holds config.json, so a plain start is refused ("already
    # holds a run: pass --resume latest"), and the resume said "start it without --resume": each sent to the other.
    killed = tmp_path / "killed"
    ok(run_here("cifar_cnn", "--data", str(data), "--output_dir", str(killed), *SHORT))
    shutil.rmtree(killed / "checkpoints")
    (killed / "model.safetensors").unlink()
    args = ("--data", str(data), "--output_dir", str(killed), *SHORT)
    one_line(run_here("cifar_cnn", *args), "already holds a run", "--overwrite to replace it (or to restart one "
             "stopped before its first checkpoint)")
    # The same line for a finished run whose checkpoints were deleted to save room: --overwrite replaces its trained
    # weights, which the line said nothing of ("only the files a run writes are replaced"); --init_from keeps them
    line = one_line(run_here("cifar_cnn", *args, "--resume", "latest"))
    assert line == (f"error: --resume latest: {killed / 'checkpoints'} has no checkpoints: start the run again without "
                    "--resume (with --overwrite where its folder holds it, replacing any model.safetensors: to train "
                    "on from it, --init_from it in a new --output_dir), or pass --output_dir of a run that saved one")
    ok(run_here("cifar_cnn", *args, "--overwrite"))


def test_resume_latest_without_output_dir_never_guesses_the_run(env, data):
    one_line(run_here("cifar_cnn", "--data", str(data), *SHORT, "--resume", "latest"), status=2, *(
        "--resume latest needs the run to continue: add --output_dir runs/cifar_cnn-<time>",))


def test_loss_becomes_nan_keeps_the_last_good_checkpoint(env, data, tmp_path):
    run = tmp_path / "run"
    line = one_line(run_here("cifar_cnn", "--data", str(data), "--output_dir", str(run), "--lr", "1e12",
                           "--batch_size", "8", "--max_steps", "20", "--log_every", "1", "--checkpoint_every", "1",
                           "--tracker", "none"), "by step", "lower --lr")
    stopped = int(line.split("by step ")[1].split(":")[0].split(" ")[0])
    checkpoints = sorted((run / "checkpoints").glob("step_*"), key=lambda p: int(p.name[5:]))
    assert checkpoints and int(checkpoints[-1].name[5:]) < stopped
    for checkpoint in checkpoints:
        assert all(torch.isfinite(t).all() for t in load_file(checkpoint / "model.safetensors").values())
    assert not (run / "model.safetensors").exists()
    # Finite, but after a step at --lr 1e12 far off: a resume at --lr 0.01 diverges again, and the line sent it back
    again = one_line(run_here("cifar_cnn", "--output_dir", str(run), "--resume", "latest", "--lr", "0.01"))
    assert again.endswith(f"the newest finite checkpoint is {checkpoints[-1]} (if a resume from it with a lower --lr "
                          "diverges again, its weights had begun to: start the run again with --overwrite)"), again
    ok(run_here("cifar_cnn", "--data", str(data), "--output_dir", str(run), "--lr", "0.01", "--batch_size", "8",
                "--max_steps", "4", "--tracker", "none", "--overwrite"))
    assert (run / "model.safetensors").is_file()


def test_a_loss_that_becomes_nan_between_checkpoints_is_one_line_at_its_log_point(env, data, tmp_path):
    """Without a checkpoint at each step (above), the loss is what shows the divergence first: the step after the
    weights became infinite."""
    run = tmp_path / "run"
    line = one_line(run_here("cifar_cnn", "--data", str(data), "--output_dir", str(run), "--lr", "1e12",
                             "--batch_size", "8", "--max_steps", "20", "--log_every", "1", "--checkpoint_every", "0",
                             "--tracker", "none"))
    stopped = re.fullmatch(r"error: the training loss became nan by step (\d+): lower --lr; the checkpoints on disk "
                           r"hold finite weights \(if a resume from one with a lower --lr diverges again, its weights "
                           r"had begun to: start the run again with --overwrite\)", line)
    assert stopped, line
    rows = [json.loads(row) for row in (run / "metrics.jsonl").read_text().splitlines()]
    # Each step before it was logged, finite; nothing was saved
    assert [row["step"] for row in rows] == list(range(1, int(stopped[1]))) and all(
        math.isfinite(row["train_loss"]) for row in rows)
    assert not (run / "checkpoints").exists() and not (run / "model.safetensors").exists()


def test_out_of_gpu_memory_is_one_line_and_the_checkpoints_stay(data, tmp_path):
    """The commonest error on a GPU, raised here at step 3 in torch's own words (its caching allocator's message, one
    line of about 500 characters): one line with the fix, and the checkpoints of steps 1 and 2 kept."""
    from recipes import cifar_cnn

    said = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.72 GiB of which 1.19 "
            "GiB is free. Including non-PyTorch memory, this process has 138.52 GiB memory in use. Of the allocated "
            "memory 135.90 GiB is allocated by PyTorch, and 1.96 GiB is reserved by PyTorch but unallocated. If "
            "reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to "
            "avoid fragmentation.  See documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
    calls = []

    def out_of_memory_at_step_3(loss_fn):
        def loss(logits, labels, reduction="mean"):
            calls.append(reduction)
            if calls.count("mean") == 3:  # the third training batch (evaluation asks for sums)
                raise torch.OutOfMemoryError(said)
            return loss_fn(logits, labels, reduction)
        return loss

    run = tmp_path / "run"
    with hooked(cifar_cnn, "loss_fn", out_of_memory_at_step_3):
        line = one_line(run_here("cifar_cnn", "--data", data, "--output_dir", run, "--batch_size", "8", "--max_steps",
                                 "6", "--checkpoint_every", "1", "--tracker", "none"))
    assert line == f"error: out of GPU memory ({said[:120]}): lower --batch_size"
    assert sorted(path.name for path in (run / "checkpoints").iterdir()) == ["step_1", "step_2"]
    assert not (run / "model.safetensors").exists()


def test_one_image_per_process_into_a_batchnorm_of_one_pixel_is_one_line(data, tmp_path):
    """finetune.py's ResNet at --image_size 32 ends in a 1x1 feature map: with --batch_size 1, its BatchNorm in training
    has one value per channel, which torch refuses (a ValueError traceback before)."""
    run = tmp_path / "run"
    line = one_line(run_here("finetune", "--data", data, "--weights", "none", "--image_size", "32", "--batch_size", "1",
                             "--max_steps", "2", "--output_dir", run, "--tracker", "none"))
    assert line == ("error: a BatchNorm layer got one value per channel to normalize (one image per process, at a size "
                    "where its feature map is 1x1): raise --batch_size to 2 or more (a resume may change it too), or "
                    "the image size")
    assert not (run / "model.safetensors").exists()


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of 2,000 KiB (a checkpoint of cifar_cnn takes 1,180): a real full disk, where torch.save fails with a
    RuntimeError ("unexpected pos") and safetensors with its own error, not with the OSError that Python raises."""
    disk = tmp_path / "disk"
    disk.mkdir()
    with mounted(disk, "-t", "tmpfs", "-o", "size=2000k", "tmpfs"):
        yield disk


@pytest.mark.parametrize("full_at", ["checkpoint", "weights"])
def test_a_full_disk_is_one_line_and_the_run_resumes_once_there_is_room(env, data, small_disk, full_at):
    run = small_disk / "run"
    args = ["cifar_cnn", "--data", str(data), "--output_dir", str(run), "--batch_size", "8", "--tracker", "none",
            *(("--max_steps", "6", "--checkpoint_every", "2") if full_at == "checkpoint" else
              ("--max_steps", "4", "--checkpoint_every", "4", "--keep_checkpoints", "1"))]
    what = "saving the checkpoint of step 4" if full_at == "checkpoint" else "writing model.safetensors"
    kept = "step_2" if full_at == "checkpoint" else "step_4"
    if full_at == "weights":  # room for the checkpoint of step 4, not for the weights (576 KiB) after it
        subprocess.run(["mount", "-o", "remount,size=1500k", str(small_disk)], check=True)
    one_line(run_here(*args), f"{what} failed (", f"MiB free there): the newest complete checkpoint is "
             f"{run / 'checkpoints' / kept}; free space, then continue with --resume latest")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [kept]  # no partial_step_4
    assert not list(run.glob("*.tmp*")) and not (run / "model.safetensors").exists()
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)
    ok(run_here(*args, "--resume", "latest"))
    assert (run / "model.safetensors").is_file() and (run / "summary.json").is_file()


def test_a_disk_full_before_the_run_files_are_written_loses_nothing(env, data, small_disk):
    """A resume on a disk with no room left: its first write (the rewrite of metrics.jsonl) fails with ENOSPC, which is
    one line; the run's files are as they were, and the resume goes on once there is room."""
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)
    run = small_disk / "run"
    args = ["cifar_cnn", "--data", str(data), "--output_dir", str(run), *SHORT, "--checkpoint_every", "2"]
    ok(run_here(*args))
    (run / "model.safetensors").unlink()  # a run stopped after its last checkpoint: the resume has files to write
    before = snapshot(run)
    fill(small_disk / "filler")
    one_line(run_here(*args, "--resume", "latest"), "failed (No space left on device): free space, then "
             "continue with --resume latest")
    assert snapshot(run) == before
    (small_disk / "filler").unlink()
    ok(run_here(*args, "--resume", "latest"))
    assert (run / "model.safetensors").is_file()


def test_a_disk_full_after_the_weights_is_finished_by_the_resume_the_line_names(env, data, small_disk, monkeypatch):
    """The disk filled after model.safetensors, as the pictures were drawn: the line said to continue with --resume
    latest, which then said the run had finished, confusion_matrix.png, summary.json and curves.png never written.
    curves.png, the last file, marks a finished run now: the resume writes the files, the same weights again."""
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)
    run = small_disk / "run"
    args = ["cifar_cnn", "--data", str(data), "--output_dir", str(run), *SHORT]
    from shared import pictures

    draw = pictures.save_pictures

    def full_disk_first(*args):  # the weights written, then no room
        fill(small_disk / "filler")
        draw(*args)

    monkeypatch.setattr(pictures, "save_pictures", full_disk_first)
    one_line(run_here(*args), "writing ", "failed (No space left on device): free space, then continue with "
             "--resume latest")
    assert (run / "model.safetensors").is_file() and not (run / "curves.png").exists()
    trained = weights(run)
    monkeypatch.undo()
    (small_disk / "filler").unlink()
    result = ok(run_here(*args, "--resume", "latest"))
    assert "the run stopped before writing its final files (weights, summary, pictures)" in result.stdout
    assert all((run / name).is_file() for name in ("confusion_matrix.png", "summary.json", "curves.png"))
    assert_bitwise_equal(weights(run), trained)
    assert not (run / "finished").exists()  # its own weights, written again in place: no finished run extended
    one_line(run_here(*args, "--resume", "latest"), "already finished its 4 steps")


@pytest.mark.slow  # wandb's service, in a launch
def test_a_disk_full_under_wandb_is_one_line_naming_the_run_folders_file(env, data, small_disk):
    """wandb offline, the disk full as the run's end copies the confusion matrix into wandb's folder: the line named
    the copy's source in /tmp (a temporary file, on another disk), and wandb's loggers, failing on the full disk as
    the process ended, printed 60-230 lines of "--- Logging error ---" tracebacks after it. Then the resume the line
    names finishes the run."""
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)
    run = small_disk / "run"
    args = ["--data", str(data), "--output_dir", str(run), "--batch_size", "8", "--max_steps", "2"]
    full = dict(env, WANDB_MODE="offline", PYTHONPATH=str(ROOT / "tests" / "faults"),
                FAULT_FILL_DISK_AFTER_SAVING_IMAGE="confusion_matrix.png")
    line = one_line(launch(full, "cifar_cnn", *args), f"error: writing {run / 'wandb'}/",
                    "failed (No space left on device): free space, then continue with --resume latest")
    assert "/media/images/confusion_matrix" in line  # wandb's copy, in the run folder
    (run / "filler").unlink()
    ok(launch(dict(env, WANDB_MODE="offline"), "cifar_cnn", *args, "--resume", "latest"))
    assert (run / "curves.png").is_file()


@pytest.mark.parametrize("tracker", [pytest.param("wandb", marks=pytest.mark.slow),  # wandb's service
                                     "tensorboard"])
def test_a_disk_full_from_the_start_is_one_line_and_leaves_no_folder(env, small_disk, tracker):
    """No room at all (a quota reached): wandb and TensorBoard started before config.json, so the line came amid
    hundreds of wandb's "--- Logging error ---" tracebacks or TensorBoard's writer thread's, and left the folder
    holding their wandb/ or tensorboard/ but no run, which the same command then refused. They start with the
    configuration now (wandb just before config.json, its own writes failing in silence; TensorBoard after it): the
    write of config.json fails as one line, and the folder this start made goes, with what wandb began in it."""
    run = small_disk / "run"
    fill(small_disk / "filler")
    one_line(launch(dict(env, WANDB_MODE="offline"), "cifar_cnn", "--synthetic", "--max_steps", "2", "--tracker",
                    tracker, "--output_dir", str(run)),
             "failed (No space left on device): free space, then continue with --resume latest (the complete "
             "checkpoints are kept; before the first one, run the same command again)")
    assert not run.exists()  # the same command starts the run again


@pytest.mark.parametrize("stdout", [">&-", ">/dev/full"])
def test_a_standard_output_closed_or_on_a_full_disk_leaves_the_run_to_finish(env, data, tmp_path, stdout):
    """`accelerate launch ... >&-` ended in an AttributeError traceback at the run's first line (Python's sys.stdout is
    None), and a standard output on a full disk in the line "writing the run's files failed", wrong about the run's
    files, which had room. Now the lines go to stderr and the run finishes."""
    run = tmp_path / "run"
    command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "-q", "--config_file",
               "accelerate_configs/cpu.yaml", "recipes/cifar_cnn.py", "--data", str(data), "--output_dir", str(run),
               *SHORT]
    result = subprocess.run(["bash", "-c", f'exec "$@" {stdout}', "bash", *command], cwd=ROOT, env=env,
                            stderr=subprocess.PIPE, text=True, timeout=600)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"model.safetensors and the run's files in {run}\n" in result.stderr
    assert read_json(run / "summary.json")["steps"] == int(SHORT[SHORT.index("--max_steps") + 1])


def test_a_standard_output_that_fails_is_pointed_at_stderr_and_descriptor_1_left_alone():
    """With stdout closed (`>&-`) the lines go to stderr, and descriptor 1 is the next file opened: the run folder's
    lock. A failed write to stderr then (its reader gone) pointed descriptor 1 at stderr, closing the lock. Now the
    stream that failed is pointed there, whichever descriptor it has."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # a pipe whose reader is gone
    kept = os.dup(1)
    try:
        with os.fdopen(write_end, "w") as stream:
            assert PrintableLines(stream).write("a line\n") == len("a line\n")  # no BrokenPipeError
            assert os.path.sameopenfile(write_end, 2) and os.path.sameopenfile(1, kept)
    finally:
        os.dup2(kept, 1)
        os.close(kept)


def test_a_line_another_thread_prints_meanwhile_is_never_spliced_into_a_line():
    """The first Ctrl-C's line is printed by a thread of its own (shared/resume.py's after_interrupt), while the run
    may be printing one: print writes its text, then its newline, and the other thread's line came between the two
    ("...without saving)cifar_cnn: ... run", then both newlines: a CI run of test_stops.py). Now each thread's line is
    written whole, and a control character in the held part is still escaped."""
    stream = io.StringIO()
    lines = PrintableLines(stream)
    lines.write("the run's line \x1b[2J")  # print's first write; its newline comes next
    other = threading.Thread(target=print, args=("the Ctrl-C's line",), kwargs={"file": lines})
    other.start()
    other.join()
    assert lines.write("\n") == 1
    assert stream.getvalue() == "the Ctrl-C's line\nthe run's line \\x1b[2J\n"


def fill(path: Path) -> None:
    """A file that takes the rest of its disk."""
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                f.write(bytes(2**16))
            except OSError:  # ENOSPC
                return


@pytest.mark.slow  # wandb's service, waiting on an address that does not answer
def test_wandb_unreachable_falls_back_to_offline_within_seconds(env, data, tmp_path):
    """With an API key and no network a 3-step run took 114 s, waiting on wandb (its own timeout: 90 s)."""
    run = tmp_path / "run"
    online_but_unreachable = dict(env, WANDB_API_KEY="a" * 40, WANDB_BASE_URL="http://127.0.0.1:9")
    result = ok(launch(online_but_unreachable, "cifar_cnn", "--data", str(data), "--output_dir", str(run),
                       "--batch_size", "8", "--max_steps", "4", config=None, timeout=60))
    assert "warning: wandb could not start online" in result.stderr and "logging offline instead" in result.stderr
    assert len(list((run / "wandb").glob("offline-run-*"))) == 1 and "wandb: offline, in " in result.stdout
    assert (run / "model.safetensors").exists()


# ------------------------------------------------------------------ several processes
def test_an_error_in_a_two_process_run_stops_both_promptly_printed_once(env, tmp_path):
    started = time.monotonic()
    result = launch(env, "cifar_cnn", "--data", str(tmp_path / "missing"), "--tracker", "none",
                    "--output_dir", str(tmp_path / "run"), config="2gpu", use_cpu=True)
    assert result.returncode != 0 and time.monotonic() - started < 90
    # Printed once by the processes, and once more as the cause in torchrun's summary, which ends the screen (the
    # launcher's traceback comes first): before, the line scrolled away above 30 lines of torchrun's
    assert "no such folder" in printed_once_and_last(result.stderr, "error: ")
    assert 'recipes/cifar_cnn.py", line' not in result.stderr and "[rank1]" not in result.stderr


@pytest.mark.slow  # two processes
@pytest.mark.parametrize("script, needle", [
    ("predict", "error: predict.py --images runs in one process: start it with `python recipes/predict.py"),
    ("deep_mlp_sweep", "error: the sweep measures a single process: launch it with cpu.yaml, 1gpu.yaml or bf16.yaml"),
])
def test_a_script_of_one_process_launched_on_two_says_so_once_and_writes_nothing(env, finished, tmp_path, script,
                                                                                  needle):
    """Without its refusal, each of the two ran on both processes and exited 0: both write the same files (predict.py's
    CSV, the sweep's reports), and the sweep's step times are measured beside the other process."""
    photos, out = tmp_path / "photos", tmp_path / "out"
    photos.mkdir()
    out.mkdir()
    Image.new("RGB", (40, 30), (200, 10, 10)).save(photos / "a.png")
    args = {"predict": ("--weights", finished / "model.safetensors", "--images", photos, "--output",
                        out / "predictions.csv"),
            "deep_mlp_sweep": ("--batch", "16", "--repeats", "1", "--segments", "2", "--output_dir", out)}
    result = launch(env, script, *map(str, args[script]), config="2gpu", use_cpu=True)
    assert result.returncode != 0
    printed_once_and_last(result.stderr, needle)
    assert f'recipes/{script}.py", line' not in result.stderr and not any(out.iterdir())


def test_under_torchrun_an_error_is_the_cause_its_summary_shows(tmp_path):
    """The file torchrun reads each failed process's cause from (TORCHELASTIC_ERROR_FILE), read by torch's own
    reader: a quick test, so both ends of the torch range run it."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    error_file = tmp_path / "error.json"
    result = run_here("cifar_cnn", "--data", tmp_path / "missing", "--output_dir", tmp_path / "run",
                      env={"TORCHELASTIC_ERROR_FILE": str(error_file)})
    line = result.stderr.strip().splitlines()[-1]
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    summary = ChildFailedError("recipes/cifar_cnn.py", {0: failure}).format_msg().splitlines()
    assert line.startswith("error: --data ") and summary[-2].strip() == f"traceback : {line}", summary


def test_a_process_stopped_while_writing_its_cause_for_torchrun_leaves_no_half_file(monkeypatch, tmp_path):
    """torchrun stops the other processes as soon as one fails, then reads their files too: one stopped between
    opening its file and writing it left it empty, and torchrun's reader ended in a JSONDecodeError (a CI run)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from shared.errors import one_line_errors

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt  # stands for the SIGTERM that ends the process here

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setattr("json.dump", stopped)
    monkeypatch.setattr("json.dumps", stopped)
    with pytest.raises(KeyboardInterrupt), one_line_errors():
        raise RecipeError("--data x: no such folder")
    ProcessFailure(local_rank=1, pid=1, exitcode=-15, error_file=str(error_file))  # torch's reader: whole or absent
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # two processes, one of them slowed down
def test_overwrite_on_two_processes_deletes_only_once_every_process_has_checked(env, data, finished, tmp_path):
    """A process that read the folder late (here 3 s late) found the old run half deleted by the main process, stopped
    alone and took the run down with it: a requeued SLURM job in a full suite on a loaded machine."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    old = read_json(run / "config.json")["run_id"]
    late = dict(env, PYTHONPATH=str(ROOT / "tests" / "faults"), FAULT_SLOW_CONFIG_READ_S="3")
    ok(launch(late, "cifar_cnn", "--data", str(data), "--output_dir", str(run), *SHORT, "--overwrite", config="2gpu",
              use_cpu=True))
    config = read_json(run / "config.json")
    assert config["run_id"] != old and config["world_size"] == 2
    assert [row["step"] for row in read_jsonl(run / "metrics.jsonl") if "train_loss" in row] == [1, 2, 3, 4]


def test_ddp_errors_keep_their_message_and_collective_failures_are_one_line(monkeypatch, capsys):
    """Under several processes, a failed collective means another process stopped (one line); an error DDP raises
    about the model (unused parameters, an unfinished reduction) is the programmer's, with its whole message."""
    from shared.errors import one_line_errors

    monkeypatch.setenv("WORLD_SIZE", "2")
    message = "Expected to have finished reduction in the prior iteration before starting a new one. " * 3

    def raise_in(path: str, error: Exception) -> None:  # as if raised by that file of torch
        exec(compile("raise error", f"/site-packages/torch/{path}", "exec"), {"error": error})

    with pytest.raises(RuntimeError, match=message), one_line_errors():
        raise_in("nn/parallel/distributed.py", RuntimeError(message))
    with pytest.raises(ImportError), one_line_errors():  # a package that does not load: not another process's stop
        raise_in("distributed/distributed_c10d.py", ImportError("cannot import name 'ProcessGroupGloo'"))
    with pytest.raises(SystemExit), one_line_errors():
        raise_in("distributed/distributed_c10d.py", RuntimeError("[gloo] Connection closed by peer"))
    assert capsys.readouterr().err.startswith("error: another process of this run stopped ([gloo] Connection closed")


def test_a_compile_that_fails_in_torchs_compiler_is_one_line(capsys):
    """--compile without a C++ compiler (a slim image's): torch's traceback, 140 lines. What torch raises there, on
    both ends of its range (tried: InductorError on 2.11 and 2.15, BackendCompilerFailed on 2.15 before the model was
    one graph), holds the cause. Without Python's headers (Python.h) the cause is a CppCompileError (tried on torch
    2.15, Python 3.15): the same line names both."""
    from shared.errors import one_line_errors

    for name in ("InductorError", "BackendCompilerFailed"):
        error = type(name, (RuntimeError,), {})("backend='inductor' raised:\nInvalidCxxCompiler: ...")
        error.inner_exception = type("InvalidCxxCompiler", (RuntimeError,), {})("No working C++ compiler found")
        with pytest.raises(SystemExit), one_line_errors():
            raise error
        assert capsys.readouterr().err == ("error: --compile failed in torch's compiler (InvalidCxxCompiler: No "
                                           "working C++ compiler found): leave out --compile, or install what "
                                           "torch.compile needs on a CPU: g++ and Python's headers (python3-dev)\n")


def test_a_requirement_not_installed_is_one_line(data, tmp_path, monkeypatch):
    """A GPU image has torch and accelerate, and often neither wandb nor datasets: the default tracker ended in
    ModuleNotFoundError's traceback, and so did a folder of photos (datasets)."""
    from shared.errors import one_line_errors

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: `import wandb` raises ModuleNotFoundError
    one_line(run_here("cifar_cnn", "--data", data, "--output_dir", tmp_path / "run"), "error: No module named 'wandb' "
             f"in this Python ({sys.executable}): install the requirements there: pip install -r requirements.txt, "
             "or train without it: --tracker tensorboard or none")
    assert not list((tmp_path / "run").iterdir())  # empty: a process's exit removes it (remove_unless_run)
    for tracker in ("tensorboard", "none"):  # what the line offers works without wandb (an offline GPU image's case)
        ok(run_here("cifar_cnn", "--data", data, "--output_dir", tmp_path / tracker, "--tracker", tracker,
                    "--max_steps", "1", "--batch_size", "8"))
        assert (tmp_path / tracker / "model.safetensors").exists()
    photos = imagefolder_dataset(tmp_path / "photos", sizes={"train": 4, "test": 2})
    monkeypatch.setitem(sys.modules, "datasets", None)  # a folder of photos: datasets' imagefolder reads it
    one_line(run_here("cifar_cnn", "--data", photos, "--output_dir", tmp_path / "run", "--tracker", "none"),
             f"error: No module named 'datasets' in this Python ({sys.executable}): install the requirements there: "
             "pip install -r requirements.txt")
    # IDX and CIFAR files need no datasets (a GPU image's benchmarks read Fashion-MNIST's)
    ok(run_here("cifar_cnn", "--data", data, "--output_dir", tmp_path / "files", "--tracker", "none", "--max_steps",
                "1", "--batch_size", "8"))
    with pytest.raises(ModuleNotFoundError), one_line_errors():  # one missing inside a package: its traceback says why
        raise ModuleNotFoundError("No module named 'torchvision._meta'", name="torchvision._meta")


def test_flags_parse_without_the_source_file_and_take_help_from_it_when_there(capsys):
    """A recipe run from a notebook cell or exec() has no source file to read the comments from: no help, same flags."""
    from shared.config import RunConfig, parse_config

    namespace = {"RunConfig": RunConfig, "dataclass": dataclass}
    exec("@dataclass\nclass Config(RunConfig):\n    widen: int = 2  # times wider\n", namespace)
    config = parse_config(namespace["Config"], ["--widen", "3", "--epochs", "4"])
    assert (config.widen, config.epochs) == (3, 4)
    with pytest.raises(SystemExit):
        parse_config(namespace["Config"], ["--help"])
    text = capsys.readouterr().out
    assert "--widen INT" in text and "passes over the training set" in text  # RunConfig's file is there


def test_a_path_given_with_a_tilde_after_an_equals_sign_is_the_home(monkeypatch, tmp_path):
    """`--output_dir=~/runs/x` is one word, and no shell expands a ~ after its `=`: the run went into a folder named
    ~ in the working folder, which a later `rm -rf ~` of it would take the home with."""
    from recipes import cifar_cnn, predict

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = cifar_cnn.Config.parse(["--output_dir=~/runs/x", "--init_from=~/w.safetensors", "--data", "~/photos"])
    assert (cfg.output_dir, cfg.init_from, cfg.data) == (f"{tmp_path}/runs/x", f"{tmp_path}/w.safetensors",
                                                         f"{tmp_path}/photos")
    cfg = predict.Config.parse(["--weights=~/m.safetensors", "--images=~/new", "--classes=~cat,dog"])
    assert (cfg.weights, cfg.images, cfg.classes) == (f"{tmp_path}/m.safetensors", f"{tmp_path}/new", "~cat,dog")


@pytest.mark.slow  # under a memory limit
def test_a_batch_whose_activations_do_not_fit_in_memory_is_one_line(env, tmp_path):
    """torch's CPU allocator raises a RuntimeError, not a MemoryError. The run gets 8 GiB of address space (torch
    takes about 5), so the ResNet's activations at batch 4096 cannot fit."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, 8 * 2**30))

    result = subprocess.run([sys.executable, "recipes/resnet18_fmnist.py", "--synthetic", "--batch_size", "4096",
                             "--max_steps", "1", "--tracker", "none", "--output_dir", str(tmp_path / "out")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, preexec_fn=limit)
    one_line(result, "this process reached its limit on address space (ulimit -v: 8.0 GiB, of which torch's libraries "
             "map about 5 GiB; a smaller --batch_size needs less): raise it, then run again")
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.slow  # under a memory limit
def test_a_sweep_batch_that_does_not_fit_in_memory_names_the_sweeps_flag(env, tmp_path):
    """The recipes' line said "lower --batch_size", a flag the sweep does not have (its own is --batch). 8 GiB of
    address space, as above: the 400 GB of inputs at --batch 100000000 are refused wherever the machine overcommits."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, 8 * 2**30))

    result = subprocess.run([sys.executable, "recipes/deep_mlp_sweep.py", "--batch", "100000000", "--segments", "2",
                             "--output_dir", str(tmp_path / "sweep")], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300, preexec_fn=limit)
    one_line(result, "error: out of memory at --batch 100000000 (can't allocate memory: you tried to allocate "
             "400000000000 bytes", "): lower --batch")
    assert "--batch_size" not in result.stderr


def test_a_sweep_out_of_gpu_memory_names_the_sweeps_flag(monkeypatch, tmp_path):
    """On a GPU: torch's OutOfMemoryError, said with the sweep's --batch (the recipes' line: --batch_size)."""
    from recipes import deep_mlp_sweep

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB.\nGPU 0 has a total capacity of "
                                     "79.19 GiB of which 1.06 GiB is free.")  # one line, whatever torch's breaks

    monkeypatch.setattr(deep_mlp_sweep, "measure", out_of_memory)
    one_line(run_here("deep_mlp_sweep", "--batch", "65536", "--segments", "2", "--output_dir", tmp_path / "sweep"),
             "error: out of memory at --batch 65536 (CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a "
             "total capacity of 79.19 GiB of which 1.06 GiB is free.): lower --batch")


@pytest.mark.parametrize("error", [MemoryError(), RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried "
                                   "to allocate 8589934592 bytes"), RuntimeError("could not create a primitive"),
                                   ImportError("libtorch_cuda.so: failed to map segment from shared object")],
                         ids=["Python", "torch", "oneDNN", "the loader"])
def test_an_allocation_refused_under_an_address_space_limit_names_the_limit(monkeypatch, capsys, error):
    """Under `prlimit --as` a run stopped wherever the limit fell: "out of memory: lower --batch_size, or check that
    --data holds what it should" (3.5 GB), or a traceback of oneDNN (4.5 GB) or of a late import. Without a limit,
    oneDNN's and the loader's errors keep their traceback: they may be a programming error."""
    from shared import errors

    real, limit = resource.getrlimit, [resource.RLIM_INFINITY]
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (limit[0], limit[0])
                        if kind == resource.RLIMIT_AS else real(kind))
    if isinstance(error, MemoryError) or "can't allocate memory" in str(error):  # Python's or torch's
        with pytest.raises(SystemExit, match="1"), errors.one_line_errors():
            raise error
        assert capsys.readouterr().err.startswith("error: out of memory: lower --batch_size")
    else:
        with pytest.raises(type(error)), errors.one_line_errors():
            raise error
    limit[0] = 4 * 2**30
    with pytest.raises(SystemExit, match="1"), errors.one_line_errors():
        raise error
    assert capsys.readouterr().err == (
        "error: this process reached its limit on address space (ulimit -v: 4.0 GiB, of which torch's libraries map "
        "about 5 GiB; a smaller --batch_size needs less): raise it, then run again\n")


def test_a_run_out_of_file_descriptors_still_ends_in_one_line(tmp_path):
    """The explanations of failures are an opt-in module, imported when a run fails: a run that used up its file
    descriptors (ulimit -n), still held by the failed frames, could not open that module, and ended in two
    tracebacks."""
    script = tmp_path / "descriptors.py"
    script.write_text("import resource, sys\n"
                      f"sys.path.insert(0, {str(ROOT)!r})\n"
                      "from shared.errors import one_line_errors\n"
                      "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))\n"
                      "held = []\n"
                      "with one_line_errors():\n"
                      "    while True:\n"
                      "        held.append(open('/dev/null'))\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stderr == (
        "error: [Errno 24] Too many open files: '/dev/null': this process is out of open files or memory (ulimit -n, "
        "ulimit -v): raise its limits, then run again\n")


@pytest.mark.slow  # a process of its own, whose threads are refused
def test_a_limit_of_the_process_is_named_as_a_limit_not_as_a_data_format(env, tmp_path):
    """At its limit on threads (datasets' reader of an imagefolder, under `ulimit -v` or a pids limit), the run said
    "could not read a dataset ... expected a save_to_disk folder, parquet files, an imagefolder ...", a data format."""
    folder = imagefolder_dataset(tmp_path / "photos")
    faulty = dict(env, PYTHONPATH=str(ROOT / "tests" / "faults"), FAULT_NO_THREADS="1")
    result = launch(faulty, "cifar_cnn", "--data", str(folder), "--max_steps", "1", "--tracker", "none",
                    "--output_dir", str(tmp_path / "out"))
    # The last line (tqdm warns first that its own monitor thread could not start), no traceback
    assert result.returncode == 1 and "Traceback" not in result.stderr and not (tmp_path / "out").exists()
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: reading {folder}, this process reached its limit on threads (ulimit -u, a container's pids limit, or "
        "the memory for their stacks: ulimit -v): raise it, then run again")


def test_a_decode_cache_left_half_written_by_a_kill_9_is_removed_by_the_next_write(tmp_path):
    """kill -9 (an OOM kill) while the decoded images were written left `<cache>.tmp<pid>` beside the cache, the size
    of the decoded dataset, and every later run left it there. The next write now removes such a file when its
    process is gone and it is an hour old; one whose writer still runs, or that changed within the hour (a writer on
    another machine sharing the cache), stays."""
    from shared import data

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    cache = tmp_path / "decoded" / "set-abc.safetensors"
    cache.parent.mkdir()
    old = time.time() - 2 * 3600
    left = {name: cache.with_name(f"{cache.name}.tmp{pid}") for name, pid in
            (("killed", dead.pid), ("running", os.getppid()), ("recent", dead.pid + 10**7), ("not a pid", "x1"))}
    for name, file in left.items():
        file.write_bytes(b"half")
        if name != "recent":
            os.utime(file, (old, old))
    splits = {split: (torch.zeros(2, 1, 4, 4, dtype=torch.uint8), torch.tensor([0, 1])) for split in ("train", "test")}
    data.write_cache(cache, splits, ["a", "b"], "a source")
    assert not left["killed"].exists()
    assert all(left[name].exists() for name in ("running", "recent", "not a pid"))
    assert data.read_cache(cache)[0].labels.tolist() == [0, 1]


def test_a_decode_cache_that_cannot_be_written_is_one_line_naming_its_folder(tmp_path):
    """HF_HOME a file (or a full disk): the decoded images cannot be kept, said with the folder and the setting."""
    from shared import data

    (tmp_path / "home").write_text("a file where a folder is expected")
    cache = tmp_path / "home" / "decoded" / "set-abc.safetensors"
    splits = {split: (torch.zeros(2, 1, 4, 4, dtype=torch.uint8), torch.tensor([0, 1])) for split in ("train", "test")}
    with pytest.raises(RecipeError) as error:
        data.write_cache(cache, splits, ["a", "b"], "a source")
    assert str(error.value) == (f"cannot write the decoded images to {cache.parent} (Not a directory): set HF_HOME (or "
                                "HF_DATASETS_CACHE) to a writable folder with room")
