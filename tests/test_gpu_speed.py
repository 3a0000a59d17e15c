"""benchmarks/gpu_speed.sh, the one prepared GPU speed check, run as a dry run on the CPU (GPU_SPEED_CPU=1): every
measurement it makes on a GPU but the compiled run (tests/test_gpu_check.py compiles a recipe) and fp16 (refused on a
CPU), tiny, so that it cannot rot before a GPU comes. The per-recipe rows here for cifar_cnn only (GPU_SPEED_RECIPES):
one code path with the recipe's name; the ResNet runs in the time to accuracy, the profile and the ablations."""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from tiny_data import idx_folder, random_splits

pytestmark = pytest.mark.slow  # a benchmark's dry run

ROW = {"recipe", "setting", "precision", "batch_size", "ema", "samples_per_s", "ms_per_step"}
RUN = {"recipe", "data", "target", "reached", "seconds", "epochs", "seed"}


def test_the_gpu_speed_check_makes_every_measurement_on_the_cpu(env, tmp_path):
    fashion = idx_folder(tmp_path / "fashion-mnist", random_splits((28, 28), sizes=(16, 20)))
    out = tmp_path / "speed"
    # Every measurement, however slow the CPU: the budget (420 s) is a GPU session's, and a 2-core EPYC without AVX-512
    # spent it before the last rows, skipped
    result = subprocess.run(["bash", "benchmarks/gpu_speed.sh", str(out)], cwd=ROOT, capture_output=True, text=True,
                            env=dict(env, GPU_SPEED_CPU="1", GPU_SPEED_FASHION_MNIST=str(fashion),
                                     GPU_SPEED_RECIPES="cifar_cnn", GPU_SPEED_RUNS=str(tmp_path / "runs"),
                                     GPU_SPEED_COMMIT="0123abc", GPU_SPEED_BUDGET_S="3600"),
                            timeout=900)  # a hang, not a slow machine: 75-91 s on most, over 300 s on one (tests.md)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads((out / "gpu_speed.json").read_text())
    assert figures["dry_run"] and figures["device"] == "CPU" and figures["torch"] and figures["date"]
    assert figures["bytecode_kept"] is Path(importlib.util.cache_from_source(torch.__file__)).exists()
    # The commit a copied tree was given wins over the .git beside it (a GPU machine's copy of it can be stale).
    assert figures["commit"] == "0123abc" and not figures["errors"], figures["errors"]
    assert [skipped["name"] for skipped in figures["skipped"]] == ["resnet18_fmnist gpu bf16 compile default",
                                                                    "resnet18_fmnist gpu bf16 compile reduce-overhead"]
    rows = figures["rows"]
    for row in rows:
        assert ROW <= row.keys() and row["setting"] in ("default", "gpu"), row
        assert row["samples_per_s"] > 0 and row["ms_per_step"] > 0 and row["batch_size"] == 8, row
        assert row["precision"] in ("float32", "bf16")  # fp16: on a GPU only
    assert {(r["recipe"], r["setting"], r["precision"], r["ema"], r["flag"]) for r in rows} == {
        ("cifar_cnn", "gpu", "bf16", False, None), ("cifar_cnn", "gpu", "float32", False, None),
        ("cifar_cnn", "gpu", "bf16", True, None), ("cifar_cnn", "default", "float32", False, None),
        ("cifar_cnn", "default", "bf16", False, None), ("resnet18_fmnist", "gpu", "bf16", False, "--cudnn_benchmark"),
        ("resnet18_fmnist", "gpu", "bf16", False, "--no-data_on_device"),
        ("resnet18_fmnist", "gpu", "float32", False, "--no-tf32"),
        ("resnet18_fmnist", "gpu", "bf16", False, "--no-cuda_graph"),
        ("resnet18_fmnist", "gpu", "float32", False, "--no-cuda_graph")}
    # Each row is a run of its own, whose config says what it was.
    runs = Path(figures["runs"])
    assert runs == tmp_path / "runs"
    config = json.loads((runs / "cifar_cnn-gpu-bf16-ema" / "config.json").read_text())
    assert config["mixed_precision"] == "bf16" and config["ema"] == 0.99 and config["tf32"]
    config = json.loads((runs / "cifar_cnn-default-float32" / "config.json").read_text())
    assert config["mixed_precision"] == "no" and config["tf32"] and not config["cudnn_benchmark"]
    # The recipes' GPU defaults, each changed by its own flag: the run's config.json records it (on a CPU the data
    # stays in host memory whatever the default).
    for name, changed in (("cudnn_benchmark", {"cudnn_benchmark": True, "tf32": True}),
                          ("no-tf32", {"cudnn_benchmark": False, "tf32": False}),
                          ("no-data_on_device", {"cudnn_benchmark": False, "tf32": True, "data_on_device": False})):
        (folder,) = runs.glob(f"resnet18_fmnist-gpu-*-{name}")
        config = json.loads((folder / "config.json").read_text())
        assert {key: config[key] for key in changed} == changed, (name, config)
    new, eager, run = figures["time_to_accuracy"]
    # The README's line in a process of its own, as a user runs it; then without the CUDA graph (on a CPU: eager both)
    for found, flags in ((new, []), (eager, ["--no-cuda_graph"])):
        assert found["new_process"] and RUN <= found.keys() and found["flags"] == flags and found["epochs"] == 1
        assert found["process_s"] > found["seconds"] > found["train_s"] > 0, found
        assert 0 < found["start_s"] < found["process_s"] and 0 < found["finish_s"] < found["process_s"], found
    summary = json.loads((runs / "resnet18_fmnist-tta-new-process-0" / "summary.json").read_text())
    assert new["reached"] == summary["eval_acc"] == new["evaluations"][-1] and summary["world_size"] == 1
    config = json.loads((runs / "resnet18_fmnist-tta-new-process-0-no-cuda_graph" / "config.json").read_text())
    assert config["cuda_graph"] is False
    assert not run["new_process"]
    (start,) = figures["start"]  # benchmarks/start_cost.py: the start's phases, in the order a run meets them
    phases = ("interpreter_s", "launcher_s", "import_torch_s", "import_recipe_s", "device_s", "data_s", "model_s",
              "dynamo_import_s", "prepare_s", "first_step_s", "second_step_s")
    assert all(start[phase] > 0 for phase in phases), start
    assert start["to_first_step_s"] >= sum(start[phase] for phase in phases[2:-1]) and start["launcher_s"] > 0.1, start
    assert start["device"] == "cpu" and start["batch_size"] == 8 and not start["decoded"], start  # the run's cache
    assert RUN <= run.keys() and run["data"] == str(fashion) and run["epochs"] == 1 and run["seed"] == 0, run
    assert run["target"] == 0.93 and 0 <= run["reached"] <= 1 and run["met"] == (run["reached"] >= 0.93)
    assert 0 < run["seconds"] < run["start_s"] + run["seconds"] and run["load_data_s"] > 0
    assert run["runs_before_in_process"] == 0  # the first run: it pays the process's set-up
    summary = json.loads((runs / "resnet18_fmnist-tta-0" / "summary.json").read_text())
    assert summary["eval_acc"] == run["reached"] and run["evaluations"] == [run["reached"]]
    profile = figures["profile_summary"]
    assert profile["steps"] == 1 and profile["wall_ms_per_step"] > 0 and profile["gpu_idle_share"] is None
    trace = json.loads(gzip.decompress(Path(figures["profile"]).read_bytes()))  # the trace's path
    assert any(event.get("name", "").startswith("ProfilerStep") for event in trace["traceEvents"])
    # The convolution's own op by name, which depends on the CPU: aten::convolution where oneDNN computes it, and
    # aten::_slow_conv2d_forward/backward on an EPYC without AVX-512, whose bf16 oneDNN does not take (82% of the time)
    assert re.search(r"aten::\S*conv", Path(profile["top_ops"]).read_text())
