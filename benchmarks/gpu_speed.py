"""Speed and time to accuracy on one GPU, in one prepared run: what benchmarks/gpu_speed.sh runs (8 minutes at most on
one H100). Every measurement is the recipe's own train(), called in this one process one after another (a process
start costs seconds on a GPU machine), each with a new accelerate state; the results go to gpu_speed.json after each.

In the order they run (the most wanted first: a run cut short keeps them), until --budget_s is spent:
- time_to_accuracy, `new_process` true: the README's GPU line as a user runs it, `accelerate launch` of the ResNet
  on the real Fashion-MNIST in the GPU setting, seed 0: `seconds` is the run's own wall_s (summary.json: from its
  loop's start to its summary, after the last evaluation), `process_s` from the launch to the exit.
- start: benchmarks/start_cost.py in the GPU setting, after the seeds' new processes (the data's cache made): the
  start of the README's GPU line, phase by phase (the launcher, torch's import, CUDA's set-up, the data, torch._dynamo's
  import, the first and the second step).
- time_to_accuracy, `new_process` false: the same in this process, seeds 0, 1, 2 (the first run of the process
  pays CUDA's start: `runs_before_in_process`). `seconds` runs from its first
  training step to the end of its last evaluation; `reached` is that evaluation's test accuracy and `met`
  whether it is at least `target`; `first_at_target_s` is the time to the first evaluation at or above it. Beside
  them, not in them: `load_data_s` (reading, or decoding into the cache, the data) and `start_s` (from this process's
  start to the first step: imports, CUDA's set-up, the data, the model).
- rows, each a short run on --synthetic data: `samples_per_s` is the median of the run's own log windows after the
  first (metrics.jsonl, as a user's run reports itself), `ms_per_step` the global batch over it. For each recipe:
  the GPU setting in bf16 and float32 and in bf16 with --ema 0.99; the recipe's defaults (`setting` "default": batch
  128) in float32, bf16 and fp16; for the ResNet, the GPU setting with one flag more (`flag`: --cudnn_benchmark,
  --no-data_on_device, --no-tf32: the recipes' GPU defaults one at a time), with --compile (`compile`: "default"), and
  compiled with CUDA graphs (`compile`: "reduce-overhead", torch.compile's mode, passed to the recipe's
  model.compile() here: no recipe flag asks for it).
- profile: torch.profiler over 20 steps of the ResNet in the GPU setting (accelerate's ProfileKwargs): a Chrome trace
  (open it at https://ui.perfetto.dev), a table of the operations that took the most time, and the GPU's idle share
  over those steps (1 - the trace's kernel, copy and memset time / wall time) and its kernels per step.

Beside them, `bytecode_kept`: whether this Python had torch's compiled code (its .pyc); without it every new process
compiles torch's Python again, seconds of each start (BENCHMARKS.md, 2026-11-29).

The GPU setting (GPU_SETTING): bf16.yaml and --batch_size 512 (the ResNet's learning rate follows the global batch by
its default --lr_scaling sqrt), on top of the recipes' GPU defaults (shared/loop.py): the data held on the GPU,
TF32 for float32 matmuls and convolutions, cudnn.benchmark off (its row turns it on).

    bash benchmarks/gpu_speed.sh                                # benchmarks/results/gpu-<name>/gpu_speed.json
    python benchmarks/gpu_speed.py --dry_run --out DIR --fashion_mnist DIR   # the same steps, tiny, on the CPU
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import importlib
import importlib.util
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

STARTED = time.perf_counter()  # as near this process's start as Python lets a script see (imports follow)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import ProfileKwargs

from benchmarks import start_cost
from shared import loop
from shared.launch import STOPS  # the signals a run's start and its stop take over

RECIPES = ("cifar_cnn", "resnet18_fmnist", "deep_mlp_ckpt")
FASHION_MNIST = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist
TARGET = 0.93  # the ResNet's test accuracy to reach on the real Fashion-MNIST
# The GPU setting, chosen by the accuracy the ResNet reached at this global batch on the CPU (BENCHMARKS.md): flags,
# the config's precision, and the process settings.
GPU_SETTING = {"flags": ["--batch_size", "512"], "precision": "bf16"}
GPU_EPOCHS = 6  # the ResNet's epochs in the GPU setting: 0.932 at this global batch on the CPU (seed 0, BENCHMARKS.md)
PRECISION = {"float32": "no", "bf16": "bf16", "fp16": "fp16"}  # ACCELERATE_MIXED_PRECISION, as the configs set it


class Speed:
    """The measurements, kept in gpu_speed.json as they come."""

    def __init__(self, args):
        self.args, self.out, self.runs = args, Path(args.out), Path(args.runs)
        self.out.mkdir(parents=True, exist_ok=True)
        self.trained = 0  # runs of train() in this process so far (the first pays cuDNN's autotuning, CUDA's start)
        self.log = (self.out / "gpu_speed.log").open("a")
        self.deadline = STARTED + args.budget_s
        self.results = {"device": device_name(), "date": time.strftime("%Y-%m-%d"), "commit": commit(),
                        "torch": torch.__version__, "dry_run": args.dry_run, "budget_s": args.budget_s,
                        "bytecode_kept": Path(importlib.util.cache_from_source(torch.__file__)).exists(),
                        "gpu_setting": {**GPU_SETTING, "epochs": GPU_EPOCHS}, "runs": str(self.runs),
                        "profile": None, "profile_summary": None, "rows": [], "start": [],
                        "time_to_accuracy": [], "skipped": [], "errors": []}

    def save(self) -> None:
        (self.out / "gpu_speed.json").write_text(json.dumps(self.results, indent=1) + "\n")

    def measure(self, kind: str, name: str, function, *args) -> None:
        """One measurement, unless the time is spent; an error is recorded, and the others still run."""
        if time.perf_counter() > self.deadline:
            self.results["skipped"].append({"name": name, "why": f"--budget_s {self.args.budget_s:.0f} spent"})
        else:
            print(f"[{time.perf_counter() - STARTED:5.0f} s] {name} ...", flush=True)
            try:
                found = function(*args)
                if kind == "profile":  # its trace's path, and what it showed
                    self.results["profile"], self.results["profile_summary"] = found.pop("path"), found
                else:
                    self.results[kind].append(found)
                print(f"    {json.dumps(found)[:300]}", flush=True)
            except Exception as error:  # noqa: BLE001 (a failed measurement is a result too; the others still run)
                self.results["errors"].append({"name": name, "error": f"{type(error).__name__}: {error}"[-1500:]})
                print(f"    failed: {self.results['errors'][-1]['error'][:500]}", flush=True)
        self.save()

    # ------------------------------------------------------------------ one run of a recipe
    def train(self, name: str, flags: list, precision: str, run: str):
        """The recipe's train() in this process with `flags`, in `precision`; returns the recipe module and its run
        folder."""
        recipe = importlib.import_module(f"recipes.{name}")
        AcceleratorState._reset_state(reset_partial_state=True)  # a singleton: each run its own precision
        GradientState._reset_state()
        os.environ["ACCELERATE_MIXED_PRECISION"] = PRECISION[precision]
        folder = self.runs / run
        cfg = recipe.Config.parse([*map(str, flags), "--tracker", "none", "--output_dir", str(folder), "--overwrite"])
        handlers = {signum: signal.getsignal(signum) for signum in STOPS}
        try:
            with contextlib.redirect_stdout(self.log), contextlib.redirect_stderr(self.log):
                recipe.train(cfg)
        finally:
            for signum, handler in handlers.items():  # train() took SIGTERM, Ctrl-C and SIGHUP (a stop)
                signal.signal(signum, handler)
            self.trained += 1
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return recipe, folder

    def small(self, flags: list) -> list:
        """The dry run's tiny version of a run's flags: batches of 8 (the last --batch_size wins)."""
        return [*flags, "--batch_size", "8"] if self.args.dry_run else list(flags)

    def data(self) -> list:
        """Generated data on a GPU; the dry run reads the (tiny) --fashion_mnist: each run then evaluates a few images,
        not 10,000 on a CPU."""
        return ["--data", self.args.fashion_mnist] if self.args.dry_run else ["--synthetic"]

    # ------------------------------------------------------------------ measurements
    def time_to_accuracy(self, seed: int) -> dict:
        epochs = 1 if self.args.dry_run else GPU_EPOCHS
        recipe = importlib.import_module("recipes.resnet18_fmnist")
        marks, load, preprocess, evaluate = {}, recipe.load_data, recipe.preprocess, recipe.evaluate

        def timed_load(cfg):
            start = time.perf_counter()
            try:
                return load(cfg)
            finally:
                marks["load_data_s"] = time.perf_counter() - start

        def timed_preprocess(images, training, *args):
            if training and "first_step" not in marks:
                marks["first_step"] = time.perf_counter()
            return preprocess(images, training, *args)

        def timed_evaluate(*args, **kwargs):
            result = evaluate(*args, **kwargs)  # ends with .item(): the GPU has finished
            marks.setdefault("evaluations", []).append((time.perf_counter(), result[0]["eval_acc"]))
            return result

        recipe.load_data, recipe.preprocess, recipe.evaluate = timed_load, timed_preprocess, timed_evaluate
        train_start, runs_before = time.perf_counter(), self.trained
        try:
            flags = [*self.small(GPU_SETTING["flags"]), "--data", self.args.fashion_mnist, "--epochs", epochs,
                     "--seed", seed]
            self.train("resnet18_fmnist", flags, GPU_SETTING["precision"], f"resnet18_fmnist-tta-{seed}")
        finally:
            recipe.load_data, recipe.preprocess, recipe.evaluate = load, preprocess, evaluate
        first, (last, reached) = marks["first_step"], marks["evaluations"][-1]
        at_target = [when for when, accuracy in marks["evaluations"] if accuracy >= TARGET]
        return {"recipe": "resnet18_fmnist", "data": self.args.fashion_mnist, "target": TARGET, "reached": reached,
                "met": reached >= TARGET, "seconds": last - first, "epochs": epochs, "seed": seed,
                "first_at_target_s": at_target[0] - first if at_target else None,
                "evaluations": [accuracy for _, accuracy in marks["evaluations"]],
                "load_data_s": marks["load_data_s"], "start_s": first - STARTED,
                "setup_s": first - train_start - marks["load_data_s"], "runs_before_in_process": runs_before,
                "new_process": False}

    def time_to_accuracy_new_process(self, seed: int, flags: tuple = ()) -> dict:
        epochs = 1 if self.args.dry_run else GPU_EPOCHS
        folder = self.runs / "-".join(["resnet18_fmnist-tta-new-process", str(seed), *(f.lstrip("-") for f in flags)])
        config = ROOT / "accelerate_configs" / ("cpu.yaml" if self.args.dry_run else "bf16.yaml")
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                   str(ROOT / "recipes" / "resnet18_fmnist.py"), *map(str, self.small(GPU_SETTING["flags"])),
                   "--data", self.args.fashion_mnist, "--epochs", str(epochs), "--seed", str(seed), "--tracker",
                   "none", "--output_dir", str(folder), "--overwrite", *flags]
        env = {key: value for key, value in os.environ.items() if key != "ACCELERATE_MIXED_PRECISION"}  # the config's
        self.log.flush()
        start = time.perf_counter()
        subprocess.run(command, stdout=self.log, stderr=subprocess.STDOUT, env=env, check=True)
        process_s = time.perf_counter() - start
        summary = json.loads((folder / "summary.json").read_text())
        return {"recipe": "resnet18_fmnist", "data": self.args.fashion_mnist, "target": TARGET,
                "reached": summary["eval_acc"], "met": summary["eval_acc"] >= TARGET, "seconds": summary["wall_s"],
                "train_s": summary["train_s"], "start_s": summary["start_s"], "finish_s": summary["finish_s"],
                "epochs": epochs, "seed": seed, "flags": list(flags),
                "evaluations": [row["eval_acc"] for row in read_rows(folder) if "eval_acc" in row],
                "process_s": process_s, "new_process": True}

    def start(self) -> dict:
        """benchmarks/start_cost.py in the GPU setting: where the start of the README's GPU line goes, phase by phase,
        each in new processes."""
        config = ROOT / "accelerate_configs" / ("cpu.yaml" if self.args.dry_run else "bf16.yaml")
        batch_size = 8 if self.args.dry_run else int(GPU_SETTING["flags"][1])
        return start_cost.measure(str(config), self.args.fashion_mnist, batch_size)  # its own new processes

    def speed(self, name: str, setting: str, precision: str, ema: bool = False, flag: str | None = None,
              compile: str | None = None) -> dict:
        flags = [*(GPU_SETTING["flags"] if setting == "gpu" else []), *([flag] if flag else [])]
        steps, every = (2, 1) if self.args.dry_run else (150, 25)
        flags = [*self.small(flags), *self.data(), "--max_steps", steps, "--log_every", every]
        flags += (["--ema", "0.99"] if ema else []) + (["--compile"] if compile else [])
        module_compile = torch.nn.Module.compile
        if compile and compile != "default":
            torch.nn.Module.compile = lambda module, **kwargs: module_compile(module, **{**kwargs, "mode": compile})
        run = "-".join([name, setting, precision] + ["ema"] * ema + ([flag.lstrip("-")] if flag else [])
                       + [f"compile-{compile}"] * bool(compile))
        try:
            _, folder = self.train(name, flags, precision, run)
        finally:
            torch.nn.Module.compile = module_compile
        config = json.loads((folder / "config.json").read_text())
        windows = [row["samples_per_s"] for row in read_rows(folder) if "train_loss" in row]
        samples_per_s = statistics.median(windows[1:] or windows)
        return {"recipe": name, "setting": setting, "precision": precision, "batch_size": config["global_batch_size"],
                "ema": ema, "samples_per_s": samples_per_s, "ms_per_step": 1000 * config["global_batch_size"]
                / samples_per_s, "flag": flag, "compile": compile, "windows": windows}

    def profile(self) -> dict:
        """20 steps of the ResNet in the GPU setting under torch.profiler, after 10 to warm up (the dry run: 1 after
        2)."""
        cuda = torch.cuda.is_available()
        wait, warmup, active = (1, 1, 1) if self.args.dry_run else (5, 5, 20)
        found = {}

        def summarize(profiler):  # once the active steps are recorded
            trace, top = self.out / "profile_trace.json.gz", self.out / "profile_top_ops.txt"
            profiler.export_chrome_trace(str(trace))
            top.write_text(profiler.key_averages().table(sort_by="self_cuda_time_total" if cuda else
                                                         "self_cpu_time_total", row_limit=25) + "\n")
            # From the trace: its GPU-side copies of the step annotations ("gpu_user_annotation") are no GPU work.
            events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
            steps = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep")]
            span_us = max(e["ts"] + e["dur"] for e in steps) - min(e["ts"] for e in steps)
            work = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
            work_us = sum(e["dur"] for e in work)
            # The GPU's busy time is the union of its kernels' intervals (kernels on several streams can overlap),
            # over the GPU's own span: the host's marks of a replayed CUDA graph's steps end before its kernels do.
            busy_us, end, gpu_span_us = 0.0, -math.inf, 0.0
            for event in sorted(work, key=lambda e: e["ts"]):
                busy_us += max(0.0, event["ts"] + event["dur"] - max(end, event["ts"]))
                end = max(end, event["ts"] + event["dur"])
            if work:
                gpu_span_us = end - min(e["ts"] for e in work)
            found.update(path=str(trace), top_ops=str(top), steps=active, wall_ms_per_step=span_us / active / 1000,
                         kernel_ms_per_step=work_us / active / 1000 if cuda else None,
                         kernels_per_step=sum(e["cat"] == "kernel" for e in work) / active if cuda else None,
                         gpu_ms_per_step=gpu_span_us / active / 1000 if cuda else None,
                         gpu_idle_share=1 - busy_us / gpu_span_us if cuda and gpu_span_us else None)

        schedule = {"wait": wait, "warmup": warmup, "active": active, "repeat": 1}
        profiler = ProfileKwargs(activities=["cpu", "cuda"] if cuda else ["cpu"], schedule_option=schedule,
                                 on_trace_ready=summarize).build()
        # A profiler step per training step (a replayed CUDA graph runs no optimizer hook: the step's own call)
        call = loop.CapturedStep.__call__
        loop.CapturedStep.__call__ = lambda step, *batch: (call(step, *batch), profiler.step())[0]
        profiler.start()
        try:
            flags = [*self.small(GPU_SETTING["flags"]), *self.data(), "--max_steps", wait + warmup + active + 2,
                     "--log_every", 1000]
            self.train("resnet18_fmnist", flags, GPU_SETTING["precision"], "resnet18_fmnist-profile")
        finally:
            profiler.stop()
            loop.CapturedStep.__call__ = call
        return found


def read_rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"


def commit() -> str | None:
    """The commit measured: GPU_SPEED_COMMIT where the tree was copied without its own .git folder (a copy of an
    older one said f984576 for 043328d), else git's."""
    if os.environ.get("GPU_SPEED_COMMIT"):
        return os.environ["GPU_SPEED_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def default_out() -> Path:
    """benchmarks/results/gpu-<name>/: h100, h200, ... from the device's name."""
    words = device_name().lower().replace("nvidia", "").split()
    return ROOT / "benchmarks" / "results" / f"gpu-{words[0] if words else 'cpu'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="default: benchmarks/results/gpu-<name>/")
    parser.add_argument("--runs", default=f"runs/gpu_speed-{time.strftime('%Y%m%d-%H%M%S')}",
                        help="the runs' own folders (config, metrics, weights): not among the results")
    parser.add_argument("--dry_run", action="store_true", help="the same measurements, tiny, on the CPU")
    parser.add_argument("--fashion_mnist", default=FASHION_MNIST, help="the real Fashion-MNIST's IDX files")
    parser.add_argument("--budget_s", type=float, default=420, help="no measurement starts after this many seconds")
    parser.add_argument("--seeds", type=int, default=3, help="time-to-accuracy runs, seeds 0, 1, ...")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES,
                        help="the recipes of the per-recipe rows")
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("error: no GPU: run it on a machine with one, or pass --dry_run to try every step on the CPU")
    if not (Path(args.fashion_mnist) / "train-images-idx3-ubyte.gz").exists() and not (
            Path(args.fashion_mnist) / "train-images-idx3-ubyte").exists():
        sys.exit(f"error: no Fashion-MNIST IDX files in {args.fashion_mnist}: apt-get install dataset-fashion-mnist, "
                 "or pass --fashion_mnist DIR")
    args.out = args.out or str(default_out())
    speed = Speed(args)
    print(f"gpu_speed on {speed.results['device']}, torch {torch.__version__}: {speed.out}", flush=True)
    # The README's GPU line as a user runs it, a process each; then without the CUDA graph; then in this process.
    for seed in range(1 if args.dry_run else args.seeds):
        speed.measure("time_to_accuracy", f"resnet18_fmnist to {TARGET}, a new process, seed {seed}",
                      speed.time_to_accuracy_new_process, seed)
    speed.measure("start", "where the start goes, phase by phase (benchmarks/start_cost.py)", speed.start)
    speed.measure("time_to_accuracy", f"resnet18_fmnist to {TARGET}, a new process, --no-cuda_graph",
                  speed.time_to_accuracy_new_process, 0, ("--no-cuda_graph",))
    speed.measure("time_to_accuracy", f"resnet18_fmnist to {TARGET}, seed 0", speed.time_to_accuracy, 0)
    for name in args.recipes:
        for precision, ema in (("bf16", False), ("float32", False), ("bf16", True)):
            speed.measure("rows", f"{name} gpu {precision}{' ema' * ema}", speed.speed, name, "gpu", precision, ema)
    for flag, precision in (("--no-cuda_graph", "bf16"), ("--no-cuda_graph", "float32"), ("--cudnn_benchmark", "bf16"),
                            ("--no-data_on_device", "bf16"), ("--no-tf32", "float32")):
        speed.measure("rows", f"resnet18_fmnist gpu {precision} {flag}", speed.speed, "resnet18_fmnist", "gpu",
                      precision, False, flag)
    speed.measure("profile", "profile", speed.profile)
    for name in args.recipes:
        for precision in ("float32", "bf16") if args.dry_run else ("float32", "bf16", "fp16"):  # a CPU refuses fp16
            speed.measure("rows", f"{name} default {precision}", speed.speed, name, "default", precision)
    for mode in ("default", "reduce-overhead"):  # last: compiling takes 15-25 s a run on a GPU
        name = f"resnet18_fmnist gpu bf16 compile {mode}"
        if args.dry_run:  # tests/test_gpu_check.py compiles a recipe on the CPU
            speed.results["skipped"].append({"name": name, "why": "dry run: compiling takes a minute on a CPU"})
        else:
            speed.measure("rows", name, speed.speed, "resnet18_fmnist", "gpu", "bf16", False, None, mode)
    speed.save()
    print(f"wrote {speed.out / 'gpu_speed.json'} in {time.perf_counter() - STARTED:.0f} s; "
          f"{len(speed.results['errors'])} failed, {len(speed.results['skipped'])} skipped", flush=True)
    sys.exit(1 if speed.results["errors"] else 0)


if __name__ == "__main__":
    main()
