"""Fault injection for the tests, not for the recipes.

Python imports `sitecustomize` at startup when this folder is on PYTHONPATH.
With RECORD_TRAINING_LABELS=DIR, every training loss appends its batch's labels as one line to
DIR/rank<R>.txt: with a dataset whose labels are all different, the samples each process trained on.
With FAULT_SLOW_CONFIG_READ_S=S, every process but the main one waits S seconds before its first read of a
config.json, so that the main process runs ahead, as one may on a loaded machine.
With FAULT_ABORT_AT_EXIT_RANK=R, the process of rank R aborts (SIGABRT) as its interpreter exits, after its run: what
gloo's teardown race (pytorch#179291) does now and then.
With FAULT_HANG_IN_EVALUATION=FILE, the first evaluation loss creates FILE and never returns: a hung evaluation.
With FAULT_FAIL_SAVING_IMAGE=NAME, PIL fails to save an image named NAME (or NAME.tmp<pid>, its temporary name),
with an OSError, as on a full disk.
With FAULT_FILL_DISK_AFTER_SAVING_IMAGE=NAME, once PIL has saved an image named NAME (or NAME.tmp<pid>), a file named
filler beside it takes the rest of its disk: a real disk that fills as a run's end writes its files.
With FAULT_KILL_WRITING=STEM, the process writes half of the first text it writes to a file named STEM.<anything>
opened for writing with pathlib (open or write_text), then kills itself (SIGKILL): a run killed while rewriting a file.
With FAULT_HOLD_SAVE_AT_STEP=N, the save of step N's checkpoint stops for good after its first file: a save caught
in the middle, whatever the machine's speed.
With FAULT_NO_THREADS=1, a thread cannot be started: what Python says when the process is at its limit on threads
(`ulimit -u`, a container's pids limit) or lacks the memory for their stacks (`ulimit -v`).
With FAULT_SIGTERM_IN_TRAINING=1, the first training loss sends SIGTERM to its own process: a stop at step 1.
With RECORD_SYNCS=FILE, each os.fsync appends a line to FILE (`fsync<TAB>the path synced`), and so does each os.replace
(`replace<TAB>from<TAB>to`): what a machine's crash could leave of each file renamed into place.
With SIGNALS_READY=DIR, a process creates DIR/<pid> once the run's own stop has taken its signals over (SIGTERM's
handler set to StopOnSignals', its last): from then on a SIGTERM, SIGINT or SIGHUP stops it with a checkpoint. Before,
one ends it in a line (shared/launch.py), and /proc's mask of caught signals cannot tell the two handlers apart.
With START_METHOD=M, multiprocessing starts its processes by M: forkserver is Python 3.14's default on Linux (fork
before), under which each semaphore is registered with a resource tracker, a process of its own.
"""

import errno
import os

_ready = os.environ.get("SIGNALS_READY")
if _ready:
    import signal

    _set_handler = signal.signal

    def _set_and_mark(signum, handler):
        previous = _set_handler(signum, handler)
        if signum == signal.SIGTERM and getattr(handler, "__name__", None) == "_on_signal":  # StopOnSignals' method
            open(os.path.join(_ready, str(os.getpid())), "w").close()
        return previous

    signal.signal = _set_and_mark

if os.environ.get("START_METHOD"):
    import multiprocessing

    multiprocessing.set_start_method(os.environ["START_METHOD"])

if os.environ.get("FAULT_NO_THREADS"):
    import threading

    def _no_thread(self):
        raise RuntimeError("can't start new thread")

    threading.Thread.start = _no_thread

_hold = os.environ.get("FAULT_HOLD_SAVE_AT_STEP")
if _hold:
    import time

    import torch

    def _holding(save):
        def save_and_hold(obj, path, *args, **kwargs):
            result = save(obj, path, *args, **kwargs)
            if f"partial_step_{_hold}" in str(path):
                while True:
                    time.sleep(1)
            return result
        return save_and_hold

    torch.save = _holding(torch.save)

_record_dir = os.environ.get("RECORD_TRAINING_LABELS")
if _record_dir:
    import torch
    import torch.nn.functional

    def _recording(cross_entropy):
        def cross_entropy_and_record(input, target, *args, **kwargs):
            if torch.is_grad_enabled():  # training, not evaluation
                with open(os.path.join(_record_dir, f"rank{os.environ.get('RANK', '0')}.txt"), "a") as f:
                    f.write(" ".join(map(str, target.tolist())) + "\n")
            return cross_entropy(input, target, *args, **kwargs)
        return cross_entropy_and_record

    torch.nn.functional.cross_entropy = _recording(torch.nn.functional.cross_entropy)

_slow = os.environ.get("FAULT_SLOW_CONFIG_READ_S")
if _slow and os.environ.get("RANK", "0") != "0":
    import pathlib
    import time

    _read_text, _waited = pathlib.Path.read_text, []

    def _read_text_late(self, *args, **kwargs):
        if self.name == "config.json" and not _waited:
            _waited.append(True)
            time.sleep(float(_slow))
        return _read_text(self, *args, **kwargs)

    pathlib.Path.read_text = _read_text_late

if os.environ.get("FAULT_ABORT_AT_EXIT_RANK", "none") == os.environ.get("RANK"):
    import atexit

    atexit.register(os.abort)

_hang = os.environ.get("FAULT_HANG_IN_EVALUATION")
if _hang:
    import time

    import torch
    import torch.nn.functional

    def _hanging(cross_entropy):
        def cross_entropy_or_hang(input, target, *args, **kwargs):
            if not torch.is_grad_enabled():  # evaluation
                open(_hang, "w").close()
                while True:
                    time.sleep(1)
            return cross_entropy(input, target, *args, **kwargs)
        return cross_entropy_or_hang

    torch.nn.functional.cross_entropy = _hanging(torch.nn.functional.cross_entropy)

_image = os.environ.get("FAULT_FAIL_SAVING_IMAGE")
if _image:
    from PIL import Image

    def _failing_image(save):
        def save_or_fail(self, fp, *args, **kwargs):
            if os.path.basename(str(fp)).startswith(_image):  # the file, or its temporary name beside it
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(fp))
            return save(self, fp, *args, **kwargs)
        return save_or_fail

    Image.Image.save = _failing_image(Image.Image.save)

_fill_after = os.environ.get("FAULT_FILL_DISK_AFTER_SAVING_IMAGE")
if _fill_after:
    from PIL import Image

    def _filling_after(save):
        def save_then_fill(self, fp, *args, **kwargs):
            result = save(self, fp, *args, **kwargs)
            if os.path.basename(str(fp)).startswith(_fill_after):
                with open(os.path.join(os.path.dirname(str(fp)), "filler"), "wb", buffering=0) as f:
                    try:
                        while True:
                            f.write(bytes(2**16))
                    except OSError:  # ENOSPC: full
                        pass
            return result
        return save_then_fill

    Image.Image.save = _filling_after(Image.Image.save)

_kill_writing = os.environ.get("FAULT_KILL_WRITING")
if _kill_writing:
    import pathlib
    import signal

    _open = pathlib.Path.open

    class _DyingFile:
        def __init__(self, file):
            self.file = file

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, text):
            self.file.write(text[:len(text) // 2])
            self.file.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        def writelines(self, lines):
            for line in lines:
                self.write(line)

    def _open_to_die(self, mode="r", *args, **kwargs):
        file = _open(self, mode, *args, **kwargs)
        return _DyingFile(file) if self.name.partition(".")[0] == _kill_writing and "w" in mode else file

    pathlib.Path.open = _open_to_die

if os.environ.get("FAULT_SIGTERM_IN_TRAINING"):
    import signal

    import torch
    import torch.nn.functional

    def _terminating(cross_entropy):
        def cross_entropy_and_terminate(input, target, *args, **kwargs):
            if torch.is_grad_enabled():
                os.kill(os.getpid(), signal.SIGTERM)
            return cross_entropy(input, target, *args, **kwargs)
        return cross_entropy_and_terminate

    torch.nn.functional.cross_entropy = _terminating(torch.nn.functional.cross_entropy)

_syncs = os.environ.get("RECORD_SYNCS")
if _syncs:
    _fsync, _replace = os.fsync, os.replace

    def _record(*words):
        with open(_syncs, "a") as f:
            f.write("\t".join(words) + "\n")

    def fsync_and_record(descriptor):
        _fsync(descriptor)
        _record("fsync", os.readlink(f"/proc/self/fd/{descriptor}"))

    def replace_and_record(source, target, *args, **kwargs):
        _replace(source, target, *args, **kwargs)
        _record("replace", os.path.realpath(source), os.path.realpath(target))

    os.fsync, os.replace = fsync_and_record, replace_and_record
