"""The run's folder: new, empty, or a run of these recipes to resume or overwrite; one folder for every process and
every node; and the trackers that record into it."""

import atexit
import contextlib
import fcntl
import itertools
import os
import shutil
import time
import uuid
from pathlib import Path

from accelerate import PartialState
from accelerate.utils import broadcast_object_list, gather_object

from shared.errors import RecipeError, check_launch
from shared.limits import walk
from shared.resume import find_checkpoint, read_json
from shared.tracking.run_files import RunFiles
from shared.tracking.trackers import TensorBoard, WandB

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
        recorded = read_json(Path(output_dir) / "config.json") if output_dir else None
        if isinstance(recorded, dict) and Path(recorded.get("checkpoint_dir") or "/").resolve() == checkpoint.parent:
            its_run = Path(output_dir).resolve()  # a checkpoint in the run's --checkpoint_dir
        if output_dir is None and not (its_run and is_run(its_run)):
            raise RecipeError(f"--resume {cfg.resume} is not in a run's checkpoints/ folder, so there is no run to "
                              "continue in: add --output_dir NEW_FOLDER to continue it there as a new run")
        output_dir = output_dir or its_run
        check_entries(checkpoint)
        if Path(output_dir).resolve() != its_run and (Path(output_dir) / "config.json").exists():
            raise RecipeError(f"--resume {cfg.resume} is not a checkpoint of {output_dir}, which holds another run: "
                              "pass a new --output_dir to continue the checkpoint there (two histories never mix)")
    if output_dir is None:
        name, stamp = [None], time.strftime("%Y%m%d-%H%M%S")
        if state.is_main_process:
            name = [new_folder(f"runs/{recipe}{'-synthetic' if cfg.synthetic else ''}-{stamp}")]
        broadcast_object_list(name)  # processes start a second apart; they must share one folder
        output_dir = name[0]
    run_dir = Path(output_dir)
    if run_dir.is_dir():
        check_entries(run_dir)
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
        if cfg.output_dir is None or not run_dir.exists():  # made by this start (new_folder made the default one)
            atexit.register(remove_if_empty, run_dir)  # a start that fails leaves no empty folder behind
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            lock(run_dir)
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
    run_id = read_json(run_dir / "config.json")["run_id"] if cfg.resume and is_run(run_dir) else None
    run_id, labels = run_id or uuid.uuid4().hex[:8], {"synthetic": True} if cfg.synthetic else {}
    chosen = {"wandb": lambda: [WandB(recipe, run_dir, run_id, tags=list(labels))],
              "tensorboard": lambda: [TensorBoard("tensorboard", run_dir)], "none": lambda: []}[cfg.tracker]()
    # RunFiles first: its config.json makes the folder a run before wandb or TensorBoard write into it, so a job
    # stopped between the two is still a run to its next start.
    return run_dir, [RunFiles(run_dir, run_id, labels)] + chosen


def remove_if_empty(folder: Path) -> None:
    with contextlib.suppress(OSError):  # holding anything (a run's files), it stays
        folder.rmdir()


def new_folder(base: str) -> str:
    """`base`, or `base`-2, -3, ...: the first that did not exist, made here. mkdir is atomic, so two runs started in
    the same second get a folder each (with the same name, the second found the first's lock). Where nothing can be
    made, `base`: the write check after says why, in one line."""
    for n in itertools.count(1):
        name = base if n == 1 else f"{base}-{n}"
        try:
            Path(name).mkdir(parents=True)
            return name
        except FileExistsError:
            continue
        except OSError:
            return base


def check_entries(folder: Path) -> None:
    """Refuse a folder from elsewhere (a colleague's run, a download) that holds a symbolic link or a special file:
    written through, a link changes a file outside the run; read, a FIFO blocks forever. wandb/ must be a folder, and
    what is in it is wandb's: it links its logs there, and replaces its links (a rename) instead of writing through."""
    for entry in walk(folder, skip=Path(folder) / "wandb"):
        if not entry.is_file(follow_symlinks=False):
            kind = "a symbolic link" if entry.is_symlink() else "a FIFO, socket or device, not a regular file"
            raise RecipeError(f"{entry.path!r} is {kind}: nothing in a run folder is written or read through one (it "
                              "may lead outside the run, or block): replace it by a copy of the file, or delete it "
                              "(checkpoints on another disk: --checkpoint_dir DIR)")


_LOCKS: dict[Path, int] = {}  # run folder -> its open descriptor, locked while this process runs in it


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
    config = read_json(Path(folder) / "config.json")
    return isinstance(config, dict) and isinstance(config.get("run_id"), str) and "recipe" in config
