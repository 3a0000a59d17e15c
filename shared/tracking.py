"""The run folder and its files, written through accelerate's tracker interface.

`make_run_dir` picks the folder, the same on every process. `trackers(cfg, run_dir)` is the
Accelerator's `log_with`: the user's tracker (wandb or tensorboard) plus `RunFiles`, which leaves
files that stay readable without any service:
    config.json     the resolved configuration               (accelerator.init_trackers)
    metrics.jsonl   one JSON object per accelerator.log call  (accelerator.log)
    summary.json    the last value of every logged key, like wandb's run summary
    curves.png      loss and accuracy against step            (both at accelerator.end_training)
"""

from __future__ import annotations

import dataclasses
import json
import netrc
import os
import platform
import resource
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

import torch
from accelerate import PartialState
from accelerate.tracking import GeneralTracker
from accelerate.utils import broadcast_object_list

from shared.checkpoints import find_checkpoint
from shared.errors import RecipeError

RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "curves.png", "model.safetensors", "checkpoints", "wandb", "tensorboard")


def make_run_dir(cfg, recipe: str) -> Path:
    """--output_dir, the run being resumed, or runs/<recipe>-<YYYYmmdd-HHMMSS>; created by the main process."""
    state = PartialState()
    if cfg.output_dir is None and cfg.resume:
        cfg.output_dir = str(find_checkpoint(None, cfg.resume, recipe).parents[1])
    if cfg.output_dir is None:
        stamp = [time.strftime("%Y%m%d-%H%M%S")]
        broadcast_object_list(stamp)  # processes start a second apart; they must share one folder
        cfg.output_dir = f"runs/{recipe}{'-synthetic' if cfg.synthetic else ''}-{stamp[0]}"
    run_dir = Path(cfg.output_dir)
    if (run_dir / "config.json").exists() and not (cfg.resume or cfg.overwrite):
        raise RecipeError(f"{run_dir} already holds a run: pass --resume latest to continue it, "
                          "--overwrite to replace it, or another --output_dir")
    if state.is_main_process:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / ".write_test").touch()
            (run_dir / ".write_test").unlink()
        except OSError as error:
            raise RecipeError(f"cannot write to {run_dir} ({error.strerror}): pass --output_dir to a writable folder") from None
        if cfg.overwrite and not cfg.resume:
            for name in RUN_FILES:  # only what a run writes; anything else in the folder stays
                path = run_dir / name
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    state.wait_for_everyone()
    return run_dir


def trackers(cfg, run_dir: Path) -> list:
    """Accelerator(log_with=...): the chosen tracker plus the run's own files."""
    chosen = [] if cfg.tracker == "none" else [cfg.tracker]
    return chosen + [RunFiles(run_dir, labels={"synthetic": True} if cfg.synthetic else {})]


def tracker_kwargs(cfg, run_dir: Path, run_name: str) -> dict:
    """init_trackers(init_kwargs=...): where each tracker writes and what it calls the run."""
    if cfg.tracker == "wandb":
        tags = ["synthetic"] if cfg.synthetic else []
        return {"wandb": {"name": run_name, "dir": str(run_dir), "mode": wandb_mode(), "tags": tags}}
    return {}


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


def run_config(cfg, accelerator, **extra) -> dict:
    """What config.json and the tracker record: every flag, the launch, and the versions."""
    import accelerate
    import datasets

    return {
        **dataclasses.asdict(cfg), **extra,
        "world_size": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "distributed_type": accelerator.distributed_type.value,
        "device": str(accelerator.device),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "accelerate": accelerate.__version__, "datasets": datasets.__version__},
    }


class Throughput:
    """Training samples per second, leaving out the time spent evaluating and checkpointing."""

    def __init__(self):
        self.samples = self.window_samples = 0
        self.seconds = self.window_seconds = 0.0
        self.started = time.perf_counter()

    def count(self, samples: int) -> None:
        self.window_samples += samples

    def _close_window(self) -> None:
        now = time.perf_counter()
        self.window_seconds += now - self.started
        self.started = now

    def window(self) -> float:
        """Samples/s since the last call; call it where the GPU was just synchronized (after .item())."""
        self._close_window()
        rate = self.window_samples / max(self.window_seconds, 1e-9)
        self.samples += self.window_samples
        self.seconds += self.window_seconds
        self.window_samples, self.window_seconds = 0, 0.0
        return rate

    @contextmanager
    def paused(self):
        self._close_window()
        yield
        self.started = time.perf_counter()

    def overall(self) -> float:
        self.window()
        return self.samples / max(self.seconds, 1e-9)


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: allocated GPU memory on CUDA, resident memory on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux reports KiB


class RunFiles(GeneralTracker):
    """An accelerate tracker that writes the run's readable files (main process only)."""

    name = "run_files"
    requires_logging_directory = False

    def __init__(self, run_dir: Path, labels: dict):
        super().__init__()
        self.run_dir, self.labels, self.summary = Path(run_dir), labels, {}
        self.metrics = self.run_dir / "metrics.jsonl"

    @property
    def tracker(self):
        return self

    def store_init_configuration(self, values: dict):
        write_json(self.run_dir / "config.json", values)
        resumed_step = values.get("resumed_step")
        if resumed_step is None:
            self.metrics.unlink(missing_ok=True)
        elif self.metrics.exists():
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
    """Loss (train and eval) and eval accuracy against optimizer step."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for key, ax in (("train_loss", loss_ax), ("eval_loss", loss_ax), ("eval_acc", acc_ax)):
        points = [(row["step"], row[key]) for row in rows if key in row and row.get("step") is not None]
        if points:
            ax.plot(*zip(*points), marker="o" if key.startswith("eval") else None, markersize=3, label=key)
    loss_ax.set(xlabel="optimizer step", ylabel="cross-entropy loss")
    acc_ax.set(xlabel="optimizer step", ylabel="test accuracy", ylim=(0, 1))
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
