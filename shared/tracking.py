"""The run folder and its files, written through accelerate's tracker interface.

`make_run_dir` picks the folder, the same on every process. `trackers(cfg, run_dir)` is the
Accelerator's `log_with`: the user's tracker (wandb or tensorboard) plus `RunFiles`, which leaves
files that stay readable without any service:
    config.json     the resolved configuration               (accelerator.init_trackers)
    metrics.jsonl   one JSON object per accelerator.log call  (accelerator.log)
    summary.json    the last value of every logged key, like wandb's run summary
    curves.png      loss, accuracy and gradient norm against step (both at accelerator.end_training)
"""

from __future__ import annotations

import dataclasses
import json
import math
import netrc
import os
import platform
import resource
import shutil
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

import torch
from accelerate import PartialState
from accelerate.tracking import GeneralTracker, TensorBoardTracker, WandBTracker, on_main_process
from accelerate.utils import broadcast_object_list

from shared.checkpoints import find_checkpoint
from shared.errors import RecipeError, first_line

RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "curves.png", "confusion_matrix.png", "misclassified.png",
             "model.safetensors", "checkpoints", "wandb", "tensorboard")


def make_run_dir(cfg, recipe: str) -> Path:
    """--output_dir, the run being resumed, or runs/<recipe>-<YYYYmmdd-HHMMSS>; created by the main process."""
    state = PartialState()
    output_dir = cfg.output_dir
    if output_dir is None and cfg.resume:
        output_dir = find_checkpoint(None, cfg.resume, recipe).parents[1]
    if output_dir is None:
        stamp = [time.strftime("%Y%m%d-%H%M%S")]
        broadcast_object_list(stamp)  # processes start a second apart; they must share one folder
        output_dir = f"runs/{recipe}{'-synthetic' if cfg.synthetic else ''}-{stamp[0]}"
    run_dir = Path(output_dir)
    if (run_dir / "config.json").exists() and not (cfg.resume or cfg.overwrite):
        raise RecipeError(f"{run_dir} already holds a run: pass --resume latest to continue it, "
                          "--overwrite to replace it, or another --output_dir")
    if state.is_main_process:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / ".write_test").touch()
            (run_dir / ".write_test").unlink()
        except OSError as error:
            raise RecipeError(f"cannot write to {run_dir} ({error.strerror}): "
                              "pass --output_dir to a writable folder") from None
        if cfg.overwrite and not cfg.resume:
            for name in RUN_FILES:  # only what a run writes; anything else in the folder stays
                path = run_dir / name
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    state.wait_for_everyone()
    return run_dir


def trackers(cfg, run_dir: Path, recipe: str) -> list:
    """Accelerator(log_with=...): wandb or TensorBoard (or neither), plus the run's own files.

    Built before the Accelerator, from what the launcher put in the environment. A resumed run
    keeps its run id (from config.json), so it continues the same wandb run."""
    previous = run_dir / "config.json"
    run_id = json.loads(previous.read_text()).get("run_id") if cfg.resume and previous.exists() else None
    run_id = run_id or uuid.uuid4().hex[:8]
    labels = {"synthetic": True} if cfg.synthetic else {}
    chosen = {
        "wandb": lambda: [WandB(recipe, run_dir, run_id, tags=list(labels))],
        "tensorboard": lambda: [TensorBoard("tensorboard", run_dir)],  # writes run_dir/tensorboard/
        "none": lambda: [],
    }[cfg.tracker]()
    return chosen + [RunFiles(run_dir, run_id, labels)]


class WandB(WandBTracker):
    """accelerate's wandb tracker, with the optimizer step as the x-axis of every chart.

    The step travels as a logged value ("step", declared the x-axis with define_metric) rather than
    as wandb's own step counter: a run resumed from its last checkpoint logs again the steps that
    came after it, and wandb silently drops any point whose own step goes backwards."""

    def __init__(self, project: str, run_dir: Path, run_id: str, tags: list[str]):
        super().__init__(project, dir=str(run_dir), id=run_id, resume="allow", mode=wandb_mode(), tags=tags)

    @on_main_process
    def start(self):
        try:
            super().start()
        except Exception as error:  # no network, server down, bad key: training matters more than the dashboard
            if self.init_kwargs["mode"] != "online":
                raise
            print(f"warning: wandb could not start online ({type(error).__name__}: {first_line(error)[:150]}); "
                  "logging offline instead, upload later with `wandb sync`", file=sys.stderr, flush=True)
            import wandb

            wandb.teardown()  # the failed attempt still holds the run id in wandb's background service
            self.init_kwargs["mode"] = "offline"
            super().start()
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    @on_main_process
    def store_init_configuration(self, values: dict):
        # Named from the configuration the run actually uses (--auto_batch_size settles the batch size
        # after this tracker is built): <recipe>-<processes>x<precision>-b<global batch>-<time>.
        self.run.name = (f"{values['recipe']}-{values['world_size']}x{values['mixed_precision']}"
                         f"-b{values['global_batch_size']}{'-synthetic' if values.get('synthetic') else ''}"
                         f"-{time.strftime('%m%d-%H%M')}")
        super().store_init_configuration(values)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        self.run.log({**values, "step": step}, **kwargs)


class TensorBoard(TensorBoardTracker):
    """accelerate's TensorBoard tracker, with the config flattened to what hparams accept."""

    @on_main_process
    def store_init_configuration(self, values: dict):
        super().store_init_configuration({key: value if isinstance(value, (int, float, str, bool)) else str(value)
                                          for key, value in values.items()})


def wandb_mode() -> str:
    """WANDB_MODE if set; online with an API key (env or `wandb login`'s netrc entry); else offline."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return "online" if netrc.netrc().authenticators(host) else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


def run_config(cfg, accelerator, run_dir: Path, **extra) -> dict:
    """What config.json and the tracker record: every flag, the run folder, the launch, and the versions."""
    import accelerate
    import datasets

    return {
        **dataclasses.asdict(cfg), "output_dir": str(run_dir), **extra,
        "world_size": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "distributed_type": accelerator.distributed_type.value,
        "device": str(accelerator.device),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "accelerate": accelerate.__version__, "datasets": datasets.__version__},
    }


class TrainWindow:
    """What happened since the last log point: mean training loss, accuracy, gradient norm and samples per second.

    Losses and gradient norms are summed on the device, so a step never waits for the GPU; `flush()` synchronizes
    once per log point. Time spent inside `paused()` (evaluation, checkpoints) is left out.
    """

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.loss_sum, self.batches = torch.zeros((), device=accelerator.device), 0
        self.correct = torch.zeros((), device=accelerator.device, dtype=torch.long)
        self.grad_norm_sum = torch.zeros((), device=accelerator.device)
        self.grad_norm_steps = torch.zeros((), device=accelerator.device, dtype=torch.long)
        self.samples = self.total_samples = 0
        self.seconds = self.total_seconds = 0.0
        self.started = time.perf_counter()

    def add(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self.loss_sum += loss.detach()  # detach: summing `loss` itself would keep every step's graph alive
        self.correct += (logits.detach().argmax(dim=1) == labels).sum()
        self.batches += 1
        self.samples += len(labels) * self.accelerator.num_processes

    def add_grad_norm(self, grad_norm: torch.Tensor) -> None:
        """The gradient norm of one optimizer step, before clipping (the same on every process). An infinite
        one (a step the fp16 gradient scaler skips) is left out of the mean."""
        finite = torch.isfinite(grad_norm)
        self.grad_norm_sum += torch.where(finite, grad_norm.detach(), 0.0)
        self.grad_norm_steps += finite

    def flush(self, step: int) -> dict:
        """train_loss, train_acc, grad_norm and samples_per_s over the window and all processes; starts a new one."""
        train_loss = (self.accelerator.reduce(self.loss_sum, "mean") / max(self.batches, 1)).item()
        train_acc = self.accelerator.reduce(self.correct, "sum").item() / max(self.samples, 1)
        grad_norm = (self.grad_norm_sum / self.grad_norm_steps.clamp(min=1)).item()
        if not math.isfinite(train_loss):
            raise RecipeError(f"the training loss became {train_loss} by step {step}: lower --lr; "
                              "checkpoints already on disk hold finite weights")
        self._clock()
        rate = self.samples / max(self.seconds, 1e-9)
        self.total_samples, self.total_seconds = self.total_samples + self.samples, self.total_seconds + self.seconds
        self.loss_sum.zero_()
        self.correct.zero_()
        self.grad_norm_sum.zero_()
        self.grad_norm_steps.zero_()
        self.batches, self.samples, self.seconds = 0, 0, 0.0
        return {"train_loss": train_loss, "train_acc": train_acc, "grad_norm": grad_norm, "samples_per_s": rate}

    @contextmanager
    def paused(self):
        self._clock()
        yield
        self.started = time.perf_counter()

    def overall_samples_per_s(self) -> float:
        self._clock()
        return (self.total_samples + self.samples) / max(self.total_seconds + self.seconds, 1e-9)

    def _clock(self) -> None:
        now = time.perf_counter()
        self.seconds += now - self.started
        self.started = now


def run_summary(accelerator, progress, window: "TrainWindow", wall_s: float, epochs: float, data: str) -> dict:
    """What summary.json reports beyond the last logged values (see RECIPES.md)."""
    return {"best_eval_acc": progress.best_eval_acc, "steps": progress.step, "epochs": epochs, "wall_s": wall_s,
            "samples_per_s": window.overall_samples_per_s(), "peak_mem_mb": peak_memory_mb(accelerator.device),
            "world_size": accelerator.num_processes, "mixed_precision": accelerator.mixed_precision, "data": data}


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: allocated GPU memory on CUDA, resident memory on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux reports KiB


class RunFiles(GeneralTracker):
    """An accelerate tracker that writes the run's readable files (main process only)."""

    name = "run_files"
    requires_logging_directory = False

    def __init__(self, run_dir: Path, run_id: str, labels: dict):
        super().__init__()
        self.run_dir, self.run_id, self.labels, self.summary = Path(run_dir), run_id, labels, {}
        self.metrics = self.run_dir / "metrics.jsonl"

    @property
    def tracker(self):
        return self

    def store_init_configuration(self, values: dict):
        resumed_step = values.get("resumed_step")
        write_json(self.run_dir / "config.json", {**values, "run_id": self.run_id})
        if resumed_step is not None and self.metrics.exists():
            # Points logged after the checkpoint will be logged again: keep the file up to it.
            rows = [row for row in read_jsonl(self.metrics) if row["step"] <= resumed_step]
            self.metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))

    def log(self, values: dict, step: int | None = None, **kwargs):
        with self.metrics.open("a") as f:
            f.write(json.dumps({"step": step, **values, **self.labels}) + "\n")
        self.summary.update(values)

    def finish(self):
        write_json(self.run_dir / "summary.json", {**self.summary, **self.labels})
        title = self.run_dir.name + (" (SYNTHETIC DATA)" if self.labels.get("synthetic") else "")
        plot_curves(read_jsonl(self.metrics), self.run_dir / "curves.png", title)
        offline_runs = sorted((self.run_dir / "wandb").glob("offline-run-*"))
        if offline_runs:
            print(f"wandb ran offline; upload the run with: wandb sync {offline_runs[-1]}")


def write_json(path: Path, values: dict) -> None:
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(values, indent=2, default=str) + "\n")
    os.replace(partial, path)  # readers never see half a file


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_curves(rows: list[dict], path: Path, title: str) -> None:
    """Loss (train and eval), accuracy (train and eval) and the gradient norm against optimizer step."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, (loss_ax, acc_ax, norm_ax) = plt.subplots(1, 3, figsize=(15, 4))
    for key, ax in (("train_loss", loss_ax), ("eval_loss", loss_ax), ("train_acc", acc_ax), ("eval_acc", acc_ax),
                    ("grad_norm", norm_ax)):
        points = [(row["step"], row[key]) for row in rows if key in row and row.get("step") is not None]
        if points:
            ax.plot(*zip(*points), marker="o" if key.startswith("eval") else None, markersize=3, label=key)
    loss_ax.set(xlabel="optimizer step", ylabel="cross-entropy loss")
    acc_ax.set(xlabel="optimizer step", ylabel="accuracy", ylim=(0, 1))
    norm_ax.set(xlabel="optimizer step", ylabel="gradient L2 norm, before clipping")
    for ax in (loss_ax, acc_ax, norm_ax):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
