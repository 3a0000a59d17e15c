"""shared/loop.py on a CPU: which runs capture their step and which run it eagerly, the learning rate written into a
captured tensor, and the models' convolutions that BatchNorm follows carry no bias. A capture itself needs a GPU
(benchmarks/gpu_speed.sh measures it, with a resume, in benchmarks/results/gpu-*); that the step makes no host sync,
which a capture refuses, is tests/test_step_cost.py's."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from shared import loop
from shared.config import RunConfig


def accelerator(device="cuda", processes=1, precision="bf16"):
    return SimpleNamespace(device=torch.device(device), num_processes=processes, mixed_precision=precision)


@pytest.mark.parametrize("where, flags, why", [
    (accelerator(), {}, None),
    (accelerator(), {"cuda_graph": False}, "--no-cuda_graph"),
    (accelerator("cpu"), {}, "not on a GPU"),
    (accelerator(processes=2), {}, "several processes (DDP's gradient hooks)"),
    (accelerator(), {"grad_accum": 2}, "--grad_accum above 1"),
    (accelerator(precision="fp16"), {}, "fp16 (its loss scaler reads the gradient)"),
    (accelerator(), {"compile": True}, "--compile"),
])
def test_which_runs_capture_their_step(where, flags, why):
    assert loop.graph_setting(where, RunConfig(**flags)) == why


def test_a_step_that_cannot_be_captured_runs_eagerly_and_the_same():
    model = nn.Linear(3, 2)
    adam = torch.optim.Adam(model.parameters(), fused=True)  # capturable=False: its step count on the host
    assert "not capturable" in loop.CapturedStep(lambda x: x, adam, None).eager_because
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    step = loop.CapturedStep(lambda x: (model(x).sum(),), sgd, "not on a GPU")
    inputs = torch.randn(4, 3)
    assert torch.equal(step(inputs)[0], model(inputs).sum()) and step.graph is None and step.calls == 0


CAPTURE_ERROR = "CUDA error: operation not permitted when stream is capturing\nCUDA kernel errors might be ..."


@pytest.mark.parametrize("error, said", [(RuntimeError(CAPTURE_ERROR),
                                          "CUDA error: operation not permitted when stream is capturing"),
                                         (RuntimeError(), "RuntimeError")])  # no message: the exception's name
def test_a_capture_that_fails_says_so_in_one_line_and_the_step_runs_eagerly(monkeypatch, capsys, error, said):
    """The capture's error, its first line, in the warning; the eager step's outputs and rates as before it. An error
    without a message (an empty first line) ended the run in an IndexError traceback instead."""
    def capture(graph):
        raise error

    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)  # a capture needs a GPU: its API stands in here
    monkeypatch.setattr(torch.cuda, "graph", capture)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    step = loop.CapturedStep(lambda x: (model(x).sum(),), optimizer, None)
    inputs = torch.randn(4, 3)
    assert torch.equal(step._capture((inputs,))[0], model(inputs).sum())
    assert step.graph is None and optimizer.param_groups[0]["lr"] == 0.1
    assert step.eager_because == f"its capture failed (RuntimeError: {said})"
    assert capsys.readouterr().out == f"warning: the training step runs without a CUDA graph: {step.eager_because}\n"


def test_the_learning_rate_goes_into_the_captured_tensor_in_place():
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1, fused=True)
    step = loop.CapturedStep(lambda: None, optimizer, None)
    optimizer.param_groups[0]["lr"] = torch.tensor(0.1)  # as a checkpoint of a captured run loads it
    step.set_lr(0.5)  # before a capture: plain numbers, as a loop without graphs sets them
    assert [group["lr"] for group in optimizer.param_groups] == [0.5, 0.5]
    captured = [torch.tensor(0.5), torch.tensor(0.5)]  # what the capture puts there: read by the graph's kernels
    for group, lr in zip(optimizer.param_groups, captured):
        group["lr"] = lr
    step.graph = object()  # captured
    step.set_lr(0.25)
    assert all(group["lr"] is lr and lr.item() == 0.25 for group, lr in zip(optimizer.param_groups, captured))


@pytest.mark.parametrize("recipe", ["resnet18_fmnist", "cifar_cnn"])
def test_no_convolution_that_batchnorm_follows_has_a_bias(recipe):
    """BatchNorm subtracts each channel's mean, a bias included (through a max-pool too): such a bias is dead weight.
    Without BatchNorm (cifar_cnn --no-batch_norm) the convolutions keep theirs."""
    module = importlib.import_module(f"recipes.{recipe}")
    layers = [m for m in module.make_model(10).modules() if not isinstance(m, (nn.Sequential, nn.MaxPool2d))
              and type(m).__name__ != "Residual"]
    pairs = [(a, b) for a, b in zip(layers, layers[1:]) if isinstance(a, nn.Conv2d)]
    assert pairs and all(conv.bias is None for conv, after in pairs if isinstance(after, nn.BatchNorm2d))
    followed = sum(isinstance(after, nn.BatchNorm2d) for _, after in pairs)
    assert followed == {"resnet18_fmnist": 17, "cifar_cnn": 3}[recipe]
    if recipe == "cifar_cnn":
        plain = module.make_model(10, module.Config(batch_norm=False))
        assert all(m.bias is not None for m in plain.modules() if isinstance(m, nn.Conv2d))


def test_compile_makes_each_recipes_model_one_graph_on_every_torch(monkeypatch):
    """model.compile() of cifar_cnn's nn.Sequential compiled nothing on torch 2.11, silently: its forward is torch's
    own, whose frame dynamo skips (pytorch #150915), and of the ResNet's each block apart (7 graphs). This runs on both
    ends of the torch range (CI's floors and pins)."""
    import torch._dynamo

    monkeypatch.setattr(torch._dynamo.config, "wrap_top_frame", False)  # as a process starts; restored after
    graphs = []
    for name in ("cifar_cnn", "resnet18_fmnist"):
        recipe = importlib.import_module(f"recipes.{name}")
        cfg = recipe.Config(compile=True)
        loop.device_settings(SimpleNamespace(device=torch.device("cpu"), mixed_precision="no"), cfg)
        model = recipe.make_model(10, cfg)
        model.compile(backend=lambda graph, inputs: (graphs.append(name), graph.forward)[1])  # counts, runs it as is
        model(torch.rand(2, *recipe.IMAGE_SHAPE))
        torch._dynamo.reset()
    assert graphs == ["cifar_cnn", "resnet18_fmnist"]
