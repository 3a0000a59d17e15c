"""Which checkpoint --resume names, and what a resume continues: steps left, and what changed since the checkpoint
(the config.json beside it) and what that does to the sample order, exactness and schedule."""

import json
import re
from pathlib import Path

from accelerate import PartialState

from shared.errors import RecipeError

STEP_DIR = re.compile(r"step_(\d+)$")
DATA_ORDER_KEYS = ("data", "synthetic", "train_size", "seed")  # change one, and the rest of the epoch is another
BATCHING_KEYS = ("world_size", "batch_size", "grad_accum")  # these only cut the same order into other batches
# Not settings of the training: where the run was started from, and which copy of the script ran it.
MAX_JSON_BYTES = 2**24  # a config.json: a few KB, up to about 2 MB with 100,000 class names
NOT_SETTINGS = ("resume", "resumed_step", "resumed_from", "run_id", "overwrite", "output_dir", "versions", "script",
                "checkpoint_dir")


def read_json(path: Path):
    """A run's JSON file (config.json), or None if missing, not a regular file (a FIFO would block the read), damaged,
    over MAX_JSON_BYTES or nested past Python's recursion limit: a run folder may come from anywhere."""
    try:
        if path.is_file():
            with path.open("rb") as f:
                raw = f.read(MAX_JSON_BYTES + 1)  # no more, whatever the file's size says
            return json.loads(raw) if len(raw) <= MAX_JSON_BYTES else None
    except (OSError, ValueError, RecursionError):
        pass
    return None


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints in a run's checkpoint folder, oldest first."""
    found = [p for p in Path(folder).glob("step_*") if p.is_dir() and STEP_DIR.search(p.name)]
    return sorted(found, key=lambda p: int(STEP_DIR.search(p.name).group(1)))


def find_checkpoint(folder: Path | None, resume: str) -> Path:
    """The checkpoint --resume names: the newest complete one in a run's checkpoint folder (`latest`), or a
    checkpoint folder."""
    if resume != "latest":
        if not (Path(resume) / "custom_checkpoint_0.pkl").is_file() or not STEP_DIR.search(Path(resume).name):
            raise RecipeError(f"--resume {resume}: not a checkpoint folder (expected checkpoints/step_<N> of a run)")
        return Path(resume)
    checkpoints = list_checkpoints(folder)
    if not checkpoints:
        raise RecipeError(f"--resume latest: {folder} has no checkpoints: start it without --resume, "
                          "or pass --output_dir of a run that saved one (--checkpoint_every N)")
    return checkpoints[-1]


def check_resume(checkpoint: Path, config: dict, progress) -> None:
    """Refuse a resume with no step left to run (`progress`: the restored Progress). Otherwise print where the run
    continues, what changed since the checkpoint (the config.json beside it), and what that does to the sample
    order, exactness and schedule."""
    checkpoint, total_steps = Path(checkpoint), config["total_steps"]
    if progress.step > total_steps:
        raise RecipeError(f"--resume {checkpoint} is at step {progress.step}, past the {total_steps} steps asked for: "
                          "raise --max_steps or --epochs, or resume from an earlier checkpoint")
    finishing = progress.step == total_steps  # the last step's checkpoint; the weights, unless the run was stopped
    if finishing and (Path(config["output_dir"]) / "model.safetensors").exists():
        raise RecipeError(f"{config['output_dir']} already finished its {total_steps} steps: "
                          "raise --max_steps or --epochs to train on")
    if not PartialState().is_main_process:
        return
    if finishing:  # stopped after its last checkpoint, before its weights: the recipe evaluates and writes them
        return print(f"resuming from {checkpoint}: its last step ({total_steps}), the run stopped before writing its "
                     "weights: evaluating and writing them now")
    epoch, left = progress.epoch + 1, config["train_size"] - progress.samples_into_epoch
    print(f"resuming from {checkpoint}: step {progress.step}, epoch {epoch} after {progress.samples_into_epoch} of its "
          f"{config['train_size']} samples")
    # The configuration that wrote the checkpoint: saved in it (older checkpoints: the run's, beside it).
    previous = next((p for p in (checkpoint / "config.json", checkpoint.parent.parent / "config.json") if p.is_file()),
                    None)
    before = read_json(previous) if previous else None
    if not isinstance(before, dict):
        return print(f"no readable config.json in or beside {checkpoint}: what changed since it cannot be listed")
    changed = [key for key in config if key not in NOT_SETTINGS and before.get(key) != config[key]]
    if not changed:
        return print("same configuration: the run continues exactly, to the same weights as a run never stopped")
    print("changed since the checkpoint: " + ", ".join(f"{k} {before.get(k)!r} -> {config[k]!r}" for k in changed))
    if any(key in DATA_ORDER_KEYS for key in changed):
        print(f"the sample order is NOT a run's never stopped ({', '.join(k for k in changed if k in DATA_ORDER_KEYS)} "
              f"changed): the rest of epoch {epoch} follows another order, so some of its samples are trained on "
              "twice and others not at all")
    elif any(key in BATCHING_KEYS for key in changed):
        print(f"the sample order continues exactly: the rest of epoch {epoch} is the {left} samples not yet trained "
              f"on, in global batches of {config['global_batch_size']} (a remainder smaller than one is dropped, "
              "as at the end of every epoch)")
    else:
        print("the sample order continues exactly")
    if "total_steps" in changed:
        print(f"length {before.get('total_steps')} -> {total_steps} steps, learning rate: {config['lr_schedule']}")
