"""Fine-tune a pretrained torchvision classifier on your own photos: the new classifier alone first (no backward
through the frozen layers), then the whole network with a lower learning rate for the pretrained part.

`--model` is any torchvision classification builder but googlenet and inception_v3 (resnet18, resnet50,
efficientnet_b0, squeezenet1_1, convnext_tiny, vit_b_16, ...), `--weights` its pretrained weights (DEFAULT, a name
such as IMAGENET1K_V1, or none), torchvision's file, read from its cache, $TORCH_HOME/hub/checkpoints/. Your
photos (an imagefolder, parquet, a hub id or any format the recipes read) are preprocessed as the weights were.

Result: with ImageNet weights, not measured (no download here). Pretrained on the real Fashion-MNIST, then 120 steps
on 150 real digits at 32 px (2-core CPU): 0.754 +- 0.020 with every layer at --lr (--backbone_lr_scale 1) against
0.526 +- 0.080 from scratch, but 0.379 with the defaults (3 seeds). A frozen epoch of 1,000 photos at 224 px takes
6.9 s, an unfrozen one 18.1 s (cpu_bf16.yaml); of 10,000, 2.0 s and 4.2 s on one H200 (BENCHMARKS.md):
  bash benchmarks/finetune_transfer.sh OUT; python benchmarks/finetune_speed.py --out DIR --config cpu_bf16

Run it from the repository root (outputs in runs/finetune-<time>/, as every recipe's):
  accelerate launch -q --config_file accelerate_configs/1gpu.yaml recipes/finetune.py --data my_photos/
  python recipes/finetune.py --synthetic --weights none --image_size 64 --max_steps 20   # offline smoke run
"""

import contextlib
import copy
import functools
import math
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

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

with one_line_errors():  # a torchvision built for another torch: one line with the command that fixes it
    import torchvision
    from torchvision.transforms.v2.functional import center_crop

RECIPE = "finetune"
# Every torchvision classification builder but two, whose training outputs include auxiliary classifiers' (a tuple)
MODELS = torchvision.models.list_models(module=torchvision.models, exclude=["googlenet", "inception_v3"])


@dataclass
class Config(RunConfig):
    data: str = "AI-Lab-Makerere/beans"  # hub id, or a folder: imagefolder, parquet, save_to_disk, IDX, CIFAR
    model: str = "resnet18"  # a torchvision classification builder: resnet50, efficientnet_b0, convnext_tiny, ...
    weights: str = "DEFAULT"  # its pretrained weights: DEFAULT, a name (e.g. IMAGENET1K_V1), or none
    image_size: int | None = None  # the model's input side in pixels; default: the weights' own (224 for most)
    epochs: int = 10  # passes over the training set
    freeze_epochs: int | None = None  # first epochs train the new classifier alone; default 1 (0 without weights)
    batch_size: int = 32  # images per process per step; global batch = batch_size x processes x grad_accum
    grad_accum: int = 1  # batches whose gradients are summed into one optimizer step
    lr: float = 0.01  # peak learning rate of the one-cycle schedule, for the new classifier
    backbone_lr_scale: float | None = None  # pretrained layers' rate as a fraction of --lr; default 0.1 (1 without)
    momentum: float = 0.9  # SGD's Nesterov momentum; 0: plain SGD
    weight_decay: float = 1e-4  # L2 penalty on conv and linear weights (not on biases)
    max_grad_norm: float = 1.0  # clip the gradient's global L2 norm to this before each step; inf: only measure it
    augment: bool = True  # random resized crop and horizontal flip, on the device
    tta: bool = False  # also evaluate each test image's logits averaged with its mirror's (eval_acc_tta)
    channels_last: bool = True  # NHWC layout for the convolutions: faster on CPUs (BENCHMARKS.md)
    NON_NEGATIVE = RunConfig.NON_NEGATIVE + ("momentum", "weight_decay", "freeze_epochs")

    def __post_init__(self):
        super().__post_init__()
        if self.model not in MODELS:
            raise ValueError(f"--model {self.model} is not a torchvision classification model this recipe trains (e.g. "
                             "resnet18, resnet50, efficientnet_b0, convnext_tiny, vit_b_16; googlenet and inception_v3 "
                             "return several outputs in training)")
        choices = torchvision.models.get_model_weights(self.model).__members__
        if self.weights not in ("none", *choices):  # choices: the enum's names, DEFAULT included
            raise ValueError(f"--weights {self.weights}: {self.model} has {', '.join(choices)} or none")
        # Without pretrained layers nothing is worth freezing or sparing: every layer is new and trains at --lr.
        pretrained = self.weights != "none" or self.init_from is not None
        if not pretrained and (self.freeze_epochs or self.backbone_lr_scale not in (None, 1)):
            raise ValueError("--freeze_epochs and --backbone_lr_scale spare pretrained layers, and --weights none "
                             "has none (every layer starts random): leave them out, or pass --weights")
        if self.freeze_epochs is None:
            self.freeze_epochs = 1 if pretrained else 0
        if self.backbone_lr_scale is None:
            self.backbone_lr_scale = 0.1 if pretrained else 1.0
        if not 0 < self.backbone_lr_scale <= 1:
            raise ValueError(f"--backbone_lr_scale is a fraction of --lr: in (0, 1], got {self.backbone_lr_scale}")
        if self.image_size is not None:  # what the architecture and its weights take: an opt-in module
            from shared.bounds import check_image_size

            check_image_size(self.image_size, self.model, self.weights, chosen_weights(self.model, self.weights))


# ----------------------------------------------------------------------------- data
IMAGE_SHAPE = (3, 256, 256)  # channels, height, width as decoded for resnet18's weights (input_sizes: any model)


@functools.cache  # preprocess asks for it every batch
def chosen_weights(model: str, weights: str) -> torchvision.models.WeightsEnum:
    """--weights as torchvision names them, with their preprocessing (`.transforms()`: resize, centre crop,
    normalization) and sizes (`.meta`). With --weights none, the architecture's DEFAULT weights: what it is made for."""
    choices = torchvision.models.get_model_weights(model)
    return choices[weights] if weights not in ("DEFAULT", "none") else choices.DEFAULT


def input_sizes(cfg: Config) -> tuple[tuple[int, int, int], int, str]:
    """(the images as decoded (C, H, W), the model's input side, the resize filter): the weights' resize and centre
    crop (256 and 224 for resnet18's, 232 and 224 for resnet50's V2, 384 and 380 for efficientnet_b4's) scaled to
    --image_size, the shorter side resized and centre-cropped to a square; and how the weights' images were resized:
    bilinear (resnet18's), bicubic (the EfficientNets', the Swins')."""
    transforms = chosen_weights(cfg.model, cfg.weights).transforms()
    crop = cfg.image_size or transforms.crop_size[0]
    side = round(crop * transforms.resize_size[0] / transforms.crop_size[0])
    return (3, side, side), crop, transforms.interpolation.value


def load_data(cfg: Config):
    """(train, test) as uint8 image tensors, decoded as input_sizes(cfg) says: the hub, a folder, or --synthetic (as
    many images and classes as the default data, beans: 1,034 and 128 photos of 3 kinds of leaves)."""
    shape, _, resize_filter = input_sizes(cfg)
    return load_image_data(cfg.data, shape, cfg.synthetic, synthetic_sizes=(1_034, 128), synthetic_classes=3,
                           interpolation=resize_filter)


def preprocess(images: torch.Tensor, training: bool, cfg: Config) -> torch.Tensor:
    """uint8 batch on the device, as decoded -> normalized float batch at the model's input size. Training: a random
    resized crop of the whole decoded image, and a flip. Evaluation: the centre crop, as the weights were evaluated
    (resize, then centre crop)."""
    transforms, (_, size, _) = chosen_weights(cfg.model, cfg.weights).transforms(), input_sizes(cfg)
    if training:
        images = augment.random_flip(augment.random_resized_crop(images, size))
    else:
        images = center_crop(images, [size, size])
    return augment.normalize(images, tuple(transforms.mean), tuple(transforms.std))


# ----------------------------------------------------------------------------- model
def classifier_name(model: nn.Module) -> str:
    """The name of the model's classifier: its last Linear layer (fc, classifier.3, heads.head, ...), or in SqueezeNet,
    which has none, its last convolution (classifier.1, a 1x1 convolution to the classes)."""
    layers = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    return (layers or [name for name, module in model.named_modules() if isinstance(module, nn.Conv2d)])[-1]


def make_model(num_classes: int, cfg: Config) -> nn.Module:
    """The architecture with a new classifier for your classes; the pretrained weights of the rest: load_pretrained."""
    # A ViT's position embeddings are made for one input size (vit_h_14's weights: 518 px)
    size = {"image_size": input_sizes(cfg)[1]} if cfg.model.startswith("vit_") else {}
    return torchvision.models.get_model(cfg.model, weights=None, num_classes=num_classes, **size)


def pretrained_state(cfg: Config):
    """--weights: (torchvision's file for them, its tensors by name), or None with --weights none. The file is
    torchvision's cache's (downloaded there if missing), checked and read as a file from anywhere (shared/init_from.py).
    Read before the images are decoded: a missing or damaged file is said at once, not after the decode."""
    if cfg.weights == "none":
        return None
    from shared.init_from import torchvision_weights  # a file from the internet, checked: an opt-in module

    return torchvision_weights(chosen_weights(cfg.model, cfg.weights))


def load_pretrained(model: nn.Module, pretrained, cfg: Config) -> None:
    """pretrained_state's tensors into every layer but the new classifier, refused in one line where they do not fit
    (shared/init_from.py)."""
    if pretrained is None:
        return
    from shared.init_from import load_all_but  # weights from anywhere, checked: an opt-in module

    load_all_but(model, *pretrained, head=classifier_name(model) + ".",
                 fix=f"delete it to download {cfg.model}'s again")


def make_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    # Weight decay on weight matrices and kernels only. Each group keeps its share of the scheduled learning rate:
    # the new classifier all of it, the pretrained layers --backbone_lr_scale of it. A frozen layer has no gradient,
    # so SGD keeps no momentum for it: the pretrained layers' momentum starts from their first gradient, at the first
    # step after the freeze, as a whole network's does at a run's first step.
    head = classifier_name(model) + "."
    groups = defaultdict(list)  # (backbone, decay): parameters
    for name, param in model.named_parameters():
        groups[not name.startswith(head), param.ndim > 1].append(param)
    return torch.optim.SGD([{"params": params, "backbone": backbone, "weight_decay": cfg.weight_decay if decay else 0}
                            for (backbone, decay), params in groups.items()],
                           lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0, fused=True)


LABEL_SMOOTHING = 0.1  # the targets 0.9 for the class and 0.1 spread over all: less overconfidence on small sets


def loss_fn(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """The objective. Training and evaluation both call this one: change the loss here."""
    return F.cross_entropy(logits.float(), labels, reduction=reduction, label_smoothing=LABEL_SMOOTHING)


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
        inputs = preprocess(images, training=False, cfg=cfg)
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
    with accelerator.local_main_process_first():  # one download and one decode per machine, into its caches
        # The pretrained file first: missing or damaged, it is said before the images' decode (10 s and more)
        pretrained = None if cfg.resume or cfg.init_from else pretrained_state(cfg)  # else the weights are there
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
    model = make_model(len(train_set.classes), cfg)
    load_pretrained(model, pretrained, cfg)
    # --init_from: trained weights to start from (a classifier trained on other classes starts new)
    init_sha256 = Checkpoints.initial_weights(model, cfg, train_set.classes)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.compile:
        model.compile()  # in place: state_dict keys stay free of `_orig_mod.`
    optimizer = make_optimizer(model, cfg)
    classifier = model.get_submodule(classifier_name(model))  # the new layer, trained from the first step
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
                      f"global batch {global_batch_size}, {total_steps} steps ({run_epochs:.3g} epochs) | {run_dir}")
    config = tracking.run_config(cfg, accelerator, run_dir, recipe=RECIPE, script=__file__, data=data_name,
                                 global_batch_size=global_batch_size, total_steps=total_steps,
                                 train_size=len(train_set), test_size=len(test_set), classes=train_set.classes,
                                 data_on_device=on_device, resumed_from=str(checkpoint) if checkpoint else None,
                                 resumed_step=progress.step if checkpoint else None, init_from_sha256=init_sha256)
    # Steps left to run? What changed, and what that changes? From an older checkpoint than the newest, this moves
    # the later history (checkpoints, weights, summary, pictures) into abandoned/: a new branch of the run.
    checkpoints.check_resume_and_branch(config, progress)
    accelerator.init_trackers(RECIPE, config=config)

    # One batch, eager: never a CUDA graph (shared/loop.py), as unfreezing changes what the step computes, which a
    # graph captured while frozen would not follow.
    def train_step(images, labels):
        # DDP syncs gradients only on the last batch of each accumulation, and never while frozen (no_sync): it
        # would wait for the gradients of every layer it wrapped. The classifier's alone are averaged below.
        with accelerator.accumulate(model), accelerator.no_sync(model) if frozen else contextlib.nullcontext():
            inputs = preprocess(images, cfg.augment, cfg)
            if cfg.channels_last:  # after preprocessing: the crop returns a plain NCHW tensor
                inputs = inputs.contiguous(memory_format=torch.channels_last)
            logits = model(inputs)
            loss = loss_fn(logits, labels)
            accelerator.backward(loss)  # scaled by 1/grad_accum, so accumulated gradients are a mean
            if frozen and accelerator.sync_gradients:  # the mean over the processes, as DDP's
                for param in classifier.parameters():
                    param.grad = accelerator.reduce(param.grad, "mean")
            grad_norm = None
            if accelerator.sync_gradients:  # the gradient is complete: accumulated, averaged over processes
                # One bad batch can take a step large enough to kill every ReLU; the clip bounds it.
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()  # does nothing until the last batch of the accumulation
            optimizer.zero_grad()
        return loss.detach(), logits.detach(), grad_norm

    progress.pieces += 1  # this launch is one more piece of the run (saved with each checkpoint, in the summary)
    window = tracking.TrainWindow(accelerator, progress)  # train_* points, and the run's time across its pieces
    while True:  # the rest of an epoch, then an evaluation; resumed at the run's last step, only the evaluation
        model.train()
        # Frozen: the new classifier alone. The pretrained layers need no gradient, so autograd records no backward
        # through them (a frozen step is their forward and the classifier's backward); BatchNorm's statistics stay.
        frozen = progress.epoch < cfg.freeze_epochs
        model.requires_grad_(not frozen)
        classifier.requires_grad_(True)
        for module in model.modules() if frozen else []:
            if isinstance(module, nn.BatchNorm2d):  # what every torchvision classifier normalizes with
                module.eval()
        order.set_position(progress.epoch, progress.samples_into_epoch)  # this epoch's order, from the first unseen one
        bar = tqdm(train_loader, desc=f"epoch {progress.epoch + 1}/{math.ceil(run_epochs)}",
                   total=min(len(train_loader), (total_steps - progress.step) * cfg.grad_accum),  # --max_steps
                   leave=False, disable=not (accelerator.is_local_main_process and window.terminal))
        for images, labels in bar:
            if progress.step == total_steps:
                break
            lr = loop.one_cycle_lr(progress.step, total_steps, cfg.lr)  # a function of the step, no state
            for group in optimizer.param_groups:  # the pretrained layers: a share of it
                group["lr"] = lr * cfg.backbone_lr_scale if group["backbone"] else lr
            loss, logits, grad_norm = train_step(images, labels)
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
