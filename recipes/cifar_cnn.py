"""CIFAR-10 with the classic small CNN: 3 x (conv 5x5 + ReLU + max-pool), Linear 1024 -> 64 -> 10.

Results (update only from real runs; the command that produced each number is given):
  real CIFAR-10   not measured yet: this file was written on a machine that cannot download it.
                  The defaults (SGD + Nesterov, one-cycle LR, crop + flip, 30 epochs) are the usual
                  recipe for a network of this size; run it and record the number here.
  synthetic, CPU  0.865 test accuracy after 2 epochs, 123 s (899 samples/s training, 62 s/epoch with
                  evaluation); 1 process on 2 cores of an AMD EPYC CPU, float32:
                    accelerate launch --config_file accelerate_configs/cpu.yaml recipes/cifar_cnn.py --synthetic --epochs 2
                  smoke run, same machine: 0.638 after 200 steps, 41 s:  ... --synthetic --max_steps 200

Run it (from the repository root):
  accelerate launch --config_file accelerate_configs/cpu.yaml recipes/cifar_cnn.py
  accelerate launch --config_file accelerate_configs/2gpu.yaml recipes/cifar_cnn.py
  python recipes/cifar_cnn.py --synthetic --max_steps 200      # offline smoke run, no download
Outputs land in runs/cifar_cnn-<time>/: config.json, metrics.jsonl, summary.json, curves.png,
model.safetensors and checkpoints/.
"""

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # find shared/ without installing it
from shared.augment import normalize, random_crop, random_flip  # noqa: E402
from shared.checkpoints import Progress, find_checkpoint, load_weights, resume_from, save_checkpoint, save_weights  # noqa: E402
from shared.config import RunConfig, parse_config  # noqa: E402
from shared.data import load_image_data, whole_batch  # noqa: E402
from shared.errors import RecipeError, check_launch, one_line_errors  # noqa: E402
from shared.tracking import Throughput, make_run_dir, peak_memory_mb, run_config, tracker_kwargs, trackers  # noqa: E402

RECIPE = "cifar_cnn"


@dataclass
class Config(RunConfig):
    data: str = "uoft-cs/cifar10"  # hub id, or a local save_to_disk / parquet / imagefolder folder
    epochs: int = 30  # passes over the training set
    batch_size: int = 128  # images per process per step; global batch = batch_size x processes x grad_accum
    grad_accum: int = 1  # batches whose gradients are summed into one optimizer step
    lr: float = 0.05  # peak learning rate of the one-cycle schedule
    momentum: float = 0.9  # SGD Nesterov momentum
    weight_decay: float = 5e-4  # L2 penalty on conv and linear weights (not on biases)
    augment: bool = True  # random crop (4 px padding) and horizontal flip, on the device


# ----------------------------------------------------------------------------- data
IMAGE_SHAPE = (3, 32, 32)  # channels, height, width
MEAN = (0.4914, 0.4822, 0.4465)  # per-channel mean and std of the CIFAR-10 training images
STD = (0.2470, 0.2435, 0.2616)


def preprocess(images: torch.Tensor, augment: bool) -> torch.Tensor:
    """uint8 batch on the device -> normalized float batch, augmented for training."""
    images = normalize(images, MEAN, STD)
    if augment:
        images = random_flip(random_crop(images, padding=4))
    return images


# ----------------------------------------------------------------------------- model
def make_model(num_classes: int) -> nn.Sequential:
    # The seed network had no nonlinearity at all, which makes it one linear map plus max-pools;
    # a ReLU after each conv and after the hidden Linear is the one change made to it.
    return nn.Sequential(
        nn.Conv2d(3, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),  # 32 x 32 -> 16 x 16
        nn.Conv2d(32, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),  # -> 8 x 8
        nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),  # -> 4 x 4
        nn.Flatten(),  # 64 channels x 4 x 4 = 1024 features
        nn.Linear(1024, 64), nn.ReLU(),
        nn.Linear(64, num_classes),
    )


@torch.no_grad()  # no autograd graph: evaluation needs no gradients, and would hold every activation
def evaluate(model, loader, accelerator) -> dict:
    model.eval()
    loss_sum = correct = count = 0
    for images, labels in loader:
        logits = model(preprocess(images, augment=False))
        # Gathered from every process; gather_for_metrics drops the samples that accelerate
        # repeated to make the last batch even, so each test image counts exactly once.
        logits, labels = accelerator.gather_for_metrics((logits, labels))
        loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum")
        correct += (logits.argmax(dim=1) == labels).sum()
        count += len(labels)
    return {"eval_loss": (loss_sum / count).item(), "eval_acc": (correct / count).item(), "eval_samples": count}


# ----------------------------------------------------------------------------- training
def train(cfg: Config) -> None:
    check_launch()  # refuses duplicate runs (2gpu.yaml without GPUs) and fp16 on a CPU
    run_dir = make_run_dir(cfg, RECIPE)
    accelerator = Accelerator(
        gradient_accumulation_steps=cfg.grad_accum,
        step_scheduler_with_optimizer=False,  # stepped below, exactly once per optimizer step
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.seed),  # order = f(seed, epoch)
        project_dir=run_dir,
        log_with=trackers(cfg, run_dir),  # wandb / tensorboard + config.json, metrics.jsonl, summary.json, curves.png
    )
    set_seed(cfg.seed)
    with accelerator.main_process_first():  # the main process decodes and caches; the others read its cache
        train_set, test_set = load_image_data(cfg.data, IMAGE_SHAPE, cfg.synthetic)
    train_loader = DataLoader(train_set, cfg.batch_size, shuffle=True, drop_last=True, collate_fn=whole_batch)
    test_loader = DataLoader(test_set, 2 * cfg.batch_size, collate_fn=whole_batch)

    model = make_model(len(train_set.classes))
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.compile:
        model.compile()  # in place: state_dict keys stay free of `_orig_mod.`
    weights = [p for p in model.parameters() if p.ndim > 1]
    biases = [p for p in model.parameters() if p.ndim <= 1]
    optimizer = torch.optim.SGD([{"params": weights, "weight_decay": cfg.weight_decay}, {"params": biases, "weight_decay": 0}],
                                lr=cfg.lr, momentum=cfg.momentum, nesterov=True)
    model, optimizer, train_loader, test_loader = accelerator.prepare(model, optimizer, train_loader, test_loader)

    # After prepare, len(train_loader) counts this process's batches: its share of the epoch.
    steps_per_epoch = math.ceil(len(train_loader) / cfg.grad_accum)
    total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    epochs = math.ceil(total_steps / steps_per_epoch)
    global_batch_size = cfg.batch_size * accelerator.num_processes * cfg.grad_accum
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg.lr, total_steps=total_steps, pct_start=0.2,
                                                    anneal_strategy="linear", cycle_momentum=False)
    scheduler = accelerator.prepare(scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)  # saved and restored with every checkpoint
    if cfg.resume:
        resume_from(accelerator, find_checkpoint(run_dir, cfg.resume, RECIPE))
        if progress.step >= total_steps:
            raise RecipeError(f"{run_dir} already finished its {total_steps} steps: raise --max_steps or --epochs to train on")

    data_name = "SYNTHETIC data" if cfg.synthetic else cfg.data
    accelerator.print(f"{RECIPE}: {data_name}, {len(train_set)} train / {len(test_set)} test images | "
                      f"{accelerator.num_processes} process(es) on {accelerator.device}, precision {accelerator.mixed_precision} | "
                      f"global batch {global_batch_size}, {steps_per_epoch} steps/epoch, {total_steps} steps | {run_dir}")
    config = run_config(cfg, accelerator, recipe=RECIPE, data=data_name, global_batch_size=global_batch_size,
                        steps_per_epoch=steps_per_epoch, total_steps=total_steps, train_size=len(train_set),
                        test_size=len(test_set), resumed_step=progress.step if cfg.resume else None)
    accelerator.init_trackers(RECIPE, config=config, init_kwargs=tracker_kwargs(cfg, run_dir, run_dir.name))

    start, speed = time.perf_counter(), Throughput()
    loss_sum, loss_count = torch.zeros((), device=accelerator.device), 0
    show_bar = accelerator.is_local_main_process and sys.stderr.isatty()
    while progress.step < total_steps:
        model.train()
        train_loader.set_epoch(progress.epoch)  # the shuffle is a function of (seed, epoch), so resume is exact
        batches = train_loader
        if progress.batches_seen:  # resuming mid-epoch: same permutation, minus the batches already trained on
            batches = accelerator.skip_first_batches(train_loader, progress.batches_seen)
        for images, labels in tqdm(batches, desc=f"epoch {progress.epoch + 1}/{epochs}", disable=not show_bar, leave=False):
            with accelerator.accumulate(model):  # DDP syncs gradients only on the last batch of each accumulation
                if cfg.channels_last:
                    images = images.contiguous(memory_format=torch.channels_last)
                loss = F.cross_entropy(model(preprocess(images, cfg.augment)), labels)
                accelerator.backward(loss)  # scaled by 1/grad_accum, so accumulated gradients are a mean
                optimizer.step()  # does nothing until the last batch of the accumulation
                optimizer.zero_grad()
            progress.batches_seen += 1
            speed.count(len(labels) * accelerator.num_processes)
            loss_sum += loss.detach()  # detach: keeping `loss` itself would keep its whole graph alive
            loss_count += 1
            if not accelerator.sync_gradients:
                continue
            lr = scheduler.get_last_lr()[0]  # the rate this step used
            scheduler.step()
            progress.step += 1
            if progress.step % cfg.log_every == 0 or progress.step == total_steps:
                train_loss = accelerator.reduce(loss_sum, "mean").item() / loss_count  # .item() waits for the GPU: only here
                if not math.isfinite(train_loss):
                    raise RecipeError(f"train loss became {train_loss} by step {progress.step}: lower --lr (now {cfg.lr}); "
                                      "checkpoints already on disk hold finite weights")
                accelerator.log({"epoch": progress.epoch + progress.batches_seen / len(train_loader), "train_loss": train_loss,
                                 "lr": lr, "samples_per_s": speed.window()}, step=progress.step)
                loss_sum.zero_()
                loss_count = 0
            if cfg.checkpoint_every and progress.step % cfg.checkpoint_every == 0:
                with speed.paused():
                    save_checkpoint(accelerator, model, run_dir, progress.step, cfg.keep_checkpoints)
            if progress.step == total_steps:
                break
        if progress.batches_seen == len(train_loader):
            progress.epoch, progress.batches_seen = progress.epoch + 1, 0
        with speed.paused():
            metrics = evaluate(model, test_loader, accelerator)
        progress.best_eval_acc = max(progress.best_eval_acc, metrics["eval_acc"])
        accelerator.log(metrics, step=progress.step)
        accelerator.print(f"step {progress.step}/{total_steps}  eval_loss {metrics['eval_loss']:.4f}  eval_acc {metrics['eval_acc']:.4f}")

    if not (cfg.checkpoint_every and progress.step % cfg.checkpoint_every == 0):
        save_checkpoint(accelerator, model, run_dir, progress.step, cfg.keep_checkpoints)
    wall_s = time.perf_counter() - start
    summary = {"best_eval_acc": progress.best_eval_acc, "steps": progress.step, "epochs": progress.step / steps_per_epoch,
               "wall_s": wall_s, "samples_per_s": speed.overall(),
               "peak_mem_mb": peak_memory_mb(accelerator.device), "world_size": accelerator.num_processes,
               "mixed_precision": accelerator.mixed_precision, "data": data_name}
    save_weights(accelerator, model, run_dir / "model.safetensors", {"recipe": RECIPE, **metrics, **summary})
    accelerator.log(summary, step=progress.step)
    accelerator.end_training()
    accelerator.print(f"done: eval_acc {metrics['eval_acc']:.4f} after {progress.step} steps in {wall_s:.0f} s; files in {run_dir}")


def evaluate_weights(cfg: Config) -> None:
    """--eval_only: test-split loss and accuracy of a weights file, printed as one JSON line."""
    check_launch()
    accelerator = Accelerator()
    with accelerator.main_process_first():
        _, test_set = load_image_data(cfg.data, IMAGE_SHAPE, cfg.synthetic)
    model = make_model(len(test_set.classes))
    load_weights(model, cfg.weights)
    model, test_loader = accelerator.prepare(model, DataLoader(test_set, 2 * cfg.batch_size, collate_fn=whole_batch))
    accelerator.print(json.dumps({"weights": cfg.weights, **evaluate(model, test_loader, accelerator)}))


def main() -> None:
    cfg = parse_config(Config)
    with one_line_errors():
        evaluate_weights(cfg) if cfg.eval_only else train(cfg)


if __name__ == "__main__":
    main()
