"""The CPU speed settings (benchmarks/BENCHMARKS.md, "On a CPU"): bf16 autocast through accelerate on 1 and 2 CPU
processes for every recipe, and channels_last inputs reaching the convolutions. Speeds themselves are measured in
benchmarks/throughput.py, not here."""

from __future__ import annotations

import importlib

import pytest
import torch
from safetensors.torch import load_file

from conftest import hooked, launch, ok, read_json, run_here
from tiny_data import save_to_disk_dataset

SHAPES = {"cifar_cnn": (3, 32, 32), "resnet18_fmnist": (1, 28, 28), "deep_mlp_ckpt": (3, 32, 32)}


@pytest.fixture(scope="module")
def datasets_by_recipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("cpu_speed")
    return {recipe: save_to_disk_dataset(root / recipe, shape=shape, sizes={"train": 32, "test": 12})
            for recipe, shape in SHAPES.items()}


# cifar_cnn on 1 process: test_cifar_cnn.py's cpu_bf16.yaml test; on 2: test_multinode.py's run on one machine;
# resnet18_fmnist on 1: test_resnet18_fmnist.py's schedule test with grad_accum; deep_mlp_ckpt on 2:
# test_deep_mlp_ckpt.py.
@pytest.mark.parametrize("recipe, processes", [pytest.param("resnet18_fmnist", 2, marks=pytest.mark.slow),
                                               ("deep_mlp_ckpt", 1)])
def test_bf16_autocast_trains_every_recipe_on_cpu_processes(env, datasets_by_recipe, tmp_path, recipe, processes):
    out = tmp_path / "run"
    args = ("--data", str(datasets_by_recipe[recipe]), "--batch_size", "4", "--max_steps", "3", "--log_every", "1",
            "--tracker", "none", "--output_dir", str(out))
    if processes == 1:  # what cpu_bf16.yaml sets for the process (test_cifar_cnn.py launches with it)
        result = ok(run_here(recipe, *args, env={"ACCELERATE_MIXED_PRECISION": "bf16"}))
    else:  # the 2-process config with its precision overridden, as a user would on the command line
        result = ok(launch(env, recipe, *args, config="2gpu", use_cpu=True,
                           launcher_args=("--mixed_precision", "bf16")))
    check_bf16_run(out, result.stdout, world_size=processes, steps=3)


def check_bf16_run(out, stdout: str, world_size: int, steps: int) -> None:
    """A finished run in bf16 autocast: said and recorded as such, and its weights still float32 (autocast computes in
    bfloat16 but the weights it updates stay float32) and finite."""
    assert "precision bf16" in stdout
    config, summary = read_json(out / "config.json"), read_json(out / "summary.json")
    assert config["mixed_precision"] == "bf16" and config["world_size"] == world_size
    assert summary["steps"] == steps and 0 <= summary["eval_acc"] <= 1
    weights = [t for t in load_file(out / "model.safetensors").values() if t.is_floating_point()]
    assert weights and all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in weights)


@pytest.mark.parametrize("recipe, flag, channels_last", [
    ("cifar_cnn", "--channels_last", True), ("cifar_cnn", "--no-channels_last", False),
    ("resnet18_fmnist", "--channels_last", True),  # its first convolution sees 1 channel: the others are probed
])
def test_channels_last_inputs_reach_every_convolution_in_training_and_evaluation(datasets_by_recipe, tmp_path,
                                                                                  recipe, flag, channels_last):
    seen = []  # (training?, channels_last input?) at every convolution with more than one input channel

    def probe(module, inputs):
        if module.in_channels > 1:
            seen.append((module.training, inputs[0].is_contiguous(memory_format=torch.channels_last)))

    def probed(make_model):
        def make(*args, **kwargs):
            model = make_model(*args, **kwargs)
            for module in model.modules():
                if isinstance(module, torch.nn.Conv2d):
                    module.register_forward_pre_hook(probe)
            return model
        return make

    with hooked(importlib.import_module(f"recipes.{recipe}"), "make_model", probed):
        ok(run_here(recipe, "--data", datasets_by_recipe[recipe], "--batch_size", "8", "--max_steps", "1", "--tracker",
                    "none", "--output_dir", tmp_path / "run", flag))
    assert {training for training, _ in seen} == {True, False}  # a training step and an evaluation were probed
    assert all(layout == channels_last for _, layout in seen), seen


def test_bf16_on_a_cpu_without_its_instructions_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    """cpu_bf16.yaml ran at 83-87 samples/s against 379-424 for cpu.yaml on an Intel Xeon without avx512_bf16, and said
    nothing; the precision itself is left as asked."""
    from unittest import mock

    from shared import launch

    for flags, emulated in (("fpu avx2 avx512f", True), ("fpu avx512f avx512_bf16", False), ("fpu amx_bf16", False)):
        (tmp_path / "cpuinfo").write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        assert launch.cpu_has_bf16(tmp_path / "cpuinfo") == (not emulated)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    with mock.patch.object(launch, "cpu_has_bf16", lambda: False):
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what accelerate launch sets from cpu_bf16.yaml
        launch.check_cpu()
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
        launch.check_cpu()
    assert capsys.readouterr().out.splitlines() == [
        "warning: this CPU has no bf16 instructions (no avx512_bf16 or amx_bf16 in lscpu), so bf16 is emulated here, "
        "4 to 16 times slower than float32: accelerate_configs/cpu.yaml is faster"]
    (tmp_path / "cpuinfo").write_text("Features\t: fp asimd bf16\n")  # ARM: no x86 flags, nothing said
    assert launch.cpu_has_bf16(tmp_path / "cpuinfo") and launch.cpu_has_bf16(tmp_path / "missing")


def test_the_cpu_lines_are_said_by_training_runs_not_by_every_launch(capsys, monkeypatch):
    """check_launch (predict.py and the sweep call it too) says nothing of the CPU: "training on the CPU" is a line of
    the training recipes (tracking.open_run), as it was when loop.device_settings said it."""
    from shared import launch

    monkeypatch.setenv("ACCELERATE_USE_CPU", "False")  # what accelerate launch sets for 1gpu.yaml
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setattr(launch, "cpu_has_bf16", lambda: False)
    launch.check_launch()
    assert "warning" not in capsys.readouterr().out
    launch.check_cpu()
    assert capsys.readouterr().out.count("warning: ") == 2


def test_the_throughput_benchmarks_dynamo_setting_exists_on_this_torch():
    """benchmarks/throughput.py raises torch._dynamo.config.recompile_limit (private: no public setting; docs/tests.md)
    when imported. A torch that renamed it fails here: the quick tier runs on the floors and on the pins."""
    importlib.import_module("throughput")
    assert torch._dynamo.config.recompile_limit == 64
