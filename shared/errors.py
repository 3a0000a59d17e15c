"""One-line errors: the problem, the fix, exit status 1, no traceback; and the launch checks.

A recipe raises `RecipeError` for anything the user can fix. Every process of a run makes the same checks
(same flags, data and checkpoint, a training loss reduced over all processes), so all stop together and
rank 0 alone prints. Programming errors keep their traceback: those are for whoever changes the code.
"""

import errno
import importlib.util
import os
import re
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import parse_flag_from_env


class RecipeError(Exception):
    """A mistake the user can fix. The message says what is wrong and how to fix it."""


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def is_main_process() -> bool:
    """From the launcher: also before (or without) a process group. Without torchrun this is the only process, whatever
    a RANK left in the shell says."""
    return os.environ.get("RANK", "0") == "0" or "TORCHELASTIC_RUN_ID" not in os.environ


@contextmanager
def one_line_errors():
    """RecipeError -> one line on stderr (rank 0) and exit status 1."""
    try:
        yield
    except (RecipeError, MemoryError, torch.OutOfMemoryError, RuntimeError, OSError) as error:
        if isinstance(error, RecipeError):
            message = str(error)
        elif isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):  # metrics, pictures, ...
            written = error.filename or "the run's files"  # a failed write() names no file
            message = (f"writing {written} failed ({error.strerror}): free space, then continue with --resume latest "
                       "(the complete checkpoints are kept)")
        elif isinstance(error, MemoryError) or "DefaultCPUAllocator: can't allocate memory" in str(error):
            # a CPU allocation, Python's or torch's (a RuntimeError); the readers of data files name the file themselves
            message = "out of memory: lower --batch_size, or check that --data holds what it should"
        elif isinstance(error, torch.OutOfMemoryError):
            message = f"out of GPU memory ({first_line(error)[:120]}): lower --batch_size"
        elif os.environ.get("WORLD_SIZE", "1") != "1" and in_collective(error):
            message = (f"another process of this run stopped ({first_line(error)[:160]}): see its error, or if a node "
                       "died, start every node again with --resume latest")
        else:
            raise
        if is_main_process():  # a file name may hold a newline: the line stays one, its author cannot add another
            print("error: " + re.sub(r"[\x00-\x1f\x7f]", lambda m: repr(m.group())[1:-1], message), file=sys.stderr,
                  flush=True)
        sys.exit(1)


def in_collective(error: RuntimeError) -> bool:
    """A collective (barrier, all-reduce) failed because another process stopped first and printed why (or the
    launcher will): more tracebacks would only bury that line. Raised in torch.distributed itself, or gloo's
    "Connection reset by peer" when another node died. DDP's own errors (unused parameters, a reduction left
    unfinished) are programming errors: they keep their traceback and whole message."""
    frames = traceback.extract_tb(error.__traceback__)
    return (bool(frames) and f"torch{os.sep}distributed" in frames[-1].filename
            or isinstance(error, torch.distributed.DistError) or "gloo" in str(error))


def check_torchvision() -> None:
    """A torchvision built for another torch (another release, or a CUDA build beside a CPU one) is one line, before
    anything imports it: its compiled operators do not load, and `import torchvision` ends in a traceback ("operator
    torchvision::nms does not exist"). Loaded here as torchvision's extension.py loads them, through torch."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return  # not installed: the import that needs it says so
    folder = Path(spec.origin).parent
    for library in sorted(folder.glob("_C*")):  # _C.so; _C_stable.so in the newer releases
        if library.suffix not in (".so", ".pyd", ".dylib"):
            continue
        try:
            torch.ops.load_library(library)
        except OSError:
            text = (folder / "version.py").read_text() if (folder / "version.py").is_file() else ""
            found = re.search(r"^__version__ = '([^']+)'", text, re.MULTILINE)
            version = found.group(1) if found else "(of an unknown version)"
            release, _, build = torch.__version__.partition("+")
            index = ""
            if build.startswith(("cpu", "cu", "rocm")):  # a build from PyTorch's own index: the same index's
                index = f" --index-url https://download.pytorch.org/whl/{build}"
            fix = f"pip uninstall -y torchvision && pip install torch=={release} torchvision{index}"
            raise RecipeError(f"torchvision {version} was not built for torch {torch.__version__}: its compiled "
                              f"operators ({library.name}) do not load; install the torchvision built for it: {fix}"
                              ) from None


def check_launch() -> None:
    """Start the process group, and stop launches that would run, but not as the user thinks."""
    check_torchvision()
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):  # what a launcher sets for each process
        if not os.environ.get(name, "0").isdigit():
            raise RecipeError(f"the environment sets {name}={os.environ[name]!r}, not a count of processes: unset it "
                              "(accelerate launch sets it)")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
        # A value left in the shell: the process group would wait forever for processes that never start.
        raise RecipeError(f"the environment sets WORLD_SIZE={os.environ['WORLD_SIZE']}, but no launcher started "
                          "this process (torchrun, which accelerate launch runs, would have): unset WORLD_SIZE, or "
                          "start it with accelerate launch")
    per_machine, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count()
    if per_machine > 1 and not parse_flag_from_env("ACCELERATE_USE_CPU") and 0 < gpus < per_machine:
        raise RecipeError(f"the config starts {per_machine} processes on this machine but it has {gpus} GPU(s): "
                          f"use --num_processes {gpus} or a config that matches the machine")
    # The Accelerator reuses this state. Like the Accelerator, honour ACCELERATE_USE_CPU (PartialState would not).
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and state.num_processes == 1:
        # accelerate 1.x starts a MULTI_GPU config's processes even without GPUs; each then trains alone on the CPU,
        # writing the same files: N duplicate runs, not one DDP run.
        raise RecipeError(f"{launched} processes were launched but no GPUs were found, so each would train alone "
                          "(duplicate runs): set ACCELERATE_USE_CPU=true to run them as one group on the CPU, "
                          "or use accelerate_configs/cpu.yaml")
    if os.environ.get("ACCELERATE_MIXED_PRECISION") == "fp16" and state.device.type == "cpu":
        # accelerate accepts fp16 on a CPU but does not autocast there: the run would be float32.
        raise RecipeError("fp16 mixed precision needs a GPU (on a CPU it would silently train in float32): "
                          "use accelerate_configs/bf16.yaml on a CPU")
