"""Where the training time goes, for each recipe and each speed option, in one run:

  (a) model only:  forward, backward, gradient clipping and optimizer step on batches already in device memory
  (b) recipe:      the recipe's own `train()`: its data pipeline, accelerate loop, logging
  (c) seed-style:  torchvision per-image transforms (PIL -> RandomCrop/Flip -> ToTensor -> Normalize)
                   in a DataLoader with 2 worker processes, as the seed posts did, then the same step (float32)
  (d) plain loop:  the pipeline of (b) in a hand-written PyTorch loop, without accelerate

The options (each row; combinations too): float32, bf16 autocast (`cpu_bf16.yaml` / `bf16.yaml`),
`--channels_last`, `--compile`. Same model, batch size and optimizer everywhere. Each is timed over
`--repeats` windows of `--window` steps after one warm-up window (which holds the compilation);
samples/s are medians, min-max in brackets. The machine's speed drifts (up to 2x within a minute
here), so everything takes turns: in each round every option runs one window of (a), of (b) and of
(d). (b) is a short run of the recipe's train() in this process, its first log window the warm-up;
its windows are the recipe's own log windows (`samples_per_s` in metrics.jsonl): measured as a user's
run reports itself. (c) runs first, alone, because its worker processes keep preparing batches in the
background.

GFLOP/s counts the model's forward and backward FLOPs per sample (torch.utils.flop_counter) times
samples/s; "peak" is the fastest of two probes of this machine in the option's precision: a 2048 x 2048
matmul, and a 128 -> 128 channel 3x3 convolution on 64 x 32 x 32 images (channels_last).

    python benchmarks/throughput.py                                      # CPU: about 30 minutes
    python benchmarks/throughput.py --recipes cifar_cnn --options float32 bf16+channels_last
    python benchmarks/throughput.py --data_on_device                     # GPU: data held on the GPU

Writes benchmarks/results/throughput-<device>.md (the tables, hardware and versions).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import datasets
import numpy as np
import torch
from accelerate.state import AcceleratorState, GradientState
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torch.utils.flop_counter import FlopCounterMode
from torchvision import transforms

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from shared.loop import keep_freed_memory
from shared.synthetic import make_synthetic
from tools.measure import synchronize

# recipe -> CPU batch size, image shape, classes, the seed-style per-image augmentation.
RECIPES = {
    "cifar_cnn": (128, (3, 32, 32), 10, [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()]),
    "resnet18_fmnist": (64, (1, 28, 28), 10, [transforms.RandomCrop(28, padding=2), transforms.RandomHorizontalFlip()]),
    "deep_mlp_ckpt": (128, (3, 32, 32), 100, []),  # no augmentation in the recipe
}
OPTIONS = ["float32", "bf16", "channels_last", "bf16+channels_last", "compile", "bf16+compile",
           "channels_last+compile", "bf16+channels_last+compile"]
# Dynamo keys its compiled code on the forward's code object, which every nn.Sequential shares: one entry per model.
torch._dynamo.config.recompile_limit = 64


def benchmark_data(name: str) -> Path:
    """The recipe's synthetic stand-in (10,000 training images), written once under the temp folder."""
    _, shape, classes, _ = RECIPES[name]
    folder = Path(tempfile.gettempdir()) / "recipes-benchmark-data" / f"{name}-{'x'.join(map(str, shape))}-{classes}"
    return write_dataset(folder, 10_000, 256, shape, classes)


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


def peak_gflops(device: torch.device, dtypes: list[torch.dtype]) -> dict[str, float]:
    """This machine's GFLOP/s in each precision: the faster of a large matmul and a large convolution."""
    peaks = {}
    for dtype in dtypes:
        a, b = (torch.randn(2048, 2048, device=device, dtype=dtype) for _ in range(2))
        matmul = 2 * 2048**3 / (min(timed(lambda: a @ b, device) for _ in range(5)))
        conv = torch.nn.Conv2d(128, 128, 3, padding=1).to(device, dtype, memory_format=torch.channels_last)
        x = torch.randn(64, 128, 32, 32, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
        with torch.no_grad():
            conv_flops = 2 * 64 * 128 * 32 * 32 * 128 * 9 / min(timed(lambda: conv(x), device) for _ in range(5))
        peaks[str(dtype).removeprefix("torch.")] = {"matmul": matmul / 1e9, "conv": conv_flops / 1e9}
    return peaks


def timed(fn, device) -> float:
    fn()
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def flops_per_sample(model, inputs, labels, loss_fn) -> float:
    """Forward + backward FLOPs of one training sample, as torch counts them (matmuls and convolutions)."""
    with FlopCounterMode(display=False) as counter:
        loss_fn(model(inputs), labels).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / len(inputs)


def recipe_windows(recipe, option: str, data: Path, batch_size: int, window: int, data_on_device: bool) -> list[float]:
    """(b): the recipe's own train() in this process, for one warm-up log window and one timed one. A new Accelerator
    each time; mixed precision is read from the environment, as `accelerate launch` passes it."""
    AcceleratorState._reset_state(reset_partial_state=True)  # the state is a singleton; a new precision needs a reset
    GradientState._reset_state()
    os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16" if "bf16" in option else "no"
    out = Path(tempfile.mkdtemp(prefix=f"bench-{recipe.RECIPE}-"))
    cfg = recipe.Config(data=str(data), batch_size=batch_size, max_steps=2 * window, log_every=window, tracker="none",
                        output_dir=str(out), channels_last="channels_last" in option, compile="compile" in option,
                        data_on_device=data_on_device)
    with contextlib.redirect_stdout(sys.stderr):
        recipe.train(cfg)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(out)
    return [row["samples_per_s"] for row in rows if "train_loss" in row][1:]  # log windows, not the summary


def bench_recipe(name: str, args, data: Path, device: torch.device) -> dict:
    recipe = importlib.import_module(f"recipes.{name}")
    cpu_batch, _, _, seed_augment = RECIPES[name]
    batch_size = args.batch_size or (cpu_batch if device.type == "cpu" else 512)
    options = [o for o in args.options if not (name == "deep_mlp_ckpt" and "channels_last" in o)]  # no convolutions
    cfg = recipe.Config(data=str(data), batch_size=batch_size, tracker="none", data_on_device=args.data_on_device)
    train_set, _ = recipe.load_data(cfg)
    if args.data_on_device:
        train_set = train_set.to(device)
    augment = name != "deep_mlp_ckpt"

    def preprocess(images, channels_last):
        inputs = recipe.preprocess(images, augment)
        return inputs.contiguous(memory_format=torch.channels_last) if channels_last else inputs

    def new_training(option):
        torch.manual_seed(0)
        model = recipe.make_model(len(train_set.classes), cfg).to(device)
        if "channels_last" in option:
            model = model.to(memory_format=torch.channels_last)
        if "compile" in option:
            model.compile()
        optimizer = (recipe.make_optimizer(model, cfg, cfg.lr) if name == "resnet18_fmnist"
                     else recipe.make_optimizer(model, cfg))
        return model.train(), optimizer

    def train_step(option, model, optimizer, inputs, labels):
        autocast = torch.autocast(device.type, dtype=torch.bfloat16) if "bf16" in option else contextlib.nullcontext()
        with autocast:
            loss = recipe.loss_fn(model(inputs), labels)
        loss.backward()  # no loss.item() per step: that would wait for the device
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)  # as the recipe does
        optimizer.step()
        optimizer.zero_grad()

    fixed_batches = [train_set[torch.arange(i * batch_size, (i + 1) * batch_size)] for i in range(4)]

    def model_only(option):
        """(a): a few preprocessed batches, already on the device, used in turn."""
        model, optimizer = new_training(option)
        fixed = itertools.cycle([(preprocess(images.to(device), "channels_last" in option), labels.to(device))
                                 for images, labels in fixed_batches])
        return lambda: train_step(option, model, optimizer, *next(fixed))

    def plain_loop(option):
        """(d): the recipe's pipeline in a hand-written loop: uint8 batches by index, preprocessed on the device."""
        model, optimizer = new_training(option)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg.lr, total_steps=10**6)
        batches = forever(DataLoader(train_set, batch_size, shuffle=True, drop_last=True,
                                     collate_fn=train_set.whole_batch))

        def step():
            images, labels = next(batches)
            train_step(option, model, optimizer, preprocess(images.to(device, non_blocking=True),
                                                            "channels_last" in option),
                       labels.to(device, non_blocking=True))
            scheduler.step()
        return step

    def windows(step, count: int) -> list[float]:
        return [samples_per_s(step, batch_size, args.window, device) for _ in range(count)]

    rates = {option: {"a": [], "b": [], "d": []} for option in options}
    if args.seed_style:  # (c) first and alone: its workers prepare batches in the background, slowing the others
        transform = transforms.Compose([*seed_augment, transforms.ToTensor(),
                                        transforms.Normalize(recipe.MEAN, recipe.STD)])
        seed_set = SeedStyleImages(train_set.images.cpu(), train_set.labels.cpu(), transform)
        seed_batches = forever(DataLoader(seed_set, batch_size, shuffle=True, drop_last=True, num_workers=2,
                                          pin_memory=device.type == "cuda", persistent_workers=True))
        model_c, optimizer_c = new_training("float32")
        finish = (lambda x: x.flatten(1) @ recipe.projection(device)) if name == "deep_mlp_ckpt" else (lambda x: x)

        def seed_step():
            images, labels = next(seed_batches)
            train_step("float32", model_c, optimizer_c, finish(images.to(device, non_blocking=True)),
                       labels.to(device, non_blocking=True))
        rates["float32"]["c"] = windows(seed_step, 1 + args.repeats)[1:]  # the first window is the warm-up
        seed_batches.close()  # stops its worker processes

    steps = {option: (model_only(option), plain_loop(option)) for option in options}
    compile_s = {}
    for option, (a_step, d_step) in steps.items():  # warm-up windows; the first steps compile
        start = time.perf_counter()
        windows(a_step, 1)
        compile_s[option] = time.perf_counter() - start
        windows(d_step, 1)
    for round_ in range(args.repeats):
        for option, (a_step, d_step) in steps.items():
            rates[option]["a"] += windows(a_step, 1)
            rates[option]["b"] += recipe_windows(recipe, option, data, batch_size, args.window, args.data_on_device)
            rates[option]["d"] += windows(d_step, 1)
        print(f"{name}: round {round_ + 1}/{args.repeats} done", file=sys.stderr, flush=True)

    images, labels = fixed_batches[0]
    model, _ = new_training("float32")
    flops = flops_per_sample(model, preprocess(images.to(device), False), labels.to(device), recipe.loss_fn)
    return {"recipe": name, "batch_size": batch_size, "window": args.window, "rates": rates,
            "median": {o: {k: statistics.median(v) for k, v in r.items() if v} for o, r in rates.items()},
            "flops_per_sample": flops, "first_window_s": compile_s}


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def recipe_table(result: dict, peaks: dict) -> str:
    m, rates = result["median"], result["rates"]
    lines = [f"**{result['recipe']}**, batch {result['batch_size']}, {result['flops_per_sample'] / 1e6:,.1f} MFLOP "
             f"per sample (forward + backward)\n",
             "| option | (a) model only | (b) recipe | (d) plain loop | b/a | d/b | (b) vs float32 | (b) GFLOP/s, "
             "% of peak | first window |",
             "|---|---|---|---|---|---|---|---|---|"]
    for option, r in rates.items():
        peak = max(peaks["bfloat16" if "bf16" in option else "float32"].values())
        gflops = m[option]["b"] * result["flops_per_sample"] / 1e9
        lines.append(f"| {option} | {cell(r['a'])} | {cell(r['b'])} | {cell(r['d'])} | "
                     f"{m[option]['b'] / m[option]['a']:.2f} | {m[option]['d'] / m[option]['b']:.2f} | "
                     f"x{m[option]['b'] / m['float32']['b']:.2f} | {gflops:,.0f}, {100 * gflops / peak:.0f}% | "
                     f"{result['first_window_s'][option]:.1f} s |")
    if "c" in m.get("float32", {}):
        lines.append(f"\n(c) seed-style pipeline, float32: {cell(rates['float32']['c'])} samples/s; "
                     f"b/c = {m['float32']['b'] / m['float32']['c']:.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--options", nargs="+", default=OPTIONS, choices=OPTIONS,
                        help="speed options to compare; float32 is always measured (the ratios' base)")
    parser.add_argument("--batch_size", type=int, default=None,
                        help="images per step (default: per recipe on CPU, 512 on GPU)")
    parser.add_argument("--window", type=int, default=None,
                        help="steps per window (default: CPU 20 cifar_cnn, 5 others; GPU 50)")
    parser.add_argument("--repeats", type=int, default=5, help="timed windows, after one warm-up window")
    parser.add_argument("--no_seed_style", dest="seed_style", action="store_false", help="skip (c)")
    parser.add_argument("--data_on_device", action="store_true",
                        help="hold the uint8 dataset on the GPU, as the recipe flag")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder for the markdown table")
    args = parser.parse_args()
    args.options = ["float32"] + [o for o in args.options if o != "float32"]

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and sys.platform == "linux":  # (a) and (d) as the recipe's (b): cpu_allocator.py
        keep_freed_memory()
    # An empty compile cache: the first compilation as long as in a user's first run.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))
    args.window = args.window or (20 if device.type == "cpu" else 50)
    dtypes = [torch.float32, torch.bfloat16] if any("bf16" in option for option in args.options) else [torch.float32]
    peaks = peak_gflops(device, dtypes)  # in the precisions measured only: the probes take seconds on a CPU
    print("peak GFLOP/s: " + json.dumps(peaks), flush=True)
    results = []
    for name in args.recipes:
        data = benchmark_data(name)
        window = args.window if name == "cifar_cnn" or device.type != "cpu" else max(3, args.window // 4)
        results.append(bench_recipe(name, argparse.Namespace(**{**vars(args), "window": window}), data, device))
        print(recipe_table(results[-1], peaks) + "\n", flush=True)

    cpu = f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"
    hardware = torch.cuda.get_device_name(0) if device.type == "cuda" else cpu
    peak_line = "; ".join(f"{dtype}: matmul {p['matmul']:,.0f}, convolution {p['conv']:,.0f}"
                          for dtype, p in peaks.items())
    notes = (f"samples/s, median (min-max) of {args.repeats} windows. {hardware}; data on device: "
             f"{args.data_on_device}; torch {torch.__version__}, Python {platform.python_version()}.\n"
             f"Measured peak GFLOP/s: {peak_line}. First window: the warm-up window of (a), compilation included.\n"
             f"Command: python benchmarks/throughput.py {' '.join(sys.argv[1:])}\n")
    text = "\n\n".join(recipe_table(r, peaks) for r in results) + "\n\n" + notes
    print(notes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"throughput-{device.type}.md").write_text(text)
    (out / f"throughput-{device.type}.json").write_text(json.dumps({"peaks": peaks, "results": results}, indent=1))
    print(f"wrote {out / f'throughput-{device.type}.md'}")


if __name__ == "__main__":
    main()
