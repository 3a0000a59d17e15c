"""What the recipes' `loop.keep_freed_memory()` is worth on a CPU: the same training steps in fresh processes,
with glibc's default allocator settings and with freed memory kept for reuse, taking turns.

glibc returns a freed block over 128 KiB (a threshold that grows up to 32 MiB as blocks are freed) to the kernel,
and trims the heap's free top; the next step's activations then come back as fresh pages that the kernel faults in
and zeroes. The recipes raise both thresholds to 1 GiB on a CPU (see `train()`). Each child process runs the
recipe's pipeline in a plain loop (uint8 batches by index, the recipe's preprocessing, forward, backward, clip,
step: (d) of throughput.py) and reports samples/s over its steps after a warm-up.

    python benchmarks/cpu_allocator.py                                 # cifar_cnn, bf16 + channels_last, 3 rounds
    python benchmarks/cpu_allocator.py --recipe resnet18_fmnist --option float32
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from shared.loop import keep_freed_memory  # noqa: E402  (after the path setup)

from throughput import RECIPES, benchmark_data  # noqa: E402


def child(args) -> None:
    if args.keep_freed:
        keep_freed_memory()
    recipe = importlib.import_module(f"recipes.{args.recipe}")
    batch_size, _, classes, _ = RECIPES[args.recipe]
    cfg = recipe.Config(data=str(benchmark_data(args.recipe)))
    train_set, _ = recipe.load_data(cfg)
    torch.manual_seed(0)
    model = recipe.make_model(classes, cfg)
    channels_last = "channels_last" in args.option
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = (recipe.make_optimizer(model, cfg, cfg.lr) if args.recipe == "resnet18_fmnist"
                 else recipe.make_optimizer(model, cfg))
    loader = DataLoader(train_set, batch_size, shuffle=True, drop_last=True, collate_fn=train_set.whole_batch)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if "bf16" in args.option else contextlib.nullcontext()
    times = []
    for step, (images, labels) in zip(range(args.warmup + args.steps), loader):
        start = time.perf_counter()
        inputs = recipe.preprocess(images, args.recipe != "deep_mlp_ckpt")
        if channels_last:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        with autocast:
            loss = recipe.loss_fn(model(inputs), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    print(json.dumps({"samples_per_s": batch_size * args.steps / sum(times[args.warmup:]),
                      "warmup_samples_per_s": batch_size * args.warmup / sum(times[:args.warmup])}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="cifar_cnn", choices=list(RECIPES))
    parser.add_argument("--option", default="bf16+channels_last", choices=["float32", "bf16", "bf16+channels_last"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=10, help="steps before the timed ones")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per process")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--keep_freed", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    rates = {"glibc defaults": [], "freed memory kept (the recipes)": []}
    for _ in range(args.rounds):
        for label, flag in zip(rates, ([], ["--keep_freed"])):
            out = subprocess.run([sys.executable, __file__, "--child", *flag, *sys.argv[1:]], check=True,
                                 capture_output=True, text=True).stdout
            rates[label].append(json.loads(out.splitlines()[-1]))
    print(f"{args.recipe}, {args.option}, {args.rounds} fresh processes each, samples/s after {args.warmup} steps "
          f"(first {args.warmup} steps in brackets):")
    for label, runs in rates.items():
        print(f"  {label}: {statistics.median(r['samples_per_s'] for r in runs):,.0f} "
              f"({statistics.median(r['warmup_samples_per_s'] for r in runs):,.0f}); "
              + ", ".join(f"{r['samples_per_s']:,.0f}" for r in runs))
    base, kept = (statistics.median(r["samples_per_s"] for r in runs) for runs in rates.values())
    print(f"  ratio: x{kept / base:.2f}\nCommand: python benchmarks/cpu_allocator.py {' '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
