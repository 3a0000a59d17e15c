"""Final test accuracy over several seeds, per recipe and data set, beside the seed posts' own loops.

Each run launches the real recipe (`accelerate launch --config_file ... recipes/<recipe>.py`) with its
defaults, except `--data`, `--epochs` and `--seed` (and `--lr` for the sweep), and reads what it wrote
(summary.json). Each seed also runs the seed post's loop (benchmarks/seed_loops.py) on the same data
for the same epochs, right after, so that drift in the machine's speed hits both alike.

    python benchmarks/accuracy.py                                  # real-image sets, 3 seeds (CPU: ~1.5 h)
    python benchmarks/accuracy.py --lr_multipliers 0.5 1 2         # the learning-rate sweep (CPU: ~3 h)
    python benchmarks/accuracy.py --cases cifar_cnn/photos10/2gpu  # one case: the signature command's setup
    python benchmarks/accuracy.py --hub --config 1gpu --no_seed_loops   # real CIFAR-10/100, Fashion-MNIST (GPU)
    python benchmarks/accuracy.py --recipe_flags="--ema 0.99 --tta" --no_seed_loops   # EMA and mirror TTA beside
    python benchmarks/accuracy.py --cases resnet18_fmnist/fashion_mnist/cpu_bf16   # the real Fashion-MNIST (Debian)

Cases (recipe / data / accelerate config): the real Fashion-MNIST's IDX files (`apt-get install
dataset-fashion-mnist`, or --fashion_mnist DIR), and sets built by benchmarks/real_images.py, with epoch
counts sized to a 2-core CPU; `--hub` runs the recipes' own hub datasets for their default epochs.
Reports final accuracy (the last evaluation, not the best) as mean +- std, min and max, seconds per epoch
(training plus that epoch's evaluation), and the time to reach --target test accuracy (the epochs until
the first evaluation at or above it, times seconds per epoch; median over the seeds that reached it).
With --recipe_flags that add evaluations (--ema, --tta), a second table pairs them with the same runs'
plain accuracy, seed by seed. Writes
benchmarks/results/accuracy-<device>.md, drawn from every run recorded in accuracy-<device>.jsonl beside it.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from real_images import build

# name -> (recipe, real-image set or hub id, accelerate config, epochs)
CASES = {
    # The real Fashion-MNIST: 60,000 training images, so a few epochs (4.3-7.6 min each for the ResNet in bf16 here).
    "resnet18_fmnist/fashion_mnist/cpu_bf16": ("resnet18_fmnist", "fashion_mnist", "cpu_bf16", 5),
    "cifar_cnn/fashion_mnist/cpu_bf16": ("cifar_cnn", "fashion_mnist", "cpu_bf16", 30),  # "your own data": defaults
    "cifar_cnn/photos10/cpu": ("cifar_cnn", "photos10", "cpu", 20),
    "cifar_cnn/photos10/2gpu": ("cifar_cnn", "photos10", "2gpu", 20),  # the signature command: 2 processes
    "resnet18_fmnist/digits/cpu": ("resnet18_fmnist", "digits", "cpu", 10),
    "resnet18_fmnist/photos10_small/cpu": ("resnet18_fmnist", "photos10_small", "cpu", 5),  # grayscale 28 x 28
    "deep_mlp_ckpt/photos100/cpu": ("deep_mlp_ckpt", "photos100", "cpu", 5),
}
MULTI_PROCESS = ("2gpu", "multigpu_bf16", "multinode")
FASHION_MNIST = "/usr/share/datasets/fashion-mnist"  # where Debian's dataset-fashion-mnist puts the IDX files
HUB = {"cifar_cnn": "uoft-cs/cifar10", "resnet18_fmnist": "zalando-datasets/fashion_mnist",
       "deep_mlp_ckpt": "uoft-cs/cifar100"}


def default_of(recipe: str, field: str):
    """A Config default, read from the recipe's source (importing it would start nothing, but costs seconds)."""
    tree = ast.parse((ROOT / "recipes" / f"{recipe}.py").read_text())
    config = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Config")
    return next(ast.literal_eval(node.value) for node in config.body
                if isinstance(node, ast.AnnAssign) and node.target.id == field)


def run_recipe(recipe: str, data: str, config: str, epochs: int, seed: int, lr: float, out: Path,
               flags: str = "") -> dict:
    env = dict(os.environ)
    if config in ("2gpu", "multigpu_bf16") and not torch.cuda.is_available():
        env["ACCELERATE_USE_CPU"] = "true"  # 2 CPU processes over gloo
    command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file",
               f"accelerate_configs/{config}.yaml", f"recipes/{recipe}.py", "--data", data, "--epochs", str(epochs),
               "--seed", str(seed), "--lr", repr(lr), "--tracker", "none", "--output_dir", str(out),
               *shlex.split(flags)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:  # e.g. the NaN guard: one line on stderr
        error = next((line for line in result.stderr.splitlines() if line.startswith("error:")), result.stderr[-300:])
        return {"eval_acc": None, "error": error.strip()}
    summary = json.loads((out / "summary.json").read_text())
    points = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {**{k: v for k, v in summary.items() if k.startswith("eval_acc")}, "best_eval_acc": summary["max_eval_acc"],
            "s_per_epoch": summary["wall_s"] / summary["epochs"],
            "eval_acc_per_epoch": [p["eval_acc"] for p in points if "eval_acc" in p and "steps" not in p]}


def run_seed_loop(recipe: str, data: str, epochs: int, seed: int, relu: bool = False) -> dict:
    command = [sys.executable, "benchmarks/seed_loops.py", recipe, "--data", data, "--epochs", str(epochs),
               "--seed", str(seed)] + (["--relu"] if relu else [])
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def time_to(row: dict, target: float) -> float | None:
    """Seconds until the first evaluation at or above `target`: its epoch count times the seconds per epoch."""
    epochs = next((i + 1 for i, acc in enumerate(row.get("eval_acc_per_epoch") or []) if acc >= target), None)
    return None if epochs is None else epochs * row["s_per_epoch"]


def stats(rows: list[dict], target: float) -> str:
    """One table row's cells: final accuracy mean +- std, min, max, runs that stopped, seconds per epoch, and the
    time to `target` (median, over the runs that reached it)."""
    finals = [r["eval_acc"] for r in rows if r["eval_acc"] is not None]
    failed = len(rows) - len(finals)
    if not finals:
        return f"- | - | - | {failed} of {len(rows)} | - | - |"
    std = statistics.stdev(finals) if len(finals) > 1 else 0.0
    seconds = statistics.median(r["s_per_epoch"] for r in rows if r["eval_acc"] is not None)
    times = [t for r in rows if r["eval_acc"] is not None and (t := time_to(r, target)) is not None]
    reached = (f"{statistics.median(times):.0f} ({len(times)} of {len(finals)})" if times
               else f"not reached (0 of {len(finals)})" if any("eval_acc_per_epoch" in r for r in rows)
               else "not measured")
    return (f"{statistics.mean(finals):.3f} +- {std:.3f} | {min(finals):.3f} | {max(finals):.3f} | "
            f"{failed} of {len(rows)} | {seconds:.1f} | {reached} |")


def table(records: list[dict], target: float) -> str:
    """One row per case, loop and learning rate, over all seeds recorded for it (the latest run of each seed)."""
    groups: dict[tuple, dict[int, dict]] = {}
    for r in records:
        groups.setdefault((r["case"], r["config"], r["data"], r["epochs"], r["loop"], r["lr"]), {})[r["seed"]] = r
    lines = ["| recipe on data, config | loop | lr | epochs | seeds | final test accuracy (mean +- std) | min | max "
             f"| stopped | s/epoch | s to {target:g} (runs) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (case, config, data, epochs, loop, lr), by_seed in groups.items():
        recipe = case.split("/")[0]
        lr_cell = "-" if lr is None else f"{lr:g} (x{by_seed[min(by_seed)]['multiplier']:g})"
        lines.append(f"| {recipe} on {data}, {config}.yaml | {loop} | {lr_cell} | {epochs} | {len(by_seed)} | "
                     + stats(list(by_seed.values()), target))
    return "\n".join(lines)


def std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def paired_table(records: list[dict]) -> str:
    """For runs that evaluated more than the trained weights (--ema, --tta): each accuracy and its gain over the same
    run's eval_acc, mean +- std over seeds. Empty when no run did."""
    groups: dict[tuple, dict[int, dict]] = {}
    for r in records:
        if r["loop"] != "recipe" and any(k.startswith("eval_acc_") for k in r):
            groups.setdefault((r["case"], r["config"], r["data"], r["epochs"], r["loop"]), {})[r["seed"]] = r
    lines = ["| recipe on data, config | flags | epochs | seeds | evaluated | final test accuracy "
             "| gain over eval_acc |", "|---|---|---|---|---|---|---|"]
    for (case, config, data, epochs, loop), by_seed in groups.items():
        runs = [r for r in by_seed.values() if r.get("eval_acc") is not None]
        for key in sorted({k for r in runs for k in r if k.startswith("eval_acc_") and k != "eval_acc_per_epoch"}):
            values, gains = [r[key] for r in runs], [r[key] - r["eval_acc"] for r in runs]
            lines.append(f"| {case.split('/')[0]} on {data}, {config}.yaml | {loop.removeprefix('recipe ')} | {epochs} "
                         f"| {len(runs)} | {key} | {statistics.mean(values):.3f} +- {std(values):.3f} | "
                         f"{statistics.mean(gains):+.3f} +- {std(gains):.3f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="the seeds to run per case")
    parser.add_argument("--lr_multipliers", type=float, nargs="+", default=[1.0], help="x the recipe's default --lr")
    parser.add_argument("--no_seed_loops", action="store_true", help="only the recipes")
    parser.add_argument("--no_recipes", action="store_true", help="only the seed loops (e.g. to add them later)")
    parser.add_argument("--fashion_mnist", default=FASHION_MNIST, help="folder of the real Fashion-MNIST IDX files")
    parser.add_argument("--target", type=float, default=0.90, help="the table's time-to-accuracy column")
    parser.add_argument("--epochs", type=int, default=None, help="instead of each case's epochs (e.g. a shorter sweep)")
    parser.add_argument("--hub", action="store_true", help="the recipes' hub datasets and default epochs")
    parser.add_argument("--config", default=None, help="accelerate config for every case (default: the case's own)")
    parser.add_argument("--recipe_flags", default="", help='more flags for every recipe run, e.g. "--ema 0.99 --tta"')
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder for the results")
    args = parser.parse_args()

    # Every run is kept as one JSON line, and the table is drawn from all of them: a sweep of hours can be
    # stopped and continued (e.g. with the missing --seeds). Delete the .jsonl file to start afresh.
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"accuracy-{'cuda' if torch.cuda.is_available() else 'cpu'}{'-hub' if args.hub else ''}"
    log = out / f"{stem}.jsonl"
    work = Path(tempfile.mkdtemp(prefix="accuracy-"))

    def record(**fields) -> None:
        print(json.dumps(fields), flush=True)
        with log.open("a") as f:
            f.write(json.dumps(fields) + "\n")

    for case in args.cases:
        recipe, data_name, config, epochs = CASES[case]
        config = args.config or config
        data = (HUB[recipe] if args.hub else args.fashion_mnist if data_name == "fashion_mnist"
                else str(build(data_name)))
        if data == args.fashion_mnist and not Path(data).is_dir():
            sys.exit(f"no Fashion-MNIST at {data}: sudo apt-get install dataset-fashion-mnist, or --fashion_mnist DIR")
        epochs = args.epochs or (default_of(recipe, "epochs") if args.hub else epochs)
        base_lr = default_of(recipe, "lr")
        where = dict(case=case, config=config, epochs=epochs,
                     data=data if args.hub else "fashion_mnist (IDX)" if data == args.fashion_mnist else
                     f"{data_name} (real images)")
        for seed in args.seeds:
            for m in [] if args.no_recipes else args.lr_multipliers:
                run_dir = work / str(len(list(work.iterdir())))
                result = run_recipe(recipe, data, config, epochs, seed, base_lr * m, run_dir, args.recipe_flags)
                loop = f"recipe {args.recipe_flags}".strip()
                record(**where, loop=loop, lr=base_lr * m, multiplier=m, seed=seed, **result)
            if not args.no_seed_loops and config not in MULTI_PROCESS:  # the seed loops run one process
                for loop in ["seed loop", "seed + ReLU loop"] if recipe == "cifar_cnn" else ["seed loop"]:
                    result = run_seed_loop(recipe, data, epochs, seed, relu="ReLU" in loop)
                    record(**where, loop=loop, lr=None, multiplier=None, seed=seed, eval_acc=result["eval_acc"],
                           s_per_epoch=result["s_per_epoch"], eval_acc_per_epoch=result["eval_acc_per_epoch"])

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else \
        f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    text = (table(records, args.target) + (f"\n\n{paired_table(records)}" if paired_table(records) else "")
            + f"\n\n{device}; torch {torch.__version__}. Runs recorded in {log.name}; "
              f"latest command: python benchmarks/accuracy.py {shlex.join(sys.argv[1:])}\n")
    print("\n" + text)
    (out / f"{stem}.md").write_text(text)
    print(f"wrote {out / f'{stem}.md'}")


if __name__ == "__main__":
    main()
