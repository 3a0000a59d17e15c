"""Full-state checkpoints (save, resume, stop on a signal) and weights files of any common layout.

A checkpoint is `accelerator.save_state` (model, optimizer, grad scaler, every process's RNG state and the
registered `Progress`) in checkpoints/step_<N>/, written under a temporary name and renamed when complete: a
run killed mid-save leaves the previous checkpoint as the newest. The learning rate is a function of the step
(shared/schedule.py), so there is no scheduler state and a run can be resumed with another length.
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
import time
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import load as accelerate_load  # torch.load(weights_only=True) + NumPy RNG types
from accelerate.utils import set_seed
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

from shared.errors import RecipeError, check_launch, first_line

STEP_DIR = re.compile(r"step_(\d+)$")
DATA_ORDER_KEYS = ("data", "synthetic", "train_size", "seed")  # change one, and the rest of the epoch is another
BATCHING_KEYS = ("world_size", "batch_size", "grad_accum")  # these only cut the same order into other batches
NOT_SETTINGS = ("resume", "resumed_step", "resumed_from", "run_id", "overwrite", "output_dir", "versions")
STOP_CHECK_S = 1.0  # several processes agree on a stop about this often (seconds of training)


class Progress:
    """Where training stands. Registered with accelerator.register_for_checkpointing, it is saved and restored
    with the model: the counters can never disagree with the weights."""

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


class Checkpoints:
    """The run's checkpoints/ folder and its final weights.

    SIGTERM (what SLURM and most schedulers send before they kill a job) or SIGINT (Ctrl-C) asks the run to
    stop: it finishes the optimizer step, saves a checkpoint and exits 0. Later signals change nothing
    (torchrun forwards the first one again, and that must not cost the checkpoint); kill -9 stops at once.

    How soon: one process stops after the step in flight. Several processes must first agree on a step, which they
    do about every STOP_CHECK_S seconds of training; the stop then takes at most that, plus an evaluation if one
    falls in between, plus the save. torchrun (what `accelerate launch` runs for several processes) kills its
    workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (default 30) after it forwards a SIGTERM: set it higher if
    your evaluation or save takes longer."""

    def __init__(self, accelerator, run_dir: Path, cfg):
        self.accelerator, self.run_dir, self.cfg = accelerator, Path(run_dir), cfg
        self.resumed_from = self.signal = None
        self.next_check, self.last_check = 0, None  # the step of the processes' next agreement on a stop; the last's
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame):
        self.signal = self.signal or signal.Signals(signum).name

    def resume(self, progress: Progress) -> Path | None:
        """With --resume: accelerator.load_state (restoring `progress` too), after checking that no file in the
        checkpoint can run code. On another number of processes than the checkpoint's, every process is re-seeded."""
        if not self.cfg.resume:
            return None
        checkpoint = find_checkpoint(self.run_dir, self.cfg.resume)
        for pickled in sorted(checkpoint.glob("*.pkl")) + sorted(checkpoint.glob("*.bin")):
            try:  # accelerate loads registered objects with weights_only=False: refuse what weights_only would
                accelerate_load(pickled, map_location="cpu")
            except Exception as error:
                raise RecipeError(f"--resume {checkpoint}: {pickled.name} is corrupt or holds more than tensors "
                                  f"and numbers ({type(error).__name__}): resume from another checkpoint") from None
        try:
            self.accelerator.load_state(checkpoint)
        except Exception as error:  # a size mismatch, a missing or truncated file: all mean "not this run's"
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            detail = next((line for line in lines if line.startswith(("size mismatch", "Missing key",
                                                                       "Unexpected key"))), first_line(error))
            raise RecipeError(f"--resume {checkpoint} cannot be loaded into this run ({type(error).__name__}: "
                              f"{detail[:200]}): resume with the recipe and flags that wrote it, "
                              "or from another checkpoint") from None
        # Checkpoints fall between optimizer steps. The micro-batch counter saved with them would, under another
        # --grad_accum, end the first accumulation early (10 batches saved, --grad_accum 4: a step after 2).
        self.accelerator.step = 0
        saved_processes = len(list(checkpoint.glob("random_states_*.pkl")))
        if saved_processes != self.accelerator.num_processes:
            # Each process restores random_states_<its rank>.pkl, and accelerate skips a missing one silently: 1 -> 2
            # would leave the new process replaying the start of the run (accelerate #784).
            set_seed(self.cfg.seed + progress.step, device_specific=True)
            self.accelerator.print(
                f"the checkpoint was written by {saved_processes} process(es), this run has "
                f"{self.accelerator.num_processes}: their random states do not map onto each other, so every "
                f"process is re-seeded from (--seed, step {progress.step}, rank). Augmentation and dropout draws "
                "differ from a run never stopped: bitwise equality holds only on the same world size")
        self.resumed_from = checkpoint
        return checkpoint

    def check_resume(self, config: dict, progress: Progress) -> None:
        """After a resume: refuse it if no step is left to run; print where the run continues and what changed."""
        if self.resumed_from:
            check_resume(self.resumed_from, config, progress)

    def step_done(self, model, step: int, synced: bool) -> bool:
        """After each optimizer step: checkpoint every --checkpoint_every steps, and when a stop was asked, checkpoint
        this step and print the command that continues the run. True: stop now.

        Several processes must agree to stop, or one would wait in the checkpoint's barrier while another runs the
        next all-reduce. They agree where the step already waits for the device (`synced`: log points), at
        checkpoints, and at least every STOP_CHECK_S seconds: log points alone can be minutes apart, and torchrun
        kills the workers 30 s after a SIGTERM."""
        save_now = self.cfg.checkpoint_every > 0 and step % self.cfg.checkpoint_every == 0
        if self.accelerator.num_processes == 1:
            stopping = self.signal is not None
        elif synced or save_now or step >= self.next_check:
            stopping = self._agree_to_stop(step)
        else:
            stopping = False
        if save_now or stopping:
            self.save(model, step)
        if stopping:
            self.accelerator.print(f"stopped by {self.signal or 'a signal to another process'} at step {step}, "
                                   f"checkpoint saved; continue with:\n  {self.resume_command()}")
        return stopping

    def _agree_to_stop(self, step: int) -> bool:
        """One gather over the processes: has any been asked to stop, and how many steps take STOP_CHECK_S seconds
        on the slowest (the step of the next check, the same on every process). On a GPU: a sync about once a second."""
        now, steps = time.monotonic(), 1  # every step until an interval has been measured
        if self.last_check is not None:
            seconds_per_step = (now - self.last_check[1]) / (step - self.last_check[0])
            steps = max(1, int(STOP_CHECK_S / max(seconds_per_step, 1e-6)))
        votes = self.accelerator.gather(torch.tensor([[int(self.signal is not None), steps]],
                                                     device=self.accelerator.device))
        self.next_check, self.last_check = step + int(votes[:, 1].min()), (step, now)
        return bool(votes[:, 0].any())

    def save(self, model, step: int) -> Path:
        """The full training state in checkpoints/step_<step>, keeping the newest --keep_checkpoints. Weights that
        are no longer finite (BatchNorm's running statistics included) are never saved."""
        if not all(torch.isfinite(t).all() for t in model.state_dict().values()):
            good = list_checkpoints(self.run_dir)
            raise RecipeError(f"the weights became NaN or inf by step {step} (lower --lr): nothing saved; "
                              f"the newest good checkpoint is {good[-1] if good else 'none (none was saved yet)'}")
        final = self.run_dir / "checkpoints" / f"step_{step}"
        if final.is_dir():
            return final  # already saved at this step (--checkpoint_every landed on the last one)
        partial = final.with_name(f"partial_{final.name}")
        if self.accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)  # left over by a run killed while saving
        self.accelerator.wait_for_everyone()
        try:
            self.accelerator.save_state(partial)  # every process writes its own RNG state into it
        except OSError as error:  # disk full, quota, permissions: keep what is on disk, say what happened
            shutil.rmtree(partial, ignore_errors=True)
            good = list_checkpoints(self.run_dir)
            raise RecipeError(f"saving the checkpoint of step {step} failed ({error.strerror or error}): the newest "
                              f"complete checkpoint is {good[-1] if good else 'none'}; free space, then continue "
                              "with --resume latest") from None
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            os.replace(partial, final)
            for old in list_checkpoints(self.run_dir)[:-self.cfg.keep_checkpoints]:
                shutil.rmtree(old)
        self.accelerator.wait_for_everyone()
        return final

    def save_weights(self, model, metadata: dict) -> None:
        """model.safetensors: a plain state dict, no `module.` or `_orig_mod.` prefixes; `metadata` as JSON text."""
        state = self.accelerator.get_state_dict(model)  # unwraps DDP; model.compile() adds no prefix
        if self.accelerator.is_main_process:
            partial = self.run_dir / "model.safetensors.tmp"
            save_file({k: v.contiguous() for k, v in state.items()}, partial,
                      metadata={k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()})
            os.replace(partial, self.run_dir / "model.safetensors")

    def resume_command(self) -> str:
        """The same script and flags, with --resume latest."""
        args, skip = [], False
        for arg in sys.argv[1:]:
            if not skip and not arg.startswith(("--output_dir", "--resume", "--overwrite")):
                args.append(arg)
            skip = arg in ("--output_dir", "--resume") and not skip
        launched = "ACCELERATE_MIXED_PRECISION" in os.environ  # set by `accelerate launch` for every config
        launcher = "accelerate launch --config_file <the same config>" if launched else "python"
        return f"{launcher} {shlex.join([sys.argv[0], *args, '--output_dir', str(self.run_dir), '--resume', 'latest'])}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    found = [p for p in (Path(run_dir) / "checkpoints").glob("step_*") if p.is_dir() and STEP_DIR.search(p.name)]
    return sorted(found, key=lambda p: int(STEP_DIR.search(p.name).group(1)))


def find_checkpoint(run_dir: Path | None, resume: str, recipe: str = "") -> Path:
    """The checkpoint --resume names: `latest` of run_dir (or of the recipe's newest run), or a folder."""
    if resume != "latest":
        if not (Path(resume) / "custom_checkpoint_0.pkl").exists():
            raise RecipeError(f"--resume {resume}: not a checkpoint folder (expected checkpoints/step_<N> of a run)")
        return Path(resume)
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


def check_resume(checkpoint: Path, config: dict, progress: Progress) -> None:
    """Refuse a resume with no step left to run. Otherwise print where the run continues, what changed since the
    checkpoint (the config.json beside it), and what that does to the sample order, exactness and schedule."""
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
        return print(f"no config.json beside {checkpoint}: what changed since it cannot be listed")
    before = json.loads(previous.read_text())
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


def load_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Load a .safetensors file, a torch.save'd state dict (plain or under 'model'/'state_dict'/'model_state_dict',
    keys prefixed 'module.' or '_orig_mod.') or an accelerate checkpoint folder into `model`, on any device."""
    path = Path(path) / "model.safetensors" if Path(path).is_dir() else Path(path)
    if not path.exists():
        raise RecipeError(f"--weights {path}: no such file: pass a model.safetensors, a .pt/.pth file "
                          "or a checkpoint folder")
    try:  # weights_only: tensors and plain containers only; a pickle that would run code is refused
        state = load_file(path) if path.suffix == ".safetensors" else torch.load(path, "cpu", weights_only=True)
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
        key = mismatched[0] if mismatched else None
        detail = (f"first missing key {missing[0]!r}" if missing else
                  f"{key!r} is {tuple(state[key].shape)} in the file, {tuple(expected[key].shape)} in the model")
        raise RecipeError(f"--weights {path} does not fit this model ({detail}): pass weights written by this recipe, "
                          "with the model flags they were trained with (see config.json beside them)")
    model.load_state_dict({k: state[k] for k in expected})


def evaluate_weights(cfg, make_model, load_test_set, evaluate) -> None:
    """--eval_only --weights PATH: test loss and accuracy of a weights file, as one JSON line. `make_model(classes)`,
    `load_test_set()` and `evaluate(model, loader, accelerator)` are the recipe's."""
    check_launch()
    accelerator = Accelerator()
    with accelerator.local_main_process_first():  # the decode cache is per machine
        test_set = load_test_set()
    model = make_model(len(test_set.classes))
    load_weights(model, cfg.weights)
    loader = DataLoader(test_set, 2 * cfg.batch_size, collate_fn=test_set.whole_batch)
    model, loader = accelerator.prepare(model, loader)
    metrics, _ = evaluate(model, loader, accelerator)
    accelerator.print(json.dumps({"weights": cfg.weights, **metrics}))
    # Leave together: gloo's teardown race at exit (docs/troubleshooting.md) is rarer then, though not gone.
    accelerator.wait_for_everyone()
    accelerator.end_training()
