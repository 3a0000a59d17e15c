"""recipes/cifar_cnn.py on tiny data, judged by the files each run leaves: in this process (run_here), and launched
with each accelerate config it is given for (the slow tier)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from conftest import launch, ok, read_json, read_jsonl, run_here
from tiny_data import cifar_binary_dataset, imagefolder_dataset, parquet_dataset, save_to_disk_dataset

STEPS = ("--max_steps", "6", "--batch_size", "8", "--log_every", "2")
SHORT = (*STEPS, "--tracker", "none")


@pytest.fixture(scope="module")
def disk_data(tmp_path_factory):
    return save_to_disk_dataset(tmp_path_factory.mktemp("data") / "tiny_cifar")


def check_run_files(run_dir, *, world_size, steps, test_size, batch_size=8, mixed_precision="no"):
    """The contract's outputs exist once, with contents that agree with each other."""
    config = read_json(run_dir / "config.json")
    assert config["world_size"] == world_size and config["mixed_precision"] == mixed_precision
    assert config["global_batch_size"] == batch_size * world_size
    assert config["versions"]["torch"] == torch.__version__ and config["versions"]["datasets"] == datasets.__version__

    rows = read_jsonl(run_dir / "metrics.jsonl")
    train_rows = [r for r in rows if "train_loss" in r]
    eval_rows = [r for r in rows if "eval_acc" in r]
    assert [r["step"] for r in train_rows] == list(range(2, steps + 1, 2))  # each point once, even with 2 processes
    for row in train_rows:
        assert row["train_loss"] > 0 and row["lr"] >= 0 and row["samples_per_s"] > 0 and row["epoch"] > 0
        assert row["grad_norm"] > 0 and 0 <= row["train_acc"] <= 1
    assert eval_rows and eval_rows[-1]["step"] == steps
    assert eval_rows[-1]["eval_samples"] == test_size  # every test image counted exactly once
    assert 0 <= eval_rows[-1]["eval_acc"] <= 1

    summary = read_json(run_dir / "summary.json")
    for key in ("eval_acc", "eval_loss", "steps", "epochs", "wall_s", "samples_per_s", "peak_mem_mb", "world_size",
                "mixed_precision"):
        assert key in summary, key
    assert summary["steps"] == steps and summary["world_size"] == world_size
    assert summary["eval_acc"] == eval_rows[-1]["eval_acc"]
    assert summary["peak_mem_mb"] > 0 and summary["wall_s"] > 0
    # This launch's start (from the command, or the process run in, to the first step; launched runs:
    # test_gpu_speed.py) and finish (from the last evaluation to the summary)
    assert summary["start_s"] > 0 and 0 < summary["finish_s"] < 60, summary
    assert config["cuda_graph"] is True  # the default; a CPU run's step is eager whatever it says

    for name, min_size in {"curves.png": (600, 300), "confusion_matrix.png": (400, 400)}.items():
        with Image.open(run_dir / name) as image:
            image.verify()  # complete and uncorrupted
        with Image.open(run_dir / name) as image:
            assert image.format == "PNG" and all(a >= b for a, b in zip(image.size, min_size)), (name, image.size)
            assert sum(1 for count in image.convert("L").histogram() if count) > 10, f"{name} is blank"

    from recipes.cifar_cnn import make_model  # noqa: E402  (imports are cheap; the recipe runs only under main())
    weights = load_file(run_dir / "model.safetensors")
    model = make_model(10)
    assert set(weights) == set(model.state_dict())  # no `module.` or `_orig_mod.` prefixes
    model.load_state_dict(weights)
    checkpoint = run_dir / "checkpoints" / f"step_{steps}"
    assert (checkpoint / "optimizer.bin").exists() and (checkpoint / "custom_checkpoint_0.pkl").exists()  # + Progress
    rng_files = sorted(p.name for p in checkpoint.glob("random_states_*.pkl"))
    assert rng_files == [f"random_states_{i}.pkl" for i in range(world_size)]
    assert torch.equal(load_file(checkpoint / "model.safetensors")["0.weight"], weights["0.weight"])
    assert not list(run_dir.glob("checkpoints/partial_*"))


@pytest.fixture(scope="module")
def disk_run(env, disk_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("cpu") / "run"
    ok(run_here("cifar_cnn", "--data", disk_data, "--output_dir", out, *SHORT))
    return out


def test_a_run_on_a_save_to_disk_folder(disk_run):
    check_run_files(disk_run, world_size=1, steps=6, test_size=20)


@pytest.mark.slow  # two processes
def test_2gpu_yaml_as_two_cpu_processes_on_parquet_with_wandb(env, tmp_path):
    """Two processes write each file once, and one wandb run (the default tracker: offline without an API key)."""
    data = parquet_dataset(tmp_path / "parquet", sizes={"train": 64, "test": 21})  # 21: uneven over 2 processes
    out = tmp_path / "run"
    result = ok(launch(env, "cifar_cnn", "--data", str(data), "--output_dir", str(out), *STEPS, config="2gpu",
                       use_cpu=True))
    assert "2 process(es)" in result.stdout and "global batch 16" in result.stdout
    check_run_files(out, world_size=2, steps=6, test_size=21)
    assert len(list((out / "wandb").glob("offline-run-*"))) == 1
    assert list(Path(env["TMPDIR"]).glob("torchelastic_*"))  # torchrun's log folder: in the tests' own, not /tmp


@pytest.mark.slow  # a launch with the config
def test_cpu_bf16_yaml_with_imagefolder(env, tmp_path):
    data = imagefolder_dataset(tmp_path / "imagefolder")
    out = tmp_path / "run"
    ok(launch(env, "cifar_cnn", "--data", str(data), "--output_dir", str(out), *SHORT, config="cpu_bf16"))
    check_run_files(out, world_size=1, steps=6, test_size=20, mixed_precision="bf16")


@pytest.mark.slow  # a launch with the config
def test_1gpu_yaml_without_a_gpu_trains_on_the_cpu(env, disk_data, tmp_path):
    out = tmp_path / "run"
    result = ok(launch(env, "cifar_cnn", "--data", str(disk_data), "--output_dir", str(out), *SHORT, config="1gpu"))
    assert "on cpu" in result.stdout
    assert read_json(out / "summary.json")["steps"] == 6
    # A GPU was meant: one line says why there is none (a CPU-only torch on a GPU machine trained on, unsaid)
    cuda = torch.version.cuda
    why = (f"it sees no GPU (CUDA {cuda}: check nvidia-smi and CUDA_VISIBLE_DEVICES)" if cuda else
           "it is built for the CPU only: install the build for your GPU (pytorch.org/get-started)")
    assert (f"warning: training on the CPU, as torch {torch.__version__} must: {why}; for the CPU, launch with "
            "accelerate_configs/cpu.yaml\n") in result.stdout
    cpu = ok(launch(env, "cifar_cnn", "--data", str(disk_data), "--output_dir", str(out), *SHORT, "--overwrite",
                    config="cpu"))
    assert "on cpu" in cpu.stdout and "training on the CPU" not in cpu.stdout + cpu.stderr  # cpu.yaml: it was meant


def test_a_cpu_only_torch_where_a_gpu_was_meant_says_so(tmp_path, monkeypatch):
    """The README's CPU wheels, installed on a GPU machine, trained on the CPU unsaid (test_1gpu_yaml_without_a_gpu_...:
    a CUDA build that sees no GPU)."""
    monkeypatch.setattr(torch.version, "cuda", None)
    result = ok(run_here("cifar_cnn", "--synthetic", "--max_steps", "1", "--output_dir", tmp_path / "run", "--tracker",
                         "none", env={"ACCELERATE_USE_CPU": "False"}))  # what accelerate launch sets for 1gpu.yaml
    assert (f"warning: training on the CPU, as torch {torch.__version__} must: it is built for the CPU only: install "
            "the build for your GPU (pytorch.org/get-started); for the CPU, launch with accelerate_configs/cpu.yaml\n"
            ) in result.stdout


def test_synthetic_data_is_learnable_and_labelled(tmp_path):
    """(wandb offline, the default tracker without an API key: test_tracking.py.)"""
    out = tmp_path / "run"
    ok(run_here("cifar_cnn", "--synthetic", "--max_steps", "40", "--log_every", "20", "--output_dir", out,
                "--tracker", "none"))
    summary = read_json(out / "summary.json")
    assert summary["eval_acc"] > 0.35, summary  # 10 classes: chance is 0.10
    assert summary["synthetic"] is True and "SYNTHETIC" in summary["data"]
    assert read_json(out / "config.json")["data"] == "SYNTHETIC data"
    assert all(row["synthetic"] is True for row in read_jsonl(out / "metrics.jsonl"))


def test_evaluate_reproduces_the_final_accuracy_on_the_data_the_weights_name(env, disk_data, disk_run):
    out = disk_run  # trained on disk_data, a folder here, which model.safetensors records: no --data needed
    result = ok(run_here("predict", "--evaluate", "--weights", out / "model.safetensors", "--recipe", "cifar_cnn"))
    evaluation = json.loads(result.stdout.strip().splitlines()[-1])
    assert evaluation["eval_acc"] == read_json(out / "summary.json")["eval_acc"]
    assert evaluation["eval_samples"] == 20


def test_help_lists_the_contract_flags_with_units():
    result = ok(run_here("cifar_cnn", "--help"))
    for flag in ("--data", "--synthetic", "--epochs", "--max_steps", "--batch_size", "--lr", "--grad_accum", "--seed",
                 "--output_dir", "--checkpoint_every", "--resume", "--tracker",
                 "--compile", "--channels_last", "--data_on_device"):
        assert flag in result.stdout, flag
    assert "images per process per step" in result.stdout
    # A default where there is one; a None's meaning is the comment's: "points; default: ~100 a run (default: None)"
    # read as two defaults that disagree
    help_text = " ".join(result.stdout.split())
    assert "x processes x grad_accum (default: 128)" in help_text and "(default: None)" not in help_text
    assert "points; default: ~100 a run --checkpoint_every" in help_text
    predict_help = " ".join(ok(run_here("predict", "--help")).stdout.split())
    assert "state dict --images" in predict_help and "(default: )" not in predict_help  # "" is no value either


def test_an_accumulation_window_spans_an_epoch_end(env, tmp_path):
    """8 batches an epoch, --grad_accum 3: every optimizer step sums 3 batches, the third step's window taking 2 from
    the first epoch and 1 from the second, so 3 epochs are 8 whole steps. With accelerate's default
    (sync_with_dataloader=True) each epoch's end would force a step of 2 batches, and 8 steps would end in epoch 3."""
    out, data = tmp_path / "run", cifar_binary_dataset(tmp_path / "data", sizes={"train": 64, "test": 16})
    ok(run_here("cifar_cnn", "--data", data, "--batch_size", "8", "--grad_accum", "3", "--epochs", "3",
                "--log_every", "1", "--tracker", "none", "--output_dir", out))
    rows = read_jsonl(out / "metrics.jsonl")
    assert [row["step"] for row in rows if "train_loss" in row] == list(range(1, 9))
    assert [round(row["epoch"], 4) for row in rows if "train_loss" in row] == [round(3 * s / 8, 4) for s in range(1, 9)]
    assert read_json(out / "summary.json")["epochs"] == 3.0
