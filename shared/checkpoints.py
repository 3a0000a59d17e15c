"""Full-state checkpoints (saved here; found, checked and loaded by shared/resume.py, an opt-in module), the run's
progress, the final weights file (model.safetensors), the stop on a signal, and whether a folder is a run of these
recipes.

A checkpoint is `accelerator.save_state` (model, optimizer, grad scaler, every process's RNG state and the
registered `Progress`) in checkpoints/step_<N>/, written under a temporary name, flushed to the disk and renamed
when complete: a run killed mid-save, or a machine that crashes, leaves the previous checkpoint as the newest. The
learning rate is a function of the step (shared/loop.py), so there is no scheduler state and a run can be resumed
with another length.

- `Checkpoints`: the run's checkpoint folder, `save`, `save_weights`, `resume` and `check_resume_and_branch`
  (--resume, in shared/resume.py), `initial_weights` (--init_from, in shared/init_from.py, an opt-in module), and
  through `StopOnSignals` a stop on SIGTERM, Ctrl-C or SIGHUP with a checkpoint and the command that continues the
  run (written by shared/resume.py);
- `new_folder`: a run folder.
"""

import itertools
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import psutil
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from shared.config import read_json
from shared.errors import RecipeError, flush_to_disk, replacing

STEP_DIR = re.compile(r"step_(\d+)$")
STOP_CHECK_S = 1.0  # several processes agree on a stop about this often (seconds of training)
CHECKPOINT_S = 600  # without --checkpoint_every, a checkpoint about this often: a crash or kill -9 loses at most this


def run_id(folder: Path) -> str | None:
    """The run id in `folder`'s config.json: a run's, or a checkpoint's (each holds a copy of its run's)."""
    config = read_json(folder / "config.json")
    return config.get("run_id") if isinstance(config, dict) else None


def list_checkpoints(folder: Path, run: str | None = None) -> list[Path]:
    """Complete checkpoints in a run's checkpoint folder, oldest first; with `run`, only those of the run of that id."""
    found = [p for p in folder.glob("step_*") if p.is_dir() and STEP_DIR.search(p.name)
             and (run is None or run_id(p) == run)]  # a config.json read only where a run's id is asked for
    return sorted(found, key=lambda p: int(STEP_DIR.search(p.name)[1]))


class StopOnSignals:
    """Checkpoints' stop on a signal; `save`, `accelerator`, `cfg` and `run_dir` are Checkpoints'.

    After `stop_on_signals()`, SIGTERM, SIGINT or SIGHUP asks the run to stop: it finishes the optimizer step, saves a
    checkpoint and exits 0. A second SIGINT more than a second after the first (Ctrl-C again, for a hung evaluation or
    collective) stops the process at once, exit 130, without saving (shared/resume.py's `after_interrupt`). Other later
    signals change nothing (torchrun forwards the first one again at once, and that must not cost the checkpoint);
    kill -9 stops at once.

    How soon: one process stops after the step in flight. Several processes must first agree on a step, which they
    do about every STOP_CHECK_S seconds of training; the stop then takes at most that, plus an evaluation if one
    falls in between, plus the save. torchrun (what `accelerate launch` runs for several processes) kills its
    workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (default 30) after it forwards a SIGTERM: set it higher if
    your evaluation or save takes longer."""

    def __init__(self):
        self.signal = None  # the first signal's name, once one came
        # Read now, for the command that continues the run: a stop under one process may outlive its launcher. The
        # environment the run was started in: the launcher's, as the shell gave it.
        self.launcher = launcher_command()
        try:
            self.started_in = psutil.Process(os.getppid() if self.launcher else None).environ()  # None: this process
        except psutil.Error:
            self.started_in = {}
        self.next_check, self.last_check = 0, None  # the step of the processes' next agreement on a stop; the last's
        self.saved_at = time.monotonic()  # the last checkpoint's time (or the start's), for CHECKPOINT_S

    def stop_on_signals(self) -> None:
        """From now on SIGTERM (what SLURM and most schedulers send before they kill a job), SIGINT (Ctrl-C) and
        SIGHUP (a terminal that closes: an ssh session that drops) ask the run to stop: `after_step` then saves a
        checkpoint and returns True. Without this call they kill it. The launcher's death already sends SIGTERM
        (shared/launch.py's stop_with_launcher)."""
        # Python runs a handler only when the main thread returns to the interpreter, which a hung collective never
        # does; the C handler writes each signal's number to this pipe at once, read by a thread of its own.
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        signal.set_wakeup_fd(write_end)
        threading.Thread(target=self._watch_interrupts, args=(read_end,), daemon=True).start()
        # Under nohup SIGHUP stays ignored, and the run goes on
        hangup = () if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else (signal.SIGHUP,)
        for signum in (*hangup, signal.SIGINT, signal.SIGTERM):  # SIGTERM's last: seen handled, the others are
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame):
        self.signal = self.signal or signal.Signals(signum).name

    def _watch_interrupts(self, read_end: int) -> None:
        while signal.SIGINT not in os.read(read_end, 64):  # the signals' numbers, as they come; SIGTERM: _on_signal's
            pass
        from shared.resume import after_interrupt  # only the runs a Ctrl-C stops: an opt-in module

        after_interrupt(self, read_end)

    def after_step(self, model, step: int, at_log_point: bool) -> bool:
        """After each optimizer step: checkpoint every --checkpoint_every steps (without it, about every CHECKPOINT_S
        seconds), and when a stop was asked, checkpoint this step and print the command that continues the run.
        True: stop now.

        Several processes must agree to stop or save, or one would wait in the checkpoint's barrier while another
        runs the next all-reduce. They agree where the step already waits for the device (`at_log_point`), at
        checkpoints, and at least every STOP_CHECK_S seconds: log points alone can be minutes apart, and torchrun
        kills the workers 30 s after a SIGTERM. The main process's clock decides when a checkpoint is due."""
        every = self.cfg.checkpoint_every
        save_now = bool(every) and step % every == 0
        stopping = self.signal is not None  # one process: its own signal and clock decide
        due = every is None and time.monotonic() - self.saved_at >= CHECKPOINT_S
        if self.accelerator.num_processes > 1:
            agree = at_log_point or save_now or step >= self.next_check
            stopping, due = self._agree(step, due) if agree else (False, False)
        if save_now or due or stopping:
            self.save(model, step)
        if stopping:
            from shared.resume import resume_command  # only the runs that stop: an opt-in module

            self.accelerator.print(f"stopped by {self.signal or 'a signal to another process'} at step {step}, "
                                   f"checkpoint saved; continue with:\n  {resume_command(self)}")
        return stopping

    def _agree(self, step: int, due: bool) -> tuple[bool, bool]:
        """One gather over the processes: has any been asked to stop; is a checkpoint due by the main process's clock;
        and how many steps take STOP_CHECK_S seconds on the slowest (the step of the next check, the same on every
        process). On a GPU: a sync about once a second."""
        now, steps = time.monotonic(), 1  # every step until an interval has been measured
        if self.last_check is not None:
            seconds_per_step = (now - self.last_check[1]) / (step - self.last_check[0])
            steps = max(1, int(STOP_CHECK_S / max(seconds_per_step, 1e-6)))
        votes = self.accelerator.gather(torch.tensor([[int(self.signal is not None), steps, int(due)]],
                                                     device=self.accelerator.device))
        self.next_check, self.last_check = step + int(votes[:, 1].min()), (step, now)
        return bool(votes[:, 0].any()), bool(votes[0, 2])


def launcher_command() -> list[str] | None:
    """`accelerate launch` and its flags, as they started this process (its parent's command line), or None when
    `accelerate launch` did not start it."""
    try:
        command = psutil.Process(os.getppid()).cmdline()
    except psutil.Error:
        return None
    # `accelerate launch`, `python -m accelerate.commands.accelerate_cli launch`, `python -m accelerate.commands.launch`
    starts = [i + 1 for i, part in enumerate(command) if part == "accelerate.commands.launch" or (
        part == "launch" and i and command[i - 1].endswith(("accelerate", "accelerate_cli")))]
    if not starts:
        return None
    end = command.index(sys.argv[0], starts[0]) if sys.argv[0] in command[starts[0]:] else len(command)
    return ["accelerate", "launch", *command[starts[0]:end]]


class Progress:
    """Where training stands. Registered with accelerator.register_for_checkpointing, it is saved and restored
    with the model: the counters can never disagree with the weights."""

    def __init__(self):
        self.step = 0  # optimizer steps taken
        self.epoch = 0  # epochs completed
        self.samples_into_epoch = 0  # samples of this epoch's order trained on, by all processes together
        self.max_eval_acc = 0.0  # the highest test accuracy of any evaluation: reported, never used to pick weights
        self.pieces = 0  # launches that trained this run: 1, plus one per resume
        self.train_samples, self.train_s = 0, 0.0  # samples and seconds of training (no evaluation, no saving)
        self.wall_s = 0.0  # seconds from each launch's first step to its last checkpoint (the last: to its end)

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        from shared.resume import checked_progress  # a checkpoint from anywhere, checked: an opt-in module

        vars(self).update(checked_progress(vars(self), state))


class Checkpoints(StopOnSignals):
    """The run's checkpoints/ folder and its final weights; stopping on a signal with a checkpoint: StopOnSignals."""

    def __init__(self, accelerator, run_dir: Path, cfg):
        super().__init__()
        self.accelerator, self.run_dir, self.cfg = accelerator, run_dir, cfg
        self.folder = Path(cfg.checkpoint_dir).absolute() if cfg.checkpoint_dir else self.run_dir / "checkpoints"
        self.resumed_from, self.extending = None, False
        self.saved = set()  # checkpoints this launch wrote: the only ones `save` may take as already saved

    def owner(self) -> str | None:
        """The run id a checkpoint must hold to be this run's: in a --checkpoint_dir, which another run may share by
        mistake, the run's; in the run folder's checkpoints/, none (the run's lock keeps other runs out)."""
        return run_id(self.run_dir) if self.cfg.checkpoint_dir else None

    def resume(self, progress: Progress) -> Path | None:
        """With --resume: the checkpoint it names, loaded (restoring `progress` too) by shared/resume.py; else None."""
        if not self.cfg.resume:
            return None
        from shared.resume import load  # only the runs that resume: an opt-in module

        self.resumed_from = load(self, progress)
        if self.resumed_from.resolve() == (self.folder / self.resumed_from.name).resolve():
            self.saved.add(self.folder / self.resumed_from.name)  # resumed at the last step: not saved again
        return self.resumed_from

    def check_resume_and_branch(self, config: dict, progress: Progress) -> None:
        """After a resume: refuse it if no step is left to run; print where the run continues and what changed; from
        an older checkpoint than the newest, move the later history aside (shared/resume.py). A finished run resumed
        with more steps is extended: its final files stay as they are until the longer run finishes (`save_weights`)."""
        if self.resumed_from:
            from shared.resume import check_resume_and_branch  # only the runs that resume: an opt-in module

            self.extending = check_resume_and_branch(self, config, progress)

    def save(self, model, step: int) -> None:
        """The full training state in checkpoints/step_<step>, keeping the newest --keep_checkpoints and removing the
        run's unfinished saves. Weights that are no longer finite (BatchNorm's running statistics included) are never
        saved."""
        if not all(torch.isfinite(t).all() for t in model.state_dict().values()):
            good = list_checkpoints(self.folder, self.owner())
            # Finite is not sound: after a step at a far too high --lr (1e12) the weights are finite but wrecked, and a
            # resume from them diverged again at --lr 0.01, this line sending the user back to them (test_errors.py)
            raise RecipeError(f"the weights became NaN or inf by step {step} (lower --lr): nothing saved; the newest "
                              f"finite checkpoint is {good[-1] if good else 'none (none was saved yet)'} (if a resume "
                              "from it with a lower --lr diverges again, its weights had begun to: start the run again "
                              "with --overwrite)")
        final = self.folder / f"step_{step}"
        if final in self.saved:
            return  # already saved at this step (--checkpoint_every landed on the last one)
        if final.exists():
            raise RecipeError(f"{final} exists but this run did not write it: is another run writing to "
                              f"{self.folder}? Nothing overwritten; pass another --output_dir (or --checkpoint_dir)")
        partial, run = final.with_name(f"partial_{final.name}"), self.owner()
        if self.accelerator.is_main_process:
            # Saves of this run that a kill cut short (kill -9, or accelerate launch's kill 5 s after a SIGTERM): no
            # run can resume from one, and a resumed run may never save its step again (another --checkpoint_every,
            # or the clock's), which alone replaced it
            for left in self.folder.glob("partial_step_*"):
                if run and run_id(left) != run:
                    raise RecipeError(f"{left} exists but this run did not write it: is another run writing to "
                                      f"{self.folder}? Nothing overwritten; pass another --checkpoint_dir")
                shutil.rmtree(left, ignore_errors=True)
            try:  # the run's config.json first (its id, and the resume report's "before"): a partial one is this run's
                partial.mkdir(parents=True)
                shutil.copy2(self.run_dir / "config.json", partial / "config.json")
            except OSError as error:
                self.write_failed(f"saving the checkpoint of step {step}", error)
        self.accelerator.wait_for_everyone()
        try:
            self.accelerator.save_state(partial)  # every process writes its own RNG state into it
        except (OSError, RuntimeError, SafetensorError) as error:  # disk full, quota: keep what is on disk, say so
            shutil.rmtree(partial, ignore_errors=True)
            self.write_failed(f"saving the checkpoint of step {step}", error)
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            flush_to_disk(partial)  # every process's files: a crash after the rename leaves them whole
            os.replace(partial, final)
            for old in list_checkpoints(self.folder, run)[:-self.cfg.keep_checkpoints]:
                shutil.rmtree(old)
        self.accelerator.wait_for_everyone()
        self.saved.add(final)
        self.saved_at = time.monotonic()

    def save_weights(self, model, metadata: dict) -> None:
        """model.safetensors: a plain state dict, no `module.` or `_orig_mod.` prefixes; `metadata` as JSON text. An
        extended run first moves the finished run's files into finished/<its steps>_steps/."""
        state = self.accelerator.get_state_dict(model)  # unwraps DDP; model.compile() adds no prefix
        if self.accelerator.is_main_process:
            try:
                if self.extending:
                    from shared.resume import set_finished_aside  # only the runs that resume: an opt-in module

                    set_finished_aside(self.run_dir)
                with replacing(self.run_dir / "model.safetensors") as partial:
                    save_file({k: v.contiguous() for k, v in state.items()}, partial,
                              metadata={k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()})
            except (OSError, SafetensorError) as error:
                self.write_failed("writing model.safetensors", error)

    def write_failed(self, what: str, error: Exception) -> None:
        """A full disk or quota: one line with the free space and the checkpoint a resume continues from
        (shared/resume.py)."""
        from shared.resume import write_failed  # only the runs whose writes fail: an opt-in module

        write_failed(self, what, error)

    @staticmethod
    def initial_weights(model, cfg, classes: list[str]) -> str | None:
        """--init_from: a model.safetensors loaded into `model` (shared/init_from.py). Returns its sha256 (config.json),
        or None without --init_from."""
        if not cfg.init_from:
            return None
        from shared.init_from import initial_weights  # only the runs that start from a file: an opt-in module

        return initial_weights(model, cfg, classes)


def new_folder(base: str) -> Path:
    """`base`, or `base`-2, -3, ...: the first that did not exist, made here. mkdir is atomic, so two runs started in
    the same second get a folder each (with the same name, the second found the first's lock). Where one cannot be
    made, the name tried: the write check after says why, in one line."""
    for n in itertools.count(1):
        name = Path(base if n == 1 else f"{base}-{n}")
        try:
            name.mkdir(parents=True)
            return name
        except FileExistsError:
            continue
        except OSError:
            return name

