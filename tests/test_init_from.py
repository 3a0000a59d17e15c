"""--init_from: a new run started from trained weights, in every recipe and across class counts. What fits (name and
shape) is loaded as it is in the file; a head for another number of classes stays new; a file that fits nothing, or
only the head, is one line."""

from __future__ import annotations

import hashlib
import importlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_errors import one_line

from conftest import ok, read_json, run_here
from tiny_data import cifar_binary_dataset, cifar_folder, random_splits

SHORT = ("--batch_size", "8", "--log_every", "1", "--tracker", "none")


@pytest.fixture(scope="module")
def source(env, tmp_path_factory) -> Path:
    """A finished cifar_cnn run on 10 classes: the weights to start from."""
    folder = tmp_path_factory.mktemp("init")
    data = cifar_binary_dataset(folder / "data", sizes={"train": 32, "test": 8})
    ok(run_here("cifar_cnn", "--data", data, *SHORT, "--max_steps", "2", "--output_dir", folder / "run"))
    return folder / "run"


@pytest.fixture(scope="module")
def three_classes(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("three") / "cifar-10-batches-bin"
    return cifar_folder(folder, random_splits((3, 32, 32), sizes=(24, 9), classes=3), ["cat", "dog", "fox"])


@pytest.mark.parametrize("recipe", ["cifar_cnn", "resnet18_fmnist", "deep_mlp_ckpt", "finetune"])
def test_every_tensor_that_fits_is_loaded_and_the_head_is_new(recipe, tmp_path):
    from shared.checkpoints import Checkpoints

    module = importlib.import_module(f"recipes.{recipe}")
    torch.manual_seed(0)
    trained = module.make_model(10, module.Config()).state_dict()  # stands in for a run's model.safetensors
    save_file({k: v.contiguous() for k, v in trained.items()}, tmp_path / "model.safetensors")
    model = module.make_model(3, module.Config())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    digest = Checkpoints.initial_weights(model, module.Config(init_from=str(tmp_path)))
    assert digest == hashlib.sha256((tmp_path / "model.safetensors").read_bytes()).hexdigest()
    head = [k for k, v in trained.items() if v.shape != before[k].shape]  # the classifier's weight and bias
    assert len(head) == 2
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name] if name in head else trained[name]), name


def test_a_run_started_from_another_runs_weights(env, source, three_classes, tmp_path):
    out = tmp_path / "run"
    args = ("--data", str(three_classes), *SHORT, "--init_from", str(source), "--checkpoint_every", "1",
            "--output_dir", str(out))
    result = ok(run_here("cifar_cnn", *args, "--max_steps", "2"))
    file = source / "model.safetensors"
    assert f"--init_from {file}: 23 of 25 tensors loaded; new: 15.weight, 15.bias" in result.stdout
    config = read_json(out / "config.json")
    assert config["init_from"] == str(source) and config["classes"] == ["cat", "dog", "fox"]
    assert config["init_from_sha256"] == hashlib.sha256(file.read_bytes()).hexdigest()
    assert read_json(out / "summary.json")["steps"] == 2  # its own schedule, from step 0
    # A resume takes the weights from its checkpoint; the file is only hashed, and nothing has changed.
    resumed = ok(run_here("cifar_cnn", *args, "--max_steps", "3", "--resume", "latest"))
    changed = next(line for line in resumed.stdout.splitlines() if line.startswith("changed since the checkpoint"))
    assert "tensors loaded" not in resumed.stdout and "init_from" not in changed and "total_steps 2 -> 3" in changed
    evaluated = ok(run_here("predict", "--weights", out / "model.safetensors", "--recipe", "cifar_cnn", "--evaluate"))
    assert json.loads(evaluated.stdout.strip().splitlines()[-1])["eval_samples"] == 9


def only_the_head(source: Path, folder: Path) -> Path:
    weight = load_file(source / "model.safetensors")["15.weight"]  # the classifier: 10 classes x 64 features
    save_file({"15.weight": weight[:3].contiguous(), "15.bias": torch.zeros(3)}, folder / "head.safetensors")
    return folder / "head.safetensors"


def nan_weights(source: Path, folder: Path) -> Path:
    trained = load_file(source / "model.safetensors")
    trained["0.weight"][0, 0, 0, 0] = float("nan")
    save_file(trained, folder / "nan.safetensors")
    return folder / "nan.safetensors"


def the_mlps_weights(source: Path, folder: Path) -> Path:
    module = importlib.import_module("recipes.deep_mlp_ckpt")
    save_file({k: v.contiguous() for k, v in module.make_model(10, module.Config()).state_dict().items()},
              folder / "mlp.safetensors")
    return folder / "mlp.safetensors"


@pytest.mark.parametrize("make, needle", [
    (only_the_head, "head.safetensors: only the last layer of it fits this model (same name and shape)"),
    (the_mlps_weights, "mlp.safetensors: no tensor of it fits this model"),
    (nan_weights, "nan.safetensors holds NaN or infinite weights"),
    (lambda source, folder: folder, "no .safetensors file there: pass a run's model.safetensors"),
    (lambda source, folder: source / "checkpoints", "no .safetensors file there"),
])
def test_weights_that_do_not_fit_are_one_line(env, source, three_classes, tmp_path, make, needle):
    path = make(source, tmp_path)
    one_line(run_here("cifar_cnn", "--data", three_classes, *SHORT, "--max_steps", "1", "--init_from", path,
                      "--output_dir", tmp_path / "out"), needle)
    assert not (tmp_path / "out" / "model.safetensors").exists()
