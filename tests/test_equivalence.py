"""More processes or gradient accumulation must not change the arithmetic, only how it is split.

With a BatchNorm-free model (cifar_cnn --no-batch_norm), no augmentation and a fixed seed, the data
order per optimizer step is identical, so the weights, and their average (--ema), must match to float rounding:
  (a) 2 processes x batch b        == 1 process x batch 2b
  (b) 1 process x batch b x accum k == 1 process x batch k*b
  (c) evaluation over 2 processes counts each of 101 test images once, with the same accuracy.
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from conftest import ema_state, launch, ok, read_json, run_here
from tiny_data import cifar_binary_dataset

# Gradient norms here are 0.44-0.64: a clip at 0.3 acts on every step, so the comparisons also check that it
# acts on the gradient averaged over processes and accumulated batches, as one process would see it.
COMMON = ("--no-augment", "--no-batch_norm", "--max_grad_norm", "0.3", "--seed", "3", "--max_steps", "8",
          "--log_every", "4", "--ema", "0.5", "--tracker", "none")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    # 64 training images: 4 global batches of 16 per epoch, so 8 steps cross an epoch boundary.
    return cifar_binary_dataset(tmp_path_factory.mktemp("eq") / "data", sizes={"train": 64, "test": 101})


def final_state(run) -> dict:
    """The trained weights and the EMA's, from the last checkpoint (the run folder's model.safetensors holds the EMA's
    under --ema: the average is the model, never picked by its test accuracy)."""
    checkpoint = run / "checkpoints" / "step_8"
    ema = ema_state(checkpoint)
    return {**load_file(checkpoint / "model.safetensors"), **{f"ema.{k}": v for k, v in ema.items()}}


def max_abs_diff(run_a, run_b) -> float:
    a, b = final_state(run_a), final_state(run_b)
    assert a.keys() == b.keys() and any(k.startswith("ema.") for k in a)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def train(env, data, out, *args, **launch_kwargs):
    """In this process, or `accelerate launch` with `launch_kwargs` (a config)."""
    args = ("--data", data, "--output_dir", out, *COMMON, *args)
    ok(launch(env, "cifar_cnn", *map(str, args), **launch_kwargs) if launch_kwargs else run_here("cifar_cnn", *args))
    return out


@pytest.fixture(scope="module")
def one(env, data, tmp_path_factory):
    """1 process x batch 16: the run every other arrangement must reproduce."""
    return train(env, data, tmp_path_factory.mktemp("eq") / "one", "--batch_size", "16")


@pytest.mark.slow  # two processes
def test_two_processes_equal_one_process_with_twice_the_batch(env, data, one, tmp_path):
    two = train(env, data, tmp_path / "two", "--batch_size", "8", config="2gpu", use_cpu=True)
    assert read_json(two / "config.json")["world_size"] == 2
    assert read_json(one / "config.json")["global_batch_size"] == 16
    assert read_json(two / "config.json")["global_batch_size"] == 16
    diff = max_abs_diff(one, two)
    print(f"(a) max |w_1proc - w_2proc| after 8 steps: {diff:.3g}")
    assert diff <= 1e-5


def test_data_held_on_the_device_changes_nothing(env, data, one, tmp_path):
    # --data_on_device moves the uint8 tensors once; order, sharding and results stay the same.
    on_device = train(env, data, tmp_path / "on_device", "--batch_size", "16", "--data_on_device")
    assert max_abs_diff(one, on_device) == 0


def test_gradient_accumulation_equals_the_bigger_batch(env, data, one, tmp_path):
    accumulated = train(env, data, tmp_path / "acc", "--batch_size", "4", "--grad_accum", "4")
    assert read_json(accumulated / "summary.json")["steps"] == 8  # logged in optimizer steps, not batches
    diff = max_abs_diff(one, accumulated)
    print(f"(b) max |w_batch16 - w_batch4x4| after 8 steps: {diff:.3g}")
    assert diff <= 1e-5


def test_the_comparison_detects_a_different_run(env, data, one, tmp_path):
    # Guards the two tests above: a run with other data order must not pass as equal.
    other = train(env, data, tmp_path / "other", "--batch_size", "16", "--seed", "4")
    assert max_abs_diff(one, other) > 1e-3


@pytest.mark.slow  # two processes
def test_two_process_evaluation_counts_every_test_image_once(env, data, one):
    flags = ("--evaluate", "--weights", str(one / "model.safetensors"), "--recipe", "cifar_cnn", "--batch_size", "16",
             "--data", str(data))
    one = json.loads(ok(run_here("predict", *flags)).stdout.splitlines()[-1])
    two = json.loads(ok(launch(env, "predict", *flags, config="2gpu", use_cpu=True)).stdout.splitlines()[-1])
    print(f"(c) gathered eval count with 2 processes: {two['eval_samples']} of 101")
    assert one["eval_samples"] == two["eval_samples"] == 101
    assert two["eval_acc"] == one["eval_acc"]
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
