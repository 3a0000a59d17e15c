"""Full-state checkpoints, resuming from them, and loading weights files of any common layout.

A checkpoint is `accelerator.save_state` (model, optimizer, grad scaler, every process's RNG
state, and the registered `Progress`) in `checkpoints/step_<N>/`. It is written under a temporary
name and renamed when complete, so a run killed mid-save leaves the previous checkpoint as the
newest one on disk. The learning rate is a function of the step (shared/schedule.py): no scheduler
state, so a run can be resumed with another length.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shlex
import shutil
import signal
import sys
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import load as accelerate_load  # torch.load(weights_only=True) + NumPy RNG types
from accelerate.utils import set_seed
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

from shared.data import whole_batch
from shared.errors import RecipeError, check_launch, first_line

STEP_DIR = re.compile(r"step_(\d+)$")


class Progress:
    """Where training stands. Registered with accelerator.register_for_checkpointing, so it is
    saved and restored together with the model: counters can never disagree with the weights."""

    def __init__(self):
        self.step = 0  # optimizer steps taken
        self.epoch = 0  # epochs completed
        self.samples_seen = 0  # samples of this epoch's order trained on, by all processes together
        self.best_eval_acc = 0.0

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        if "samples_seen" not in state:
            raise ValueError("this checkpoint counts its place in the epoch in batches, as the recipes did before "
                             "they counted samples; resume it with the version of the recipe that wrote it")
        vars(self).update(state)


class StopSignal:
    """SIGTERM (what SLURM and most schedulers send before they kill a job) or SIGINT (Ctrl-C) asks
    the run to stop: it finishes the optimizer step in progress, saves a checkpoint and exits 0.

    Later signals change nothing: launchers forward the first one again (torchrun sends SIGTERM to
    its workers when it gets one), and that must not cost the checkpoint. kill -9 stops at once."""

    def __init__(self, accelerator):
        self.accelerator, self.received = accelerator, None
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame):
        self.received = self.received or signal.Signals(signum).name

    def requested(self, synced: bool) -> bool:
        """Whether to stop after this step: the same answer on every process.

        One process answers at once. Several must agree, or one would wait in a checkpoint's
        barrier while another runs the next step's all-reduce; they agree through a collective
        (accelerate's set_trigger/check_trigger), only where the step already waits for the
        device (`synced`: log points and checkpoints), so the loop gains no extra GPU sync."""
        if self.accelerator.num_processes == 1:
            return self.received is not None
        if not synced:
            return False
        if self.received:
            self.accelerator.set_trigger()
        return self.accelerator.check_trigger()


def resume_command(run_dir: Path) -> str:
    """The command that continues this run: the same script and flags, --resume latest."""
    args, skip = [], False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
        elif arg in ("--output_dir", "--resume"):
            skip = True
        elif not arg.startswith(("--output_dir=", "--resume=", "--overwrite")):
            args.append(arg)
    launched = "ACCELERATE_MIXED_PRECISION" in os.environ  # set by `accelerate launch` for every config
    launcher = "accelerate launch --config_file <the same config>" if launched else "python"
    return f"{launcher} {shlex.join([sys.argv[0], *args, '--output_dir', str(run_dir), '--resume', 'latest'])}"


def save_checkpoint(accelerator, model, run_dir: Path, step: int, keep: int) -> Path:
    """Save the full training state to checkpoints/step_<step>; keep the newest `keep`.

    Weights that are no longer finite are never saved: the newest checkpoint stays a good one. Buffers
    count too: BatchNorm's running statistics turn inf while the parameters are still finite."""
    if not all(torch.isfinite(t).all() for t in model.state_dict().values()):
        good = list_checkpoints(run_dir)
        raise RecipeError(f"the weights became NaN or inf by step {step} (lower --lr): nothing saved; "
                          f"the newest good checkpoint is {good[-1] if good else 'none (none was saved yet)'}")
    final = Path(run_dir) / "checkpoints" / f"step_{step}"
    if final.is_dir():
        return final  # already saved at this step (--checkpoint_every landed on the last one)
    partial = final.with_name(f"partial_{final.name}")
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)  # left over by a run killed while saving
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(partial)  # every process writes its own RNG state into it
    except OSError as error:  # disk full, quota, permissions: keep what is on disk, say what happened
        shutil.rmtree(partial, ignore_errors=True)
        good = list_checkpoints(run_dir)
        raise RecipeError(f"saving the checkpoint of step {step} failed ({error.strerror or error}): the newest "
                          f"complete checkpoint is {good[-1] if good else 'none'}; free space, then continue with "
                          "--resume latest") from None
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        os.replace(partial, final)
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def checkpoint_or_stop(accelerator, model, run_dir: Path, step: int, cfg, stop: StopSignal, window,
                       synced: bool) -> bool:
    """After each optimizer step: checkpoint every --checkpoint_every steps, and when a stop was asked
    (SIGTERM, Ctrl-C), checkpoint this step and print the command that continues the run.

    Returns True when the run must stop. `synced`: the step already waited for the device (a log point)."""
    save_now = cfg.checkpoint_every > 0 and step % cfg.checkpoint_every == 0
    stopping = stop.requested(synced=synced or save_now)
    if save_now or stopping:
        with window.paused():  # saving is not training time
            save_checkpoint(accelerator, model, run_dir, step, cfg.keep_checkpoints)
    if stopping:
        accelerator.print(f"stopped by {stop.received or 'a signal to another process'} at step {step}, "
                          f"checkpoint saved; continue with:\n  {resume_command(run_dir)}")
    return stopping


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    folder = Path(run_dir) / "checkpoints"
    found = [p for p in folder.glob("step_*") if p.is_dir() and STEP_DIR.search(p.name)] if folder.is_dir() else []
    return sorted(found, key=lambda p: int(STEP_DIR.search(p.name).group(1)))


def find_checkpoint(run_dir: Path | None, resume: str, recipe: str) -> Path:
    """The checkpoint that --resume names: `latest` of run_dir (or of the newest run of the recipe), or a folder."""
    if resume != "latest":
        path = Path(resume)
        if not (path / "custom_checkpoint_0.pkl").exists():
            raise RecipeError(f"--resume {resume}: not a checkpoint folder (expected checkpoints/step_<N> of a run)")
        return path
    if run_dir is None:
        runs = sorted((p for p in Path("runs").glob(f"{recipe}-*") if list_checkpoints(p)), key=os.path.getmtime)
        if not runs:
            raise RecipeError(f"--resume latest: no run of {recipe} with checkpoints under runs/: "
                              "pass --output_dir of the run to continue")
        run_dir = runs[-1]
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        raise RecipeError(f"--resume latest: {run_dir} has no checkpoints: start it without --resume, "
                          "or pass --output_dir of a run that saved one (--checkpoint_every N)")
    return checkpoints[-1]


def resume_from(accelerator, checkpoint: Path, progress: Progress, seed: int) -> None:
    """accelerator.load_state, after checking that no file in the checkpoint can run code; `progress` is
    restored with it. On another number of processes than the checkpoint's, every process is re-seeded."""
    for pickled in sorted(checkpoint.glob("*.pkl")) + sorted(checkpoint.glob("*.bin")):
        try:
            # accelerate loads registered objects with weights_only=False: refuse anything that a
            # weights_only load (plus the NumPy types of the RNG states, as accelerate allows) would not.
            accelerate_load(pickled, map_location="cpu")
        except Exception as error:
            raise RecipeError(f"--resume {checkpoint}: {pickled.name} is corrupt or holds more than tensors and "
                              f"numbers ({type(error).__name__}): resume from another checkpoint") from None
    try:
        accelerator.load_state(checkpoint)
    except Exception as error:  # a size mismatch, a missing or truncated file: all mean "not this run's"
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        detail = next((line for line in lines if line.startswith(("size mismatch", "Missing key", "Unexpected key"))),
                      lines[0] if lines else type(error).__name__)
        raise RecipeError(f"--resume {checkpoint} cannot be loaded into this run ({type(error).__name__}: "
                          f"{detail[:200]}): resume with the recipe and flags that wrote it, "
                          "or from another checkpoint") from None
    # Checkpoints fall between optimizer steps. The micro-batch counter saved with them would, under another
    # --grad_accum, end the first accumulation early (10 batches saved, --grad_accum 4: a step after 2).
    accelerator.step = 0
    saved_processes = len(list(checkpoint.glob("random_states_*.pkl")))
    if saved_processes != accelerator.num_processes:
        # Each process restores random_states_<its rank>.pkl; accelerate skips a missing one silently, and
        # 1 -> 2 would leave the new process replaying the start of the run (accelerate #784). Instead every
        # process gets a new seed from (--seed, step, rank): reproducible, and distinct per process.
        set_seed(seed + progress.step, device_specific=True)
        accelerator.print(f"the checkpoint was written by {saved_processes} process(es), this run has "
                          f"{accelerator.num_processes}: their random states do not map onto each other, so every "
                          f"process is re-seeded from (--seed, step {progress.step}, rank). Augmentation and dropout "
                          "draws differ from a run never stopped: bitwise equality holds only on the same world size")


# What decides the order of the samples: with one changed, the rest of an epoch is not the samples not yet used.
DATA_ORDER_KEYS = ("data", "synthetic", "train_size", "seed")
# What only cuts the same order into other batches.
BATCHING_KEYS = ("world_size", "batch_size", "grad_accum")
NOT_SETTINGS = ("resume", "resumed_step", "resumed_from", "run_id", "overwrite", "output_dir", "versions")


def check_resume(checkpoint: Path, config: dict, progress: Progress) -> None:
    """Refuse a resume with no steps left to run. Otherwise print where the run continues, what changed since its
    checkpoint (the config.json beside it), and what each change does: to the sample order, to bitwise exactness,
    to the learning-rate schedule."""
    total_steps = config["total_steps"]
    if progress.step > total_steps:
        raise RecipeError(f"--resume {checkpoint} is at step {progress.step}, past the {total_steps} steps asked for: "
                          "raise --max_steps or --epochs, or resume from an earlier checkpoint")
    if progress.step == total_steps:
        raise RecipeError(f"{config['output_dir']} already finished its {total_steps} steps: "
                          "raise --max_steps or --epochs to train on")
    if not PartialState().is_main_process:
        return
    epoch, left = progress.epoch + 1, config["train_size"] - progress.samples_seen
    print(f"resuming from {checkpoint}: step {progress.step}, epoch {epoch} after {progress.samples_seen} of its "
          f"{config['train_size']} samples")
    previous = Path(checkpoint).parents[1] / "config.json"
    if not previous.exists():
        print(f"no config.json beside {checkpoint}: what changed since it cannot be listed")
        return
    before = json.loads(previous.read_text())
    changed = [key for key in config if key not in NOT_SETTINGS and before.get(key) != config[key]]
    if not changed:
        print("same configuration: the run continues exactly, to the same weights as a run never stopped")
        return
    print("changed since the checkpoint: "
          + ", ".join(f"{key} {before.get(key)!r} -> {config[key]!r}" for key in changed))
    order = [key for key in changed if key in DATA_ORDER_KEYS]
    if order:
        print(f"the sample order is NOT a run's never stopped ({', '.join(order)} changed): the rest of epoch {epoch} "
              "follows another order, so some of its samples are trained on twice and others not at all")
    elif any(key in BATCHING_KEYS for key in changed):
        print(f"the sample order continues exactly: the rest of epoch {epoch} is the {left} samples not yet trained "
              f"on, in global batches of {config['global_batch_size']} (a remainder smaller than one is dropped, "
              "as at the end of every epoch)")
    else:
        print("the sample order continues exactly")
    if "total_steps" in changed:
        print(f"length {before.get('total_steps')} -> {config['total_steps']} steps, learning rate: "
              f"{config.get('lr_schedule', 'rebuilt for the new length')}")


def save_weights(accelerator, model, path: Path, metadata: dict) -> None:
    """Final weights as a plain safetensors state dict: no `module.` or `_orig_mod.` prefixes."""
    state = accelerator.get_state_dict(model)  # unwraps DDP; model.compile() adds no prefix
    if accelerator.is_main_process:
        partial = Path(path).with_suffix(".tmp")
        save_file({k: v.contiguous() for k, v in state.items()}, partial,
                  metadata={k: str(v) for k, v in metadata.items()})
        os.replace(partial, path)


def load_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Load a weights file into `model`: a .safetensors file, a torch.save'd state dict (plain or
    under 'model'/'state_dict'/'model_state_dict', keys prefixed 'module.' or '_orig_mod.'), or an
    accelerate checkpoint folder; tensors saved on a GPU load on a CPU."""
    path = Path(path)
    if path.is_dir():
        path = path / "model.safetensors"
    if not path.exists():
        raise RecipeError(f"--weights {path}: no such file: pass a model.safetensors, a .pt/.pth file "
                          "or a checkpoint folder")
    try:
        if path.suffix == ".safetensors":
            state = load_file(path)
        else:  # weights_only: tensors and plain containers only; a pickle that would run code is refused
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"GLOBAL (\S+)", str(error))
        raise RecipeError(
            f"--weights {path} holds pickled Python objects ({found.group(1) if found else 'not only tensors'}), "
            "and loading it could run code: refused. Where the file was made and is trusted, convert it with "
            "`model = torch.load(path, weights_only=False)` then `torch.save(model.state_dict(), 'weights.pt')`"
        ) from None
    except Exception as error:
        raise RecipeError(f"--weights {path} cannot be read ({type(error).__name__}: {first_line(error)}): "
                          "it may be truncated or not a weights file; pass a model.safetensors or a .pt state dict"
                          ) from None
    for key in ("model_state_dict", "state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    state = {re.sub(r"^(module\.|_orig_mod\.)+", "", k): v for k, v in state.items()}
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    mismatched = [k for k in expected if k in state and state[k].shape != expected[k].shape]
    if missing or mismatched:
        detail = (f"first missing key {missing[0]!r}" if missing else
                  f"{mismatched[0]!r} is {tuple(state[mismatched[0]].shape)} in the file, "
                  f"{tuple(expected[mismatched[0]].shape)} in the model")
        raise RecipeError(f"--weights {path} does not fit this model ({detail}): pass weights written by this recipe, "
                          "with the model flags they were trained with (see config.json beside them)")
    model.load_state_dict({k: state[k] for k in expected})



def evaluate_weights(cfg, make_model, load_test_set, evaluate) -> None:
    """--eval_only --weights PATH: test-split loss and accuracy of a weights file, as one JSON line.

    `make_model(num_classes)`, `load_test_set()` and `evaluate(model, loader, accelerator)` are the recipe's."""
    check_launch()
    accelerator = Accelerator()
    with accelerator.main_process_first():
        test_set = load_test_set()
    model = make_model(len(test_set.classes))
    load_weights(model, cfg.weights)
    loader = DataLoader(test_set, 2 * cfg.batch_size, collate_fn=whole_batch)
    model, loader = accelerator.prepare(model, loader)
    metrics, _ = evaluate(model, loader, accelerator)
    accelerator.print(json.dumps({"weights": cfg.weights, **metrics}))
    # Leave together and take the process group down before exiting: a process that left alone
    # could abort while gloo tore down ("terminate called without an active exception").
    accelerator.wait_for_everyone()
    accelerator.end_training()
