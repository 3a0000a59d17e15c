"""One-line errors: the problem, the fix, exit status 1, no traceback; the launch checks; and the bounds on files from
anywhere.

A recipe raises `RecipeError` for anything the user can fix. Every process of a run makes the same checks
(same flags, data and checkpoint, a training loss reduced over all processes), so all stop together and
rank 0 alone prints. Programming errors keep their traceback: those are for whoever changes the code.

Files from anywhere: a walk of a folder tree that no depth breaks, and a write that neither a crash nor a link breaks
(`replacing`). What a file may claim is checked before anything is allocated, where it is read: the free memory and a
dataset's decoded size in shared/bounds.py, a dataset file's size and a parquet file's decompressed size in
shared/dataset_files.py (opt-in modules). The limits are listed in docs/troubleshooting.md.
"""

import contextlib
import errno
import glob
import importlib.util
import json
import os
import resource
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path

import psutil
import torch
from accelerate import PartialState
from accelerate.utils import parse_flag_from_env

# An allocation refused, as torch's CPU allocator, oneDNN and the dynamic loader (a library imported late) say it: under
# an address-space limit (ulimit -v), where a run may stop at any of them, this is the limit.
ALLOCATION_FAILED = ("can't allocate memory", "could not create a primitive", "failed to map segment")
# The mode open() gives a new file (0o644 under umask 022), for the files safetensors makes (flush_to_disk). Read at
# import, before a thread runs: umask is the process's, and a file another thread made meanwhile would get 0o666.
UMASK = os.umask(0)
os.umask(UMASK)
STALE_S = 3600  # a write's temporary file untouched this long, its process gone, was left by a kill -9


class RecipeError(Exception):
    """A mistake the user can fix. The message says what is wrong and how to fix it."""


def printable(text: str) -> str:
    """`text` with each character a terminal acts on (ESC, a newline, a C1 control, ...) written as its escape: a name
    from a file, a folder or a flag is shown as it is, and never retitles the window, clears the screen or adds a
    line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


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


def is_main_process() -> bool:
    """From the launcher: also before (or without) a process group. Without torchrun this is the only process, whatever
    a RANK left in the shell says."""
    return os.environ.get("RANK", "0") == "0" or "TORCHELASTIC_RUN_ID" not in os.environ


class PrintableLines:
    """The standard output while an entry point runs (`one_line_errors`): each line passes through `printable`, so a
    name from a file, a folder or a flag, in any message, is shown and never acted on by the terminal."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        return self.stream.write("\n".join(map(printable, text.split("\n"))))

    def __getattr__(self, name: str):  # flush, isatty, fileno, encoding: the stream's own
        return getattr(self.stream, name)


@contextmanager
def one_line_errors():
    """RecipeError -> one line on stderr (rank 0) and exit status 1, Ctrl-C -> one line and 130; what is printed
    meanwhile: PrintableLines."""
    try:
        with redirect_stdout(PrintableLines(sys.stdout)):
            yield
    except KeyboardInterrupt:  # Ctrl-C before StopOnSignals takes it over: while the data, the model, ... load
        if is_main_process():
            print("stopped by Ctrl-C, with nothing to save yet (a training run saves from its first step on): run the "
                  "same command again", file=sys.stderr, flush=True)
        sys.exit(130)
    except (RecipeError, MemoryError, torch.OutOfMemoryError, RuntimeError, OSError, ImportError) as error:
        if isinstance(error, RecipeError):
            message = str(error)
        elif isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):  # metrics, pictures, ...
            written = error.filename or "the run's files"  # a failed write() names no file
            message = (f"writing {written} failed ({error.strerror}): free space, then continue with --resume latest "
                       "(the complete checkpoints are kept)")
        elif limit := process_limit(error):
            message = f"this process reached its limit on {limit}: raise it, then run again"
        elif isinstance(error, ModuleNotFoundError) and error.name and "." not in error.name:
            # a requirement not installed (a GPU image has torch and accelerate, and often neither wandb nor datasets)
            untracked = ", or train without it: --tracker tensorboard or none" if error.name == "wandb" else ""
            message = (f"No module named {error.name!r} in this Python ({sys.executable}): install the requirements "
                       f"there: pip install -r requirements.txt{untracked}")
        elif isinstance(error, ImportError):  # a package that does not load says why, in its traceback
            raise
        elif isinstance(error, MemoryError) or "DefaultCPUAllocator: can't allocate memory" in str(error):
            # a CPU allocation, Python's or torch's (a RuntimeError); the readers of data files name the file themselves
            message = "out of memory: lower --batch_size, or check that --data holds what it should"
        elif isinstance(error, torch.OutOfMemoryError):
            message = f"out of GPU memory ({first_line(error)[:120]}): lower --batch_size"
        elif type(error).__name__ in ("BackendCompilerFailed", "InductorError"):  # --compile: torch's compiler failed
            cause = getattr(error, "inner_exception", error)  # on a CPU, often no C++ compiler (a slim image's)
            message = (f"--compile failed in torch's compiler ({type(cause).__name__}: {first_line(cause)[:160]}): "
                       "leave out --compile (torch.compile needs a C++ compiler, g++, on a CPU)")
        elif os.environ.get("WORLD_SIZE", "1") != "1" and in_collective(error):
            message = (f"another process of this run stopped ({first_line(error)[:160]}): see its error, or if a node "
                       "died, start every node again with --resume latest")
        else:
            raise
        line = "error: " + printable(message)  # a file name may hold a newline: the line stays one
        if is_main_process():
            print(line, file=sys.stderr, flush=True)
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):
            # Under torchrun, which ends a failed run in its traceback and a summary of each process's exit: the
            # summary shows this as the cause ("traceback : error: ..."), last on the screen, every process's. Whole
            # or absent: torchrun stops the other processes as soon as one fails, then reads their files too, and
            # one stopped between opening and writing left an empty file that ended torchrun in a JSONDecodeError.
            with contextlib.suppress(OSError), replacing(Path(os.environ["TORCHELASTIC_ERROR_FILE"])) as partial:
                partial.write_text(json.dumps({"message": line, "timestamp": int(time.time())}))
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
            from shared.reinstall import torchvision_for_this_torch  # only a broken install: an opt-in module

            raise RecipeError(torchvision_for_this_torch(folder, library)) from None


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
    # Set by accelerate launch from a config (`accelerate config`'s default config, say) that these recipes do not
    # follow: each model fits on one device (DDP), and --compile compiles it in place, where accelerate's dynamo would
    # wrap it (every weight named `_orig_mod.` in model.safetensors and the checkpoints)
    for name in ("USE_FSDP", "USE_DEEPSPEED", "USE_MEGATRON_LM", "DYNAMO_BACKEND"):
        if os.environ.get(f"ACCELERATE_{name}", "NO").upper() not in ("NO", "FALSE", "0", ""):
            raise RecipeError(f"the accelerate config sets ACCELERATE_{name}={os.environ[f'ACCELERATE_{name}']}: these "
                              "recipes train with DDP and compile with --compile: pass --config_file "
                              "accelerate_configs/2gpu.yaml or another of accelerate_configs/")
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
    from shared.checkpoints import launcher_command  # a module that imports this one

    if launched == 1 and "MASTER_ADDR" in os.environ and "--cpu" in (launcher_command() or []):
        # The launcher --cpu always takes starts one process, and sets MASTER_ADDR for the mpirun it expects
        print("warning: accelerate launch --cpu starts one process, whatever --num_processes or the config asks: for "
              "several on the CPU, set ACCELERATE_USE_CPU=true instead (ACCELERATE_USE_CPU=true accelerate launch "
              "--config_file accelerate_configs/2gpu.yaml ...)", flush=True)
    source = Path(torch.__file__)
    if state.is_main_process and source.suffix == ".py" and not Path(importlib.util.cache_from_source(source)).exists():
        # Python compiles torch's code again in each process that cannot keep its compiled copy (the launcher's too):
        # on one H200 whose image sets PYTHONDONTWRITEBYTECODE, the README's GPU line took 22-25 s, 13-15 s once kept
        fixes = []
        if sys.dont_write_bytecode:
            fixes.append("unset PYTHONDONTWRITEBYTECODE")
        if not os.access(source.parent, os.W_OK):  # a read-only image (Apptainer's, say): keep the copies elsewhere
            fixes.append("export PYTHONPYCACHEPREFIX=~/.cache/pycache")
        if fixes:
            print("note: each start compiles torch's Python code again, as Python cannot keep the compiled copy here "
                  "(the README's GPU line took 22-25 s without it on one H200, 13-15 s with it): to keep it, "
                  f"{' and '.join(fixes)}", flush=True)
    if os.environ.get("ACCELERATE_MIXED_PRECISION") == "fp16" and state.device.type == "cpu":
        # accelerate accepts fp16 on a CPU but does not autocast there: the run would be float32.
        raise RecipeError("fp16 mixed precision needs a GPU (on a CPU it would silently train in float32): "
                          "use accelerate_configs/bf16.yaml on a CPU")


def walk(folder: Path, skip: Path | None = None) -> Iterator[os.DirEntry]:
    """Every entry below `folder` that is not a folder (files, links, FIFOs, ...), links not followed, and nothing below
    `skip`. Not recursive: rglob and os.walk recurse in Python 3.11, and a tree 1,500 folders deep ended in a
    RecursionError."""
    folders = [Path(folder)]
    while folders:
        try:
            entries = os.scandir(folders.pop())
        except OSError as error:  # a tree deeper than the system's path limit (4,096 bytes), a folder you may not read
            raise RecipeError(f"cannot list the folders under {folder} ({error.strerror}): move the files nearer the "
                              "root, or make their folders readable") from None
        with entries:
            for entry in entries:
                if not entry.is_dir(follow_symlinks=False):
                    yield entry
                elif Path(entry.path) != skip:
                    folders.append(Path(entry.path))


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """Write `path` under a temporary name beside it (what this yields), renamed over it when complete: a reader, a
    run killed while writing, and another name of the file (a hard link from elsewhere) see the old file or the new
    one, never half of one (a machine's crash too: flush_to_disk), and the file is never changed in place. A link left
    at the temporary name is removed, never written through, and so is the temporary file of a writer killed before
    (the decode cache's is the size of the decoded dataset)."""
    partial = path.with_name(f"{path.name}.tmp{os.getpid()}")
    partial.unlink(missing_ok=True)
    for stale in path.parent.glob(f"{glob.escape(path.name)}.tmp*"):  # left by a writer killed mid-write (kill -9)
        pid = stale.name.rpartition(".tmp")[2]
        # Its process gone, and untouched for STALE_S: a writer on another machine (a shared cache) keeps writing.
        with contextlib.suppress(OSError):
            if pid.isdigit() and not psutil.pid_exists(int(pid)) and time.time() - stale.lstat().st_mtime > STALE_S:
                stale.unlink()
    try:
        yield partial
        flush_to_disk(partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)  # after a failed write: a full disk, pieces read from a damaged file


def flush_to_disk(path: Path) -> None:
    """A file, or every file in a folder, written from memory to the disk (fsync) before a rename says it is complete:
    the system may write the rename first, and a machine that crashed between the two (power lost, a node or VM gone)
    came back with a file of that name empty or zero-filled. torch.distributed.checkpoint syncs its files for this too
    (FileSystemWriter's sync_files). Each also gets the mode open() gives a new file: safetensors (0.8) makes its
    files 0600 (safetensors #782), and weights, checkpoints and the decode cache were their owner's alone, unreadable
    to a group that shares them, or to a container's user where root trained."""
    for file in walk(path) if path.is_dir() else [path]:
        os.chmod(file, 0o666 & ~UMASK)
        with open(file, "rb") as f:
            os.fsync(f.fileno())
