"""recipes/cifar_cnn.py launched for real on tiny data, judged by the files each run leaves."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from conftest import launch, ok, read_json, read_jsonl
from tiny_data import image_splits, imagefolder_dataset, parquet_dataset, save_to_disk_dataset, text_dataset

SHORT = ("--max_steps", "6", "--batch_size", "8", "--log_every", "2", "--tracker", "none")


@pytest.fixture(scope="module")
def disk_data(tmp_path_factory):
    return save_to_disk_dataset(tmp_path_factory.mktemp("data") / "tiny_cifar")


def check_run_files(run_dir, *, world_size, steps, test_size, batch_size=8, mixed_precision="no"):
    """The contract's outputs exist once, with contents that agree with each other."""
    config = read_json(run_dir / "config.json")
    assert config["world_size"] == world_size and config["mixed_precision"] == mixed_precision
    assert config["global_batch_size"] == batch_size * world_size
    assert config["versions"]["torch"] == torch.__version__

    rows = read_jsonl(run_dir / "metrics.jsonl")
    train_rows = [r for r in rows if "train_loss" in r]
    eval_rows = [r for r in rows if "eval_acc" in r]
    assert [r["step"] for r in train_rows] == list(range(2, steps + 1, 2))  # each point once, even with 2 processes
    for row in train_rows:
        assert row["train_loss"] > 0 and row["lr"] >= 0 and row["samples_per_s"] > 0 and row["epoch"] > 0
    assert eval_rows and eval_rows[-1]["step"] == steps
    assert eval_rows[-1]["eval_samples"] == test_size  # every test image counted exactly once
    assert 0 <= eval_rows[-1]["eval_acc"] <= 1

    summary = read_json(run_dir / "summary.json")
    for key in ("eval_acc", "eval_loss", "steps", "epochs", "wall_s", "samples_per_s", "peak_mem_mb", "world_size", "mixed_precision"):
        assert key in summary, key
    assert summary["steps"] == steps and summary["world_size"] == world_size
    assert summary["eval_acc"] == eval_rows[-1]["eval_acc"]
    assert summary["peak_mem_mb"] > 0 and summary["wall_s"] > 0

    with Image.open(run_dir / "curves.png") as image:
        assert image.format == "PNG" and image.size[0] >= 600 and image.size[1] >= 300

    from recipes.cifar_cnn import make_model  # noqa: E402  (imports are cheap; the recipe runs only under main())
    weights = load_file(run_dir / "model.safetensors")
    model = make_model(10)
    assert set(weights) == set(model.state_dict())  # no `module.` or `_orig_mod.` prefixes
    model.load_state_dict(weights)
    checkpoint = run_dir / "checkpoints" / f"step_{steps}"
    assert (checkpoint / "optimizer.bin").exists() and (checkpoint / "scheduler.bin").exists()
    assert sorted(p.name for p in checkpoint.glob("random_states_*.pkl")) == [f"random_states_{i}.pkl" for i in range(world_size)]
    assert torch.equal(load_file(checkpoint / "model.safetensors")["0.weight"], weights["0.weight"])
    assert not list(run_dir.glob("checkpoints/partial_*"))


def test_cpu_yaml_on_a_save_to_disk_folder(env, disk_data, tmp_path):
    out = tmp_path / "run"
    ok(launch(env, "cifar_cnn", "--data", str(disk_data), "--output_dir", str(out), *SHORT))
    check_run_files(out, world_size=1, steps=6, test_size=20)
    # Decoded once, cached under the dataset's fingerprint for the next run.
    cached = {p.name.split("-")[0] for p in (Path(env["HF_HOME"]) / "datasets" / "decoded").glob("*-3x32x32.safetensors")}
    assert {datasets.load_from_disk(str(disk_data))[s]._fingerprint for s in ("train", "test")} <= cached


def test_2gpu_yaml_as_two_cpu_processes_on_parquet(env, tmp_path):
    data = parquet_dataset(tmp_path / "parquet", sizes={"train": 64, "test": 21})  # 21: uneven over 2 processes
    out = tmp_path / "run"
    result = ok(launch(env, "cifar_cnn", "--data", str(data), "--output_dir", str(out), *SHORT, config="2gpu", use_cpu=True))
    assert "2 process(es)" in result.stdout and "global batch 16" in result.stdout
    check_run_files(out, world_size=2, steps=6, test_size=21)


def test_bf16_yaml_runs_on_cpu_with_imagefolder(env, tmp_path):
    data = imagefolder_dataset(tmp_path / "imagefolder")
    out = tmp_path / "run"
    ok(launch(env, "cifar_cnn", "--data", str(data), "--output_dir", str(out), *SHORT, config="bf16"))
    check_run_files(out, world_size=1, steps=6, test_size=20, mixed_precision="bf16")


def test_1gpu_yaml_without_a_gpu_trains_on_the_cpu(env, disk_data, tmp_path):
    out = tmp_path / "run"
    result = ok(launch(env, "cifar_cnn", "--data", str(disk_data), "--output_dir", str(out), *SHORT, config="1gpu"))
    assert "on cpu" in result.stdout
    assert read_json(out / "summary.json")["steps"] == 6


def test_synthetic_data_is_learnable_and_labelled(env, tmp_path):
    out = tmp_path / "run"
    ok(launch(env, "cifar_cnn", "--synthetic", "--max_steps", "200", "--log_every", "50", "--output_dir", str(out)))
    summary = read_json(out / "summary.json")
    assert summary["eval_acc"] > 0.35, summary  # 10 classes: chance is 0.10
    assert summary["synthetic"] is True and "SYNTHETIC" in summary["data"]
    assert read_json(out / "config.json")["data"] == "SYNTHETIC data"
    assert all(row["synthetic"] is True for row in read_jsonl(out / "metrics.jsonl"))
    offline_runs = list((out / "wandb").glob("offline-run-*"))  # default tracker, no API key: offline
    assert len(offline_runs) == 1 and list(offline_runs[0].glob("run-*.wandb"))


def test_eval_only_reproduces_the_final_accuracy(env, disk_data, tmp_path):
    out = tmp_path / "run"
    ok(launch(env, "cifar_cnn", "--data", str(disk_data), "--output_dir", str(out), *SHORT))
    result = ok(launch(env, "cifar_cnn", "--data", str(disk_data), "--eval_only", "--weights", str(out / "model.safetensors")))
    evaluation = json.loads(result.stdout.strip().splitlines()[-1])
    assert evaluation["eval_acc"] == read_json(out / "summary.json")["eval_acc"]
    assert evaluation["eval_samples"] == 20


def test_help_lists_the_contract_flags_with_units(env):
    result = ok(launch(env, "cifar_cnn", "--help", config=None))
    for flag in ("--data", "--synthetic", "--epochs", "--max_steps", "--batch_size", "--lr", "--grad_accum", "--seed",
                 "--output_dir", "--checkpoint_every", "--resume", "--eval_only", "--weights", "--tracker",
                 "--compile", "--channels_last"):
        assert flag in result.stdout, flag
    assert "images per process per step" in result.stdout


# ------------------------------------------------------------------ bad input: one line, non-zero exit
def one_line_error(result, *needles):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # `python recipes/...`: nothing but the message
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_unknown_flag(env):
    one_line_error(launch(env, "cifar_cnn", "--bogus", "1", config=None), "unrecognized arguments: --bogus")


def test_out_of_range_flag(env):
    one_line_error(launch(env, "cifar_cnn", "--batch_size", "0", config=None), "--batch_size must be > 0")


def test_missing_local_path(env, tmp_path):
    one_line_error(launch(env, "cifar_cnn", "--data", str(tmp_path / "nope"), "--tracker", "none", config=None),
                   "no such folder", "--synthetic")


def test_dataset_without_an_image_column(env, tmp_path):
    data = text_dataset(tmp_path / "text")
    one_line_error(launch(env, "cifar_cnn", "--data", str(data), "--tracker", "none", config=None), "no image column", "text")


def test_images_of_the_wrong_size(env, tmp_path):
    data = save_to_disk_dataset(tmp_path / "small", shape=(3, 28, 28))
    one_line_error(launch(env, "cifar_cnn", "--data", str(data), "--tracker", "none", config=None), "28x28", "expects 32x32")


def test_grayscale_images_for_a_colour_recipe(env, tmp_path):
    data = save_to_disk_dataset(tmp_path / "gray", shape=(1, 32, 32))
    one_line_error(launch(env, "cifar_cnn", "--data", str(data), "--tracker", "none", config=None), "grayscale")


def test_hub_id_without_network(env):
    # HF_HUB_OFFLINE gives the same answer as a machine without network, without 20 s of retries.
    result = launch(dict(env, HF_HUB_OFFLINE="1"), "cifar_cnn", "--data", "someone/not-cached", "--tracker", "none", config=None)
    one_line_error(result, "hub could not provide it", "--data PATH", "--synthetic")


def test_fp16_on_cpu_points_to_bf16(env, disk_data, tmp_path):
    result = launch(env, "cifar_cnn", "--data", str(disk_data), "--output_dir", str(tmp_path / "run"), config="fp16")
    assert result.returncode != 0
    assert result.stderr.count("error: fp16 mixed precision needs a GPU") == 1 and "bf16.yaml" in result.stderr
    assert 'recipes/cifar_cnn.py", line' not in result.stderr  # no traceback from the recipe itself
    assert not (tmp_path / "run").exists()


def test_2gpu_yaml_without_gpus_stops_the_duplicate_runs(env, disk_data, tmp_path):
    result = launch(env, "cifar_cnn", "--data", str(disk_data), "--output_dir", str(tmp_path / "run"), config="2gpu")
    assert result.returncode != 0
    assert result.stderr.count("error: 2 processes were launched but no GPUs were found") == 1
    assert "ACCELERATE_USE_CPU=true" in result.stderr
    assert 'recipes/cifar_cnn.py", line' not in result.stderr
    assert not (tmp_path / "run").exists()


def test_refuses_to_overwrite_a_finished_run(env, disk_data, tmp_path):
    out = tmp_path / "run"
    ok(launch(env, "cifar_cnn", "--data", str(disk_data), "--output_dir", str(out), *SHORT))
    before = {p: p.read_bytes() for p in out.glob("*.json*")}
    one_line_error(launch(env, "cifar_cnn", "--data", str(disk_data), "--output_dir", str(out), *SHORT, config=None),
                   "already holds a run", "--resume latest", "--overwrite")
    assert before == {p: p.read_bytes() for p in out.glob("*.json*")}
