"""1 process vs 2 processes, with and without learning-rate scaling, for recipes/resnet18_fmnist.py.

Each row launches the real recipe (`accelerate launch ...`) for the same number of epochs on the
same data and reports its seconds per epoch and final test accuracy from the run's summary.json.
On a machine without GPUs the 2-process rows run as 2 CPU processes (ACCELERATE_USE_CPU=true).

    python benchmarks/one_vs_two_processes.py                      # CPU: real handwritten digits, ~15 min
    python benchmarks/one_vs_two_processes.py --data zalando-datasets/fashion_mnist --epochs 30   # GPU

The default data is the real-image `digits` set of benchmarks/real_images.py (Fashion-MNIST's format,
1,500 training and 297 test images), so every row reads the same real images.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from real_images import build

ROWS = [  # label, processes, batch per process, --lr_scaling
    ("1 process, batch 128", 1, 128, "sqrt"),
    ("2 processes x 128, no LR scaling", 2, 128, "none"),
    ("2 processes x 128, sqrt LR scaling", 2, 128, "sqrt"),
    ("2 processes x 128, linear LR scaling", 2, 128, "linear"),
    ("2 processes x 64 (global batch 128)", 2, 64, "sqrt"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=None, help="--data for every row (default: the real-image digits set)")
    parser.add_argument("--epochs", type=int, default=5, help="epochs per row")
    parser.add_argument("--out", default="runs/one_vs_two_processes", help="folder for the runs and the table")
    args = parser.parse_args()

    out = Path(args.out)
    data = args.data or build("digits")
    gpus = torch.cuda.device_count()
    env = dict(os.environ) if gpus >= 2 else dict(os.environ, ACCELERATE_USE_CPU="true")
    lines = ["| setup | global batch | effective LR | steps | s/epoch (training) | samples/s | test accuracy |",
             "|---|---|---|---|---|---|---|"]
    for label, processes, batch, scaling in ROWS:
        config = ("1gpu" if gpus else "cpu") if processes == 1 else "2gpu"
        run = out / label.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
        command = ["accelerate", "launch", "--config_file", f"accelerate_configs/{config}.yaml",
                   "recipes/resnet18_fmnist.py", "--data", str(data), "--epochs", str(args.epochs),
                   "--batch_size", str(batch), "--lr_scaling", scaling,
                   "--tracker", "none", "--output_dir", str(run), "--overwrite"]
        print("+", " ".join(command), flush=True)
        subprocess.run(command, cwd=ROOT, env=env, check=True)
        summary = json.loads((run / "summary.json").read_text())
        config_json = json.loads((run / "config.json").read_text())
        seconds_per_epoch = config_json["train_size"] / summary["samples_per_s"]
        lines.append(f"| {label} | {config_json['global_batch_size']} | {config_json['effective_lr']:.3g} "
                     f"| {summary['steps']} "
                     f"| {seconds_per_epoch:.1f} | {summary['samples_per_s']:.1f} | {summary['eval_acc']:.3f} |")
    device = torch.cuda.get_device_name() if gpus else f"CPU ({os.cpu_count()} cores)"
    table = "\n".join(lines) + (f"\n\n{device}; {args.epochs} epochs of {config_json['train_size']} training images "
                                f"of {data}, test accuracy on {config_json['test_size']}; torch {torch.__version__}.\n")
    (out / "table.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
