"""recipes/finetune.py: a torchvision model fine-tuned on a folder of photos, its pretrained weights read from
torchvision's cache ($TORCH_HOME/hub/checkpoints/), where the test puts a file of torchvision's layout (ImageNet
weights cannot be downloaded here). Frozen first, then the whole network; exact resume; predict.py on the result;
offline without the file: one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchvision
from test_errors import one_line

from conftest import ROOT, assert_bitwise_equal, launch, ok, weights
from tiny_data import idx_folder, imagefolder_dataset, random_splits

# 24 training photos in batches of 8: 3 steps an epoch, the first epoch frozen
RUN = ("--image_size", "32", "--batch_size", "8", "--max_steps", "6", "--freeze_epochs", "1", "--log_every", "1",
       "--tracker", "none", "--checkpoint_every", "3")
CACHED = "resnet18-f37072fd.pth"  # the name torchvision's ResNet18_Weights.IMAGENET1K_V1 downloads to


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    return imagefolder_dataset(tmp_path_factory.mktemp("photos") / "shoes", sizes={"train": 24, "test": 9},
                               num_classes=3)


@pytest.fixture(scope="module")
def torch_home(tmp_path_factory) -> Path:
    """A torchvision hub cache holding resnet18's weights file, in torchvision's layout (random weights here)."""
    home = tmp_path_factory.mktemp("torch_home")
    (home / "hub" / "checkpoints").mkdir(parents=True)
    torch.manual_seed(0)
    torch.save(torchvision.models.resnet18().state_dict(), home / "hub" / "checkpoints" / CACHED)
    return home


@pytest.fixture(scope="module")
def reference(env, photos, torch_home, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ft") / "run"
    ok(launch(dict(env, TORCH_HOME=str(torch_home)), "finetune", "--data", str(photos), *RUN, "--output_dir", str(out),
              "--keep_checkpoints", "5"))
    return out


def test_the_frozen_backbone_keeps_the_pretrained_weights_then_trains(reference, torch_home):
    pretrained = torch.load(torch_home / "hub" / "checkpoints" / CACHED, weights_only=True)
    after_freeze = weights(reference / "checkpoints" / "step_3")
    backbone = [k for k in pretrained if not k.startswith("fc.")]
    for name in backbone:  # weights and BatchNorm's running statistics, as in the file
        assert torch.equal(after_freeze[name], pretrained[name]), name
    assert after_freeze["fc.weight"].shape == (3, 512)  # the new classifier, trained
    final = weights(reference)
    assert not torch.equal(final["layer4.1.conv2.weight"], pretrained["layer4.1.conv2.weight"])  # then unfrozen


def test_a_resume_at_the_end_of_the_frozen_epoch_is_exact(env, photos, torch_home, reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    shutil.rmtree(out / "checkpoints" / "step_6")
    (out / "model.safetensors").unlink()
    ok(launch(dict(env, TORCH_HOME=str(torch_home)), "finetune", "--data", str(photos), *RUN, "--output_dir", str(out),
              "--keep_checkpoints", "5", "--resume", "latest"))
    assert_bitwise_equal(weights(out), weights(reference))


def test_predict_uses_the_fine_tuned_model(env, photos, reference, tmp_path):
    result = ok(subprocess.run([sys.executable, "recipes/predict.py", "--weights", str(reference / "model.safetensors"),
                                "--recipe", "finetune", "--images", str(photos / "test"), "--output",
                                str(tmp_path / "predictions.csv")], cwd=ROOT, env=env, capture_output=True, text=True))
    rows = (tmp_path / "predictions.csv").read_text().splitlines()
    assert len(rows) == 1 + 9 and "finetune" in result.stdout


def test_offline_without_the_weights_file_is_one_line(env, photos, tmp_path):
    offline = dict(env, TORCH_HOME=str(tmp_path / "empty"), HTTPS_PROXY="http://127.0.0.1:9",
                   https_proxy="http://127.0.0.1:9")  # no download, wherever the test runs
    line = one_line(launch(offline, "finetune", "--data", str(photos), *RUN, "--output_dir", str(tmp_path / "out")),
                    f"{tmp_path / 'empty' / 'hub' / 'checkpoints' / CACHED} is not there and could not be downloaded "
                    "from https://download.pytorch.org/models/resnet18-f37072fd.pth",
                    "or pass --weights none")
    assert "ResNet18_Weights.IMAGENET1K_V1" in line


def test_a_cached_weights_file_with_compressed_entries_is_not_inflated(env, photos, torch_home, tmp_path):
    """The cache may hold a file from anywhere: deflated entries could inflate to any size in torch.load."""
    from test_hostile import zip_bomb

    home = tmp_path / "home"
    shutil.copytree(torch_home, home)
    zip_bomb(home / "hub" / "checkpoints" / CACHED)
    one_line(launch(dict(env, TORCH_HOME=str(home)), "finetune", "--data", str(photos), *RUN, "--output_dir",
                    str(tmp_path / "out")), f"{CACHED}' holds compressed entries (", "which torch.save never writes")
    (home / "hub" / "checkpoints" / CACHED).unlink()
    os.mkfifo(home / "hub" / "checkpoints" / CACHED)  # would block the read forever
    one_line(launch(dict(env, TORCH_HOME=str(home)), "finetune", "--data", str(photos), *RUN, "--output_dir",
                    str(tmp_path / "out2")), f"{CACHED}' is not a regular file (a FIFO, socket, device or folder)")


def test_photos_that_would_not_fit_in_memory_decoded_are_refused_first(env, photos, tmp_path):
    """33 photos at 200,000 px take 3.6 TiB decoded (the decode holds both splits at once), on any machine: one line,
    before any photo is decoded."""
    line = one_line(launch(env, "finetune", "--data", str(photos), "--weights", "none", "--image_size", "200000",
                           "--tracker", "none", "--output_dir", str(tmp_path / "out")),
                    "33 images of 3x200000x200000 take 3688.0 GiB decoded, more than the",
                    "use smaller images (finetune.py: --image_size) or fewer")
    assert "GiB of free memory" in line


def test_published_files_that_would_not_fit_in_memory_converted_are_refused_first(env, tmp_path):
    """IDX files are read, then converted to --image_size all at once: the same bound, before the conversion."""
    digits = idx_folder(tmp_path / "digits", random_splits((28, 28), sizes=(24, 9), classes=3))
    line = one_line(launch(env, "finetune", "--data", str(digits), "--weights", "none", "--image_size", "200000",
                           "--tracker", "none", "--output_dir", str(tmp_path / "out")),
                    "33 images of 3x200000x200000 take 3688.0 GiB decoded, more than the")
    assert "GiB of free memory" in line
