"""Where the training time goes, for each recipe, in one process and one run:

  (a) model only:  forward, backward, gradient clipping and optimizer step on batches already in device memory
  (b) recipe:      the recipe's own `train()`: its data pipeline, accelerate loop, logging
  (c) seed-style:  torchvision per-image transforms (PIL -> RandomCrop/Flip -> ToTensor -> Normalize)
                   in a DataLoader with 2 worker processes, as the seed posts did, then the same step
  (d) plain loop:  the pipeline of (b) in a hand-written PyTorch loop, without accelerate

Same model, batch size, optimizer and precision in all four. Each is timed over `--repeats` windows
of `--window` steps after one warm-up window; samples/s are the median (min-max in brackets), and
the ratios b/a, b/c, d/b use the medians. (a) and (d) take turns window by window with (b) in the
middle, so that a machine whose speed drifts treats them alike; (c) runs first, alone, because its
worker processes keep preparing batches in the background. (b)'s windows are the recipe's own log
windows (`samples_per_s` in metrics.jsonl): measured as a user's run reports itself.

    python benchmarks/throughput.py                                     # CPU: about 5 minutes
    python benchmarks/throughput.py --data_on_device                    # GPU: data held on the GPU
    python benchmarks/throughput.py --data_on_device --mixed_precision bf16 --batch_size 512

Writes benchmarks/results/throughput-<device>.md (the table, hardware and versions).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import datasets
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from shared.data import make_synthetic
from tools.measure import synchronize

# recipe -> CPU batch size, image shape, classes, the seed-style per-image augmentation.
RECIPES = {
    "cifar_cnn": (128, (3, 32, 32), 10, [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()]),
    "resnet18_fmnist": (64, (1, 28, 28), 10, [transforms.RandomCrop(28, padding=2), transforms.RandomHorizontalFlip()]),
    "deep_mlp_ckpt": (128, (3, 32, 32), 100, []),  # no augmentation in the recipe
}


def write_dataset(folder: Path, train_size: int, test_size: int, shape=(1, 28, 28), num_classes: int = 10) -> Path:
    """The synthetic stand-in written once as a `save_to_disk` folder, so every variant reads the same images."""
    if folder.exists():
        return folder
    splits = {}
    for name, split in zip(("train", "test"), make_synthetic(shape, train_size, test_size, num_classes)):
        images = [(image[0] if shape[0] == 1 else image.permute(1, 2, 0)).numpy().astype(np.uint8)
                  for image in split.images]
        features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=split.classes)})
        splits[name] = datasets.Dataset.from_dict({"image": images, "label": split.labels.tolist()}, features=features)
    datasets.DatasetDict(splits).save_to_disk(str(folder))
    return folder


class SeedStyleImages(Dataset):
    """The seeds' pipeline: one PIL image at a time through torchvision transforms."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform):
        channels_last = images.permute(0, 2, 3, 1)
        self.images = channels_last.squeeze(3).numpy() if images.shape[1] == 1 else channels_last.numpy()
        self.labels, self.transform = labels.tolist(), transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.transform(Image.fromarray(self.images[index])), self.labels[index]


def forever(loader):
    """Batches without end: a new epoch starts when one runs out."""
    while True:
        yield from loader


def samples_per_s(step, batch_size: int, window: int, device) -> float:
    synchronize(device)
    start = time.perf_counter()
    for _ in range(window):
        step()
    synchronize(device)
    return window * batch_size / (time.perf_counter() - start)


def run_recipe(recipe, cfg, mixed_precision: str) -> list[float]:
    """(b): the recipe's own train(), in this process; its log windows after the first (the warm-up)."""
    os.environ["ACCELERATE_MIXED_PRECISION"] = mixed_precision
    with contextlib.redirect_stdout(sys.stderr):
        recipe.train(cfg)
    rows = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    return [row["samples_per_s"] for row in rows if "samples_per_s" in row][1:]


def bench_recipe(name: str, args, data: Path, device: torch.device) -> dict:
    recipe = importlib.import_module(f"recipes.{name}")
    cpu_batch, _, _, seed_augment = RECIPES[name]
    batch_size = args.batch_size or (cpu_batch if device.type == "cpu" else 512)
    cfg = recipe.Config(data=str(data), batch_size=batch_size, max_steps=(1 + args.repeats) * args.window,
                        log_every=args.window, tracker="none",
                        data_on_device=args.data_on_device, output_dir=tempfile.mkdtemp(prefix=f"bench-{name}-"))
    train_set, _ = recipe.load_data(cfg)
    if args.data_on_device:
        train_set = train_set.to(device)
    augment = name != "deep_mlp_ckpt"
    preprocess = (lambda images: recipe.preprocess(images, augment)) if augment else recipe.preprocess
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if args.mixed_precision == "bf16" \
        else contextlib.nullcontext

    def new_training():
        torch.manual_seed(0)
        model = (recipe.make_model(len(train_set.classes), cfg) if name == "deep_mlp_ckpt"
                 else recipe.make_model(len(train_set.classes))).to(device)
        optimizer = (recipe.make_optimizer(model, cfg, cfg.lr) if name == "resnet18_fmnist"
                     else recipe.make_optimizer(model, cfg))
        return model.train(), optimizer

    def train_step(model, optimizer, inputs, labels):
        with autocast():
            loss = F.cross_entropy(model(inputs), labels)
        loss.backward()  # no loss.item() per step: that would wait for the device
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)  # as the recipe does
        optimizer.step()
        optimizer.zero_grad()

    # (a) model only: a few preprocessed batches, already on the device, used in turn.
    model_a, optimizer_a = new_training()
    fixed = [train_set[torch.arange(i * batch_size, (i + 1) * batch_size)] for i in range(4)]
    fixed = itertools.cycle([(preprocess(images.to(device)), labels.to(device)) for images, labels in fixed])

    def model_step():
        train_step(model_a, optimizer_a, *next(fixed))

    # (c) seed-style: per-image PIL transforms in 2 DataLoader workers, then the same step.
    transform = transforms.Compose([*seed_augment, transforms.ToTensor(),
                                    transforms.Normalize(recipe.MEAN, recipe.STD)])
    seed_set = SeedStyleImages(train_set.images.cpu(), train_set.labels.cpu(), transform)
    seed_batches = forever(DataLoader(seed_set, batch_size, shuffle=True, drop_last=True, num_workers=2,
                                      pin_memory=device.type == "cuda", persistent_workers=True))
    model_c, optimizer_c = new_training()
    finish = (lambda x: x.flatten(1) @ recipe.projection(device)) if name == "deep_mlp_ckpt" else (lambda x: x)

    def seed_step():
        images, labels = next(seed_batches)
        train_step(model_c, optimizer_c, finish(images.to(device, non_blocking=True)),
                   labels.to(device, non_blocking=True))

    # (d) the recipe's pipeline in a hand-written loop: uint8 batches by index, preprocessed on the device.
    model_d, optimizer_d = new_training()
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer_d, max_lr=cfg.lr, total_steps=10**6)
    plain_batches = forever(DataLoader(train_set, batch_size, shuffle=True, drop_last=True,
                                       collate_fn=train_set.whole_batch))

    def plain_step():
        images, labels = next(plain_batches)
        train_step(model_d, optimizer_d, preprocess(images.to(device, non_blocking=True)),
                   labels.to(device, non_blocking=True))
        scheduler.step()

    def windows(step, count: int) -> list[float]:
        return [samples_per_s(step, batch_size, args.window, device) for _ in range(count)]

    # (c) first and alone: its workers prepare batches in the background, which would slow the others.
    rates = {"c": windows(seed_step, 1 + args.repeats)[1:]}  # the first window is the warm-up
    seed_batches.close()  # stops its worker processes
    # The machine's speed drifts: (a) and (d) take turns window by window, with (b) in the middle.
    windows(model_step, 1)  # warm-up windows
    windows(plain_step, 1)
    rates["a"], rates["d"] = [], []
    for round_ in range(args.repeats):
        if round_ == args.repeats // 2:
            rates["b"] = run_recipe(recipe, cfg, args.mixed_precision)
        rates["a"] += windows(model_step, 1)
        rates["d"] += windows(plain_step, 1)
    median = {key: statistics.median(values) for key, values in rates.items()}
    rates = dict(sorted(rates.items()))
    return {"recipe": name, "batch_size": batch_size, "rates": rates, "median": median}


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--batch_size", type=int, default=None,
                        help="images per step (default: per recipe on CPU, 512 on GPU)")
    parser.add_argument("--window", type=int, default=None, help="steps per timed window (default: 10 CPU, 50 GPU)")
    parser.add_argument("--repeats", type=int, default=5, help="timed windows, after one warm-up window")
    parser.add_argument("--mixed_precision", choices=["no", "bf16"], default="no")
    parser.add_argument("--data_on_device", action="store_true",
                        help="hold the uint8 dataset on the GPU, as the recipe flag")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder for the markdown table")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.window = args.window or (10 if device.type == "cpu" else 50)
    data_root = Path(tempfile.gettempdir()) / "recipes-benchmark-data"
    results = []
    for name in args.recipes:
        _, shape, classes, _ = RECIPES[name]
        data = write_dataset(data_root / f"{name}-{'x'.join(map(str, shape))}-{classes}", 10_000, 256, shape, classes)
        window = args.window if name == "cifar_cnn" or device.type != "cpu" else max(3, args.window // 3)
        results.append(bench_recipe(name, argparse.Namespace(**{**vars(args), "window": window}), data, device))
        print(f"{name}: " + ", ".join(f"({k}) {v:,.0f}" for k, v in results[-1]["median"].items()) + " samples/s",
              flush=True)

    cpu = f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"
    hardware = torch.cuda.get_device_name(0) if device.type == "cuda" else cpu
    lines = ["| recipe | batch | (a) model only | (b) recipe | (c) seed-style | (d) plain loop | b/a | b/c | d/b |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        m = r["median"]
        lines.append(f"| {r['recipe']} | {r['batch_size']} | " + " | ".join(cell(r["rates"][k]) for k in "abcd")
                     + f" | {m['b'] / m['a']:.2f} | {m['b'] / m['c']:.2f} | {m['d'] / m['b']:.2f} |")
    table = "\n".join(lines)
    notes = (f"\nsamples/s, median (min-max) of {args.repeats} windows. {hardware}; precision {args.mixed_precision}; "
             f"data on device: {args.data_on_device}; torch {torch.__version__}, Python {platform.python_version()}.\n"
             f"Command: python benchmarks/throughput.py {' '.join(sys.argv[1:])}\n")
    print("\n" + table + notes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"throughput-{device.type}.md").write_text(table + "\n" + notes)
    print(f"wrote {out / f'throughput-{device.type}.md'}")


if __name__ == "__main__":
    main()
