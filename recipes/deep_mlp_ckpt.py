"""Gradient checkpointing on the seed's 72-layer MLP: how much memory it saves, and what it costs.

Backward needs the activations of forward. Checkpointing keeps only the inputs of each segment and
recomputes the rest during backward: memory for time. With n layers in k segments, the activations
held fall from n layers' worth to about k inputs + n/k layers, smallest near k = sqrt(n).
deep_mlp_sweep.py, beside this file, measures it for every k instead of claiming it.

The seed's network: Linear 1000->1000, 70 x Linear 1000->1000, Linear 1000->100, Adam lr 0.002,
betas (0.5, 0.999). Each of the 71 hidden layers adds gate * ReLU(LayerNorm(Linear(x))) to its input
x, with a learned scalar gate that starts at 0 (ReZero, Bachlechner et al. 2020); see HiddenLayer.
Images are flattened and projected to 1000 inputs by a fixed random matrix (same in every run).

Results (update only from real runs; the command that produced each number is given):
  real CIFAR-100   not measured yet: the machine this was written on cannot download it. On a GPU:
                     python benchmarks/accuracy.py --hub --config 1gpu --cases deep_mlp_ckpt/photos100/cpu
  real photos      final test accuracy 0.271 +- 0.009 (0.264-0.281, 3 seeds) after 5 epochs, 27.5 s/epoch;
                   the seed's own loop (the plain 72-layer stack, Adam, batch 16) on the same data: 0.009
                   (2 seeds; chance), 104 s/epoch. Learning rate x0.5 or x2: 0.274 and 0.271; none diverged.
                   Data: 100 classes, 5 strips of each of 20 photographs bundled with scikit-image,
                   scikit-learn and matplotlib, as 32x32 crops (5,000 train / 1,000 test, built by
                   benchmarks/real_images.py). 2-core CPU, float32; table in benchmarks/BENCHMARKS.md:
                     python benchmarks/accuracy.py --lr_multipliers 0.5 1 2 --cases deep_mlp_ckpt/photos100/cpu
  sweep, CPU       8 segments hold 0.15x the activations of no checkpointing (125 of 836 MB at batch
                   1024) for 1.36x the step time; 12 and 18 segments hold the least (0.13x). 2-core CPU,
                   float32, 8 min 36 s, measured as `python recipes/deep_mlp_ckpt.py --sweep --sweep_repeats 5`,
                   now `python recipes/deep_mlp_sweep.py --repeats 5`.

Run it (from the repository root):
  accelerate launch --config_file accelerate_configs/1gpu.yaml recipes/deep_mlp_ckpt.py --ckpt sequential --segments 8
  python recipes/deep_mlp_sweep.py                 # memory and step time for every segment count
  python recipes/deep_mlp_ckpt.py --synthetic --max_steps 200      # offline smoke run, no download
Outputs land in runs/deep_mlp_ckpt-<time>/; the sweep's in runs/deep_mlp_sweep-<time>/.
"""

import functools
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin, set_seed
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential
from torch.utils.data import DataLoader
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # find shared/ without installing it
from shared.augment import normalize
from shared.batch_size import largest_batch_size
from shared.checkpoints import (
    Progress,
    StopSignal,
    check_resume,
    checkpoint_or_stop,
    evaluate_weights,
    find_checkpoint,
    resume_from,
    save_checkpoint,
    save_weights,
)
from shared.config import RunConfig, parse_config
from shared.data import EpochOrder, load_image_data, whole_batch
from shared.errors import RecipeError, check_launch, one_line_errors
from shared.pictures import save_pictures
from shared.schedule import SCHEDULE_RULE, one_cycle_lr
from shared.tracking import TrainWindow, make_run_dir, run_config, run_summary, trackers

RECIPE = "deep_mlp_ckpt"
WIDTH, HIDDEN_LAYERS = 1000, 71  # + the 1000 -> classes output layer: 72 Linear layers


@dataclass
class Config(RunConfig):
    data: str = "uoft-cs/cifar100"  # hub id or local folder; 100 classes, as the seed's 100 outputs
    epochs: int = 10  # passes over the training set
    batch_size: int = 128  # images per process per step; global batch = batch_size x processes x grad_accum
    grad_accum: int = 1  # batches whose gradients are summed into one optimizer step
    lr: float = 2e-3  # peak Adam learning rate of the one-cycle schedule (the seed's 0.002)
    max_grad_norm: float = 1.0  # clip the gradient's global L2 norm to this before each step; inf: only measure it
    dropout: float = 0.0  # dropout after every hidden layer; > 0 shows why preserve_rng_state matters
    ckpt: Literal["none", "sequential", "blocks"] = "none"  # checkpoint_sequential, or checkpoint() per block of layers
    segments: int = 8  # checkpointed segments; about sqrt(72) = 8.5 holds the least
    preserve_rng_state: bool = True  # replay dropout's masks when recomputing; off is faster, and wrong with dropout

    def __post_init__(self):
        super().__post_init__()
        if self.segments < 1:
            raise ValueError(f"--segments must be > 0, got {self.segments}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.segments > HIDDEN_LAYERS + 1:
            raise ValueError(f"--segments must be at most {HIDDEN_LAYERS + 1}, one per layer; got {self.segments}")


# ----------------------------------------------------------------------------- data
IMAGE_SHAPE = (3, 32, 32)  # channels, height, width
MEAN = (0.5071, 0.4865, 0.4409)  # per-channel mean and std of the CIFAR-100 training images
STD = (0.2673, 0.2564, 0.2762)


def load_data(cfg: Config):
    """(train, test) as uint8 image tensors: the hub, a local folder, or --synthetic (CIFAR-100's sizes and classes)."""
    return load_image_data(cfg.data, IMAGE_SHAPE, cfg.synthetic, synthetic_classes=100)


@functools.cache
def projection(device: torch.device) -> torch.Tensor:
    """Fixed random features, 3 x 32 x 32 = 3072 pixels -> 1000 inputs: the same matrix in every run and process."""
    generator = torch.Generator().manual_seed(0)
    pixels = math.prod(IMAGE_SHAPE)
    return (torch.randn(pixels, WIDTH, generator=generator) / math.sqrt(pixels)).to(device)


def preprocess(images: torch.Tensor) -> torch.Tensor:
    """uint8 images on the device -> normalized, flattened, projected (N, 1000) floats."""
    return normalize(images, MEAN, STD).flatten(1) @ projection(images.device)


# ----------------------------------------------------------------------------- model
class HiddenLayer(nn.Module):
    """x + gate * Dropout(ReLU(LayerNorm(Linear(x)))), with the gate starting at 0 (ReZero).

    As a plain stack of Linear + LayerNorm + ReLU, the 72 layers did not learn: 400 steps of
    --synthetic ended at chance (test accuracy 0.0083 on 100 classes). With every gate at 0 the
    network starts as its output layer on the inputs, a linear classifier that learns at once; the
    skip paths carry the gradient to every layer unchanged, and each layer joins in as its gate grows.
    """

    def __init__(self, dropout: float):
        super().__init__()
        self.branch = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.ReLU(), nn.Dropout(dropout))
        self.gate = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return x + self.gate * self.branch(x)


class DeepMLP(nn.Module):
    """The layers stay one nn.Sequential, so checkpoint_sequential can cut it into segments."""

    def __init__(self, num_classes: int, dropout: float = 0.0, ckpt: str = "none", segments: int = 8,
                 preserve_rng_state: bool = True):
        super().__init__()
        hidden = [HiddenLayer(dropout) for _ in range(HIDDEN_LAYERS)]
        self.layers = nn.Sequential(*hidden, nn.Linear(WIDTH, num_classes))
        self.ckpt, self.segments, self.preserve_rng_state = ckpt, segments, preserve_rng_state

    def forward(self, x):
        # use_reentrant=False: the seed used the older use_reentrant=True, which runs the segment under
        # no_grad and relies on an input that requires grad to recompute it. The first segment's input
        # is the data, which does not, so its layers silently got no gradients (PyTorch warns "None of
        # the inputs have requires_grad=True"); the seed passed a dummy tensor with requires_grad=True.
        # The non-reentrant version records the segment in the autograd graph itself: no dummy needed.
        rng = self.preserve_rng_state  # False skips saving and restoring the RNG: faster, but dropout
        if self.ckpt == "sequential":  # would draw new masks when recomputed, and gradients go wrong
            return checkpoint_sequential(self.layers, self.segments, x, use_reentrant=False, preserve_rng_state=rng)
        if self.ckpt == "blocks":
            size = math.ceil(len(self.layers) / self.segments)
            for start in range(0, len(self.layers), size):
                x = checkpoint(self.layers[start:start + size], x, use_reentrant=False, preserve_rng_state=rng)
            return x
        return self.layers(x)


def make_model(num_classes: int, cfg=None) -> DeepMLP:
    cfg = cfg or Config()
    return DeepMLP(num_classes, cfg.dropout, cfg.ckpt, cfg.segments, cfg.preserve_rng_state)


def make_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=(0.5, 0.999))  # the seed's optimizer


@torch.no_grad()  # no autograd graph: evaluation needs no gradients, and would hold every activation
def evaluate(model, loader, accelerator) -> tuple[dict, torch.Tensor]:
    """Test loss and accuracy over every process, and the predictions in test-set order."""
    model.eval()
    loss_sum = correct = 0
    predictions = []
    for images, labels in loader:
        logits = model(preprocess(images))
        # From every process, minus the samples accelerate repeated to even out the last batch.
        logits, labels = accelerator.gather_for_metrics((logits, labels))
        loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum")
        predictions.append(logits.argmax(dim=1))
        correct += (predictions[-1] == labels).sum()
    count = sum(len(p) for p in predictions)
    metrics = {"eval_loss": (loss_sum / count).item(), "eval_acc": (correct / count).item(), "eval_samples": count}
    return metrics, torch.cat(predictions).cpu()


# ----------------------------------------------------------------------------- training
def train(cfg: Config) -> None:
    check_launch()  # stops launches that would not run as configured (see shared/errors.py)
    run_dir = make_run_dir(cfg, RECIPE)
    accelerator = Accelerator(
        # Every optimizer step averages exactly grad_accum batches, also across an epoch's end
        # (by default accelerate steps early at the end of the data, with too small a gradient).
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=cfg.grad_accum, sync_with_dataloader=False),
        project_dir=run_dir,
        log_with=trackers(cfg, run_dir, RECIPE),  # wandb / tensorboard + config.json, metrics.jsonl, summary.json, ...
    )
    set_seed(cfg.seed)
    with accelerator.main_process_first():  # the main process decodes and caches; the others read its cache
        train_set, test_set = load_data(cfg)
    if cfg.data_on_device:  # one copy of the uint8 dataset now, instead of a host-to-GPU copy per batch
        train_set, test_set = train_set.to(accelerator.device), test_set.to(accelerator.device)
    if cfg.auto_batch_size:  # halve --batch_size until one training step fits in memory, on every process
        cfg.batch_size = largest_batch_size(accelerator, cfg.batch_size, train_set,
                                            lambda: make_model(len(train_set.classes), cfg),
                                            lambda model: make_optimizer(model, cfg), preprocess)
    # Each epoch's order is a function of (seed, epoch), resumable at any sample (see EpochOrder). Own generators:
    # every new DataLoader iterator draws a seed, and drawing it from the global RNG would shift the augmentation's
    # random numbers after a mid-epoch resume (no longer bitwise exact).
    order = EpochOrder(len(train_set), cfg.seed)
    train_loader = DataLoader(train_set, cfg.batch_size, sampler=order, drop_last=True, collate_fn=whole_batch,
                              generator=torch.Generator())
    test_loader = DataLoader(test_set, 2 * cfg.batch_size, collate_fn=whole_batch, generator=torch.Generator())

    global_batch_size = cfg.batch_size * accelerator.num_processes * cfg.grad_accum
    model = make_model(len(train_set.classes), cfg)
    if cfg.compile:
        model.compile()  # in place: state_dict keys stay free of `_orig_mod.`
    optimizer = make_optimizer(model, cfg)
    model, optimizer, train_loader, test_loader = accelerator.prepare(model, optimizer, train_loader, test_loader)

    # After prepare, len(train_loader) counts this process's batches: its share of an epoch.
    epoch_batches = len(train_loader)
    epoch_samples = epoch_batches * cfg.batch_size * accelerator.num_processes  # less a remainder short of a batch
    progress = Progress()
    accelerator.register_for_checkpointing(progress)  # saved and restored with every checkpoint
    if cfg.resume:
        checkpoint = find_checkpoint(run_dir, cfg.resume, RECIPE)
        resume_from(accelerator, checkpoint, progress, cfg.seed)
    order.set_position(progress.epoch, progress.samples_seen)
    # Optimizer steps to the end of --epochs from where the run stands: the rest of this epoch, then whole ones
    # (counted this way, a resume on another number of processes still ends after --epochs).
    batches_left = len(train_loader) + (cfg.epochs - progress.epoch - 1) * epoch_batches
    total_steps = cfg.max_steps or progress.step + batches_left // cfg.grad_accum
    if total_steps == 0:  # drop_last leaves no batch when the data is smaller than one
        raise RecipeError(f"{len(train_set)} training images make no full step of {global_batch_size}: "
                          "lower --batch_size or --grad_accum")
    epochs = cfg.epochs if cfg.max_steps is None else math.ceil(total_steps * cfg.grad_accum / epoch_batches)
    log_every = cfg.log_every or max(1, total_steps // 100)  # about 100 points on each curve

    data_name = "SYNTHETIC data" if cfg.synthetic else cfg.data
    accelerator.print(f"{RECIPE}: {data_name}, {len(train_set)} train / {len(test_set)} test images | "
                      f"{accelerator.num_processes} process(es) on {accelerator.device}, "
                      f"precision {accelerator.mixed_precision} | "
                      f"global batch {global_batch_size}, {total_steps} steps ({epochs} epochs) | {run_dir}")
    config = run_config(cfg, accelerator, run_dir, recipe=RECIPE, data=data_name, global_batch_size=global_batch_size,
                        total_steps=total_steps, train_size=len(train_set), test_size=len(test_set),
                        lr_schedule=SCHEDULE_RULE, resumed_step=progress.step if cfg.resume else None,
                        resumed_from=str(checkpoint) if cfg.resume else None)
    if cfg.resume:
        check_resume(checkpoint, config, progress)  # steps left to run? what changed, and what that changes
    accelerator.init_trackers(RECIPE, config=config)

    start, window = time.perf_counter(), TrainWindow(accelerator)
    stop = StopSignal(accelerator)  # SIGTERM or Ctrl-C: checkpoint after the current step, then exit 0
    show_bar = accelerator.is_local_main_process and sys.stderr.isatty()
    while progress.step < total_steps:
        model.train()
        order.set_position(progress.epoch, progress.samples_seen)  # this epoch's order, from the first unseen sample
        bar = tqdm(train_loader, desc=f"epoch {progress.epoch + 1}/{epochs}", disable=not show_bar, leave=False)
        for images, labels in bar:
            lr = one_cycle_lr(progress.step, total_steps, cfg.lr)  # a function of the step: see shared/schedule.py
            for group in optimizer.param_groups:
                group["lr"] = lr
            with accelerator.accumulate(model):  # DDP syncs gradients only on the last batch of each accumulation
                logits = model(preprocess(images))
                loss = F.cross_entropy(logits, labels)
                accelerator.backward(loss)  # scaled by 1/grad_accum, so accumulated gradients are a mean
                if accelerator.sync_gradients:  # the gradient is complete: accumulated, averaged over processes
                    # Adam scales each step by the gradient's own size, so the clip changed nothing measurable
                    # here (0.281 on real photos either way); it bounds the step after a rare outlier batch.
                    window.add_grad_norm(accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
                optimizer.step()  # does nothing until the last batch of the accumulation
                optimizer.zero_grad()
            progress.samples_seen += len(labels) * accelerator.num_processes
            window.add(loss, logits, labels)  # summed on the device: no loss.item() (a GPU sync) every step
            if not accelerator.sync_gradients:
                continue
            progress.step += 1
            log_now = progress.step % log_every == 0 or progress.step == total_steps
            if log_now:
                epoch = progress.epoch + progress.samples_seen / epoch_samples
                point = {"epoch": epoch, "lr": lr, **window.flush(progress.step)}
                accelerator.log(point, step=progress.step)
                bar.set_postfix(loss=f"{point['train_loss']:.3f}", acc=f"{point['train_acc']:.3f}",
                                samples_per_s=f"{point['samples_per_s']:.0f}")
            if checkpoint_or_stop(accelerator, model, run_dir, progress.step, cfg, stop, window, synced=log_now):
                accelerator.end_training()
                return
            if progress.step == total_steps:
                break
        if len(train_set) - progress.samples_seen < cfg.batch_size * accelerator.num_processes:  # no full batch left
            progress.epoch, progress.samples_seen = progress.epoch + 1, 0
        with window.paused():
            metrics, predictions = evaluate(model, test_loader, accelerator)
        progress.best_eval_acc = max(progress.best_eval_acc, metrics["eval_acc"])
        accelerator.log(metrics, step=progress.step)
        accelerator.print(f"step {progress.step}/{total_steps}  eval_loss {metrics['eval_loss']:.4f}  "
                          f"eval_acc {metrics['eval_acc']:.4f}")

    save_checkpoint(accelerator, model, run_dir, progress.step, cfg.keep_checkpoints)  # no-op if this step is saved
    wall_s = time.perf_counter() - start
    epochs_done = progress.epoch + progress.samples_seen / epoch_samples
    summary = run_summary(accelerator, progress, window, wall_s, epochs_done, data_name)
    save_weights(accelerator, model, run_dir / "model.safetensors", {"recipe": RECIPE, **metrics, **summary})
    save_pictures(accelerator, run_dir, test_set, predictions, progress.step)  # confusion matrix, misclassified images
    accelerator.log(summary, step=progress.step)
    accelerator.end_training()
    accelerator.print(f"done: eval_acc {metrics['eval_acc']:.4f} after {progress.step} steps in {wall_s:.0f} s; "
                      f"files in {run_dir}")


def main() -> None:
    cfg = parse_config(Config)
    with one_line_errors():
        if cfg.eval_only:  # --eval_only --weights PATH: test metrics of a weights file, as one JSON line
            evaluate_weights(cfg, lambda n: make_model(n, cfg), lambda: load_data(cfg)[1], evaluate)
        else:
            train(cfg)


if __name__ == "__main__":
    main()
