"""Every GPU path of the recipes, run once for real, for correctness, with every figure in one JSON file: what
benchmarks/gpu_check.sh runs (it installs missing packages first). Speed and time to accuracy are
benchmarks/gpu_speed.sh's.

For each recipe, on --synthetic data held on the GPU (--data_on_device, the default --channels_last):
  precision    1gpu.yaml (float32), bf16.yaml, fp16.yaml: 200 steps each; loss, peak memory, samples/s
  resume       SIGTERM to `accelerate launch` mid-epoch, then --resume latest; the weights against an
               uninterrupted run, and that run against a second one (GPU kernels need not be deterministic)
  predict      recipes/predict.py --evaluate on the CPU of the weights written on the GPU
Then: deep_mlp_sweep.py's CUDA memory at batch 16 for 0, 2, 5 and 10 segments; the ResNet with bf16.yaml --compile
(it trains and saves plain weights; the first log window, compilation included, and the steady speed). What is timed
runs alone; resume and predict, which time nothing, run side by side for the three recipes.

--dry_run (GPU_CHECK_CPU=1 in gpu_check.sh): the same steps on the CPU, tiny (cpu.yaml and cpu_bf16.yaml stand in
for the GPU configs, the recipes read --fashion_mnist instead of --synthetic), so that this script is tested before
a GPU comes. Left out there: fp16, which a CPU refuses (tests/test_errors.py), and the second uninterrupted run, which
on a CPU is bitwise the first (tests/test_checkpoints.py).

  bash benchmarks/gpu_check.sh                      # writes runs/gpu_check-<time>/gpu_check.json and .log
  python benchmarks/gpu_check.py --dry_run --out /tmp/check --fashion_mnist tests/...
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECIPES = ("cifar_cnn", "resnet18_fmnist", "deep_mlp_ckpt")
FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")  # Debian's dataset-fashion-mnist
SEED_SWEEP_MB = {0: 1717, 2: 1283, 5: 1043, 10: 959}  # seed 003's CUDA memory at batch 16, by segments


class Check:
    """Runs the steps, logs every command and its output, and keeps every figure in gpu_check.json."""

    def __init__(self, args):
        self.args, self.out = args, Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = (self.out / "gpu_check.log").open("a")
        self.results = {"device": device_name(), "dry_run": args.dry_run, "versions": versions(), "steps": {}}
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="disabled")
        if args.dry_run:  # every process on the CPU, whatever the machine has
            self.env.update(ACCELERATE_USE_CPU="true", CUDA_VISIBLE_DEVICES="")

    def config(self, precision: str) -> str:
        if self.args.dry_run:
            return {"float32": "cpu", "bf16": "cpu_bf16"}[precision]
        return {"float32": "1gpu", "bf16": "bf16", "fp16": "fp16"}[precision]

    def launch_command(self, script: str, *args, precision: str = "float32") -> list[str]:
        return [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file",
                f"accelerate_configs/{self.config(precision)}.yaml", f"recipes/{script}.py", *map(str, args)]

    def run(self, command: list, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
        command, start = [str(part) for part in command], time.perf_counter()
        result = subprocess.run(command, cwd=ROOT, env=env or self.env, capture_output=True, text=True,
                                timeout=timeout)
        self.write(f"$ {' '.join(command)}\n# exit {result.returncode} after {time.perf_counter() - start:.1f} s\n"
                   f"{result.stdout[-4000:]}{result.stderr[-4000:]}\n")
        return result

    def write(self, text: str) -> None:
        self.log.write(text)
        self.log.flush()

    def step(self, name: str, function, *args) -> dict:
        """One step: its figures, or the error that stopped it. Saved at once: a check cut short keeps the rest."""
        start = time.perf_counter()
        print(f"[{time.strftime('%H:%M:%S')}] {name} ...", flush=True)
        try:
            figures = {"ok": True, **function(*args)}
        except Exception as error:  # noqa: BLE001 (a failed step is a figure too; the others still run)
            figures = {"ok": False, "error": f"{type(error).__name__}: {str(error)[-1500:]}"}
        figures["seconds"] = round(time.perf_counter() - start, 1)
        self.results["steps"][name] = figures
        (self.out / "gpu_check.json").write_text(json.dumps(self.results, indent=1) + "\n")
        print(f"    {json.dumps(figures)[:600]}", flush=True)
        return figures

    # ------------------------------------------------------------------ per recipe
    def steps(self, recipe: str) -> int:
        return 6 if self.args.dry_run else 200

    def common(self, recipe: str, run: str) -> list:
        # The dry run reads the (tiny) --fashion_mnist instead: each run then evaluates 20 images, not 10,000.
        data = ["--data", self.args.fashion_mnist] if self.args.dry_run else ["--synthetic"]
        return [*data, "--data_on_device", "--batch_size", 8 if self.args.dry_run else 128, "--tracker", "none",
                "--output_dir", self.out / "runs" / f"{recipe}-{run}", "--overwrite"]

    def precision(self, recipe: str, precision: str) -> dict:
        steps = self.steps(recipe)
        result = self.run(self.launch_command(recipe, *self.common(recipe, precision), "--max_steps", steps,
                                              "--log_every", max(1, steps // 6), precision=precision), 300)
        return run_figures(result, self.out / "runs" / f"{recipe}-{precision}")

    def compile(self, recipe: str) -> dict:
        steps = self.steps(recipe)
        run = self.out / "runs" / f"{recipe}-compile"
        result = self.run(self.launch_command(recipe, *self.common(recipe, "compile"), "--compile", "--max_steps",
                                              steps, "--log_every", max(1, steps // 6), precision="bf16"), 600)
        figures = run_figures(result, run)
        figures["plain_weight_names"] = not any(name.startswith("_orig_mod.") for name in load_weights(run))
        first = next(row for row in read_rows(run) if "train_loss" in row)
        figures["first_window_s"] = first["step"] * figures["global_batch_size"] / first["samples_per_s"]
        plain = self.results["steps"].get(f"{recipe} bf16", {}).get("steady_samples_per_s")
        if plain:
            figures["steady_x_plain_bf16"] = figures["steady_samples_per_s"] / plain
        return figures

    def resume(self, recipe: str) -> dict:
        steps, stop_after = (64, 2) if self.args.dry_run else (600, 100)  # dry run: steps left after the signal
        args = ["--max_steps", steps, "--log_every", 1 if self.args.dry_run else 10, "--seed", 3]
        uninterrupted = ("reference",) if self.args.dry_run else ("reference", "again")
        runs = {name: self.out / "runs" / f"{recipe}-{name}" for name in (*uninterrupted, "stopped")}
        for name in uninterrupted:
            assert self.run(self.launch_command(recipe, *self.common(recipe, name), *args), 600).returncode == 0
        launcher = subprocess.Popen(self.launch_command(recipe, *self.common(recipe, "stopped"), *args), cwd=ROOT,
                                    env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while not any(row.get("step", 0) >= stop_after for row in read_rows(runs["stopped"], quiet=True)):
            assert launcher.poll() is None and time.monotonic() < deadline, "the run ended before the signal"
            time.sleep(0.01)
        launcher.send_signal(signal.SIGTERM)  # to `accelerate launch`, as `kill <pid>` would
        stdout, stderr = launcher.communicate(timeout=300)
        self.write(f"$ (SIGTERM after step {stop_after})\n{stdout[-3000:]}{stderr[-3000:]}\n")
        stopped = int(stdout.split("stopped by SIGTERM at step ")[1].split(",")[0])
        resumed = self.run(self.launch_command(recipe, *self.common(recipe, "stopped")[:-1], *args, "--resume",
                                               "latest"), 600)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        weights = {name: load_weights(run) for name, run in runs.items()}
        figures = {"stopped_at_step": stopped, "of_steps": steps,
                   "resumed_vs_reference_max_abs": max_abs_diff(weights["stopped"], weights["reference"])}
        if "again" in weights:
            figures["again_vs_reference_max_abs"] = max_abs_diff(weights["again"], weights["reference"])
        return figures

    def predict_on_cpu(self, recipe: str) -> dict:
        run = self.out / "runs" / f"{recipe}-reference"
        env = dict(self.env, CUDA_VISIBLE_DEVICES="")  # weights written on the GPU, read on the CPU
        result = self.run([sys.executable, "recipes/predict.py", "--weights", run / "model.safetensors", "--recipe",
                           recipe, "--evaluate"], 600, env=env)
        assert result.returncode == 0, result.stderr[-2000:]
        on_cpu = json.loads(result.stdout.strip().splitlines()[-1])
        on_gpu = read_json(run / "summary.json")
        return {"eval_acc_cpu": on_cpu["eval_acc"], "eval_acc_gpu": on_gpu["eval_acc"],
                "eval_loss_cpu": on_cpu["eval_loss"], "eval_loss_gpu": on_gpu["eval_loss"]}

    # ------------------------------------------------------------------ once
    def sweep(self) -> dict:
        folder = self.out / "sweep"
        # The dry run measures one segment count at the seed's batch only: test_deep_mlp_ckpt.py runs a fuller sweep.
        tiny = ["--segments", "2", "--batch", "16", "--repeats", "1"] if self.args.dry_run else ["--segments", "2,5,10"]
        result = self.run(self.launch_command("deep_mlp_sweep", *tiny, "--output_dir", folder), 600)
        assert result.returncode == 0, result.stderr[-2000:]
        lines = (folder / "sweep.csv").read_text().splitlines()
        rows = [dict(zip(lines[0].split(","), line.split(","))) for line in lines[1:]]
        at_16 = {row["segments"] if row["segments"].isdigit() else "0":  # none: no checkpointing
                 {k: row[k] for k in ("peak_MB", "activations_MB", "params_MB", "grads_MB", "optimizer_MB", "saved_MB",
                                      "step_ms") if k in row} for row in rows if row["batch"] == "16"}
        return {"batch_16": at_16, "seed_003_MB": SEED_SWEEP_MB}


def run_figures(result: subprocess.CompletedProcess, run: Path) -> dict:
    assert result.returncode == 0, result.stderr[-2000:]
    summary, config = read_json(run / "summary.json"), read_json(run / "config.json")
    rows = [row for row in read_rows(run) if "train_loss" in row]  # the log points (evaluations are rows too)
    steady = [row["samples_per_s"] for row in rows[1:]] or [rows[-1]["samples_per_s"]]
    return {"steady_samples_per_s": statistics.median(steady), "first_window_samples_per_s": rows[0]["samples_per_s"],
            "train_loss": rows[-1]["train_loss"], "eval_acc": summary.get("eval_acc"), "wall_s": summary["wall_s"],
            "samples_per_s": summary["samples_per_s"], "peak_mem_mb": summary["peak_mem_mb"],
            "global_batch_size": config["global_batch_size"], "mixed_precision": config["mixed_precision"],
            "device": config["device"], "steps": summary["steps"]}


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def read_rows(run: Path, quiet: bool = False) -> list[dict]:
    try:
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError):  # not there yet, or a line half written
        if quiet:
            return []
        raise


def load_weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run / "model.safetensors")


def max_abs_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"


def versions() -> dict:
    import accelerate

    found = {"python": sys.version.split()[0], "torch": torch.__version__, "accelerate": accelerate.__version__,
             "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}
    try:
        import datasets

        found["datasets"] = datasets.__version__
    except ImportError:
        pass
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=f"runs/gpu_check-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--dry_run", action="store_true", help="the same steps, tiny, on the CPU")
    parser.add_argument("--fashion_mnist", default=str(FASHION_MNIST), help="the real Fashion-MNIST's IDX files")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("error: no GPU: run it on a machine with one, or pass --dry_run to try every step on the CPU")
    check = Check(args)
    print(f"gpu_check on {check.results['device']}: {json.dumps(check.results['versions'])}", flush=True)
    # Correctness first, side by side (nothing is timed): resume and predict per recipe.
    with ThreadPoolExecutor(len(args.recipes)) as pool:
        list(pool.map(lambda r: (check.step(f"{r} resume", check.resume, r),
                                 check.step(f"{r} predict on the CPU", check.predict_on_cpu, r)), args.recipes))
    # Timed, one at a time.
    for recipe in args.recipes:
        for precision in ("float32", "bf16") if args.dry_run else ("float32", "bf16", "fp16"):
            check.step(f"{recipe} {precision}", check.precision, recipe, precision)
    check.step("deep_mlp_sweep memory", check.sweep)
    # Compiling takes a minute or more a recipe (on a CPU too): once, on the model where it may pay.
    recipe = "cifar_cnn" if args.dry_run else "resnet18_fmnist"
    check.step(f"{recipe} compile", check.compile, recipe)
    failed = [name for name, figures in check.results["steps"].items() if not figures["ok"]]
    print(f"wrote {check.out / 'gpu_check.json'} and gpu_check.log; "
          + (f"FAILED: {', '.join(failed)}" if failed else "every step ran"), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
