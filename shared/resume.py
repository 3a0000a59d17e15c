"""Resuming a run (--resume), in one place: where its checkpoint is, whether it is this run's, what changed since.
Imported only where a run resumes or replaces a run, is stopped by a signal, is given a --checkpoint_dir or cannot
write a checkpoint (an opt-in module).

- `check_run_folder`: a folder that already holds files is a run to resume or replace (open_run), and
  `check_entries`: it, or a checkpoint from anywhere, holds no link or special file;
- `recorded_flags`: the flags a resume continues with, those its run's config.json records (Config.parse);
- `run_of_checkpoint`: the run folder that --resume PATH, a checkpoint folder, continues (open_run);
- `check_checkpoint_folder`: a --checkpoint_dir holds this run's checkpoints and nothing else (open_run, for a new run
  too);
- `find_checkpoint`: the checkpoint --resume names; `load`: it, loaded after checking that no file in it can run
  code (Checkpoints.resume); `changes`: the settings that differ from a checkpoint's, which both say;
- `checked_progress`: a checkpoint's Progress, checked (Progress.load_state_dict);
- `check_resume_and_branch`: what a resume continues (steps left, what changed since the checkpoint and what that
  does to the sample order, exactness and schedule); from an older checkpoint than the newest, the later history
  moved aside (`branch`); `cut_metrics`: metrics.jsonl cut back to the checkpoint's step, and the summary so far
  (RunFiles); `set_finished_aside`: a finished run's files moved aside when a resume extends it
  (Checkpoints.save_weights);
- `interrupted`: the line a first Ctrl-C prints, and `resume_command`: the command that continues a run, printed
  when a signal stops it (StopOnSignals);
  `write_failed`: the line that names the checkpoint to continue from when a checkpoint or the weights could not be
  written (Checkpoints).
"""

import dataclasses
import errno
import json
import os
import re
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
from accelerate import PartialState
from accelerate.utils import compare_versions, set_seed
from accelerate.utils import load as accelerate_load  # torch.load(weights_only=True) + NumPy RNG types

from shared.bounds import walk
from shared.checkpoints import STEP_DIR, list_checkpoints, new_folder, run_id
from shared.config import read_json
from shared.errors import RecipeError, first_line
from shared.pictures import MAX_KEYS, read_rows
from shared.tracking import RUN_FILES, write_atomic

# Change one, and the rest of the epoch is another order: each epoch's is (seed, epoch)'s permutation of the training
# set's size. Another --data of as many images (the same folder by another path, say) continues the same order.
DATA_ORDER_KEYS = ("train_size", "seed")
BATCHING_KEYS = ("world_size", "batch_size", "grad_accum")  # these only cut the same order into other batches
# Not settings of the training: where the run was started from, and which copy of the script ran it.
NOT_SETTINGS = ("resume", "resumed_step", "resumed_from", "run_id", "overwrite", "output_dir", "versions", "script",
                "checkpoint_dir")
# Flags a resume takes from the command line only: where the run writes and what it continues (a run folder may come
# from anywhere, and never chooses those).
FROM_THE_COMMAND_LINE = ("resume", "output_dir", "overwrite", "checkpoint_dir")
FINISHED_FILES = ("model.safetensors", "summary.json", "curves.png", "confusion_matrix.png")  # a finished run's record
RENAMED = {"samples_seen": "samples_into_epoch", "best_eval_acc": "max_eval_acc"}  # Progress, in older checkpoints
SECOND_INTERRUPT_S = 1.0  # a SIGINT this long after the first is the user's second Ctrl-C, not torchrun's copy
MOST = {"max_eval_acc": 1, "pieces": 10**6, "train_s": 10**9, "wall_s": 10**9}  # Progress's bounds; the others: 2**62
# The variables of the launch a resume needs, and no others (an allow-list: the printed line is pasted, shown and kept
# in wandb's log): accelerate's settings, the GPUs seen (CUDA_VISIBLE_DEVICES counts in CUDA_DEVICE_ORDER's order),
# torch's threads and the kernels' settings (another thread count, CPU instruction set, TF32 or cuBLAS workspace sums
# in another order: the resume is no longer bitwise; docs/resume.md sets CUBLAS_WORKSPACE_CONFIG for bitwise GPU runs),
# the GPU memory allocator's (a run that fits only with expandable_segments, as torch's out-of-memory error advises),
# where the data and weights were found, and wandb's mode and project.
RESUME_ENVIRONMENT = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "OMP_NUM_THREADS", "ATEN_CPU_CAPABILITY",
                      "ONEDNN_MAX_CPU_ISA", "NVIDIA_TF32_OVERRIDE", "CUBLAS_WORKSPACE_CONFIG",
                      "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "HF_HOME", "HF_DATASETS_CACHE",
                      "HF_HUB_OFFLINE", "TORCH_HOME", "WANDB_MODE", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_DIR")
RUN_ID = re.compile(r"[0-9A-Za-z]{1,64}")  # a run id is one name in wandb's folders and URLs
SECRET = re.compile(r"KEY|TOKEN|SECRET|PASS|AUTH|CREDENTIAL|COOKIE", re.IGNORECASE)  # in a variable's name


def is_run(folder: Path) -> bool:
    """Whether `folder` holds a run of these recipes: its config.json, with the run id every run records (8 hex digits;
    wandb continues the run of that id, and refuses one with a character such as / in a traceback)."""
    config = read_json(folder / "config.json")
    return (isinstance(config, dict) and isinstance(config.get("run_id"), str)
            and RUN_ID.fullmatch(config["run_id"]) is not None and "recipe" in config)


def recorded_flags(cfg, argv: list[str]):
    """The flags of the run that --resume continues, as words of a command line, and the config.json they come from:
    the one saved in the checkpoint (`--resume latest`: the run's own). Every field of the Config it records but those
    given in `argv` and those FROM_THE_COMMAND_LINE, each to be parsed as if typed; refused: a run of another recipe,
    and a --data that names no folder here and is not the recipe's own (a run folder never makes a run fetch)."""
    recipe = getattr(sys.modules[type(cfg).__module__], "RECIPE", None)
    latest = cfg.resume == "latest"
    if latest and not cfg.output_dir:  # never a guess at which run the user meant
        raise ValueError(f"--resume latest needs the run to continue: add --output_dir runs/{recipe}-<time>")
    path = recorded_path(cfg)
    if latest and not path.exists():  # else the recipe's defaults: its hub data, fetched for nothing
        raise ValueError(f"--resume latest: no run in {path.parent} (looked for {path.absolute()}): pass the run's "
                         "folder, as a full path or from the folder the run was started in")
    recorded = read_json(path)
    if not isinstance(recorded, dict):
        return [], path  # none: the flags given (a run that is none: open_run says so)
    if recorded.get("recipe") not in (None, recipe):
        raise ValueError(f"{path} is a run of {str(recorded['recipe'])[:60]}, not of {recipe}: resume it with the "
                         "recipe that wrote it")
    # A resume's weights are its checkpoint's: another file would change nothing, yet be recorded as the run's start
    if cfg.init_from and cfg.init_from != recorded.get("init_from"):
        raise ValueError(f"--init_from {cfg.init_from}: a resume takes its weights from its checkpoint, and "
                         "--init_from starts a new run from a file: leave it out, or start a new run in a new "
                         "--output_dir")
    given = {word[2:].split("=")[0].removeprefix("no-") for word in argv if word.startswith("--")}
    kept = recorded.get("checkpoint_dir")  # where the run's checkpoints go: a run writes only where told
    if kept and "checkpoint_dir" not in given:
        raise ValueError(f"{path} keeps its checkpoints in {str(kept)[:200]!r}: pass --checkpoint_dir with that "
                         "folder to continue it")
    # --resume latest looks in the --checkpoint_dir given: one other than the run's, without its checkpoints, read as
    # a run that saved none
    if latest and "checkpoint_dir" in given and kept != cfg.checkpoint_dir and not list_checkpoints(
            Path(cfg.checkpoint_dir)):
        raise ValueError(f"{path} keeps its checkpoints in {str(kept or path.parent / 'checkpoints')[:200]!r}, and "
                         f"--checkpoint_dir {cfg.checkpoint_dir} holds none: continue it with "
                         f"{'that --checkpoint_dir' if kept else 'no --checkpoint_dir'}, or move them there first")
    words = []
    for field in dataclasses.fields(cfg):
        value = recorded.get(field.name)
        synthetic = field.name == "data" and recorded.get("synthetic") is True  # recorded as "SYNTHETIC data"
        if field.name in (*FROM_THE_COMMAND_LINE, *given) or value is None or synthetic:
            continue
        if field.name == "data" and value != field.default and not os.path.exists(os.path.expanduser(str(value))):
            # A relative path is read from the folder the run was started in: the run folder, less the --output_dir
            # it recorded (runs/x, given as ~/project/runs/x, was started in ~/project). The run folder: a
            # checkpoint's two folders up (<run>/checkpoints/step_<N>), else the --output_dir given (--resume latest's,
            # or the run that a checkpoint in its --checkpoint_dir continues)
            checkpoints = path.absolute().parent.parent
            in_run = not latest and checkpoints.name == "checkpoints"
            run = checkpoints.parent if in_run else Path(cfg.output_dir or "").absolute()
            start = str(run).removesuffix(os.sep + str(recorded.get("output_dir")))
            value = os.path.join(start, str(value))
            if not os.path.exists(value):
                raise ValueError(f"{path} records --data {str(recorded['data'])[:200]!r}, which is no folder here "
                                 "(a relative path is read from the folder a run is started in): pass --data to "
                                 "continue (a run folder never makes a run fetch what it names)")
        # one word a flag, `--name=value`: a value that starts with "--" stays a value
        words.append(f"--{'no-' * (not value)}{field.name}" if isinstance(value, bool) else f"--{field.name}={value}")
    return words, path


def recorded_path(cfg) -> Path:
    """The config.json whose flags a resume continues with: its run's (--resume latest), or its checkpoint's."""
    return Path(cfg.output_dir if cfg.resume == "latest" else cfg.resume) / "config.json"


def check_checkpoint_folder(folder: str | Path, run: str | None, run_dir: Path) -> list[Path]:
    """A --checkpoint_dir, before anything is written: it may hold only checkpoints (complete or partial) of the run
    whose id is `run` (the run resumed, or the one --overwrite replaces), which are returned. Anything else is
    refused, since pruning, --resume latest and --overwrite would act on it; so is the run folder or one above it,
    which the run's own files fill (a new run's start found it empty, and its resume refused it)."""
    folder = Path(folder)
    if run_dir.resolve().is_relative_to(folder.resolve()):
        raise RecipeError(f"--checkpoint_dir {folder} holds the run folder {run_dir}: pass a folder of its own (on a "
                          f"scratch disk, say), or leave it out for {run_dir / 'checkpoints'}")
    if not os.path.lexists(folder):  # made by the first save; a file, or a link to nothing, is refused here, not there
        return []
    check_entries(folder)
    entries = sorted(folder.iterdir())
    for entry in entries:
        if entry.name == ".shared_check":  # left by a start of several nodes killed within its check (check_shared)
            continue
        owner = run_id(entry)
        if not (re.fullmatch(r"(partial_)?step_\d+", entry.name) and run and owner == run):
            found = f"a checkpoint of run {owner!r}" if owner else "no checkpoint of this run"
            raise RecipeError(f"--checkpoint_dir {folder} holds {entry.name!r}, {found}: a checkpoint folder holds one "
                              "run's checkpoints (this run's pruning and --resume latest would take the rest for its "
                              "own): pass an empty or new folder, or move that out")
    return entries


def run_of_checkpoint(cfg) -> Path:
    """--resume PATH, a checkpoint folder: the run folder it continues (its own run's; or --output_dir, a new run or
    the run whose --checkpoint_dir holds it), checked."""
    output_dir = Path(cfg.output_dir) if cfg.output_dir else None
    checkpoint = find_checkpoint(None, cfg.resume).resolve()
    its_run = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None
    recorded = read_json(output_dir / "config.json") if output_dir else None
    kept = str(recorded.get("checkpoint_dir") or "/") if isinstance(recorded, dict) else "/"  # from a file: any value
    if "\0" not in kept and Path(kept).resolve() == checkpoint.parent:  # a NUL: no path (resolve's ValueError)
        its_run = output_dir.resolve()  # a checkpoint in the run's --checkpoint_dir
    if output_dir is None and not (its_run and is_run(its_run)):
        raise RecipeError(f"--resume {cfg.resume} is not in a run's checkpoints/ folder, so there is no run to "
                          "continue in: add --output_dir NEW_FOLDER to continue it there as a new run")
    output_dir = output_dir or its_run
    check_entries(checkpoint)
    if output_dir.resolve() != its_run and (output_dir / "config.json").exists():
        raise RecipeError(f"--resume {cfg.resume} is not a checkpoint of {output_dir}, which holds another run: "
                          "pass a new --output_dir to continue the checkpoint there (two histories never mix)")
    return output_dir


def find_checkpoint(folder: Path | None, resume: str, run: str | None = None) -> Path:
    """The checkpoint --resume names: the run's (id `run`) newest complete one in its checkpoint folder (`latest`),
    or a checkpoint folder."""
    if resume != "latest":
        where = Path(resume)
        if (where / "custom_checkpoint_0.pkl").is_file() and STEP_DIR.fullmatch(where.name):
            return where
        # Not there: a step mistyped, or a checkpoint the run has pruned since
        found = "not a checkpoint folder (expected checkpoints/step_<N> of a run)" if where.exists() else (
            "no such folder: pass a checkpoint that exists (a run's checkpoints/step_<N>), or --resume latest")
        if where.name.startswith("partial_step_"):  # renamed step_<N> once whole (Checkpoints.save)
            found = "a checkpoint whose save did not finish: resume from a complete one, a step_<N> beside it"
        elif is_run(where):
            found = f"a run folder: continue it with --resume latest --output_dir {resume}"
        elif where.name == "checkpoints" and is_run(where.parent):
            found = f"its run's checkpoints: continue the run with --resume latest --output_dir {where.parent}"
        raise RecipeError(f"--resume {resume}: {found}")
    checkpoints = list_checkpoints(folder, run)
    if not checkpoints:
        raise RecipeError(f"--resume latest: {folder} has no checkpoints: start the run again without --resume (with "
                          "--overwrite where its folder holds it, replacing any model.safetensors: to train on from "
                          "it, --init_from it in a new --output_dir), or pass --output_dir of a run that saved one")
    return checkpoints[-1]


def check_resume(checkpoint: Path, config: dict, progress) -> None:
    """Refuse a resume with no step left to run (`progress`: the restored Progress). Otherwise print where the run
    continues, what changed since the checkpoint (the config.json saved in it), and what that does to the sample
    order, exactness and schedule."""
    total_steps = config["total_steps"]
    # The flag that makes the run longer: a --max_steps the run has wins over --epochs (a larger --epochs alone
    # changes nothing, so naming both misled)
    longer = f"--max_steps (its {config['max_steps']} wins over --epochs)" if config.get("max_steps") else "--epochs"
    if checkpoint.name != f"step_{progress.step}":  # the name orders a run's checkpoints: --resume latest, pruning
        raise RecipeError(f"--resume {checkpoint} holds step {progress.step}: its folder was renamed or copied; "
                          f"name it step_{progress.step} or move it aside, then resume")
    if progress.step > total_steps:
        raise RecipeError(f"--resume {checkpoint} is at step {progress.step}, past the {total_steps} steps asked for: "
                          f"raise {longer}, or resume from an earlier checkpoint")
    finishing = progress.step == total_steps  # the last step's checkpoint; the weights, unless the run was stopped
    # Finished: the weights, and curves.png, the last file a run's end writes (RunFiles.finish). Weights without it:
    # that end was cut short (a full disk after model.safetensors), and the resume its error printed writes them again
    if finishing and os.path.exists(f"{config['output_dir']}/model.safetensors") and os.path.exists(
            f"{config['output_dir']}/curves.png"):
        raise RecipeError(f"{config['output_dir']} already finished its {total_steps} steps: "
                          f"raise {longer} to train on")
    if not PartialState().is_main_process:
        return
    if finishing:  # stopped after its last checkpoint, before its weights: the recipe evaluates and writes them
        return print(f"resuming from {checkpoint}: its last step ({total_steps}), the run stopped before writing its "
                     "final files (weights, summary, pictures): evaluating and writing them now")
    before = read_json(checkpoint / "config.json")  # the configuration that wrote the checkpoint, saved in it
    epoch = progress.epoch + 1
    # The position is in the checkpoint's epoch: of its data's size (another --data may hold fewer samples)
    # What a config.json from anywhere holds is cut to a length where it is printed (`!s:.100`: 100 characters)
    print(f"resuming from {checkpoint}: step {progress.step}, epoch {epoch} after {progress.samples_into_epoch} of its "
          f"{(before if isinstance(before, dict) else config).get('train_size', config['train_size'])!s:.100} samples")
    if not isinstance(before, dict):
        return print(f"no readable config.json in {checkpoint}: what changed since it cannot be listed")
    changed = changes(before, config)
    # A flag of the checkpoint's run that this recipe does not have (another version of it, an edited copy): gone.
    # Among its first 1,000 keys (a run records about 60): a file from anywhere may hold a million
    changed |= {key: f"{key:.60} {before[key]!r:.100} -> no such flag" for key in list(before)[:1000]
                if key not in config and key not in NOT_SETTINGS and key.isidentifier()}
    # Another release of torch or its libraries may compute the same step to other last bits (a GPU's kernels most)
    versions = before.get("versions") if isinstance(before.get("versions"), dict) else {}
    # A library one of the two runs did not import is no change (None: datasets, which accelerate imports on several
    # processes, and a recipe only for data that needs it)
    if moved := [f"{k} {versions[k]!s:.100} -> {v}" for k, v in config["versions"].items()
                 if None not in (versions.get(k), v) and versions[k] != v]:
        print(f"other versions than the checkpoint's: {', '.join(moved)}: the same steps, perhaps not to the same bits")
    if not changed:
        return print("same configuration: " + ("the sample order continues exactly" if moved else
                                               "the run continues exactly, to the same weights as a run never stopped"))
    print("changed since the checkpoint: " + ", ".join(changed.values()))
    if changed.keys() & DATA_ORDER_KEYS:
        print(f"the sample order is NOT a run's never stopped ({', '.join(k for k in changed if k in DATA_ORDER_KEYS)} "
              f"changed): the rest of epoch {epoch} follows another order, so some of its samples are trained on "
              "twice and others not at all")
    elif changed.keys() & BATCHING_KEYS:
        print(f"the sample order continues exactly: the rest of epoch {epoch} is the "
              f"{config['train_size'] - progress.samples_into_epoch} samples not yet trained on, in global batches "
              f"of {config['global_batch_size']} (a remainder smaller than one is dropped, as at the end of every "
              "epoch)")
    else:
        print("the sample order continues exactly")
    # A larger --epochs where the run's --max_steps wins changes no length, and says so
    if "total_steps" in changed or "epochs" in changed:
        print(f"length {before.get('total_steps')!s:.100} -> {total_steps} steps, set by {longer}, learning rate: "
              f"{config['lr_schedule']}")


def changes(before: dict, now: dict) -> dict[str, str]:
    """The settings of `now` that differ from `before` (a checkpoint's config.json): name -> 'name before -> now'. A
    --synthetic run records its data as "SYNTHETIC data": the --data flag it leaves unused is no change."""
    return {key: f"{key} {before.get(key)!r:.200} -> {value!r}" for key, value in now.items()
            if key not in NOT_SETTINGS and before.get(key) != value and not (key == "data" and now.get("synthetic"))}


def load(checkpoints, progress) -> Path:
    """The checkpoint --resume names, loaded by accelerator.load_state (restoring `progress` too) after checking that
    no file in it can run code; returned. On another number of processes than the checkpoint's, every process is
    re-seeded."""
    from shared.pickles import check_archive  # files from anywhere, checked: an opt-in module

    accelerator = checkpoints.accelerator
    checkpoint = find_checkpoint(checkpoints.folder, checkpoints.cfg.resume, checkpoints.owner())
    check_entries(checkpoint)  # --checkpoint_dir: outside the run folder its open_run checked
    # A damaged file's fix: the run's checkpoint before this one, named, where there is one
    saved = list_checkpoints(checkpoint.parent, checkpoints.owner())
    earlier = saved[:saved.index(checkpoint)] if checkpoint in saved else []
    other = f"resume from the one before it: --resume {earlier[-1]}" if earlier else "resume from another checkpoint"
    # The random states name NumPy's array rebuilder by the module of the NumPy that wrote them (numpy.core in 1.x,
    # numpy._core in 2.x), and accelerate allows only this NumPy's name: a checkpoint written under the other major
    # version (a run moved to another machine) was refused as corrupt. The same function, under both names.
    rebuild = np.array(0).__reduce__()[0]
    numpy_names = [(rebuild, f"{module}.multiarray._reconstruct") for module in ("numpy.core", "numpy._core")]
    with torch.serialization.safe_globals(numpy_names):
        for pickled in sorted(path for path in checkpoint.iterdir() if path.suffix in (".pkl", ".bin", ".pt")):
            check_archive(pickled, fix=other)
            try:  # accelerate loads registered objects with weights_only=False: refuse what weights_only would
                accelerate_load(pickled, map_location="cpu")
            except Exception as error:
                raise RecipeError(f"--resume {checkpoint}: {pickled.name} is corrupt or holds more than tensors "
                                  f"and numbers ({type(error).__name__}): {other}") from None
        try:
            accelerator.load_state(checkpoint)
        except Exception as error:  # another model's (a size mismatch, a missing key), or a damaged file
            # torch's line of what does not fit, or accelerate's count of the registered objects (--ema added)
            mismatch = ("size mismatch", "Missing key", "Unexpected key", "Number of custom checkpoints")
            detail = next((line for line in map(str.strip, str(error).splitlines()) if line.startswith(mismatch)), None)
            fix = "resume with the recipe and flags that wrote it, or from another checkpoint" if detail else other
            # The cause: flags given with --resume that differ from the checkpoint's (--model, --no-batch_norm)
            before = read_json(checkpoint / "config.json")
            flags = changes(before, vars(checkpoints.cfg)) if isinstance(before, dict) else {}
            changed = f"; changed since it: {', '.join(flags.values())}" if detail and flags else ""
            raise RecipeError(f"--resume {checkpoint} cannot be loaded into this run ({type(error).__name__}: "
                              f"{(detail or first_line(error))[:200].rstrip('.:')}{changed}): {fix}") from None
    # Checkpoints fall between optimizer steps. The micro-batch counter saved with them would, under another
    # --grad_accum, end the first accumulation early (10 batches saved, --grad_accum 4: a step after 2).
    accelerator.step = 0
    saved_processes = len(list(checkpoint.glob("random_states_*.pkl")))
    if saved_processes != accelerator.num_processes:
        # Each process restores random_states_<its rank>.pkl, and accelerate skips a missing one silently: 1 -> 2
        # would leave the new process replaying the start of the run (accelerate #784).
        set_seed(checkpoints.cfg.seed + progress.step, device_specific=True)
        accelerator.print(
            f"the checkpoint was written by {saved_processes} process(es), this run has "
            f"{accelerator.num_processes}: their random states do not map onto each other, so every "
            f"process is re-seeded from (--seed, step {progress.step}, rank). Augmentation and dropout draws "
            "differ from a run never stopped: bitwise equality holds only on the same world size")
    return checkpoint


def branch(checkpoints, checkpoint: Path, step: int) -> None:
    """Resumed from a checkpoint older than the run's newest: move the later history (its checkpoints, final
    weights, summary, pictures and predict.py's predictions, a copy of its metrics) aside into abandoned/, so that it
    is neither deleted nor ever continued by --resume latest or mixed into this history's files (predictions of the
    abandoned weights, left, read as the new ones')."""
    later = [p for p in list_checkpoints(checkpoints.folder, checkpoints.owner()) if int(p.name.split("_")[1]) > step]
    if checkpoints.accelerator.is_main_process and later:
        # -2, -3 after the name for branches from one step in one second; a read-only abandoned/ (a run folder
        # from elsewhere) makes nothing, and the first move fails, before anything moved
        aside = new_folder(f"{checkpoints.run_dir}/abandoned/after_step_{step}-{time.strftime('%Y%m%d-%H%M%S')}")
        try:  # the copies first, which need room on the disk; then the moves, renames within it, which need none
            for name in ("metrics.jsonl", "config.json"):
                if (checkpoints.run_dir / name).exists():
                    shutil.copy2(checkpoints.run_dir / name, aside / name)
            for path in later + finished_files(checkpoints.run_dir):
                os.replace(path, aside / path.name)
        except OSError as error:
            raise RecipeError(f"moving the run's later history aside into {aside} failed ({error.strerror}): "
                              f"{aside.parent} must be a folder you can write in (and the run's folders too), "
                              "with room on its disk, then resume again; nothing was deleted") from None
        print(f"{checkpoint} is older than the run's newest checkpoint ({later[-1].name}): this is a new branch "
              f"of the run; the later history ({', '.join(p.name for p in later)}) moved to {aside}")
    checkpoints.accelerator.wait_for_everyone()


def check_resume_and_branch(checkpoints, config: dict, progress) -> bool:
    """After a resume: refuse it if no step is left to run; print where the run continues and what changed; from an
    older checkpoint than the newest, move the later history aside (`branch`). Returns whether a finished run is
    extended (resumed with more steps): its final files then stay as they are until the longer run finishes."""
    check_resume(checkpoints.resumed_from, config, progress)
    branch(checkpoints, checkpoints.resumed_from, progress.step)
    # Weights still there (no later history) before the last step: a finished run made longer. At the last step they
    # are this run's own, whose end was cut short: written again in place
    extending = progress.step < config["total_steps"] and (checkpoints.run_dir / "model.safetensors").exists()
    if extending:
        checkpoints.accelerator.print(
            f"extending the finished run to {config['total_steps']} steps: its model.safetensors and "
            f"summary.json stay until this run finishes, then move to {checkpoints.run_dir / 'finished'}/")
    return extending


def checked_progress(fresh: dict, state: dict) -> dict:
    """A checkpoint's Progress (`state`), as `fresh` (a new Progress's values) holds it: each a count (an int) or a
    measure (an int or a float), within its range, which NaN is in none of (an accuracy, under a million launches,
    seconds under 30 years). Refused, as a ValueError: anything else."""
    state = {RENAMED.get(key, key): value for key, value in state.items()}
    if "samples_into_epoch" not in state:
        raise ValueError("this checkpoint counts its place in the epoch in batches, as the recipes did before "
                         "they counted samples; resume it with the version of the recipe that wrote it")
    loaded = {key: state.get(key, default) for key, default in fresh.items()}
    if not all(type(value) in ((int,) if type(fresh[key]) is int else (int, float))
               and 0 <= value <= MOST.get(key, 2**62) for key, value in loaded.items()):
        raise ValueError(f"its progress is not counts of steps, epochs and samples: {str(state)[:100]}")
    return loaded


def cut_metrics(run_files, step: int) -> dict:
    """metrics.jsonl of a run (shared/tracking.py's RunFiles) resumed at `step`: the points after the checkpoint will be
    logged again, and so will those of its own step logged after it was written (an epoch's or the run's evaluation,
    the summary), so the file is kept up to its training point; then a row that marks the resume on curves.png. A
    damaged row stops the resume here, before any change. Returns the last value of every key in the rows kept: the
    summary so far, which a piece that logs no training (a run stopped at its last step) would otherwise leave out."""
    summary = {}

    def kept(rows):
        for row in rows:
            if row["step"] < step or row["step"] == step and "train_loss" in row:
                # A finished run's summary row ("steps", which RunFiles.finish reads as this run finished) is never
                # kept: it is logged at the last step, without train_loss, so the resume that extends the run cuts it.
                # Numbers, as a run logs them: not a resume's mark ("resumed": true), nor a file's 1 MiB texts
                summary.update({key: value for key, value in row.items() if type(value) in (int, float)
                                and (key in summary or len(summary) < MAX_KEYS)})
                yield json.dumps(row) + "\n"

    if run_files.metrics.exists():
        write_atomic(run_files.metrics, kept(read_rows(run_files.metrics)))  # one row in memory at a time
    with run_files.metrics.open("a") as f:
        f.write(json.dumps({"step": step, "resumed": True, **run_files.labels}) + "\n")
    return summary


def set_finished_aside(run_dir: Path) -> None:
    """A finished run extended by a resume, as it writes its new weights: the finished run's files (FINISHED_FILES), and
    predict.py's predictions of its weights, move into finished/<its steps>_steps/."""
    summary = read_json(run_dir / "summary.json")
    steps = summary.get("steps") if isinstance(summary, dict) else None
    name = f"{steps}_steps" if type(steps) is int else "earlier"
    aside = new_folder(f"{run_dir}/finished/{name}")
    for path in finished_files(run_dir):
        os.replace(path, aside / path.name)


def finished_files(run_dir: Path) -> list[Path]:
    """A finished run's files (FINISHED_FILES) that are there, and predict.py's predictions of its weights: what goes
    wherever its weights go (finished/ when it is extended, abandoned/ when an older checkpoint branches it)."""
    return [path for path in run_dir.iterdir() if path.name in FINISHED_FILES] + predictions(run_dir)


def predictions(run_dir: Path) -> list[Path]:
    """The CSVs recipes/predict.py wrote in a run folder, known by their first line: the predictions of the run's
    weights, which go with them (a finished run extended or branched, a run replaced by --overwrite) and which
    predict.py replaces; never a file of yours that happens to have such a name."""
    found = []
    for path in run_dir.glob("predictions-*.csv"):
        if path.is_file():  # a FIFO would block the read
            with open(path, "rb") as f:
                if re.fullmatch(rb"path,class,confidence,top_\d+\r?\n", f.readline(64)):
                    found.append(path)
    return found


def interrupted(stop) -> str:
    """The line a first Ctrl-C prints (`stop`: the run's Checkpoints): what a second one does. `accelerate launch` of
    one process before accelerate 1.16 ends at once, forwarding nothing (accelerate #929), and the shell's prompt is
    back: a second Ctrl-C no longer reaches this process. From 1.16 it sends this process a SIGTERM, waits 5 s for it,
    then kills it (at once on a second Ctrl-C)."""
    again = "Ctrl-C again to stop at once, without saving"
    if stop.launcher and stop.accelerator.num_processes == 1:
        if compare_versions("accelerate", ">=", "1.16"):
            again += "; accelerate launch allows the save 5 s, then kills this process"
        else:
            again = (f"accelerate launch ends now, in its own traceback; this process, {os.getpid()}, saves after it: "
                     f"wait for its 'stopped by' line, or stop it at once with kill -INT {os.getpid()}")
    return f"Ctrl-C: stopping after this step with a checkpoint ({again})"


def after_interrupt(stop, read_end: int) -> None:
    """After the first Ctrl-C (`stop`: the run's Checkpoints; `read_end`: the pipe its signals' numbers come through):
    the line that says what a second one does; then a second SIGINT, more than SECOND_INTERRUPT_S after the first,
    stops the process at once, exit 130, without saving (a hung evaluation or collective)."""
    first = time.monotonic()
    # Through sys.stdout, as every line: a pipe whose reader ended with the Ctrl-C (`| tee`) is PrintableLines' to
    # handle
    stop.accelerator.print(interrupted(stop))
    while True:
        # Within SECOND_INTERRUPT_S: torchrun's copy of the first
        if signal.SIGINT in os.read(read_end, 64) and time.monotonic() - first > SECOND_INTERRUPT_S:
            try:
                os.write(2, f"error: stopped at once by a second Ctrl-C, without saving: continue from the newest "
                            f"checkpoint in {stop.folder} with --resume latest\n".encode())
            finally:  # stderr a pipe its Ctrl-C ended (`2>&1 | tee`): the stop still comes
                os._exit(128 + signal.SIGINT)


def resume_command(stop) -> str:
    """The command that continues a stopped run (`stop`: its Checkpoints): in the folder it was started in, the
    variables of its launch that a resume needs, the same launcher and script, the run folder and --resume latest
    (the run's flags are in its config.json), and what a resume never takes from a run folder: where the checkpoints
    go, and a --data that is not the recipe's own. Then the variables left out, if any."""
    environment, left_out = launch_environment(stop.started_in)
    kept = [word for name in ("checkpoint_dir", "data") if getattr(stop.cfg, name) != getattr(type(stop.cfg), name)
            for word in (f"--{name}", str(getattr(stop.cfg, name)))]
    # The launcher and its flags (accelerate launch), else the interpreter, as it was started
    words = [*(stop.launcher or [sys.orig_argv[0]]), sys.argv[0], *kept, "--output_dir", str(stop.run_dir), "--resume",
             "latest"]
    # From the folder the run was started in, where its relative paths lead: the same run, pasted in any folder
    command = f"cd {shell_word(os.getcwd())} && " + " ".join([*environment, *map(shell_word, words)])
    if left_out:
        command += f"\n  (left out: {' '.join(left_out)}; set them again if the run needs them)"
    return command


def launch_environment(environment: dict) -> tuple[list[str], list[str]]:
    """NAME=value for each variable of RESUME_ENVIRONMENT (and ACCELERATE_*) in `environment`, the one the run was
    started in: pasted without them, the command that continues the run ran otherwise (2gpu.yaml without
    ACCELERATE_USE_CPU=true: no GPUs, no run). Then the names left out, each alone: a name that reads as a secret, a
    URL with a user or password in it, a name a shell cannot take, a control character."""
    kept, left_out = [], []
    for name, value in environment.items():
        if name in RESUME_ENVIRONMENT or name.startswith("ACCELERATE_"):
            # a name a shell takes, no secret's, a printable value, no URL with a user or password
            if (re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) and not SECRET.search(name) and value.isprintable()
                    and not re.search(r"://[^/]*@", value)):
                kept.append(f"{name}={shlex.quote(value)}")
            else:
                left_out.append(shell_word(name))
    return kept, left_out


def shell_word(word: str) -> str:
    """`word` quoted for a shell. With a control character (or a byte that is not UTF-8), in bash's $'...' with those
    written as \\xNN: printed, it cannot move the cursor or forge a line; pasted, it is the same word."""
    if word.isprintable():
        return shlex.quote(word)
    escaped = (c if c.isprintable() and c not in "\\'" else "".join(f"\\x{b:02x}" for b in
               c.encode(errors="surrogateescape")) for c in word)
    return f"$'{''.join(escaped)}'"


def write_failed(checkpoints, what: str, error: Exception) -> None:
    """A full disk or quota: torch.save says it as a RuntimeError ("unexpected pos"), safetensors as its own error,
    Python as OSError. One line with the free space and the checkpoint a resume continues from. Another OSError
    names its file (a file where the save makes a folder, from elsewhere, said "free space")."""
    reason = error.strerror if isinstance(error, OSError) and error.strerror else first_line(error)[:120]
    full = not isinstance(error, OSError) or error.errno in (errno.ENOSPC, errno.EDQUOT) or not error.filename
    fix = "free space" if full else f"move {error.filename} aside or make it writable"
    good = list_checkpoints(checkpoints.folder, checkpoints.owner())
    raise RecipeError(f"{what} failed ({reason}; {shutil.disk_usage(checkpoints.run_dir).free / 2**20:.1f} MiB free "
                      f"there): the newest complete checkpoint is {good[-1] if good else 'none'}; {fix}, then continue "
                      "with --resume latest") from None


def check_run_folder(run_dir: Path, cfg, recipe: str) -> None:
    """A run folder that already holds files (open_run): a run of these recipes that --resume continues or --overwrite
    replaces, holding no link or special file (`check_entries`); any other is refused, untouched."""
    if (run_dir / "config.json").exists() and not (cfg.resume or cfg.overwrite):
        raise RecipeError(f"{run_dir} already holds a run: pass --resume latest to continue it, --overwrite to "
                          "replace it (or to restart one stopped before its first checkpoint), or another --output_dir")
    # A user's own folder (its metrics.jsonl would be appended to); but wandb/ alone was left by a start stopped before
    # its config.json (killed in its first second): the same command starts there again
    if not is_run(run_dir) and os.listdir(run_dir) != ["wandb"]:
        raise RecipeError(f"{run_dir} holds files but no run of these recipes (no config.json with a run_id of letters "
                          "and digits), so nothing is written into it: pass a new or empty --output_dir, or to "
                          f"continue a run, its own folder (runs/{recipe}-<time>)")
    for name in RUN_FILES:  # a folder where the run writes a file, or a file where it makes a folder: a traceback
        path = run_dir / name
        if path.exists() and path.is_dir() != ("." not in name):
            raise RecipeError(f"{path} is {'a folder' if path.is_dir() else 'no folder'}, where a run keeps its "
                              f"{name}: rename it, or pass another --output_dir")
    check_entries(run_dir)  # from anywhere: checked before a file in it is read or written


def check_entries(folder: Path) -> None:
    """Refuse a folder from elsewhere (a colleague's run, a download) that holds a symbolic link or a special file:
    written through, a link changes a file outside the run; read, a FIFO blocks forever. wandb/ must be a folder, and
    what is in it is wandb's: it links its logs there, and replaces its links (a rename) instead of writing through."""
    for entry in walk(folder, skip=folder / "wandb"):
        if not entry.is_file(follow_symlinks=False):
            kind = "a symbolic link" if entry.is_symlink() else "a FIFO, socket or device, not a regular file"
            raise RecipeError(f"{entry.path!r} is {kind}: nothing in a run folder is written or read through one (it "
                              "may lead outside the run, or block): replace it by a copy of the file, or delete it "
                              "(checkpoints on another disk: --checkpoint_dir DIR)")
