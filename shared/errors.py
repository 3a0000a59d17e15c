"""One-line errors: the problem, the fix, a non-zero exit, no traceback.

A recipe raises `RecipeError` for anything the user can fix (data, flags, launch, checkpoints);
`one_line_errors()` around `train()` turns it into a single line on stderr and exit status 1.
Programming errors keep their traceback: those are for the person changing the code.

In a run of several processes every process makes the same checks (same flags, data, checkpoint,
and a training loss reduced over all processes), so all stop together and rank 0 alone prints.
"""

from __future__ import annotations

import os
import sys
import traceback
from contextlib import contextmanager

import torch
from accelerate import PartialState
from accelerate.utils import parse_flag_from_env


class RecipeError(Exception):
    """A mistake the user can fix. The message says what is wrong and how to fix it."""


def first_line(error: BaseException) -> str:
    """The first line of an exception's message, for one-line reports."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def is_main_process() -> bool:
    # From the launcher's environment, so it also works before (or without) a process group.
    return os.environ.get("RANK", "0") == "0"


@contextmanager
def one_line_errors():
    """Report RecipeError as one line (printed once, by rank 0) and exit with status 1."""
    try:
        yield
    except RecipeError as error:
        if is_main_process():
            print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(1)
    except RuntimeError as error:
        # A collective (barrier, all-reduce) failed: another process of the run stopped first and
        # printed why (or the launcher will). More tracebacks here would only bury that line.
        if os.environ.get("WORLD_SIZE", "1") == "1" or not _raised_in_torch_distributed(error):
            raise
        if is_main_process():
            print(f"error: another process of this run stopped ({first_line(error)[:160]})", file=sys.stderr,
                  flush=True)
        sys.exit(1)


def _raised_in_torch_distributed(error: BaseException) -> bool:
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and f"torch{os.sep}distributed" in frames[-1].filename


def check_launch() -> None:
    """Stop launches that would run, but not as the user thinks."""
    per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count()
    if per_machine > 1 and not parse_flag_from_env("ACCELERATE_USE_CPU") and 0 < gpus < per_machine:
        raise RecipeError(f"the config starts {per_machine} processes on this machine but it has "
                          f"{gpus} GPU(s): use --num_processes {gpus} "
                          "or a config that matches the machine")
    # The process group starts here; the Accelerator reuses it. Like the Accelerator, honour
    # ACCELERATE_USE_CPU (PartialState alone would ignore it).
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and state.num_processes == 1:
        # accelerate 1.x starts a MULTI_GPU config's processes even without GPUs; each then
        # trains alone on the CPU, writing the same files: N duplicate runs, not one DDP run.
        raise RecipeError(
            f"{launched} processes were launched but no GPUs were found, so each would train alone "
            "(duplicate runs): set ACCELERATE_USE_CPU=true to run them as one group on the CPU, "
            "or use accelerate_configs/cpu.yaml"
        )
    mixed_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if mixed_precision == "fp16" and state.device.type == "cpu":
        # accelerate accepts fp16 on a CPU but does not autocast there: the run would be float32.
        raise RecipeError(
            "fp16 mixed precision needs a GPU (on a CPU it would silently train in float32): "
            "use accelerate_configs/bf16.yaml on a CPU"
        )
