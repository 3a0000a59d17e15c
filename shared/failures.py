"""Why a run failed, in one line, where the error is not a RecipeError but still the user's to fix: a full disk, a limit
of the process, a requirement not installed, a torchvision built for another torch, memory, torch's compiler, a
BatchNorm given one value per channel, another process of the run. Called by shared/errors.py's `one_line_errors`
only when a run fails (an opt-in module); any other error is a programming error and keeps its traceback. And wandb's
start that failed (`start_offline`)."""

import errno
import os
import resource
import sys
import traceback
from contextlib import suppress

import torch

from shared.errors import RecipeError, first_line

# An allocation refused, as torch's CPU allocator, oneDNN and the dynamic loader (a library imported late) say it: under
# an address-space limit (ulimit -v), where a run may stop at any of them, this is the limit.
ALLOCATION_FAILED = ("can't allocate memory", "could not create a primitive", "failed to map segment")


def explain(error: BaseException) -> str | None:
    """The line that says what stopped the run and how to fix it, or None: an error for whoever changes the code."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):  # metrics, pictures, ...
        # A copy names its source first (shutil's: wandb's pictures, from the temporary folder); a write() none
        written = error.filename2 or error.filename or "the run's files"
        return (f"writing {written} failed ({error.strerror}): free space, then continue with --resume latest (the "
                "complete checkpoints are kept; before the first one, run the same command again)")
    if limit := process_limit(error):
        return f"this process reached its limit on {limit}: raise it, then run again"
    if isinstance(error, OSError) and error.errno == errno.ENAMETOOLONG:  # a path a flag gave (a name over 255 bytes)
        return f"a path is too long for this system ({error.strerror}: {error.filename!s:.100}...): pass a shorter one"
    if isinstance(error, ModuleNotFoundError) and error.name and "." not in error.name:
        # a requirement not installed (a GPU image has torch and accelerate, and often neither wandb nor datasets)
        untracked = ", or train without it: --tracker tensorboard or none" if error.name == "wandb" else ""
        return (f"No module named {error.name!r} in this Python ({sys.executable}): install the requirements there: "
                f"pip install -r requirements.txt{untracked}")
    if any(f"torchvision{os.sep}" in frame.filename for frame in traceback.extract_tb(error.__traceback__)):
        from shared.reinstall import torchvision_mismatch  # finetune.py's import of it failed: is it this torch's?

        if line := torchvision_mismatch():
            return line
    if isinstance(error, ImportError):  # a package that does not load says why, in its traceback
        return None
    if isinstance(error, MemoryError) or "DefaultCPUAllocator: can't allocate memory" in str(error):
        # a CPU allocation, Python's or torch's (a RuntimeError); the readers of data files name the file themselves
        return "out of memory: lower --batch_size, or check that --data holds what it should"
    if isinstance(error, torch.OutOfMemoryError):
        return f"out of GPU memory ({first_line(error)[:120]}): lower --batch_size"
    if type(error).__name__ in ("BackendCompilerFailed", "InductorError"):  # --compile: torch's compiler failed
        # On a CPU, often no C++ compiler (a slim image's), or no Python.h (a system Python without its -dev package:
        # CppCompileError after torch's warning "Can't find Python.h")
        cause = getattr(error, "inner_exception", error)
        return (f"--compile failed in torch's compiler ({type(cause).__name__}: {first_line(cause)[:160]}): leave "
                "out --compile, or install what torch.compile needs on a CPU: g++ and Python's headers (python3-dev)")
    if "Expected more than 1 value per channel" in str(error):  # torch's BatchNorm in training, given one image
        # whose feature map is 1x1 there (finetune.py's resnet18 at --image_size 32, densenet121 up to 56)
        return ("a BatchNorm layer got one value per channel to normalize (one image per process, at a size where its "
                "feature map is 1x1): raise --batch_size to 2 or more (a resume may change it too), or the image size")
    if os.environ.get("WORLD_SIZE", "1") != "1" and in_collective(error):
        return (f"another process of this run stopped ({first_line(error)[:160]}): see its error, or if a node died, "
                "start every node again with --resume latest")
    return None


def process_limit(error: BaseException) -> str | None:
    """The limit of this process that `error` says it reached, in words, or None: a limit is named as one, never taken
    for damaged data (datasets' reader, short of threads under `ulimit -v`, said "could not read a dataset")."""
    if "can't start new thread" in str(error):
        return "threads (ulimit -u, a container's pids limit, or the memory for their stacks: ulimit -v)"
    if isinstance(error, OSError) and error.errno in (errno.EMFILE, errno.ENFILE):
        return "open files (ulimit -n)"
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY and (isinstance(error, MemoryError) or any(
            failed in str(error) for failed in ALLOCATION_FAILED)):
        return (f"address space (ulimit -v: {limit / 2**30:.1f} GiB, of which torch's libraries map about 5 GiB; a "
                "smaller --batch_size needs less)")
    return None


def in_collective(error: BaseException) -> bool:
    """A collective (barrier, all-reduce) failed because another process stopped first and printed why (or the
    launcher will): more tracebacks would only bury that line. Raised in torch.distributed itself, or gloo's
    "Connection reset by peer" when another node died. DDP's own errors (unused parameters, a reduction left
    unfinished) are programming errors: they keep their traceback and whole message."""
    frames = traceback.extract_tb(error.__traceback__)
    return (bool(frames) and f"torch{os.sep}distributed" in frames[-1].filename
            or isinstance(error, torch.distributed.DistError) or "gloo" in str(error))


def start_offline(tracker, error: Exception) -> None:
    """Start `tracker` (shared/tracking.py's WandB), whose start raised `error`, offline where it failed online (no
    network, server down, no or a bad key: training matters more than the dashboard). A setting wandb refuses in
    every mode (its UsageError, or pydantic's ValidationError: a WANDB_* variable, WANDB_PROJECT=a/b or an empty
    WANDB_MODE) is one line; any other error offline is raised again."""
    try:
        if tracker.init_kwargs["mode"] != "online":
            raise error
        print(f"warning: wandb could not start online ({type(error).__name__}: {first_line(error)[:150]}); "
              "logging offline instead, upload later with `wandb sync`", file=sys.stderr)
        import wandb
        from accelerate.tracking import WandBTracker

        wandb.teardown()  # the failed attempt still holds the run id in wandb's background service
        tracker.init_kwargs["mode"] = "offline"
        WandBTracker.start(tracker)  # accelerate's: wandb.init with these settings
    except Exception as failed:
        if type(failed).__name__ not in ("UsageError", "ValidationError"):  # ValidationError: pydantic's, of Settings
            raise
        said = " ".join(str(failed).split())  # pydantic's are several lines
        raise RecipeError(f"wandb refused its settings ({said[:300]}): fix the WANDB_* variable that set it, or pass "
                          "--tracker tensorboard or none") from None


def without_wandb(error: ConnectionError):
    """A disabled wandb run, in place of one whose service process (wandb-core) has gone: `error`, from the socket to
    it. wandb-core takes a SIGINT or SIGTERM as its own stop, at once, keeping only what it had written (wandb/wandb
    #9963), and `accelerate launch` of one process, from 1.16, sends one to every process under it, wandb-core
    included, as SLURM's stops of a job step do. The run's stop goes on without it: the step's checkpoint,
    metrics.jsonl and summary.json. Said once."""
    import wandb

    print(f"wandb: its service process has stopped ({type(error).__name__}: {first_line(error)[:100]}): a SIGINT or "
          "SIGTERM to it stops it (wandb/wandb#9963); accelerate launch from 1.16, SLURM and systemd signal every "
          "process of a run: wandb's record of this launch may end early (offline: at what it wrote); metrics.jsonl "
          "and the checkpoints have every step. To keep it, signal the training process alone (kill <its pid>)")
    with suppress(Exception):  # the service is gone: the teardown's message to it fails, after it unhooks wandb's exit
        wandb.teardown()  # handler, which would end the process in a traceback
    return wandb.init(mode="disabled")
