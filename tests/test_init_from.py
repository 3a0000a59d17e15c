"""--init_from: a new run started from trained weights, in every recipe and across class counts. Every tensor is
loaded as it is in the file, but the classifier where it was trained on other classes (another count, or other
names: --keep_classifier keeps it); weights of another model are one line (--init_partial loads what fits), and so is
a file that fits nothing, or only the head."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_errors import one_line, snapshot

from shared.checkpoints import Checkpoints
from shared.errors import RecipeError

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
    digest = Checkpoints.initial_weights(model, module.Config(init_from=str(tmp_path)), ["a", "b", "c"])
    assert digest == hashlib.sha256((tmp_path / "model.safetensors").read_bytes()).hexdigest()
    head = [k for k, v in trained.items() if v.shape != before[k].shape]  # the classifier's weight and bias
    assert len(head) == 2
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name] if name in head else trained[name]), name


def test_a_resume_records_the_sha256_its_run_recorded_and_nothing_else(tmp_path):
    """A resume reads no --init_from file: the hash comes from the run's config.json, which may come from anywhere, so
    only a sha256 as a run writes it is kept (a megabyte of text would go on into config.json and the tracker)."""
    from types import SimpleNamespace

    from shared.init_from import initial_weights

    digest = hashlib.sha256(b"weights").hexdigest()
    cfg = SimpleNamespace(resume="latest", output_dir=str(tmp_path), init_from=str(tmp_path / "gone.safetensors"))
    for recorded, kept in ((digest, digest), ("f" * 10**6, None), (digest.upper(), None), ([digest], None),
                           (None, None)):
        (tmp_path / "config.json").write_text(json.dumps({"init_from_sha256": recorded}))
        assert initial_weights(None, cfg, []) == kept
    (tmp_path / "config.json").write_text("[1, 2]")  # not a run's config.json
    assert initial_weights(None, cfg, []) is None


def test_a_run_started_from_another_runs_weights(env, source, three_classes, tmp_path):
    out = tmp_path / "run"
    args = ("--data", str(three_classes), *SHORT, "--init_from", str(source), "--checkpoint_every", "1",
            "--output_dir", str(out))
    result = ok(run_here("cifar_cnn", *args, "--max_steps", "2"))
    file = source / "model.safetensors"
    assert f"--init_from {file}: 20 of 22 tensors loaded; new: 15.weight, 15.bias" in result.stdout
    config = read_json(out / "config.json")
    assert config["init_from"] == str(source) and config["classes"] == ["cat", "dog", "fox"]
    assert config["init_from_sha256"] == hashlib.sha256(file.read_bytes()).hexdigest()
    assert read_json(out / "summary.json")["steps"] == 2  # its own schedule, from step 0
    # Another file given to a resume: refused, nothing written (a resume's weights are its checkpoint's)
    other = tmp_path / "other.safetensors"
    shutil.copy(file, other)
    before = snapshot(out)
    refused = run_here("cifar_cnn", "--init_from", other, "--output_dir", out, "--resume", "latest")
    one_line(refused, f"--init_from {other}: a resume takes its weights from its checkpoint", status=2)
    assert snapshot(out) == before
    # A resume takes the weights from its checkpoint: the file is not read, moved away here since (the run continues
    # by its folder alone), the hash stays the run's record, and nothing has changed.
    file.rename(moved := file.with_name("moved.safetensors"))
    try:
        resumed = ok(run_here("cifar_cnn", *args, "--max_steps", "3", "--resume", "latest"))
    finally:
        moved.rename(file)
    changed = next(line for line in resumed.stdout.splitlines() if line.startswith("changed since the checkpoint"))
    assert "tensors loaded" not in resumed.stdout and "init_from" not in changed and "total_steps 2 -> 3" in changed
    assert read_json(out / "config.json")["init_from_sha256"] == config["init_from_sha256"]
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


def cut_short(source: Path, folder: Path) -> Path:
    """The weights as a copy or download stopped halfway leaves them."""
    weights = (source / "model.safetensors").read_bytes()
    (folder / "cut.safetensors").write_bytes(weights[:len(weights) // 2])
    return folder / "cut.safetensors"


def fifo(source: Path, folder: Path) -> Path:
    os.mkfifo(folder / "w.safetensors")
    return folder / "w.safetensors"


@pytest.mark.parametrize("make, needle", [
    (only_the_head, "head.safetensors holds another model's weights ('0.weight' is missing in the file, (32, 3, 5, 5) "
     "in the model, and 19 more tensors differ): pass weights of this model"),
    (the_mlps_weights, "mlp.safetensors holds another model's weights ('0.weight' is missing in the file"),
    (nan_weights, "nan.safetensors holds NaN or infinite weights"),
    (cut_short, "cut.safetensors cannot be read (SafetensorError: Error while deserializing header: incomplete "
     "metadata, file not fully covered): pass a model.safetensors written by a run"),
    # a folder of no weights and no checkpoints, as a run's is before its end and its first checkpoint
    (lambda source, folder: folder, "no regular .safetensors file there: pass a run's model.safetensors (written as "
     "it finishes), or the run or checkpoint folder that holds one"),
    (lambda source, folder: source / "checkpoints", "no regular .safetensors file there"),
    (lambda source, folder: folder / "typo.safetensors", "typo.safetensors: no such file or folder: pass a run's"),
    (fifo, "w.safetensors: no regular .safetensors file there: pass a run's"),  # a read of it would block for ever
])
def test_weights_that_do_not_fit_are_one_line(env, source, three_classes, tmp_path, make, needle):
    path = make(source, tmp_path)
    one_line(run_here("cifar_cnn", "--data", three_classes, *SHORT, "--max_steps", "1", "--init_from", path,
                      "--output_dir", tmp_path / "out"), needle)
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_a_run_that_has_not_written_its_weights_names_its_newest_checkpoint(env, source, three_classes, tmp_path):
    stopped = tmp_path / "stopped"  # a run folder as a stop leaves it: its checkpoints, no weights yet
    shutil.copytree(source / "checkpoints", stopped / "checkpoints")
    one_line(run_here("cifar_cnn", "--data", three_classes, *SHORT, "--max_steps", "1", "--init_from", stopped,
                      "--output_dir", tmp_path / "out"), "no regular .safetensors file there: the run has not "
             f"written its weights (stopped, or still running): pass {stopped / 'checkpoints' / 'step_2'}, its newest "
             "checkpoint")


def test_with_init_partial_what_fits_is_loaded_and_the_rest_refused_as_before(source, three_classes, tmp_path):
    for make, needle in ((only_the_head, "head.safetensors: only the last layer of it fits this model"),
                         (the_mlps_weights, "mlp.safetensors: no tensor of it fits this model")):
        one_line(run_here("cifar_cnn", "--data", three_classes, *SHORT, "--max_steps", "1", "--init_partial",
                          "--init_from", make(source, tmp_path), "--output_dir", tmp_path / "out"), needle)


def test_a_classifier_trained_on_other_class_names_starts_new_unless_kept(source, tmp_path):
    """Ten classes again, but not the source's ten: the count fits, the classes do not (it loaded all 22 tensors)."""
    other = cifar_folder(tmp_path / "cifar-10-batches-bin", random_splits((3, 32, 32), sizes=(24, 9), classes=10),
                         [f"digit {i}" for i in range(10)])
    args = ("--data", other, *SHORT, "--max_steps", "1", "--init_from", source)
    result = ok(run_here("cifar_cnn", *args, "--output_dir", tmp_path / "new"))
    assert ("20 of 22 tensors loaded; new: 15.weight, 15.bias (its classifier was trained on class_0, class_1, "
            "class_2, class_3, ..., this data's classes are digit 0, digit 1, digit 2, digit 3, ...: "
            "--keep_classifier keeps it)") in result.stdout
    kept = ok(run_here("cifar_cnn", *args, "--keep_classifier", "--output_dir", tmp_path / "kept"))
    assert "22 of 22 tensors loaded; new: none" in kept.stdout


@pytest.mark.parametrize("recorded", ["5", '{"a": 1}', '["cat", 7]'])
def test_class_names_a_file_records_that_are_no_list_of_names_are_one_line(tmp_path, recorded):
    """A file from anywhere may record anything as its classes: a number ended in a TypeError's traceback."""
    from recipes import cifar_cnn

    state = cifar_cnn.make_model(10).state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "model.safetensors",
              metadata={"classes": recorded})
    cfg = cifar_cnn.Config(init_from=str(tmp_path))
    with pytest.raises(RecipeError, match=r"records its classes as .*, not a list of names: pass a model.safetensors"):
        Checkpoints.initial_weights(cifar_cnn.make_model(10), cfg, [f"class_{i}" for i in range(10)])


def test_another_architecture_is_refused_or_loaded_in_part_on_request(tmp_path):
    """A ResNet-50 state dict given to finetune.py's resnet18 loaded 98 of 122 tensors and trained."""
    import torchvision

    finetune = importlib.import_module("recipes.finetune")
    torch.manual_seed(0)
    save_file(torchvision.models.resnet50(num_classes=3).state_dict(), tmp_path / "model.safetensors")
    cfg = finetune.Config(init_from=str(tmp_path), weights="none")
    with pytest.raises(RecipeError, match=r"holds another model's weights \('layer1.0.conv1.weight' is "
                                          r"\(64, 64, 1, 1\) in the file, \(64, 64, 3, 3\) in the model, and \d+ more"):
        Checkpoints.initial_weights(finetune.make_model(3, cfg), cfg, ["a", "b", "c"])
    partial = finetune.Config(init_from=str(tmp_path), weights="none", init_partial=True)
    Checkpoints.initial_weights(finetune.make_model(3, partial), partial, ["a", "b", "c"])  # conv1, bn1, ...: fit
