"""One-line errors: the problem, the fix, exit status 1, no traceback; and a write that neither a crash nor a link
breaks.

A recipe raises `RecipeError` for anything the user can fix. Every process of a run makes the same checks (same
flags, data and checkpoint, a training loss reduced over all processes), so all stop together and rank 0 alone prints.
Other errors the user can fix (a full disk, a process limit, memory, a torchvision built for another torch, a batch
too small for BatchNorm) are put in a line by shared/failures.py, an opt-in module imported only when a run fails.
Programming errors keep their traceback: those are for whoever changes the code.

Files from anywhere: a write that neither a crash nor a link breaks (`replacing`). What a file may claim is checked
before anything is allocated, where it is read: the free memory, a dataset's decoded size and a walk of a folder tree
that no depth breaks in shared/bounds.py, a dataset file's size and a parquet file's decompressed size in
shared/dataset_files.py (opt-in modules). The limits are listed in docs/troubleshooting.md.
"""

import glob
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout, suppress
from pathlib import Path

import psutil

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


def is_main_process() -> bool:
    """From the launcher: also before (or without) a process group. Without torchrun this is the only process, whatever
    a RANK left in the shell says."""
    return os.environ.get("RANK", "0") == "0" or "TORCHELASTIC_RUN_ID" not in os.environ


class PrintableLines:
    """The standard output while an entry point runs (`one_line_errors`): each line passes through `printable`, so a
    name from a file, a folder or a flag, in any message, is shown and never acted on by the terminal; and each line
    is written whole, once it ends (as a terminal's line buffering shows it), whichever threads print meanwhile."""

    def __init__(self, stream):
        self.stream, self.started = stream, threading.local()  # each thread's line not yet ended

    def write(self, text: str) -> int:
        # print writes its text, then its newline: a line another thread printed between the two (the first
        # Ctrl-C's, shared/resume.py's after_interrupt) was spliced into this one
        ended, newline, self.started.line = (getattr(self.started, "line", "") + text).rpartition("\n")
        shown = "\n".join(map(printable, ended.split("\n"))) + newline
        try:
            self.stream.write(shown)
            self.stream.flush()  # each line shown at once (no print needs flush=True), and here, where a closed
            # pipe is caught: a flush left for later would fail outside
        except OSError:  # its reader ended (`| head`, a Ctrl-C to `| tee`), or its disk is full: the run goes on,
            # printing to stderr: the stream's own descriptor made stderr's (with stdout closed, `>&-`, the stream is
            # stderr, and descriptor 1 another file's: the run folder's lock)
            os.dup2(2, self.stream.fileno())
            with suppress(OSError):  # stderr's reader ended too (`2>&1 | tee`), or its disk is full: unheard
                self.stream.write(shown)  # the failed flush dropped it (Python 3.10-3.13, tried)
        return len(text)

    def __getattr__(self, name: str):  # flush, isatty, fileno, encoding: the stream's own
        return getattr(self.stream, name)


@contextmanager
def one_line_errors():
    """RecipeError -> one line on stderr (rank 0) and exit status 1, Ctrl-C -> one line and 130; what is printed
    meanwhile: PrintableLines."""
    # A library's logger that cannot write says nothing (Python's switch for it): wandb's, into the run folder on a full
    # disk, printed hundreds of lines of "--- Logging error ---" tracebacks around the line that names the disk
    logging.raiseExceptions = False
    try:  # stdout closed (`>&-`): Python's sys.stdout is None; the lines go to stderr, as after a closed pipe
        with redirect_stdout(PrintableLines(sys.stdout or sys.stderr)):
            yield
    except KeyboardInterrupt:  # Ctrl-C before StopOnSignals takes it over (the data, the model load), or in predict.py
        if is_main_process():
            print("stopped by Ctrl-C before there was anything to save (a training run saves a checkpoint from its "
                  "first step on, predict.py its CSV once every image is read): run the same command again",
                  file=sys.stderr)  # stderr writes through: no flush
        sys.exit(130)
    # RuntimeError: torch's, its OutOfMemoryError included; ValueError: torch's BatchNorm given one value per channel
    except (RecipeError, MemoryError, RuntimeError, ValueError, OSError, ImportError) as error:
        if isinstance(error, RecipeError):
            message = str(error)
        else:  # a failure the user can act on, said in a line; a programming error keeps its traceback
            try:
                from shared.failures import explain  # only a run that fails: an opt-in module
            except (OSError, MemoryError):  # no file or memory left to import it with: a limit, said here
                message = (f"{first_line(error)}: this process is out of open files or memory (ulimit -n, ulimit -v): "
                           "raise its limits, then run again")
            else:
                if (message := explain(error)) is None:
                    raise
        line = "error: " + printable(message)  # a file name may hold a newline: the line stays one
        if is_main_process():
            print(line, file=sys.stderr)
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):
            # Under torchrun, which ends a failed run in its traceback and a summary of each process's exit: the
            # summary shows this as the cause ("traceback : error: ..."), last on the screen, every process's. Whole
            # or absent: torchrun stops the other processes as soon as one fails, then reads their files too, and
            # one stopped between opening and writing left an empty file that ended torchrun in a JSONDecodeError.
            with suppress(OSError), replacing(Path(os.environ["TORCHELASTIC_ERROR_FILE"])) as partial:
                partial.write_text(json.dumps({"message": line, "timestamp": int(time.time())}))
        sys.exit(1)


@contextmanager
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
        with suppress(OSError):
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
    for file in [file for file in path.rglob("*") if file.is_file()] if path.is_dir() else [path]:  # ours
        os.chmod(file, 0o666 & ~UMASK)
        with open(file, "rb") as f:
            os.fsync(f.fileno())
