"""What a run records: its folder, wandb or TensorBoard, and files readable without any service.

`open_run` picks the folder (the same on every process) and builds the Accelerator's `log_with`: the user's
tracker plus `RunFiles`, which writes config.json (at init_trackers), metrics.jsonl (one line per
accelerator.log), summary.json (the last value of every key, like wandb's run summary) and curves.png (at
end_training). `TrainWindow` measures training between log points.
"""

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
from accelerate.utils import broadcast_object_list, gather_object

from shared.diagnostics import plot_curves
from shared.errors import RecipeError, check_launch, first_line
from shared.resume import find_checkpoint
from shared.schedule import SCHEDULE_RULE

HEARTBEAT_S = 30  # without a terminal, TrainWindow.heartbeat prints a line at least this often
# What a run writes (misclassified.png and profile/: what earlier versions wrote), and all --overwrite deletes.
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "curves.png", "confusion_matrix.png", "misclassified.png",
             "model.safetensors", "checkpoints", "wandb", "tensorboard", "profile", "abandoned")


def open_run(cfg, recipe: str) -> tuple[Path, list]:
    """Check the launch; return the run folder (--output_dir, the run being resumed, or
    runs/<recipe>-<YYYYmmdd-HHMMSS>) and the trackers for Accelerator(log_with=...)."""
    check_launch()  # also starts the process group, which the folder's name is broadcast over
    state = PartialState()
    if cfg.resume == "latest" and cfg.output_dir is None:  # never a guess at which run the user meant
        raise RecipeError(f"--resume latest needs the run to continue: add --output_dir runs/{recipe}-<time>")
    output_dir = cfg.output_dir
    if cfg.resume and cfg.resume != "latest":  # a checkpoint folder: it continues its own run, or a new one
        checkpoint = find_checkpoint(None, cfg.resume).resolve()
        its_run = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None
        if output_dir is None and not (its_run and is_run(its_run)):
            raise RecipeError(f"--resume {cfg.resume} is not in a run's checkpoints/ folder, so there is no run to "
                              "continue in: add --output_dir NEW_FOLDER to continue it there as a new run")
        output_dir = output_dir or its_run
        if Path(output_dir).resolve() != its_run and (Path(output_dir) / "config.json").exists():
            raise RecipeError(f"--resume {cfg.resume} is not a checkpoint of {output_dir}, which holds another run: "
                              "pass a new --output_dir to continue the checkpoint there (two histories never mix)")
    if output_dir is None:
        stamp = [time.strftime("%Y%m%d-%H%M%S")]
        broadcast_object_list(stamp)  # processes start a second apart; they must share one folder
        output_dir = f"runs/{recipe}{'-synthetic' if cfg.synthetic else ''}-{stamp[0]}"
    run_dir = Path(output_dir)
    if (run_dir / "config.json").exists() and not (cfg.resume or cfg.overwrite):
        raise RecipeError(f"{run_dir} already holds a run: pass --resume latest to continue it, "
                          "--overwrite to replace it, or another --output_dir")
    filled = run_dir.is_dir() and any(run_dir.iterdir())
    if filled and not is_run(run_dir):  # a user's own folder: its metrics.jsonl would be appended to
        raise RecipeError(f"{run_dir} holds files but no run of these recipes (no config.json with a run_id), so "
                          "nothing is written into it: pass a new or empty --output_dir")
    overwrite = cfg.overwrite and not cfg.resume and filled
    state.wait_for_everyone()  # every process has read the folder before the main process changes it
    if state.is_main_process:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / ".write_test").touch()
            (run_dir / ".write_test").unlink()
        except OSError as error:
            raise RecipeError(f"cannot write to {run_dir} ({error.strerror}): pass --output_dir to a writable folder"
                              ) from None
        if overwrite:
            for path in (run_dir / name for name in RUN_FILES):  # only what a run writes; the rest stays
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    state.wait_for_everyone()
    # A resumed run keeps its run id (from config.json), so it continues the same wandb run.
    check_shared(run_dir)
    run_id = json.loads((run_dir / "config.json").read_text())["run_id"] if cfg.resume and is_run(run_dir) else None
    run_id, labels = run_id or uuid.uuid4().hex[:8], {"synthetic": True} if cfg.synthetic else {}
    chosen = {"wandb": lambda: [WandB(recipe, run_dir, run_id, tags=list(labels))],
              "tensorboard": lambda: [TensorBoard("tensorboard", run_dir)], "none": lambda: []}[cfg.tracker]()
    # RunFiles first: its config.json makes the folder a run before wandb or TensorBoard write into it, so a job
    # stopped between the two is still a run to its next start.
    return run_dir, [RunFiles(run_dir, run_id, labels)] + chosen


def check_shared(run_dir: Path) -> None:
    """On several machines: refuse a run folder the nodes do not share (a file the main process writes must be seen
    by all), since only the main process writes the run's files and completes its checkpoints."""
    state = PartialState()
    if state.num_processes == int(os.environ.get("LOCAL_WORLD_SIZE", state.num_processes)):
        return  # one machine
    token, check = [uuid.uuid4().hex], run_dir / ".shared_check"
    broadcast_object_list(token)
    if state.is_main_process:
        check.write_text(token[0])
    state.wait_for_everyone()
    seen = gather_object([check.is_file() and check.read_text() == token[0]])
    if state.is_main_process:
        check.unlink()
    if not all(seen):
        raise RecipeError(f"--output_dir {run_dir} is not one folder shared by every node ({seen.count(False)} "
                          "process(es) do not see the main process's files): put it on a filesystem all nodes mount")


def is_run(folder: Path) -> bool:
    """Whether `folder` holds a run of these recipes: its config.json, with the run id every run records."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("run_id"), str) and "recipe" in config


class WandB(WandBTracker):
    """accelerate's wandb tracker, offline without an API key, with the optimizer step as every chart's x-axis.

    The step travels as a logged value ("step", the x-axis by define_metric), not as wandb's own step counter: a
    resumed run logs again the steps after its checkpoint, and wandb drops points whose own step goes backwards."""

    def __init__(self, project: str, run_dir: Path, run_id: str, tags: list[str]):
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else None)
        if mode is None:  # `wandb login` writes the key into ~/.netrc
            host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
            try:
                mode = "online" if netrc.netrc().authenticators(host) else "offline"
            except (OSError, netrc.NetrcParseError):
                mode = "offline"
        super().__init__(project, dir=str(run_dir), id=run_id, resume="allow", mode=mode, tags=tags)

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
        # Named from the configuration the run records: its launch, precision and global batch.
        self.run.name = (f"{values['recipe']}-{values['world_size']}x{values['mixed_precision']}"
                         f"-b{values['global_batch_size']}{'-synthetic' if values.get('synthetic') else ''}"
                         f"-{time.strftime('%m%d-%H%M')}")
        super().store_init_configuration(values)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        self.run.log({**values, "step": step}, **kwargs)


class TensorBoard(TensorBoardTracker):
    """accelerate's TensorBoard tracker, one run and one history per run folder: the flags go into the run's own
    event file (add_hparams writes them as a second run, pytorch#32651); a resume hides the events logged after its
    checkpoint (a branch's abandoned points, a piece killed after its checkpoint) with SummaryWriter's purge_step;
    the summary's one-point scalars stay in summary.json."""

    @on_main_process
    def store_init_configuration(self, values: dict):
        from torch.utils.tensorboard.summary import hparams

        if values.get("resumed_step") is not None:
            self.writer.close()
            self.writer = type(self.writer)(self.logging_dir, purge_step=values["resumed_step"] + 1)
        flags = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in values.items()}
        for summary in hparams(flags, {}):  # hparams take numbers, strings and booleans only
            self.writer.file_writer.add_summary(summary)
        self.writer.flush()

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        if "pieces" not in values:  # the summary (TrainWindow.summary): one point per key
            super().log(values, step=step, **kwargs)


def run_config(cfg, accelerator, run_dir: Path, **extra) -> dict:
    """What config.json and the tracker record: every flag, the run folder, the launch and the versions."""
    import accelerate

    return {**dataclasses.asdict(cfg), "output_dir": str(run_dir), **extra, "lr_schedule": SCHEDULE_RULE,
            "world_size": accelerator.num_processes, "mixed_precision": accelerator.mixed_precision,
            "distributed_type": accelerator.distributed_type.value, "device": str(accelerator.device),
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "accelerate": accelerate.__version__,  # datasets: None when this run's data needed none
                         "datasets": getattr(sys.modules.get("datasets"), "__version__", None)}}


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

    def add(self, loss: torch.Tensor, metric_sums: dict[str, torch.Tensor], samples: int) -> None:
        """One batch of this process: its mean loss, the recipe's metrics summed over it, and its size."""
        self.losses.append(loss.detach())  # detach: keeping `loss` itself would keep every step's graph alive
        for name, value in metric_sums.items():
            self.sums.setdefault(name, []).append(value.detach())
        self.batches += 1
        self.samples += samples * self.accelerator.num_processes
        self.progress.train_samples += samples * self.accelerator.num_processes

    def add_grad_norm(self, grad_norm: torch.Tensor) -> None:
        """One step's norm before clipping; an infinite one (a step fp16's scaler skips) stays out of the mean."""
        self.grad_norms.append(grad_norm.detach())

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
                "world_size": self.accelerator.num_processes, "mixed_precision": self.accelerator.mixed_precision}


def total(values: list[torch.Tensor], device=None) -> torch.Tensor:
    """The sum of a window's per-step values, in one operation: 0 on `device` for an empty window."""
    return torch.stack(values).sum(0) if values else torch.zeros((), device=device)


class RunFiles(GeneralTracker):
    """An accelerate tracker that writes the run's readable files (main process only)."""

    name, requires_logging_directory = "run_files", False

    def __init__(self, run_dir: Path, run_id: str, labels: dict):
        self.tracker = self  # what accelerator.get_tracker("run_files", unwrap=True) returns
        super().__init__()
        self.run_dir, self.run_id, self.labels, self.summary = Path(run_dir), run_id, labels, {}
        self.metrics = self.run_dir / "metrics.jsonl"

    def store_init_configuration(self, values: dict):
        write_json(self.run_dir / "config.json", {**values, "run_id": self.run_id})
        step = values.get("resumed_step")
        if step is not None and self.metrics.exists():
            # The points after the checkpoint will be logged again, and so will those of its own step logged after
            # it was written (an epoch's or the run's evaluation, the summary): keep the file up to its training point.
            rows = [row for row in read_jsonl(self.metrics) if row["step"] < step or row["step"] == step
                    and "train_loss" in row]
            self.metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))

    def log(self, values: dict, step: int | None = None, **kwargs):
        with self.metrics.open("a") as f:
            f.write(json.dumps({"step": step, **values, **self.labels}) + "\n")
        self.summary.update(values, step=step)  # the last logged step: a run stopped early says where it stopped

    def finish(self):
        write_json(self.run_dir / "summary.json", {**self.summary, **self.labels})
        plot_curves(read_jsonl(self.metrics), self.run_dir / "curves.png",
                    self.run_dir.name + (" (SYNTHETIC DATA)" if self.labels else ""))
        offline_runs = sorted((self.run_dir / "wandb").glob("offline-run-*"))
        if offline_runs:
            print(f"wandb ran offline; upload the run with: wandb sync {offline_runs[-1]}")


def write_json(path: Path, values: dict) -> None:
    partial = path.with_suffix(".tmp")
    partial.unlink(missing_ok=True)  # a link left there (a run folder from anywhere) goes, and is never written through
    partial.write_text(json.dumps(values, indent=2, default=str) + "\n")
    os.replace(partial, path)  # readers never see half a file


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
