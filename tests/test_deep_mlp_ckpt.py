"""recipes/deep_mlp_ckpt.py: checkpointing changes memory and time, never the gradients."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file
from torch.utils.checkpoint import checkpoint

import recipes.deep_mlp_ckpt
import shared.data
import shared.synthetic
from recipes.deep_mlp_ckpt import Config, DeepMLP, make_model, make_optimizer, preprocess
from recipes.deep_mlp_sweep import saved_bytes

from conftest import launch, ok, read_json, read_jsonl, run_here
from tiny_data import cifar_binary_dataset


def opened(model: DeepMLP) -> DeepMLP:
    """Every gate set to 0.5, as after some training: at 0 (their start) no hidden layer gets a gradient."""
    with torch.no_grad():
        for layer in model.layers[:-1]:
            layer.gate.fill_(0.5)
    return model


def gradients(model: DeepMLP, x, labels, seed=0) -> dict:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks in every mode
    F.cross_entropy(model(x), labels).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


NARROW = 64


@pytest.fixture
def batch(monkeypatch):
    """The recipe's 72 layers at width 64 instead of 1000, and a batch for them: what checkpointing does to gradients
    does not depend on the width, and a 244th of the weights took these tests from 24 s to 7 s."""
    monkeypatch.setattr(recipes.deep_mlp_ckpt, "WIDTH", NARROW)
    torch.manual_seed(0)
    return torch.randn(4, NARROW), torch.randint(100, (4,))


MODES = [("sequential", k) for k in (1, 2, 8, 9, 72)] + [("blocks", k) for k in (1, 5, 8, 72)]


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("mode, segments", MODES)
def test_every_mode_gives_the_gradients_of_no_checkpointing(batch, mode, segments, dropout):
    torch.manual_seed(1)
    model = opened(DeepMLP(100, dropout=dropout))
    reference = gradients(model, *batch)
    model.ckpt, model.segments, model.preserve_rng_state = mode, segments, True
    checkpointed = gradients(model, *batch)
    assert reference.keys() == checkpointed.keys()
    worst = max((reference[k] - checkpointed[k]).abs().max().item() for k in reference)
    assert worst <= 1e-6, f"{mode} x {segments}, dropout {dropout}: max |grad difference| {worst:.3g}"
    assert all(g.abs().sum() > 0 for g in checkpointed.values())  # every layer, the first one too, gets gradients


def test_without_preserve_rng_state_dropout_gradients_go_wrong(batch):
    torch.manual_seed(1)
    model = opened(DeepMLP(100, dropout=0.2))
    reference = gradients(model, *batch)
    model.ckpt, model.segments, model.preserve_rng_state = "sequential", 8, False
    wrong = gradients(model, *batch)  # recomputation draws new dropout masks
    assert max((reference[k] - wrong[k]).abs().max().item() for k in reference) > 1e-3


def test_the_reentrant_trap_the_seed_hit(batch):
    """use_reentrant=True with an input that needs no grad: the segment's parameters get none."""
    torch.manual_seed(1)
    model = opened(DeepMLP(100))
    x, labels = batch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch warns: "None of the inputs have requires_grad=True"
        hidden = checkpoint(model.layers[:8], x, use_reentrant=True)
    F.cross_entropy(model.layers[8:](hidden), labels).backward()
    assert model.layers[0].branch[0].weight.grad is None  # silently untrained
    assert model.layers[8].branch[0].weight.grad.abs().sum() > 0


def test_saved_activations_fall_from_one_segment_towards_sqrt_n():
    torch.manual_seed(1)
    model = DeepMLP(100)
    x = torch.randn(64, 1000)
    held = {}
    for segments in (1, 2, 3, 4, 6, 8):
        model.ckpt, model.segments = "sequential", segments
        held[segments] = saved_bytes(model, x, model)
    model.ckpt = "none"
    none = saved_bytes(model, x, model)
    assert held[1] == none  # checkpoint_sequential never checkpoints its last segment: 1 segment = none
    values = list(held.values())
    assert all(a > b for a, b in zip(values, values[1:])), held
    assert held[8] <= 0.25 * none, (held[8], none)


def test_the_72_layers_learn(tmp_path, monkeypatch):
    """The recipe's model, optimizer and inputs leave chance (loss ln 100 = 4.6, accuracy 0.01) within 15 steps (3.99
    and 0.13 here)."""
    monkeypatch.setattr(shared.data, "CACHE_DIR", tmp_path)
    train, test = shared.synthetic.make_synthetic((3, 32, 32), 64 * 15, 500, num_classes=100)
    torch.manual_seed(0)
    model = make_model(100)
    optimizer = make_optimizer(model, Config())  # the seed's Adam at a constant 0.002
    losses = []
    for start in range(0, len(train), 64):
        loss = F.cross_entropy(model(preprocess(train.images[start:start + 64])), train.labels[start:start + 64])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        accuracy = (model(preprocess(test.images)).argmax(1) == test.labels).float().mean().item()
    assert sum(losses[-5:]) / 5 < 4.3, losses  # the plain 72-layer stack stayed above 4.6 for 400 steps
    assert accuracy >= 0.05, accuracy  # five times chance


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return cifar_binary_dataset(tmp_path_factory.mktemp("mlp") / "data", sizes={"train": 64, "test": 20})


@pytest.mark.slow  # two processes
def test_trains_on_two_processes_in_bf16(env, data, tmp_path):
    """One process with --ckpt sequential and dropout trains (and resumes bitwise) in test_stops.py's kill -9
    test."""
    out = tmp_path / "run"
    ok(launch(env, "deep_mlp_ckpt", "--data", str(data), "--ckpt", "sequential", "--segments", "8", "--dropout", "0.1",
              "--batch_size", "8", "--max_steps", "2", "--log_every", "1", "--ema", "0.9", "--tracker", "none",
              "--output_dir", str(out), config="2gpu", use_cpu=True, launcher_args=("--mixed_precision", "bf16")))
    summary = read_json(out / "summary.json")
    assert summary["steps"] == 2 and summary["world_size"] == 2 and "eval_acc_ema" in summary
    assert read_json(out / "config.json")["mixed_precision"] == "bf16"
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "train_loss" in r] == [1, 2]
    assert set(load_file(out / "model.safetensors")) == set(DeepMLP(10).state_dict())


def test_sweep_writes_markdown_csv_and_png(env, tmp_path):
    out = tmp_path / "sweep"
    result = ok(run_here("deep_mlp_sweep", "--batch", "32", "--repeats", "1", "--segments", "8,72", "--output_dir",
                         out))
    assert "~ sqrt(72)" in result.stdout
    table = (out / "sweep.md").read_text()
    assert table.count("~ sqrt(72)") == 2  # at --batch and at the seed's 16
    rows = (out / "sweep.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * 3  # none, 8 and 72 segments at each batch
    eight = next(r for r in rows[1:] if r.startswith("32,8,"))
    saved_x = float(eight.split(",")[rows[0].split(",").index("saved_x")])
    assert saved_x <= 0.25
    with Image.open(out / "sweep.png") as image:
        assert image.format == "PNG"
    # Again into the same folder: refused, the first sweep's files kept (they were replaced); a folder below a file is
    # one line (it was a NotADirectoryError traceback)
    before = {file.name: file.read_bytes() for file in out.iterdir()}
    (tmp_path / "file").write_text("not a folder")
    for folder, needle in ((out, f"{out} already holds files, which a sweep would replace: pass a new or empty"),
                           (tmp_path / "file" / "sweep", f"cannot write to {tmp_path / 'file' / 'sweep'} (Not a "
                                                         "directory): pass --output_dir a writable folder, not a "
                                                         "file or a path inside one")):
        result = run_here("deep_mlp_sweep", "--batch", "32", "--repeats", "1", "--segments", "8", "--output_dir",
                          folder)
        assert result.returncode == 1 and result.stderr.startswith(f"error: {needle}")
        assert len(result.stderr.strip().splitlines()) == 1
    assert {file.name: file.read_bytes() for file in out.iterdir()} == before
