"""`TrainWindow`: training between log points, and the run's time and samples across its pieces."""

import math
import os
import resource
import sys
import time
from contextlib import contextmanager

import psutil
import torch

from shared.errors import RecipeError
from shared.stopping import launcher_command

HEARTBEAT_S = 30  # without a terminal, TrainWindow.heartbeat prints a line at least this often


class TrainWindow:
    """Training loss, the recipe's metrics, gradient norm and samples per second since the last log point, kept on the
    device as each step made them (no kernel in a step, no wait for the GPU: `flush()` adds them up and reads them once
    per log point); and the whole run's training time and samples, kept in `progress` (saved with every checkpoint), so
    that a resumed run's summary covers all its pieces. Time inside `paused()` is left out."""

    def __init__(self, accelerator, progress):
        self.accelerator, self.progress = accelerator, progress
        self.losses, self.sums, self.grad_norms = [], {}, []  # per batch or step, on the device
        self.batches = self.samples = self.seconds = 0
        self.started = self.launched = self.last_line = time.perf_counter()
        self.wall_before = progress.wall_s
        self.first_step_at = None  # time.time() at this launch's first batch

    def add(self, loss: torch.Tensor, metric_sums: dict[str, torch.Tensor], samples: int,
            grad_norm: torch.Tensor | None = None) -> None:
        """One batch of this process: its mean loss, the recipe's metrics summed over it, and its size; and the norm of
        the gradient before clipping when the batch completed an optimizer step (an infinite one, a step fp16's scaler
        skips, stays out of the mean)."""
        self.first_step_at = self.first_step_at or time.time()
        self.losses.append(loss.detach())  # detach: keeping `loss` itself would keep every step's graph alive
        for name, value in metric_sums.items():
            self.sums.setdefault(name, []).append(value.detach())
        if grad_norm is not None:
            self.grad_norms.append(grad_norm.detach())
        self.batches += 1
        self.samples += samples * self.accelerator.num_processes
        self.progress.train_samples += samples * self.accelerator.num_processes

    def flush(self, step: int) -> dict:
        """train_loss, train_<metric> for each metric, grad_norm and samples_per_s over the window and all processes;
        starts a new window."""
        train_loss = (self.accelerator.reduce(total(self.losses, self.accelerator.device), "mean")
                      / max(self.batches, 1)).item()
        if not math.isfinite(train_loss):
            raise RecipeError(f"the training loss became {train_loss} by step {step}: lower --lr; "
                              "checkpoints already on disk hold finite weights")
        self._clock()
        norms = torch.stack(self.grad_norms) if self.grad_norms else torch.zeros(0)
        finite = norms.isfinite()
        point = {"train_loss": train_loss, **{f"train_{name}": self.accelerator.reduce(total(values), "sum").item()
                                              / max(self.samples, 1) for name, values in self.sums.items()},
                 "grad_norm": (torch.where(finite, norms, 0.0).sum() / finite.sum().clamp(min=1)).item(),
                 "samples_per_s": self.samples / max(self.seconds, 1e-9)}
        self.losses, self.sums, self.grad_norms, self.batches, self.samples, self.seconds = [], {}, [], 0, 0, 0
        return point

    def heartbeat(self, step: int, total_steps: int) -> None:
        """Without a terminal (a log file, a batch job) there is no progress bar: a line at least every HEARTBEAT_S
        seconds, from the main process's own batches (it waits for no other process)."""
        now = time.perf_counter()
        if now - self.last_line < HEARTBEAT_S or sys.stderr.isatty() or not self.accelerator.is_main_process:
            return
        self._clock()
        self.last_line = now
        print(f"step {step}/{total_steps}  train_loss {total(self.losses).item() / max(self.batches, 1):.4f}  "
              f"{self.samples / max(self.seconds, 1e-9):.0f} samples/s (since the last log point)", flush=True)

    @contextmanager
    def paused(self):
        self._clock()  # the run's times up to now, for a checkpoint saved inside
        yield
        self.started = time.perf_counter()

    def _clock(self) -> None:
        """Training time since the last call into the window and the run's totals; the run's wall time up to now."""
        now = time.perf_counter()
        self.seconds += now - self.started
        self.progress.train_s += now - self.started
        self.progress.wall_s = self.wall_before + now - self.launched
        self.started = now

    def summary(self, epochs: float, data: str) -> dict:
        """What summary.json reports beyond the last logged values (docs/recipe_contract.md): the whole run, over
        all its pieces (each resume is one more), but peak_mem_mb (this launch's)."""
        self._clock()
        device, progress = self.accelerator.device, self.progress
        peak_mem_mb = (torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda"  # else resident
                       else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10)  # memory; Linux counts KiB
        return {"max_eval_acc": progress.max_eval_acc, "steps": progress.step, "epochs": epochs, "data": data,
                "pieces": progress.pieces, "wall_s": progress.wall_s, "train_s": progress.train_s,
                "samples_per_s": progress.train_samples / max(progress.train_s, 1e-9), "peak_mem_mb": peak_mem_mb,
                "world_size": self.accelerator.num_processes, "mixed_precision": self.accelerator.mixed_precision,
                "start_s": (self.first_step_at or time.time()) - command_started()}


def command_started() -> float:
    """When the command started, as time.time(): under `accelerate launch` its launcher (this process's parent, found
    as the resume command finds it), else this process."""
    try:
        return psutil.Process(os.getppid() if launcher_command() else os.getpid()).create_time()
    except psutil.Error:  # the launcher already gone: this process's own start
        return psutil.Process().create_time()


def total(values: list[torch.Tensor], device=None) -> torch.Tensor:
    """The sum of a window's per-step values, in one operation: 0 on `device` for an empty window."""
    return torch.stack(values).sum(0) if values else torch.zeros((), device=device)
