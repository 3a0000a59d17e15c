"""Fashion-MNIST with the d2l ResNet-18: 3x3 stem, four stages of two residual blocks, 512 -> 10.

It teaches what changes when one process becomes several: the global batch grows, so the learning
rate must follow it (--lr_scaling), gradient accumulation makes a bigger batch on fewer processes
(--grad_accum), and BatchNorm sees only its own process's images unless synchronized (--sync_bn).

Result: the real Fashion-MNIST (Debian's dataset-fashion-mnist) in cpu_bf16.yaml on a 2-core CPU: test accuracy
0.951 after the default 30 epochs (seed 0), 0.930 +- 0.001 after 5 (3 seeds; 257 s an epoch; both with d2l's conv
biases, without them not measured on a CPU); d2l's loop 0.883 after 5. On one H200 in bf16.yaml, --batch_size 512
--epochs 6, the step a CUDA graph: 0.9326-0.9354 in 6.2-6.3 s of training (seeds 0-2, each a new process; 12.8-14.8
s from the command, Python's compiled code kept; benchmarks/results/gpu-h200/2026-11-29/call3.sh, 2026-11-29).
More: benchmarks/BENCHMARKS.md.
  accelerate launch -q --config_file accelerate_configs/cpu_bf16.yaml recipes/resnet18_fmnist.py \
    --data /usr/share/datasets/fashion-mnist

Run it from the repository root (outputs in runs/resnet18_fmnist-<time>/):
  accelerate launch --config_file accelerate_configs/2gpu.yaml recipes/resnet18_fmnist.py --sync_bn
  python recipes/resnet18_fmnist.py --synthetic --max_steps 100      # offline smoke run, no download
"""

import copy
import math
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import GradientAccumulationPlugin, broadcast, set_seed
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # find shared/ without installing it
from shared import augment, loop, tracking  # augmentation; lr, EMA, CUDA graph, device settings; run files
from shared.checkpoints import Checkpoints, Progress
from shared.config import RunConfig
from shared.data import EpochOrder, load_image_data
from shared.errors import RecipeError, one_line_errors

RECIPE = "resnet18_fmnist"
REFERENCE_BATCH = 128  # the global batch size that --lr is given for


@dataclass
class Config(RunConfig):
    data: str = "zalando-datasets/fashion_mnist"  # hub id, or a folder: save_to_disk, parquet, imagefolder, IDX
    epochs: int = 30  # passes over the training set
    batch_size: int = 128  # images per process per step; global batch = batch_size x processes x grad_accum
    grad_accum: int = 1  # batches whose gradients are summed into one optimizer step
    lr: float = 0.1  # peak learning rate of the one-cycle schedule, for a global batch of 128
    lr_scaling: Literal["none", "linear", "sqrt"] = "sqrt"  # how the learning rate follows the global batch
    sync_bn: bool = False  # BatchNorm statistics over the global batch, not each process's share (GPUs)
    momentum: float = 0.9  # SGD's Nesterov momentum; 0: plain SGD
    weight_decay: float = 5e-4  # L2 penalty on conv and linear weights (not on biases)
    max_grad_norm: float = 1.0  # clip the gradient's global L2 norm to this before each step; inf: only measure it
    augment: bool = True  # random crop (2 px padding), horizontal flip and --erase, on the device
    erase: float = 0.5  # random erasing: the share of training images with a random rectangle blanked (0: off)
    tta: bool = False  # also evaluate each test image's logits averaged with its mirror's (eval_acc_tta)
    channels_last: bool = True  # NHWC layout for the convolutions: faster on CPUs and on GPUs with bf16 (BENCHMARKS)

    NON_NEGATIVE = RunConfig.NON_NEGATIVE + ("momentum", "weight_decay")

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.erase <= 1:
            raise ValueError(f"--erase is a share of the images, from 0 to 1, got {self.erase}")


# ----------------------------------------------------------------------------- data
IMAGE_SHAPE = (1, 28, 28)  # channels, height, width: grayscale
MEAN, STD = (0.2860,), (0.3530,)  # mean and std of the Fashion-MNIST training pixels
PAD_FILL = tuple(round(255 * m) for m in MEAN)  # crops' border: the mean colour


def load_data(cfg: Config):
    """(train, test) as uint8 image tensors: the hub, a local folder, or --synthetic (Fashion-MNIST's sizes)."""
    return load_image_data(cfg.data, IMAGE_SHAPE, cfg.synthetic, synthetic_sizes=(60_000, 10_000))


def preprocess(images: torch.Tensor, training: bool, erase: float = 0.0) -> torch.Tensor:
    """uint8 batch on the device -> normalized float batch, augmented for training (in uint8: fewer bytes to move).
    The padding and the erased rectangles are the mean colour on the 8-bit grid, which normalizes to 0 (within
    0.5/255/std)."""
    if training:
        # Clothes are left-right symmetric enough to mirror; a 2 px shift suits 28 px images. Erasing a part of the
        # garment makes the network use all of it (the best Fashion-MNIST results use it; BENCHMARKS.md).
        images = augment.random_flip(augment.random_crop(images, padding=2, fill=PAD_FILL))
        if erase:
            images = random_erase(images, erase, fill=PAD_FILL)
    return augment.normalize(images, MEAN, STD)


def random_erase(images: torch.Tensor, p: float, fill: tuple[int, ...], scale=(0.02, 0.33),
                 ratio=(0.3, 3.3)) -> torch.Tensor:
    """Random erasing (Zhong et al. 2017) with torchvision's defaults: in a random `p` share of the images, a rectangle
    of colour `fill` covering `scale` of the image, with an aspect ratio in `ratio` (log-uniform), clamped to the
    image. Each image draws its own rectangle."""
    n, c, h, w = images.shape
    # Five uniform numbers per image in [0, 1), drawn at once: the area, the aspect ratio, the top, the left, and
    # whether to erase at all.
    area_draw, aspect_draw, top_draw, left_draw, erase_draw = torch.rand(5, n, 1, 1, device=images.device)
    area = (scale[0] + (scale[1] - scale[0]) * area_draw) * (h * w)
    aspect = torch.exp(math.log(ratio[0]) + math.log(ratio[1] / ratio[0]) * aspect_draw)
    height, width = (area * aspect).sqrt_().round_().clamp_(1, h), (area / aspect).sqrt_().round_().clamp_(1, w)
    top, left = (top_draw * (h - height + 1)).floor_(), (left_draw * (w - width + 1)).floor_()
    rows, cols = torch.arange(h, device=images.device).view(1, h, 1), torch.arange(w, device=images.device)
    inside = (rows >= top) & (rows < top + height) & (cols >= left) & (cols < left + width)
    inside &= erase_draw < p
    return torch.where(inside.unsqueeze(1), augment.fill_colour(tuple(fill), c, images.device), images)


# ----------------------------------------------------------------------------- model
class Residual(nn.Module):
    """Two 3x3 convs with BatchNorm, added to the input (through a 1x1 conv when the shape changes)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        # No bias on a conv that BatchNorm follows: BatchNorm subtracts each channel's mean, bias included, and adds
        # its own shift. d2l's convs all have one: 17 of its 20 are dead weight, each one more gradient reduction.
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(out_channels),
            nn.ReLU(),
            nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False), nn.BatchNorm2d(out_channels))
        projects = stride != 1 or in_channels != out_channels
        self.shortcut = nn.Conv2d(in_channels, out_channels, 1, stride=stride) if projects else nn.Identity()

    def forward(self, x):
        return F.relu(self.body(x) + self.shortcut(x))


def make_model(num_classes: int, cfg: Config | None = None) -> nn.Sequential:  # cfg: no model flags here
    # d2l's ResNet-18 with a 3x3 stride-1 stem and no max-pool: 28 x 28 images are small enough.
    return nn.Sequential(
        nn.Conv2d(IMAGE_SHAPE[0], 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),  # 28 x 28
        Residual(64, 64), Residual(64, 64),
        Residual(64, 128, stride=2), Residual(128, 128),  # -> 14 x 14
        Residual(128, 256, stride=2), Residual(256, 256),  # -> 7 x 7
        Residual(256, 512, stride=2), Residual(512, 512),  # -> 4 x 4
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),  # 512 features
        nn.Linear(512, num_classes),
    )


def make_optimizer(model: nn.Module, cfg: Config, lr: float) -> torch.optim.Optimizer:
    # Weight decay on weight matrices and kernels only: decaying biases and BatchNorm's scales and shifts just limits
    # what they can fit.
    weights = [p for p in model.parameters() if p.ndim > 1]
    biases = [p for p in model.parameters() if p.ndim <= 1]
    groups = [{"params": weights, "weight_decay": cfg.weight_decay}, {"params": biases, "weight_decay": 0}]
    # fused: the whole update in one kernel per device and dtype, where a loop over the tensors makes several each.
    return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0, fused=True)


def scaled_lr(cfg, global_batch_size: int) -> float:
    """--lr is for a global batch of REFERENCE_BATCH; a bigger batch takes fewer, less noisy steps.
    linear (Goyal et al. 2017) is the large-batch SGD rule, with warmup; sqrt, the default, is gentler
    (never above linear) and matches what the seed runs found by hand: x2 batch -> x1.5 LR."""
    ratio = global_batch_size / REFERENCE_BATCH
    return cfg.lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[cfg.lr_scaling]


def loss_fn(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """The objective. Training and evaluation both call this one: change the loss here."""
    return F.cross_entropy(logits.float(), labels, reduction=reduction)


def metric_sums(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """The metrics, each summed over a batch: logged as train_<name> and eval_<name> (divided by the samples) in
    metrics.jsonl, the trackers, curves.png and summary.json, and by predict.py --evaluate. Add a metric here."""
    return {"acc": (logits.argmax(dim=1) == labels).sum()}


@torch.no_grad()  # no autograd graph: evaluation needs no gradients, and would hold every activation
def evaluate(model, loader, accelerator, cfg: Config) -> tuple[dict, torch.Tensor]:
    """Test loss and accuracy over every process, and the predictions in test-set order. With --tta, also those of
    each image's logits averaged with its mirror's (eval_loss_tta, eval_acc_tta): training flips, so both count."""
    model.eval()
    sums, predictions = defaultdict(int), []
    for images, labels in loader:
        inputs = preprocess(images, training=False)
        if cfg.channels_last:  # the layout the model was trained in
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        outputs = {"": model(inputs)}
        if cfg.tta:
            outputs["_tta"] = (outputs[""] + model(inputs.flip(3))) / 2
        # From every process, minus the samples accelerate repeated to even out the last batch.
        outputs, labels = accelerator.gather_for_metrics((outputs, labels))
        for suffix, logits in outputs.items():
            sums[f"eval_loss{suffix}"] += loss_fn(logits, labels, reduction="sum")
            for name, value in metric_sums(logits, labels).items():
                sums[f"eval_{name}{suffix}"] += value
        predictions.append(outputs[""].argmax(dim=1))
    count = sum(len(p) for p in predictions)
    return {**{k: (v / count).item() for k, v in sums.items()}, "eval_samples": count}, torch.cat(predictions).cpu()


# ----------------------------------------------------------------------------- training
def train(cfg: Config) -> None:
    run_dir, trackers = tracking.open_run(cfg, RECIPE)  # checks the launch first (see shared/launch.py)
    accelerator = Accelerator(
        # Every optimizer step averages exactly grad_accum batches, also across an epoch's end (by default accelerate
        # steps early at the end of the data, with too small a gradient).
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=cfg.grad_accum, sync_with_dataloader=False),
        # Pinned batches (pin_memory below) copied to a GPU without waiting for it; no effect on a CPU.
        dataloader_config=DataLoaderConfiguration(non_blocking=True),
        project_dir=run_dir,
        log_with=trackers,  # wandb or TensorBoard, and config.json, metrics.jsonl, summary.json, curves.png
    )
    # CPU: glibc keeps freed memory (up to a quarter faster steps); GPU: TF32, cuDNN autotuning if asked (BENCHMARKS.md)
    loop.device_settings(accelerator, cfg)
    set_seed(cfg.seed, device_specific=True)  # seed + rank: each process its own crops, flips and dropout masks
    with accelerator.local_main_process_first():  # one process per machine decodes into the machine's cache
        train_set, test_set = load_data(cfg)
    on_device = loop.data_on_device(accelerator.device, cfg.data_on_device, train_set, test_set)
    if on_device:  # one copy of the uint8 dataset now, instead of a host-to-GPU copy per batch
        train_set, test_set = train_set.to(accelerator.device), test_set.to(accelerator.device)
    # Each epoch's order is a function of (seed, epoch), resumable at any sample (see EpochOrder). Own generators:
    # every new DataLoader iterator draws a seed, and drawing it from the global RNG would shift the augmentation's
    # random numbers after a mid-epoch resume (no longer bitwise exact).
    order = EpochOrder(len(train_set), cfg.seed)
    pin = train_set.images.device.type == "cpu" and accelerator.device.type == "cuda"  # page-locked: async copies
    train_loader = DataLoader(train_set, cfg.batch_size, sampler=order, drop_last=True,
                              collate_fn=train_set.whole_batch, generator=torch.Generator(), pin_memory=pin)
    test_loader = DataLoader(test_set, 2 * cfg.batch_size, collate_fn=test_set.whole_batch, generator=torch.Generator())

    global_batch_size = cfg.batch_size * accelerator.num_processes * cfg.grad_accum
    peak_lr = scaled_lr(cfg, global_batch_size)
    model = make_model(len(train_set.classes), cfg)
    # --init_from: trained weights to start from (a classifier trained on other classes starts new)
    init_sha256 = Checkpoints.initial_weights(model, cfg, train_set.classes)
    if cfg.sync_bn and accelerator.num_processes > 1:
        # BatchNorm normalizes each process's own b images: 2 processes x b do not normalize like 1 x 2b (the
        # exact-equivalence tests use a BatchNorm-free model). SyncBatchNorm all-reduces the statistics at every
        # BatchNorm layer. Accumulated batches still differ: they run one after another, with nothing to sync.
        if accelerator.device.type == "cpu":
            raise RecipeError("--sync_bn needs GPUs: PyTorch's SyncBatchNorm does not run on CPU tensors")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.compile:
        model.compile()  # in place: state_dict keys stay free of `_orig_mod.`
    optimizer = make_optimizer(model, cfg, peak_lr)
    model, optimizer, train_loader, test_loader = accelerator.prepare(model, optimizer, train_loader, test_loader)

    # After prepare, len(train_loader) counts this process's batches: its share of an epoch.
    epoch_batches = len(train_loader)
    epoch_samples = epoch_batches * cfg.batch_size * accelerator.num_processes  # less a remainder short of a batch
    progress = Progress()
    accelerator.register_for_checkpointing(progress)  # saved and restored with every checkpoint
    # --ema: an average of the weights (shared/ema.py), a copy of the model updated on every process after every
    # optimizer step. The processes hold the same weights, so the same average; BatchNorm's running statistics too.
    ema = copy.deepcopy(accelerator.unwrap_model(model)).requires_grad_(False) if cfg.ema else None
    if ema is not None:
        from shared.ema import update_ema  # only the runs that pass --ema: an opt-in module

        accelerator.register_for_checkpointing(ema)  # in every checkpoint, so a resume continues it exactly
    checkpoints = Checkpoints(accelerator, run_dir, cfg)
    # SIGTERM (sent by SLURM and most schedulers before a kill) or Ctrl-C: finish this step, save, exit 0 (after_step).
    checkpoints.stop_on_signals()
    # With --resume: the checkpoint loaded, else None. From another number of processes, every process is re-seeded.
    checkpoint = checkpoints.resume(progress)
    order.set_position(progress.epoch, progress.samples_into_epoch)
    # Optimizer steps to the end of --epochs from where the run stands: the rest of this epoch, then whole ones
    # (counted this way, a resume on another number of processes still ends after --epochs).
    batches_left = len(train_loader) + (cfg.epochs - progress.epoch - 1) * epoch_batches
    total_steps = cfg.max_steps or progress.step + batches_left // cfg.grad_accum
    if epoch_batches < cfg.grad_accum or total_steps == 0:  # an epoch must hold a step (drop_last: whole batches)
        raise RecipeError(f"{len(train_set)} training images make no full step of {global_batch_size}: "
                          "lower --batch_size or --grad_accum")
    run_epochs = total_steps * cfg.grad_accum / epoch_batches  # the run's length: a fraction with --max_steps
    log_every = cfg.log_every or max(1, total_steps // 100)  # about 100 points on each curve

    data_name = "SYNTHETIC data" if cfg.synthetic else cfg.data
    accelerator.print(f"{RECIPE}: {data_name}, {len(train_set)} train / {len(test_set)} test images | "
                      f"{accelerator.num_processes} process(es) on {accelerator.device}, "
                      f"precision {accelerator.mixed_precision} | "
                      f"global batch {global_batch_size}, {total_steps} steps ({run_epochs:.3g} epochs) | "
                      f"lr {cfg.lr} for batch {REFERENCE_BATCH} -> {peak_lr:.4g} ({cfg.lr_scaling} scaling) | "
                      f"{run_dir}")
    config = tracking.run_config(cfg, accelerator, run_dir, recipe=RECIPE, script=__file__, data=data_name,
                                 global_batch_size=global_batch_size, effective_lr=peak_lr, total_steps=total_steps,
                                 train_size=len(train_set), test_size=len(test_set), classes=train_set.classes,
                                 data_on_device=on_device, resumed_from=str(checkpoint) if checkpoint else None,
                                 resumed_step=progress.step if checkpoint else None, init_from_sha256=init_sha256)
    # Steps left to run? What changed, and what that changes? From an older checkpoint than the newest, this moves
    # the later history (checkpoints, weights, summary, pictures) into abandoned/: a new branch of the run.
    checkpoints.check_resume_and_branch(config, progress)
    accelerator.init_trackers(RECIPE, config=config)

    def train_step(images, labels):  # one batch; on one GPU, a CUDA graph of it is replayed (shared/loop.py)
        with accelerator.accumulate(model):  # DDP syncs gradients only on the last batch of each accumulation
            inputs = preprocess(images, cfg.augment, cfg.erase)
            if cfg.channels_last:  # after preprocessing: the crop's gather returns a plain NCHW tensor
                inputs = inputs.contiguous(memory_format=torch.channels_last)
            logits = model(inputs)
            loss = loss_fn(logits, labels)
            accelerator.backward(loss)  # scaled by 1/grad_accum, so accumulated gradients are a mean
            grad_norm = None
            if accelerator.sync_gradients:  # the gradient is complete: accumulated, averaged over processes
                # Early steps at the peak rate moved the weights faster than BatchNorm's running statistics could
                # follow (test loss 102 at the peak); the clip bounds each step.
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()  # does nothing until the last batch of the accumulation
            optimizer.zero_grad()
        return loss.detach(), logits.detach(), grad_norm

    step = loop.CapturedStep(train_step, optimizer, loop.graph_setting(accelerator, cfg))
    progress.pieces += 1  # this launch is one more piece of the run (saved with each checkpoint, in the summary)
    window = tracking.TrainWindow(accelerator, progress)  # train_* points, and the run's time across its pieces
    while True:  # the rest of an epoch, then an evaluation; resumed at the run's last step, only the evaluation
        model.train()
        order.set_position(progress.epoch, progress.samples_into_epoch)  # this epoch's order, from the first unseen one
        bar = tqdm(train_loader, desc=f"epoch {progress.epoch + 1}/{math.ceil(run_epochs)}",
                   total=min(len(train_loader), (total_steps - progress.step) * cfg.grad_accum),  # --max_steps
                   leave=False, disable=not (accelerator.is_local_main_process and window.terminal))
        for images, labels in bar:
            if progress.step == total_steps:
                break
            lr = loop.one_cycle_lr(progress.step, total_steps, peak_lr)  # a function of the step, no state
            step.set_lr(lr)
            loss, logits, grad_norm = step(images, labels)
            progress.samples_into_epoch += len(labels) * accelerator.num_processes
            window.add(loss, metric_sums(logits, labels), len(labels), grad_norm)  # summed on the device: no sync
            if not accelerator.sync_gradients:
                continue
            if ema is not None:
                update_ema(ema, model, progress.step, cfg.ema)  # no host sync: the decay is a Python number
            progress.step += 1
            window.heartbeat(progress.step, total_steps)  # without a terminal (a log file): a line every 30 s
            log_now = progress.step % log_every == 0 or progress.step == total_steps
            if log_now:
                epoch = progress.epoch + progress.samples_into_epoch / epoch_samples
                point = {"epoch": epoch, "lr": lr, **window.flush(progress.step)}
                accelerator.log(point, step=progress.step)
                bar.set_postfix(loss=f"{point['train_loss']:.3f}", acc=f"{point['train_acc']:.3f}",
                                samples_per_s=f"{point['samples_per_s']:.0f}")
            with window.paused():  # checkpointing is not training time
                if checkpoints.after_step(model, progress.step, at_log_point=log_now):  # a stop was asked: saved
                    accelerator.end_training()
                    return
        if len(train_set) - progress.samples_into_epoch < cfg.batch_size * accelerator.num_processes:  # no batch left
            progress.epoch, progress.samples_into_epoch = progress.epoch + 1, 0
        with window.paused():
            metrics, predictions = evaluate(model, test_loader, accelerator, cfg)
            if ema is not None:  # BatchNorm statistics differ between processes: the main process's, as DDP does
                broadcast(list(ema.buffers()))
                ema_metrics, _ = evaluate(ema, test_loader, accelerator, cfg)
                metrics |= {f"{key}_ema": value for key, value in ema_metrics.items() if key != "eval_samples"}
        progress.max_eval_acc = max(progress.max_eval_acc, metrics["eval_acc"])  # reported, never selected on
        accelerator.log(metrics, step=progress.step)
        accelerator.print(f"step {progress.step}/{total_steps}  "
                          + "  ".join(f"{key} {value:.4f}" for key, value in metrics.items() if key != "eval_samples"))
        if progress.step == total_steps:
            break

    checkpoints.save(model, progress.step)  # a no-op if this step is already saved
    summary = window.summary(progress.epoch + progress.samples_into_epoch / epoch_samples, data_name)  # whole run
    # With --ema the average is the model: choosing between it and the trained weights by their test accuracy would
    # select on the test set. The trained weights stay in the last checkpoint (predict.py --evaluate takes either).
    checkpoints.save_weights(model if ema is None else ema, {  # model.safetensors
        "recipe": RECIPE, "script": __file__, "weights": "trained" if ema is None else "ema",
        "classes": train_set.classes, "flags": vars(cfg), **metrics, **summary})
    from shared.pictures import save_pictures  # matplotlib: an opt-in module

    save_pictures(accelerator, run_dir, test_set, predictions, progress.step)  # confusion_matrix.png
    accelerator.log(summary, step=progress.step)
    accelerator.wait_for_everyone()  # gloo's exit race (docs/troubleshooting.md) is rarer if all leave together
    accelerator.end_training()
    saved = "trained" if ema is None else "EMA"  # the weights in model.safetensors, and their test accuracy
    accelerator.print(f"done: {saved} weights' eval_acc {metrics['eval_acc' if ema is None else 'eval_acc_ema']:.4f} "
                      f"after {progress.step} steps, {summary['wall_s']:.0f} s in {summary['pieces']} piece(s); "
                      f"model.safetensors and the run's files in {run_dir}")


def main() -> None:
    cfg = Config.parse()
    with one_line_errors():
        train(cfg)


if __name__ == "__main__":
    main()
