"""No device sync in an optimizer step, and few ATen operations per step: benchmarks/step_cost.py counts them for
every recipe and option under a stand-in for the accelerator (on a CPU-only run every tensor is on the CPU, and a
sync cannot be seen otherwise), beside a plain loop over the recipe's own parts."""

from __future__ import annotations

import importlib
import tempfile

import pytest
import torch
from torch.optim.swa_utils import AveragedModel

import shared.data

import step_cost
from tiny_data import cifar_binary_dataset

MOST_OPS_PER_PLAIN_LOOP = 1.3  # a recipe's step: at most this many ATen operations per plain loop's
MOST_OPS_FOR_EMA = 1.15  # --ema: at most this many per step without it


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    # 6 steps of 2 batches of 2 in one epoch: no epoch's end, evaluation or log point among the counted steps.
    return cifar_binary_dataset(tmp_path_factory.mktemp("steps") / "data", sizes={"train": 40, "test": 20})


def test_the_stand_in_device_sees_what_would_make_a_gpu_wait():
    """Each kind of sync in a step of its own (steps end at optimizer.step()), and what is no sync counted apart."""
    model = torch.nn.Linear(3, 2)
    with step_cost.StandInDevice() as counts:
        device = torch.device("cpu")  # the stand-in's: what moves there with .to(device) is on it
        model = model.to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
        inputs = torch.randn(4, 3).to(device, non_blocking=True)
        model(inputs).sum().backward()
        optimizer.step()  # 1: the model's two tensors moved by blocking copies; the inputs' copy does not block
        model(inputs).sum().item()
        optimizer.step()  # 2: a read of a device value
        torch.tensor(2.0).item()
        optimizer.step()  # 3: a read of a host value: no sync
        inputs.to("cpu")  # "cpu" written as a string: the host
        optimizer.step()  # 4: a blocking copy to the host
        torch.tensor([1.0], device=device)
        optimizer.step()  # 5: a blocking copy to the device
        inputs[inputs > 0]
        optimizer.step()  # 6: an output size set by device values
        inputs + torch.ones(3)
        optimizer.step()  # 7: a host tensor in an operation on device tensors
        # torch's AveragedModel, as the recipes' --ema used it: a blocking copy of its update count per parameter
        average = AveragedModel(model, avg_fn=lambda averaged, current, updates: (averaged + current) / 2)
        average.update_parameters(model)
        optimizer.step()  # 8: its first update (a copy)
        average.update_parameters(model)
        optimizer.step()  # 9
    syncs = [step["device syncs"] for step in counts.steps]
    assert syncs[:7] == [2, 1, 0, 1, 1, 1, 1] and syncs[8] >= 2, [dict(step) for step in counts.steps]
    assert counts.steps[1]["scalar reads"] == counts.steps[2]["scalar reads"] == 1
    assert counts.steps[0]["copies to the device"] == 3 and counts.steps[0]["aten ops"] > 0


def test_fp16s_gradient_scaler_syncs_only_with_an_optimizer_that_is_not_fused():
    """What fp16.yaml runs on a GPU (a CPU refuses fp16 in the recipes): the scaler checks the gradients for inf. A
    fused optimizer takes that check as a tensor; torch's loop over the tensors reads it on the host."""
    for fused, most_syncs in ((True, 0), (False, 1)):
        model = torch.nn.Linear(3, 2)
        with step_cost.StandInDevice() as counts:
            model = model.to(torch.device("cpu"))  # the stand-in's device
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused)
            scaler = torch.amp.GradScaler("cpu", init_scale=1.0)  # no overflow: every step is taken
            for _ in range(4):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(torch.randn(4, 3).to(torch.device("cpu"), non_blocking=True)).float().sum()
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
        steady = step_cost.steady(counts.steps)
        assert (steady["device syncs"] == 0) == fused and steady["device syncs"] >= most_syncs, dict(steady)


def count_steps(options: dict, data, monkeypatch, tmp_path) -> list[dict]:
    monkeypatch.setattr(shared.data, "CACHE_DIR", tmp_path)  # the decoded images stay out of the user's cache
    # As another test on this worker may have done: each recipe's preprocess() caches its constants on the CPU.
    for name, shape in (("cifar_cnn", (3, 32, 32)), ("resnet18_fmnist", (1, 28, 28)), ("deep_mlp_ckpt", (3, 32, 32))):
        importlib.import_module(f"recipes.{name}").preprocess(torch.zeros(2, *shape, dtype=torch.uint8), True)
    temporary = tmp_path / "temporary"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))  # where each counted run's folder is made
    rows = step_cost.measure(list(step_cost.RECIPES), ["--data", str(data), "--batch_size", "2"], options)
    assert not list(temporary.glob("step-cost-*"))  # and removed: a test run leaves none in /tmp
    assert {(r["recipe"], r["option"]) for r in rows} == {(name, option) for name in step_cost.RECIPES
                                                         for option in options}
    for r in rows:
        where = f"{r['recipe']} {r['option']}: {r}"
        assert r["device_syncs"] == 0 and r["scalar_reads"] <= r["plain_scalar_reads"], where
        assert r["aten_ops"] <= MOST_OPS_PER_PLAIN_LOOP * r["plain_aten_ops"], where
    return rows


def test_no_recipe_makes_a_device_sync_in_a_step_and_each_costs_few_operations(data, monkeypatch, tmp_path):
    count_steps({"default": ([], "cpu")}, data, monkeypatch, tmp_path)


@pytest.mark.slow  # 9 runs
def test_no_option_makes_a_device_sync_in_a_step_and_each_costs_few_operations(data, monkeypatch, tmp_path):
    """Every option the benchmark measures apart (bf16 autocast, --grad_accum 2, --ema), here in fewer runs: --ema
    beside the default, bf16 and accumulation together (syncs would add up, not cancel)."""
    options = {"default": ([], "cpu"), "ema": (["--ema", "0.99"], "cpu"), "bf16, grad_accum 2": (
        ["--grad_accum", "2"], "cpu_bf16")}
    ops = {(r["recipe"], r["option"]): r["aten_ops"] for r in count_steps(options, data, monkeypatch, tmp_path)}
    for name in step_cost.RECIPES:
        assert ops[name, "ema"] <= MOST_OPS_FOR_EMA * ops[name, "default"]
        assert ops[name, "bf16, grad_accum 2"] > ops[name, "default"]  # two batches a step: the count sees them


@pytest.mark.slow  # two processes
def test_two_processes_make_no_device_sync_between_their_stop_agreements(env, data):
    row = step_cost.two_processes("cifar_cnn", ["--data", str(data), "--batch_size", "2"], env=env)
    assert row["device_syncs"] == 0 and row["scalar_reads"] == 0, row
    assert row["aten_ops"] <= MOST_OPS_PER_PLAIN_LOOP * row["plain_aten_ops"], row
    assert row["ops"].get("allreduce_", 0) >= 1  # DDP's all-reduce of the gradients is among the counted operations
