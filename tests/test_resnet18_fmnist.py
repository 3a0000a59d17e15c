"""recipes/resnet18_fmnist.py: the d2l ResNet-18, LR scaling, and a schedule that ends on the last step."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from test_cpu_speed import check_bf16_run

from recipes.resnet18_fmnist import Config, Residual, make_model, scaled_lr

from conftest import launch, ok, printed_once_and_last, read_json, read_jsonl, run_here
from tiny_data import parquet_dataset


@pytest.fixture(scope="module")
def fmnist(tmp_path_factory):
    # Fashion-MNIST's layout on the hub: 28x28 grayscale in a column named 'image'.
    return parquet_dataset(tmp_path_factory.mktemp("fm") / "data", sizes={"train": 32, "test": 20}, shape=(1, 28, 28),
                           image_column="image")


def test_model_is_the_d2l_resnet18():
    model = make_model(10)
    stem = model[0]
    assert (stem.in_channels, stem.out_channels, stem.kernel_size, stem.stride) == (1, 64, (3, 3), (1, 1))
    assert not any(isinstance(m, torch.nn.MaxPool2d) for m in model.modules())
    blocks = [m for m in model if isinstance(m, Residual)]
    assert [b.body[3].out_channels for b in blocks] == [64, 64, 128, 128, 256, 256, 512, 512]
    projections = [isinstance(b.shortcut, torch.nn.Conv2d) for b in blocks]
    assert projections == [False, False, True, False, True, False, True, False]
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()) == 1 + 2 * 8
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def replay_one_cycle(peak_lr: float, total_steps: int) -> list[float]:
    """The LR each optimizer step uses under the recipe's schedule, recomputed from scratch."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=peak_lr)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=peak_lr, total_steps=total_steps, pct_start=0.2,
                                                   anneal_strategy="linear", cycle_momentum=False)
    rates = []
    for _ in range(total_steps):
        rates.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    return rates


# On 2 processes, the scaled rate and the schedule after a resume: test_resume.py's chain (global batch 8 -> 16).
# The grad_accum case runs under cpu_bf16.yaml: it is also test_cpu_speed.py's bf16 check of the ResNet on 1 process.
@pytest.mark.parametrize("name, args, launch_kwargs, global_batch, steps", [
    ("1 process", ("--batch_size", "8"), {}, 8, 8),  # 32 images: 4 batches per epoch, 2 epochs
    pytest.param("grad_accum 4, bf16", ("--batch_size", "4", "--grad_accum", "4"), {"config": "cpu_bf16"}, 16, 4,
                 marks=pytest.mark.slow),  # 2 an epoch; a launch with the config
])
def test_lr_schedule_ends_exactly_on_the_last_step(env, fmnist, tmp_path, name, args, launch_kwargs, global_batch,
                                                   steps):
    out = tmp_path / "run"
    args = ("--data", str(fmnist), "--epochs", "2", "--log_every", "1", "--tracker", "none", "--output_dir", str(out),
            *args)
    result = ok(launch(env, "resnet18_fmnist", *args, **launch_kwargs) if launch_kwargs else
                run_here("resnet18_fmnist", *args))
    config = read_json(out / "config.json")
    assert config["global_batch_size"] == global_batch and config["total_steps"] == steps
    # sqrt scaling (the default) from the reference batch of 128 at --lr 0.1
    assert config["effective_lr"] == pytest.approx(0.1 * (global_batch / 128) ** 0.5)
    assert f"lr 0.1 for batch 128 -> {config['effective_lr']:.4g} (sqrt scaling)" in result.stdout

    rows = [row for row in read_jsonl(out / "metrics.jsonl") if "lr" in row]
    assert [row["step"] for row in rows] == list(range(1, steps + 1))  # optimizer steps, each once
    expected = replay_one_cycle(config["effective_lr"], steps)
    assert [row["lr"] for row in rows] == pytest.approx(expected, rel=1e-9)
    final_lr = config["effective_lr"] / 25 / 1e4  # OneCycleLR ends at max_lr / div_factor / final_div_factor
    print(f"{name}: lr at the last step {rows[-1]['lr']:.3g}, schedule's final value {final_lr:.3g}")
    assert rows[-1]["lr"] == pytest.approx(final_lr, rel=1e-9)
    assert read_json(out / "summary.json")["epochs"] == pytest.approx(2.0)
    assert set(load_file(out / "model.safetensors")) == set(make_model(10).state_dict())
    if launch_kwargs.get("config") == "cpu_bf16":
        check_bf16_run(out, result.stdout, world_size=1, steps=steps)


@pytest.mark.parametrize("rule, factor", [("none", 1.0), ("linear", 2.0), ("sqrt", 2 ** 0.5)])
def test_lr_scaling_rules(rule, factor):
    assert scaled_lr(Config(lr=0.1, lr_scaling=rule), global_batch_size=256) == pytest.approx(0.1 * factor)
    assert scaled_lr(Config(lr=0.1, lr_scaling=rule), global_batch_size=128) == pytest.approx(0.1)


@pytest.mark.parametrize("length", [(), ("--max_steps", "5")])  # --max_steps: no epoch length to divide by
def test_a_batch_bigger_than_the_data_is_one_line(env, fmnist, length):
    result = run_here("resnet18_fmnist", "--data", fmnist, "--batch_size", "256", "--tracker", "none", *length)
    assert result.returncode == 1
    assert result.stderr.strip() == ("error: 32 training images make no full step of 256: "
                                     "lower --batch_size or --grad_accum")


@pytest.mark.slow  # two processes
def test_sync_bn_is_refused_on_cpu_processes(env, fmnist, tmp_path):
    result = launch(env, "resnet18_fmnist", "--data", str(fmnist), "--sync_bn", "--tracker", "none",
                    "--output_dir", str(tmp_path / "run"), config="2gpu", use_cpu=True)
    assert result.returncode != 0
    printed_once_and_last(result.stderr, "error: --sync_bn needs GPUs")
    assert 'resnet18_fmnist.py", line' not in result.stderr
