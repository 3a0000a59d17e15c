"""Stop a run on SIGTERM or Ctrl-C with a checkpoint, and print the command that continues it: the `StopOnSignals`
part of `Checkpoints` (shared/checkpoints.py), which saves."""

import ctypes
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

import torch

STOP_CHECK_S = 1.0  # several processes agree on a stop about this often (seconds of training)
SECOND_INTERRUPT_S = 1.0  # a SIGINT this long after the first is the user's second Ctrl-C, not torchrun's copy
PR_SET_PDEATHSIG = 1  # prctl: the signal this process gets when its parent dies (<linux/prctl.h>)
# Variables of the launch that change what a run does: accelerate's, the GPUs seen, wandb's, the data's caches, torch's
# (its threads too: another count sums in another order, and the resume is no longer bitwise)
READ_FROM_ENVIRONMENT = ("ACCELERATE_", "CUDA_VISIBLE_DEVICES", "WANDB_", "HF_", "TORCH_", "OMP_NUM_THREADS")


class StopOnSignals:
    """Checkpoints' stop on a signal; `save`, `accelerator`, `cfg` and `run_dir` are Checkpoints'.

    After `stop_on_signals()`, SIGTERM or SIGINT asks the run to stop: it finishes the optimizer step, saves a
    checkpoint and exits 0. A second SIGINT more than SECOND_INTERRUPT_S after the first (Ctrl-C again, for a hung
    evaluation or collective) stops the process at once, exit 130, without saving. Other later signals change nothing
    (torchrun forwards the first one again at once, and that must not cost the checkpoint); kill -9 stops at once.

    How soon: one process stops after the step in flight. Several processes must first agree on a step, which they
    do about every STOP_CHECK_S seconds of training; the stop then takes at most that, plus an evaluation if one
    falls in between, plus the save. torchrun (what `accelerate launch` runs for several processes) kills its
    workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (default 30) after it forwards a SIGTERM: set it higher if
    your evaluation or save takes longer."""

    def __init__(self):
        self.signal = None  # the first signal's name, once one came
        self.launcher = launcher_command()  # read now: a stop under one process may outlive its launcher
        self.environment = launch_environment(os.getppid() if self.launcher else os.getpid())
        self.next_check, self.last_check = 0, None  # the step of the processes' next agreement on a stop; the last's

    def stop_on_signals(self) -> None:
        """From now on SIGTERM (what SLURM and most schedulers send before they kill a job) and SIGINT (Ctrl-C) ask
        the run to stop: `after_step` then saves a checkpoint and returns True. Without this call they kill it."""
        if sys.platform == "linux" and "LOCAL_RANK" not in os.environ and self.launcher:
            # `accelerate launch` of one process starts this script and waits: it forwards no signal (accelerate
            # #929), so a SIGTERM to it (Kubernetes stops a container's first process; a user kills the pid they
            # see) would leave this process training on, never saving. Asked here, the kernel sends SIGTERM to this
            # process when the launcher dies, and the stop saves a checkpoint. torchrun (several processes) forwards
            # signals itself, and a script run with `python` has no launcher to lose. Asked before the handlers are
            # set, so that a process seen handling SIGTERM (tests/test_checkpoints.py) has both.
            ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        # Python runs a handler only when the main thread returns to the interpreter, which a hung collective never
        # does; the C handler writes each signal's number to this pipe at once, read by a thread of its own.
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        signal.set_wakeup_fd(write_end)
        threading.Thread(target=self._stop_at_second_interrupt, args=(read_end,), daemon=True).start()
        for signum in (signal.SIGINT, signal.SIGTERM):  # SIGTERM's last: seen handled, both are
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame):
        self.signal = self.signal or signal.Signals(signum).name

    def _stop_at_second_interrupt(self, read_end: int) -> None:
        first = None
        while True:
            for signum in os.read(read_end, 64):
                if signum == signal.SIGINT and first is not None and time.monotonic() - first > SECOND_INTERRUPT_S:
                    os.write(2, f"error: stopped at once by a second Ctrl-C, without saving: continue from the newest "
                                f"checkpoint in {self.folder} with --resume latest\n".encode())
                    os._exit(128 + signal.SIGINT)
                if signum == signal.SIGINT and first is None:
                    first = time.monotonic()
                    if self.accelerator.is_main_process:
                        os.write(1, b"Ctrl-C: stopping after this step with a checkpoint (Ctrl-C again to stop at "
                                    b"once, without saving)\n")

    def after_step(self, model, step: int, at_log_point: bool) -> bool:
        """After each optimizer step: checkpoint every --checkpoint_every steps, and when a stop was asked, checkpoint
        this step and print the command that continues the run. True: stop now.

        Several processes must agree to stop, or one would wait in the checkpoint's barrier while another runs the
        next all-reduce. They agree where the step already waits for the device (`at_log_point`), at
        checkpoints, and at least every STOP_CHECK_S seconds: log points alone can be minutes apart, and torchrun
        kills the workers 30 s after a SIGTERM."""
        save_now = self.cfg.checkpoint_every > 0 and step % self.cfg.checkpoint_every == 0
        stopping = self.signal is not None  # one process: its own signal decides
        if self.accelerator.num_processes > 1:
            stopping = (at_log_point or save_now or step >= self.next_check) and self._agree_to_stop(step)
        if save_now or stopping:
            self.save(model, step)
        if stopping:
            self.accelerator.print(f"stopped by {self.signal or 'a signal to another process'} at step {step}, "
                                   f"checkpoint saved; continue with:\n  {self.resume_command()}")
        return stopping

    def _agree_to_stop(self, step: int) -> bool:
        """One gather over the processes: has any been asked to stop, and how many steps take STOP_CHECK_S seconds
        on the slowest (the step of the next check, the same on every process). On a GPU: a sync about once a second."""
        now, steps = time.monotonic(), 1  # every step until an interval has been measured
        if self.last_check is not None:
            seconds_per_step = (now - self.last_check[1]) / (step - self.last_check[0])
            steps = max(1, int(STOP_CHECK_S / max(seconds_per_step, 1e-6)))
        votes = self.accelerator.gather(torch.tensor([[int(self.signal is not None), steps]],
                                                     device=self.accelerator.device))
        self.next_check, self.last_check = step + int(votes[:, 1].min()), (step, now)
        return bool(votes[:, 0].any())

    def resume_command(self) -> str:
        """The same script and flags, with --resume latest."""
        args, skip = [], False
        for arg in sys.argv[1:]:
            if not skip and not arg.startswith(("--output_dir", "--resume", "--overwrite")):
                args.append(arg)
            skip = arg in ("--output_dir", "--resume") and not skip
        launcher = self.launcher or [sys.orig_argv[0]]  # else the interpreter, as it was started
        return " ".join([*self.environment, shlex.join([*launcher, sys.argv[0], *args, "--output_dir",
                                                        str(self.run_dir), "--resume", "latest"])])


def launch_environment(pid: int) -> list[str]:
    """NAME=value for each variable of the environment the run was started in (the launcher's, as the shell gave it)
    that accelerate, torch, the data or the trackers read, secrets left out: pasted without them, the command that
    continues the run ran otherwise (2gpu.yaml without ACCELERATE_USE_CPU=true: no GPUs, no run)."""
    try:
        pairs = [item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")]
    except (OSError, UnicodeDecodeError):
        return []
    return [f"{name}={shlex.quote(value)}" for name, value in (pair for pair in pairs if len(pair) == 2)
            if name.startswith(READ_FROM_ENVIRONMENT) and not any(secret in name for secret in ("KEY", "TOKEN"))]


def launcher_command() -> list[str] | None:
    """`accelerate launch` and its flags, as they started this process (its parent's command line, from /proc), or
    None when `accelerate launch` did not start it."""
    try:
        command = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")
    except (OSError, UnicodeDecodeError):
        return None
    # `accelerate launch`, `python -m accelerate.commands.accelerate_cli launch`, `python -m accelerate.commands.launch`
    starts = [i + 1 for i, part in enumerate(command) if part == "accelerate.commands.launch" or (
        part == "launch" and i and command[i - 1].endswith(("accelerate", "accelerate_cli")))]
    if not starts:
        return None
    end = command.index(sys.argv[0], starts[0]) if sys.argv[0] in command[starts[0]:] else len(command)
    return ["accelerate", "launch", *command[starts[0]:end]]
