"""What a run records:

- `open_run` picks the run's folder (the same on every process and every node; a new, empty or resumable one) and
  builds the Accelerator's `log_with`: the user's tracker plus `RunFiles`;
- `RunFiles`, an accelerate tracker writing the files readable without any service: config.json (at
  init_trackers), metrics.jsonl (one line per accelerator.log), summary.json (the last value of every key, like
  wandb's run summary) and curves.png (at end_training, drawn by shared/pictures.py, an opt-in module);
- wandb (offline without an API key) as accelerate's tracker (TensorBoard: shared/tensorboard_tracker.py, an opt-in
  module), and `run_config`, what config.json and the tracker record;
- `TrainWindow`: training between log points, and the run's time and samples across its pieces.
"""

import atexit
import contextlib
import dataclasses
import fcntl
import json
import math
import netrc
import os
import platform
import resource
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlparse

import psutil
import torch
from accelerate import PartialState
from accelerate.tracking import GeneralTracker, WandBTracker, on_main_process
from accelerate.utils import broadcast_object_list
from tqdm import tqdm

from shared.checkpoints import launcher_command, new_folder, run_id
from shared.errors import RecipeError, replacing
from shared.loop import SCHEDULE_RULE

# What a run writes (misclassified.png and profile/: what earlier versions wrote), and all --overwrite deletes.
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "curves.png", "confusion_matrix.png", "misclassified.png",
             "model.safetensors", "checkpoints", "wandb", "tensorboard", "profile", "abandoned", "finished")
_LOCKS: dict[Path, int] = {}  # run folder -> its open descriptor, locked while this process runs in it
HEARTBEAT_S = 30  # without a terminal, TrainWindow.heartbeat prints a line at least this often
ESTIMATE_S, ESTIMATE_STEPS = 10, 20  # the time a run takes is said after this much of it (heartbeat)
# No monitor thread behind the progress bars (it only retunes the refresh rate of a bar that stalls): under `ulimit -v`
# its start hung the run for ever, a thread that never began while tqdm held its lock (a 4.5 GB address space here).
tqdm.monitor_interval = 0
# A thread lock for the bars (one process draws them), not tqdm's default, which holds a multiprocessing lock: under
# Python 3.14's default start method (forkserver) its semaphore is registered with a resource tracker, a process of its
# own, which printed a "leaked semaphore" warning after the run's last line where the run ended without Python's exit
# (a second Ctrl-C, a kill; tqdm #1677).
tqdm.set_lock(threading.RLock())


def open_run(cfg, recipe: str) -> tuple[Path, list]:
    """Check the launch; return the run folder (--output_dir, the run being resumed, or
    runs/<recipe>-<YYYYmmdd-HHMMSS>) and the trackers for Accelerator(log_with=...)."""
    from shared.launch import check_cpu, check_launch  # the launch's settings, checked: an opt-in module

    check_launch()  # also starts the process group, which the folder's name is broadcast over, and ties this
    # process to its launcher's life (a SIGTERM when the launcher dies: shared/launch.py's stop_with_launcher)
    state = PartialState()
    if state.device.type == "cpu" and state.is_main_process:  # training where a GPU was meant, or bf16 emulated
        check_cpu()
    output_dir = cfg.output_dir
    if cfg.resume and cfg.resume != "latest":  # a checkpoint folder: it continues its own run, or a new one
        from shared.resume import run_of_checkpoint  # only the runs that resume: an opt-in module

        output_dir = run_of_checkpoint(cfg)
    if output_dir is None:
        name, stamp = [None], time.strftime("%Y%m%d-%H%M%S")
        if state.is_main_process:
            name = [new_folder(f"runs/{recipe}{'-synthetic' if cfg.synthetic else ''}-{stamp}")]
        broadcast_object_list(name)  # processes start a second apart; they must share one folder
        output_dir = name[0]
    run_dir = Path(output_dir)
    filled = run_dir.is_dir() and any(run_dir.iterdir())
    if filled:  # a run to resume or replace, checked (only the runs in a folder with files: an opt-in module)
        from shared.resume import check_run_folder

        check_run_folder(run_dir, cfg, recipe)
    # --checkpoint_dir: this run's checkpoints (resumed), the replaced run's (--overwrite), or nothing. Read where it is
    # written: a node's own folder is refused below.
    mine, its_checkpoints = run_id(run_dir), []
    if cfg.checkpoint_dir and state.is_main_process:
        from shared.resume import check_checkpoint_folder  # only the runs given a --checkpoint_dir: an opt-in module

        its_checkpoints = check_checkpoint_folder(cfg.checkpoint_dir, mine, run_dir)
    state.wait_for_everyone()  # every process has read the folder before the main process changes it
    if state.is_main_process:
        if cfg.output_dir is None or not run_dir.exists():  # made by this start (new_folder made the default one)
            atexit.register(remove_unless_run, run_dir)  # a start that fails before config.json leaves no folder
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            lock(run_dir)
            probe = run_dir / ".write_test"
            probe.touch()
            probe.unlink()
        except OSError as error:
            raise RecipeError(f"cannot write to {run_dir} ({error.strerror}): pass --output_dir a writable folder, "
                              "not a file or a path inside one (a run there: --resume its newest checkpoint)") from None
    state.wait_for_everyone()
    if state.num_processes != int(os.environ.get("LOCAL_WORLD_SIZE", state.num_processes)):  # several machines
        from shared.nodes import check_shared  # only the runs of several nodes: an opt-in module

        check_shared(run_dir, cfg.checkpoint_dir)
    # A resumed run keeps its run id (from config.json), so it continues the same wandb run; a new one, or a checkpoint
    # continued in a new folder, gets its own (a folder that is not a run was refused above)
    run = mine if cfg.resume and mine else uuid.uuid4().hex[:8]
    labels = {"synthetic": True} if cfg.synthetic else {}
    replaced = []  # what --overwrite deletes: only what a run writes (and predict.py of its weights); the rest stays
    if cfg.overwrite and not cfg.resume and filled:
        from shared.resume import predictions  # only the runs that replace one: an opt-in module

        replaced = [*(run_dir / name for name in RUN_FILES), *predictions(run_dir), *its_checkpoints]
    # init_trackers starts every tracker, then gives each the configuration: RunFiles' start deletes what --overwrite
    # replaces before wandb or TensorBoard write anything (they start with the configuration), and its config.json
    # makes the folder a run. wandb before it: settings wandb refuses leave no run folder (remove_unless_run), nor do
    # the wandb/ it began on a disk too full for config.json. TensorBoard after it: its writer's thread, on such a disk,
    # printed its own traceback
    trackers = [RunFiles(run_dir, run, labels, replaced)]
    if cfg.tracker == "wandb":
        trackers.insert(0, WandB(recipe, run_dir, run, tags=list(labels)))
    elif cfg.tracker == "tensorboard":
        from shared.tensorboard_tracker import TensorBoard  # only the runs that ask for it: an opt-in module

        trackers.append(TensorBoard("tensorboard", run_dir))
    return run_dir, trackers


def remove_unless_run(folder: Path) -> None:
    """A folder this start made, left without config.json: empty, or holding only what wandb or TensorBoard began."""
    if not (folder / "config.json").exists():
        shutil.rmtree(folder, ignore_errors=True)


def lock(run_dir: Path) -> None:
    """Hold an exclusive lock on the run folder (flock on the folder itself: no file left behind; the system releases
    it when the process ends, however it ends): a second run started in the same folder stops with one line."""
    key = run_dir.resolve()
    if key in _LOCKS:  # a new run in the same folder within this process (train() called again)
        os.close(_LOCKS.pop(key))
    descriptor = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise RecipeError(f"{run_dir} is in use by another run, still running: wait for it to end, or pass another "
                          "--output_dir") from None
    except OSError:
        pass  # a filesystem without locks (some network mounts): the folder stays unlocked
    _LOCKS[key] = descriptor


class RunFiles(GeneralTracker):
    """An accelerate tracker that writes the run's readable files (main process only)."""

    name, requires_logging_directory = "run_files", False

    def __init__(self, run_dir: Path, run_id: str, labels: dict, replaced: list[Path]):
        self.tracker = self  # what accelerator.get_tracker("run_files", unwrap=True) returns
        super().__init__()
        self.run_dir, self.run_id, self.labels, self.summary = run_dir, run_id, labels, {}
        self.replaced = replaced  # --overwrite: the replaced run's files
        self.metrics = self.run_dir / "metrics.jsonl"
        self.last_evaluation = None  # time.perf_counter() at the last eval_* point

    def start(self):
        # The replaced run is deleted only as this one starts to write: after the checks of its flags, data and
        # weights, so that a mistake among them leaves it whole
        for path in self.replaced:
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)

    def store_init_configuration(self, values: dict):
        if values.get("resumed_step") is not None:  # first: a damaged row stops the resume before any change
            from shared.resume import cut_metrics  # only the runs that resume: an opt-in module

            self.summary = cut_metrics(self, values["resumed_step"])  # the summary so far: its pieces' last values
        write_json(self.run_dir / "config.json", {**values, "run_id": self.run_id})

    def log(self, values: dict, step: int | None = None, **kwargs):
        with self.metrics.open("a") as f:
            f.write(json.dumps({"step": step, **values, **self.labels}) + "\n")
        self.summary.update(values, step=step)  # the last logged step: a run stopped early says where it stopped
        if "eval_loss" in values:
            self.last_evaluation = time.perf_counter()

    def finish(self):
        # A stop (no `steps`: only a run's end logs them) where model.safetensors is a finished run's, which a resume
        # extends: its summary and curves stay, as its weights do, until the longer run finishes (shared/resume.py)
        if "steps" not in self.summary and (self.run_dir / "model.safetensors").exists():
            return
        # finish_s: from the last evaluation to here, the weights and pictures saved (curves.png and the other
        # trackers' ends come after it)
        finish_s = None if self.last_evaluation is None else time.perf_counter() - self.last_evaluation
        write_json(self.run_dir / "summary.json", {**self.summary, "finish_s": finish_s, **self.labels})
        from shared.pictures import plot_curves, read_rows  # matplotlib: an opt-in module

        plot_curves(read_rows(self.metrics), self.run_dir / "curves.png",
                    self.run_dir.name + (" (SYNTHETIC DATA)" if self.labels else ""))


def write_json(path: Path, values: dict) -> None:
    write_atomic(path, [json.dumps(values, indent=2, default=str) + "\n"])


def write_atomic(path: Path, pieces: Iterable[str]) -> None:
    with replacing(path) as partial, partial.open("w") as f:
        f.writelines(pieces)


class WandB(WandBTracker):
    """accelerate's wandb tracker, offline without an API key, with the optimizer step as every chart's x-axis.

    The step travels as a logged value ("step", the x-axis by define_metric), not as wandb's own step counter: a
    resumed run logs again the steps after its checkpoint, and wandb drops points whose own step goes backwards."""

    def __init__(self, project: str, run_dir: Path, run_id: str, tags: list[str]):
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else None)
        if mode not in (None, "online", "offline", "disabled", "dryrun", "run", "shared"):  # wandb's own choices
            raise RecipeError(f"the environment sets WANDB_MODE={mode!r}: wandb takes online, offline or disabled "
                              "(or --tracker tensorboard or none)")
        if mode is None:  # `wandb login` writes the key into ~/.netrc
            host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
            try:
                mode = "online" if netrc.netrc().authenticators(host) else "offline"
            except (OSError, netrc.NetrcParseError):
                mode = "offline"
        import wandb

        # silent: wandb's own dozen lines at the start and a table at the end; where the run is, said once in start().
        # Online but unreachable, wandb waited 90 s before start() could fall back to offline: 10 s, unless set.
        timeout = {} if "WANDB_INIT_TIMEOUT" in os.environ else {"init_timeout": 10}
        super().__init__(project, dir=str(run_dir), id=run_id, resume="allow", mode=mode, tags=tags,
                         settings=wandb.Settings(silent=True, **timeout))

    def start(self):  # wandb starts with the run's configuration (below), after RunFiles' start: see open_run
        pass

    @on_main_process
    def store_init_configuration(self, values: dict):
        try:
            super().start()
        except Exception as error:  # no network, server down, bad key; a WANDB_* setting wandb refuses
            from shared.failures import start_offline  # only a failed start: an opt-in module

            start_offline(self, error)  # where online failed; else one line, or the error again
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        if self.run.offline:  # the folder to upload; disabled, wandb keeps nothing (its run.url warns offline)
            where = (f"offline, in {Path(self.run.dir).parent}; upload it later with: wandb sync "
                     f"{Path(self.run.dir).parent}")
        elif self.run.disabled:
            where = "disabled by WANDB_MODE: nothing is logged there"
        else:
            where = self.run.url
        print(f"wandb: {where}")
        # Named from the configuration the run records: its launch, precision and global batch.
        self.run.name = (f"{values['recipe']}-{values['world_size']}x{values['mixed_precision']}"
                         f"-b{values['global_batch_size']}{'-synthetic' if values.get('synthetic') else ''}"
                         f"-{time.strftime('%m%d-%H%M')}")
        super().store_init_configuration(values)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        self.call("log", {**values, "step": step}, **kwargs)

    @on_main_process
    def finish(self):
        self.call("finish")

    def call(self, method: str, *args, **kwargs):
        """The wandb run's `method`; once wandb's service process is gone (stopped by the signal that stops this run),
        a disabled run's: the stop's checkpoint and the run's own files come first."""
        try:
            getattr(self.run, method)(*args, **kwargs)
        except ConnectionError as error:
            from shared.failures import without_wandb  # only a run whose wandb service stopped: an opt-in module

            self.run = without_wandb(error)


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
        self.first_step_at = None  # time.time() at this launch's first batch
        self.first, self.estimated = None, False  # (step, time.perf_counter()) after this launch's first step
        # On a terminal the recipe draws a progress bar (tqdm, on stderr), else heartbeat() prints a line every
        # HEARTBEAT_S. stdout counts too: from accelerate 1.16, `accelerate launch` of one process passes its
        # process's stderr through a pipe of its own (to keep its end for an error), onto the terminal.
        self.terminal = sys.stderr.isatty() or sys.stdout.isatty()

    def add(self, loss: torch.Tensor, metric_sums: dict, samples: int, grad_norm: torch.Tensor | None = None):
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
        samples *= self.accelerator.num_processes  # every process's batch is as large
        self.samples += samples
        self.progress.train_samples += samples

    def flush(self, step: int) -> dict:
        """train_loss, train_<metric> for each metric, grad_norm and samples_per_s over the window and all processes;
        starts a new window."""
        train_loss = (self.accelerator.reduce(total(self.losses, self.accelerator.device), "mean")
                      / max(self.batches, 1)).item()
        if not math.isfinite(train_loss):
            raise RecipeError(f"the training loss became {train_loss} by step {step}: lower --lr; the checkpoints "
                              "on disk hold finite weights (if a resume from one with a lower --lr diverges again, its "
                              "weights had begun to: start the run again with --overwrite)")
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
        """After each optimizer step. Once, ESTIMATE_S seconds (or ESTIMATE_STEPS steps) after this launch's first
        step, which warms caches up: the time the rest of the training takes at that pace. Without a terminal (a log
        file, a batch job) there is no progress bar: a line at least every HEARTBEAT_S seconds, from the main
        process's own batches (it waits for no other process)."""
        now = time.perf_counter()
        self._clock()  # the training time so far: progress.train_s, evaluations and checkpoints left out
        if self.first is None:
            self.first = (step, self.progress.train_s)
        elif not self.estimated and (self.progress.train_s - self.first[1] >= ESTIMATE_S
                                     or step - self.first[0] >= ESTIMATE_STEPS):
            self.estimated, seconds = True, (self.progress.train_s - self.first[1]) / (step - self.first[0])
            left = seconds * (total_steps - step)
            if self.accelerator.is_main_process:  # tqdm.write: above a progress bar, not through it
                tqdm.write(f"about {f'{left / 60:.0f} min' if left >= 90 else f'{left:.0f} s'} of training left to "
                           f"step {total_steps}, at {seconds:.3g} s a step (steps {self.first[0] + 1}-{step}; "
                           "evaluations and checkpoints come on top)")
        if now - self.last_line < HEARTBEAT_S or self.terminal or not self.accelerator.is_main_process:
            return
        self.last_line = now
        print(f"step {step}/{total_steps}  train_loss {total(self.losses).item() / max(self.batches, 1):.4f}  "
              f"{self.samples / max(self.seconds, 1e-9):.0f} samples/s (since the last log point)")

    @contextlib.contextmanager
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
        return psutil.Process(os.getppid() if launcher_command() else None).create_time()  # None: this process
    except psutil.Error:  # the launcher already gone: this process's own start
        return psutil.Process().create_time()


def total(values: list, device=None) -> torch.Tensor:
    """The sum of a window's per-step values, in one operation: 0 on `device` for an empty window."""
    return torch.stack(values).sum(0) if values else torch.zeros((), device=device)

