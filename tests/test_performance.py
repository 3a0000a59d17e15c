"""--auto_batch_size settles on the largest batch that fits, the same on every process.

Out-of-memory is simulated (tests/faults/sitecustomize.py) the way accelerate's own tests do it:
the loss of a batch larger than N raises the error PyTorch's CPU allocator raises."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_tracking import wandb_run_name

from conftest import ROOT, launch, ok, read_json
from tiny_data import save_to_disk_dataset

RUN = ("--batch_size", "64", "--auto_batch_size", "--max_steps", "2", "--log_every", "1", "--tracker", "none")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return save_to_disk_dataset(tmp_path_factory.mktemp("perf") / "data", sizes={"train": 64, "test": 20})


def faulty(env, above: int, rank: int | None = None) -> dict:
    extra = {"FAULT_OOM_RANK": str(rank)} if rank is not None else {}
    return dict(env, PYTHONPATH=str(ROOT / "tests" / "faults"), FAULT_OOM_ABOVE_BATCH=str(above), **extra)


def test_auto_batch_size_halves_until_a_step_fits(env, data, tmp_path):
    out = tmp_path / "run"
    result = ok(launch(faulty(env, 16), "cifar_cnn", "--data", str(data), "--output_dir", str(out), *RUN,
                       "--tracker", "wandb", config=None))
    assert "--auto_batch_size: 16 images per process fit (tried 64, 32, 16)" in result.stdout
    assert read_json(out / "config.json")["batch_size"] == 16
    assert wandb_run_name(out).startswith("cifar_cnn-1xno-b16-")  # the batch it settled on, not --batch_size 64
    assert read_json(out / "summary.json")["steps"] == 2


def test_two_processes_agree_when_only_one_runs_out_of_memory(env, data, tmp_path):
    # Only the second process fails above 8: if it settled alone, the group would hang.
    out = tmp_path / "run"
    result = ok(launch(faulty(env, 8, rank=1), "cifar_cnn", "--data", str(data), "--output_dir", str(out), *RUN,
                       config="2gpu", use_cpu=True, timeout=180))
    assert result.stdout.count("--auto_batch_size: 8 images per process fit (tried 64, 32, 16, 8)") == 1
    config = read_json(out / "config.json")
    assert config["batch_size"] == 8 and config["global_batch_size"] == 16


def test_when_nothing_fits_it_is_one_line(env, data, tmp_path):
    result = launch(faulty(env, 0), "cifar_cnn", "--data", str(data), "--output_dir", str(tmp_path / "run"), *RUN,
                    config=None)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: --auto_batch_size: not even a batch of 1 fits in memory: use a smaller model, bf16.yaml, "
        "or a device with more memory"]


def test_random_crop_cuts_each_image_at_its_own_offset():
    from shared.augment import random_crop

    images = torch.randint(0, 256, (64, 3, 8, 8), dtype=torch.uint8)
    padded = F.pad(images, (2, 2, 2, 2))
    crops = random_crop(images, padding=2)
    offsets = set()
    for image, crop in zip(padded, crops):
        matches = [(dy, dx) for dy in range(5) for dx in range(5) if torch.equal(image[:, dy:dy + 8, dx:dx + 8], crop)]
        assert matches, "a crop that is no window of the padded image"
        offsets.add(matches[0])
    assert len(offsets) > 10  # offsets differ from image to image
