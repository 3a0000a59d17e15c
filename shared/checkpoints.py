"""Full-state checkpoints (save, resume, stop on a signal) and the final weights file, model.safetensors.

A checkpoint is `accelerator.save_state` (model, optimizer, grad scaler, every process's RNG state and the
registered `Progress`) in checkpoints/step_<N>/, written under a temporary name and renamed when complete: a
run killed mid-save leaves the previous checkpoint as the newest. The learning rate is a function of the step
(shared/schedule.py), so there is no scheduler state and a run can be resumed with another length.
"""

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import load as accelerate_load  # torch.load(weights_only=True) + NumPy RNG types
from accelerate.utils import set_seed
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from shared.errors import RecipeError, first_line
from shared.limits import replacing
from shared.resume import check_resume, find_checkpoint, list_checkpoints, read_json
from shared.stopping import StopOnSignals
from shared.tracking.folder import check_entries, new_folder


def plain_name(key: str) -> str:
    """A state dict key without the prefixes DDP (`module.`) and torch.compile (`_orig_mod.`) add to it."""
    return re.sub(r"^(module\.|_orig_mod\.)+", "", key)


class Progress:
    """Where training stands. Registered with accelerator.register_for_checkpointing, it is saved and restored
    with the model: the counters can never disagree with the weights."""

    RENAMED = {"samples_seen": "samples_into_epoch", "best_eval_acc": "max_eval_acc"}  # in older checkpoints

    def __init__(self):
        self.step = 0  # optimizer steps taken
        self.epoch = 0  # epochs completed
        self.samples_into_epoch = 0  # samples of this epoch's order trained on, by all processes together
        self.max_eval_acc = 0.0  # the highest test accuracy of any evaluation: reported, never used to pick weights
        self.pieces = 0  # launches that trained this run: 1, plus one per resume
        self.train_samples, self.train_s = 0, 0.0  # samples and seconds of training (no evaluation, no saving)
        self.wall_s = 0.0  # seconds from each launch's first step to its last checkpoint (the last: to its end)

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        state = {self.RENAMED.get(key, key): value for key, value in state.items()}
        if "samples_into_epoch" not in state:
            raise ValueError("this checkpoint counts its place in the epoch in batches, as the recipes did before "
                             "they counted samples; resume it with the version of the recipe that wrote it")
        counts, times = ("step", "epoch", "samples_into_epoch", "pieces", "train_samples"), ("train_s", "wall_s")
        if (any(type(state.get(k, 0)) is not int or not 0 <= state.get(k, 0) < 2**62 for k in counts)
                or any(type(state.get(k, 0.0)) not in (int, float) for k in ("max_eval_acc", *times))
                # within their ranges (NaN is in none): an accuracy, under a million launches, seconds under 30 years
                or not (0 <= state.get("max_eval_acc", 0.0) <= 1 and state.get("pieces", 0) < 10**6)
                or not all(0 <= state.get(k, 0.0) < 10**9 for k in times)):
            raise ValueError(f"its progress is not counts of steps, epochs and samples: {str(state)[:100]}")
        vars(self).update({k: state[k] for k in vars(self) if k in state})


class Checkpoints(StopOnSignals):
    """The run's checkpoints/ folder and its final weights; stopping on a signal with a checkpoint: StopOnSignals."""

    def __init__(self, accelerator, run_dir: Path, cfg):
        super().__init__()
        self.accelerator, self.run_dir, self.cfg = accelerator, Path(run_dir), cfg
        self.folder = Path(cfg.checkpoint_dir).absolute() if cfg.checkpoint_dir else self.run_dir / "checkpoints"
        recorded = read_json(self.run_dir / "config.json") if cfg.resume else None
        if isinstance(recorded, dict) and recorded.get("checkpoint_dir") and not cfg.checkpoint_dir:
            # config.json says where they are, but a run folder (from anywhere) never chooses where a run writes
            raise RecipeError(f"{self.run_dir} keeps its checkpoints in {str(recorded['checkpoint_dir'])[:200]!r}: "
                              "pass --checkpoint_dir with that folder to continue it")
        self.resumed_from = None
        self.saved = set()  # checkpoints this launch wrote: the only ones `save` may take as already saved

    def resume(self, progress: Progress) -> Path | None:
        """With --resume: accelerator.load_state (restoring `progress` too), after checking that no file in the
        checkpoint can run code. On another number of processes than the checkpoint's, every process is re-seeded."""
        if not self.cfg.resume:
            return None
        from shared.pickles import check_archive  # files from anywhere, checked: an opt-in module

        checkpoint = find_checkpoint(self.folder, self.cfg.resume)
        check_entries(checkpoint)  # --checkpoint_dir: outside the run folder its open_run checked
        for pickled in sorted(path for path in checkpoint.iterdir() if path.suffix in (".pkl", ".bin", ".pt")):
            check_archive(pickled, fix="resume from another checkpoint")
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
        if checkpoint.resolve() == (self.folder / checkpoint.name).resolve():
            self.saved.add(self.folder / checkpoint.name)  # resumed at the last step: not saved again
        return checkpoint

    def branch(self, checkpoint: Path, step: int) -> None:
        """Resumed from a checkpoint older than the run's newest: move the later history (its checkpoints, final
        weights, summary and pictures, a copy of its metrics) aside into abandoned/, so that it is neither deleted
        nor ever continued by --resume latest or mixed into this history's files."""
        later = [p for p in list_checkpoints(self.folder) if int(p.name.split("_")[1]) > step]
        if self.accelerator.is_main_process and later:
            # -2, -3 after the name for branches from one step in one second; a read-only abandoned/ (a run folder
            # from elsewhere) makes nothing, and the first move fails, before anything moved
            aside = Path(new_folder(f"{self.run_dir}/abandoned/after_step_{step}-{time.strftime('%Y%m%d-%H%M%S')}"))
            try:  # the copies first, which need room on the disk; then the moves, renames within it, which need none
                for name in ("metrics.jsonl", "config.json"):
                    if (self.run_dir / name).exists():
                        shutil.copy2(self.run_dir / name, aside / name)
                for path in later + [self.run_dir / name for name in ("model.safetensors", "summary.json",
                                                                       "curves.png", "confusion_matrix.png")]:
                    if path.exists():
                        os.replace(path, aside / path.name)
            except OSError as error:
                raise RecipeError(f"moving the run's later history aside into {aside} failed ({error.strerror}): "
                                  f"{aside.parent} must be a folder you can write in (and the run's folders too), "
                                  "with room on its disk, then resume again; nothing was deleted") from None
            print(f"{checkpoint} is older than the run's newest checkpoint ({later[-1].name}): this is a new branch "
                  f"of the run; the later history ({', '.join(p.name for p in later)}) moved to {aside}")
        self.accelerator.wait_for_everyone()

    def check_resume_and_branch(self, config: dict, progress: Progress) -> None:
        """After a resume: refuse it if no step is left to run; print where the run continues and what changed; from
        an older checkpoint than the newest, move the later history aside (`branch`)."""
        if self.resumed_from:
            check_resume(self.resumed_from, config, progress)
            self.branch(self.resumed_from, progress.step)

    def save(self, model, step: int) -> Path:
        """The full training state in checkpoints/step_<step>, keeping the newest --keep_checkpoints. Weights that
        are no longer finite (BatchNorm's running statistics included) are never saved."""
        if not all(torch.isfinite(t).all() for t in model.state_dict().values()):
            good = list_checkpoints(self.folder)
            raise RecipeError(f"the weights became NaN or inf by step {step} (lower --lr): nothing saved; "
                              f"the newest good checkpoint is {good[-1] if good else 'none (none was saved yet)'}")
        final = self.folder / f"step_{step}"
        if final in self.saved:
            return final  # already saved at this step (--checkpoint_every landed on the last one)
        if final.exists():
            raise RecipeError(f"{final} exists but this run did not write it: is another run writing to "
                              f"{self.folder}? Nothing overwritten; pass another --output_dir (or --checkpoint_dir)")
        partial = final.with_name(f"partial_{final.name}")
        if self.accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)  # left over by a run killed while saving
        self.accelerator.wait_for_everyone()
        try:
            self.accelerator.save_state(partial)  # every process writes its own RNG state into it
        except (OSError, RuntimeError, SafetensorError) as error:  # disk full, quota: keep what is on disk, say so
            shutil.rmtree(partial, ignore_errors=True)
            self.write_failed(f"saving the checkpoint of step {step}", error)
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            if (self.run_dir / "config.json").exists():  # the configuration that wrote it, for the resume report
                shutil.copy2(self.run_dir / "config.json", partial / "config.json")
            os.replace(partial, final)
            for old in list_checkpoints(self.folder)[:-self.cfg.keep_checkpoints]:
                shutil.rmtree(old)
        self.accelerator.wait_for_everyone()
        self.saved.add(final)
        return final

    def save_weights(self, model, metadata: dict) -> None:
        """model.safetensors: a plain state dict, no `module.` or `_orig_mod.` prefixes; `metadata` as JSON text."""
        state = self.accelerator.get_state_dict(model)  # unwraps DDP; model.compile() adds no prefix
        if self.accelerator.is_main_process:
            try:
                with replacing(self.run_dir / "model.safetensors") as partial:
                    save_file({k: v.contiguous() for k, v in state.items()}, partial,
                              metadata={k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()})
            except (OSError, SafetensorError) as error:
                self.write_failed("writing model.safetensors", error)

    def write_failed(self, what: str, error: Exception) -> None:
        """A full disk or quota: torch.save says it as a RuntimeError ("unexpected pos"), safetensors as its own
        error, Python as OSError. One line with the free space and the checkpoint a resume continues from."""
        reason = error.strerror if isinstance(error, OSError) and error.strerror else first_line(error)[:120]
        good = list_checkpoints(self.folder)
        raise RecipeError(f"{what} failed ({reason}; {shutil.disk_usage(self.run_dir).free / 2**20:.1f} MiB free "
                          f"there): the newest complete checkpoint is {good[-1] if good else 'none'}; free space, then "
                          "continue with --resume latest") from None

    @staticmethod
    def initial_weights(model, cfg, classes: list[str]) -> str | None:
        """--init_from: a model.safetensors of this model (or the one in a run or checkpoint folder), loaded into it.
        Its classifier (the model's last layer) starts new where the file's was trained on other classes than the
        data's (the names it records), unless --keep_classifier. Weights of another model (a tensor missing, or of
        another shape) are refused, unless --init_partial loads what fits. A resumed run takes its weights from the
        checkpoint: the file is only hashed. Returns its sha256 (config.json), or None without --init_from."""
        if not cfg.init_from:
            return None
        path = Path(cfg.init_from) / "model.safetensors" if Path(cfg.init_from).is_dir() else Path(cfg.init_from)
        if not path.is_file() or path.suffix != ".safetensors":  # a regular file: a FIFO would block the read
            raise RecipeError(f"--init_from {cfg.init_from}: no .safetensors file there: pass a run's "
                              "model.safetensors, or the run or checkpoint folder that holds one")
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for piece in iter(lambda: f.read(2**24), b""):
                digest.update(piece)
        if cfg.resume:
            return digest.hexdigest()
        expected = model.state_dict()
        head = next(reversed(expected)).rsplit(".", 1)[0] + "."  # the classifier: the model's last layer
        try:  # safetensors: a header of names, shapes and offsets, checked against the file; no code
            with safe_open(path, "pt") as f:
                keys = {plain_name(key): key for key in f.keys()}
                shapes = {name: tuple(f.get_slice(key).get_shape()) for name, key in keys.items()}
                recorded = json.loads((f.metadata() or {}).get("classes", "null"))
                if not (recorded is None or isinstance(recorded, list) and all(isinstance(c, str) for c in recorded)):
                    raise RecipeError(f"--init_from {path} records its classes as {str(recorded)[:60]!r}, not a list "
                                      "of names: pass a model.safetensors written by a run")
                other_classes = recorded not in (None, classes) and not cfg.keep_classifier
                wrong = mismatch(expected, shapes, skip=head)
                if wrong and not cfg.init_partial:
                    raise RecipeError(f"--init_from {path} holds another model's weights ({wrong}): pass weights of "
                                      "this model, with the model flags in the config.json beside them, or "
                                      "--init_partial to load only the tensors that fit")
                loaded = {name: f.get_tensor(keys[name]) for name, tensor in expected.items()  # no larger than ours
                          if shapes.get(name) == tuple(tensor.shape) and not (other_classes and name.startswith(head))}
        except RecipeError:
            raise
        except Exception as error:
            raise RecipeError(f"--init_from {path} cannot be read ({type(error).__name__}: {first_line(error)[:200]}"
                              "): pass a model.safetensors written by a run") from None
        if not loaded or all(name.startswith(head) for name in loaded):
            raise RecipeError(f"--init_from {path}: {'no tensor' if not loaded else 'only the last layer'} of it fits "
                              "this model (same name and shape): pass weights of the same model")
        if not all(torch.isfinite(tensor).all() for tensor in loaded.values() if tensor.is_floating_point()):
            raise RecipeError(f"--init_from {path} holds NaN or infinite weights: pass weights of a finished run")
        model.load_state_dict(loaded, strict=False)
        new = [name for name in expected if name not in loaded]
        why = (f" (its classifier was trained on {', '.join(map(str, recorded[:4]))}{', ...' * (len(recorded) > 4)}, "
               f"this data's classes are {', '.join(classes[:4])}{', ...' * (len(classes) > 4)}: --keep_classifier "
               "keeps it)") if other_classes else ""
        PartialState().print(f"--init_from {path}: {len(loaded)} of {len(expected)} tensors loaded; new: "
                             f"{', '.join(new) if new else 'none'}{why}")
        return digest.hexdigest()


def mismatch(expected: dict[str, torch.Tensor], shapes: dict[str, tuple], skip: str = "\0") -> str:
    """Weights of another model, in words: the first of the model's tensors (but those whose names start with `skip`)
    that the file lacks or holds in another shape, and how many more; empty where every one fits."""
    wrong = [name for name, tensor in expected.items()
             if not name.startswith(skip) and shapes.get(name) != tuple(tensor.shape)]
    if not wrong:
        return ""
    found = shapes.get(wrong[0])
    return (f"{wrong[0]!r} is {found if found else 'missing'} in the file, {tuple(expected[wrong[0]].shape)} in the "
            "model" + (f", and {len(wrong) - 1} more tensors differ" if len(wrong) > 1 else ""))
