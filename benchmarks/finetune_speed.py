"""recipes/finetune.py's frozen and unfrozen steps, measured in one run per image size: the samples/s of the first
epoch (the new classifier alone, the pretrained layers frozen: no backward through them) against the second (every
layer), and the time of one epoch of each at the median speed.

The data: --images generated images (IDX files, gray pixels the recipe turns into colour), written at the side the
recipe decodes to, so that no time goes to resizing. The pretrained weights: random weights in torchvision's layout,
in a TORCH_HOME of its own (a step's speed does not depend on the values). Each run is `accelerate launch` of the
recipe, as a user runs it; its folder, log and metrics.jsonl stay under --out.

    python benchmarks/finetune_speed.py --out DIR                                        # CPU, cpu.yaml, 64 and 224 px
    python benchmarks/finetune_speed.py --out DIR --config bf16 --images 10000           # one GPU, bf16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torchvision

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from recipes.finetune import Config, input_sizes
from shared.pictures import read_rows

CACHED = "resnet18-f37072fd.pth"  # the file torchvision's ResNet18_Weights.IMAGENET1K_V1 is cached as


def write_idx(path: Path, array: np.ndarray) -> None:
    """The IDX format: 0, 0, 0x08 (unsigned bytes), the number of dimensions, each size as a big-endian uint32."""
    with path.open("wb") as f:
        f.write(bytes([0, 0, 8, array.ndim]) + np.array(array.shape, ">u4").tobytes())
        f.write(array.tobytes())


def images(folder: Path, count: int, side: int) -> Path:
    """`count` training and count / 10 test images of side x side, random pixels, 10 classes."""
    if (folder / "t10k-labels-idx1-ubyte").exists():
        return folder
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, size in (("train", count), ("t10k", max(count // 10, 10))):
        write_idx(folder / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (size, side, side), dtype=np.uint8))
        write_idx(folder / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, size, dtype=np.uint8))
    return folder


def phases(run: Path) -> dict:
    """Median samples/s of the frozen (first) and the unfrozen (second) epoch's log windows, each phase's first
    window left out (it holds the warm-up: the first steps, and the first after the freeze)."""
    rows = [row for row in read_rows(run / "metrics.jsonl") if "train_loss" in row]
    frozen = [row["samples_per_s"] for row in rows if row["epoch"] <= 1][1:]
    unfrozen = [row["samples_per_s"] for row in rows if row["epoch"] > 1][1:]
    return {"frozen_samples_per_s": statistics.median(frozen), "unfrozen_samples_per_s": statistics.median(unfrozen),
            "frozen_windows": len(frozen), "unfrozen_windows": len(unfrozen)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", default="cpu", help="a config of accelerate_configs/, without .yaml")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 224], help="--image_size of each run")
    parser.add_argument("--images", type=int, default=1000, help="training images (an epoch)")
    parser.add_argument("--batch_size", type=int, default=32)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch_home = args.out / "torch_home"
    cached = torch_home / "hub" / "checkpoints" / CACHED
    if not cached.exists():
        cached.parent.mkdir(parents=True)
        torch.manual_seed(0)
        torch.save(torchvision.models.resnet18().state_dict(), cached)
    env = dict(os.environ, TORCH_HOME=str(torch_home), HF_HOME=str(args.out / "hf"), PYTHONUNBUFFERED="1")
    results = []
    for size in args.sizes:
        decoded = input_sizes(Config(image_size=size))[0][1]
        data = images(args.out / f"images-{args.images}-{decoded}px", args.images, decoded)
        run = args.out / f"{args.config}-{size}px-b{args.batch_size}"
        steps = args.images // args.batch_size  # an epoch
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(ROOT / "accelerate_configs" / f"{args.config}.yaml"), str(ROOT / "recipes" / "finetune.py"),
                   "--data", str(data), "--image_size", str(size), "--batch_size", str(args.batch_size),
                   "--epochs", "2", "--freeze_epochs", "1", "--log_every", str(max(1, steps // 10)),
                   "--tracker", "none", "--output_dir", str(run), "--overwrite"]
        started = time.perf_counter()
        with (args.out / f"{run.name}.log").open("w") as log:
            subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, check=True, cwd=ROOT)
        summary = json.loads((run / "summary.json").read_text())
        found = phases(run)
        results.append({"config": args.config, "image_size": size, "decoded": decoded, "images": args.images,
                        "batch_size": args.batch_size, **found,
                        "frozen_over_unfrozen": found["frozen_samples_per_s"] / found["unfrozen_samples_per_s"],
                        "frozen_epoch_s": args.images / found["frozen_samples_per_s"],
                        "unfrozen_epoch_s": args.images / found["unfrozen_samples_per_s"],
                        "train_s": summary["train_s"], "process_s": time.perf_counter() - started,
                        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                        "date": time.strftime("%Y-%m-%d")})
        print(json.dumps(results[-1]), flush=True)
    with (args.out / "finetune_speed.jsonl").open("a") as f:
        f.writelines(json.dumps(result) + "\n" for result in results)


if __name__ == "__main__":
    main()
