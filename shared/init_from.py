"""--init_from: a new run started from a model.safetensors; and what every reader of weights from elsewhere uses:
`mismatch` (weights of another model, in words) and `plain_name` (a key without the prefixes DDP and torch.compile
add); and finetune.py's pretrained file, torchvision's, read (`torchvision_weights`) and loaded but its classifier
(`load_all_but`). An opt-in module, imported by shared/checkpoints.py's `Checkpoints.initial_weights` for the runs
that pass --init_from, by finetune.py where it reads and checks its pretrained file, and by predict.py where it loads
weights."""

import hashlib
import json
import re
from pathlib import Path
from urllib.parse import urlparse

import torch
from accelerate import PartialState
from safetensors import safe_open

from shared.checkpoints import list_checkpoints
from shared.config import read_json
from shared.errors import RecipeError, first_line
from shared.pickles import check_archive


def initial_weights(model, cfg, classes: list[str]) -> str | None:
    """--init_from: a model.safetensors of this model (or the one in a run or checkpoint folder), loaded into it.
    Its classifier (the model's last layer) starts new where the file's was trained on other classes than the
    data's (the names it records), unless --keep_classifier. Weights of another model (a tensor missing, or of
    another shape) are refused, unless --init_partial loads what fits. A resumed run takes its weights from the
    checkpoint, and the file (perhaps moved or deleted since) is not read: the hash is the one its run recorded.
    Returns its sha256 (config.json)."""
    if cfg.resume:
        from shared.resume import recorded_path  # resuming: an opt-in module

        recorded = read_json(recorded_path(cfg))  # from anywhere: kept only if it is a sha256, as a run writes it
        sha256 = recorded.get("init_from_sha256") if isinstance(recorded, dict) else None
        return sha256 if re.fullmatch("[0-9a-f]{64}", str(sha256)) else None
    given = Path(cfg.init_from)
    path = given / "model.safetensors" if given.is_dir() else given
    if not path.is_file() or path.suffix != ".safetensors":  # a regular file: a FIFO would block the read
        # A run folder without its weights yet (stopped, or still running): its newest checkpoint holds them
        newest = list_checkpoints(path.parent / "checkpoints")[-1:] if path.name == "model.safetensors" else []
        fix = (f"the run has not written its weights (stopped, or still running): pass {newest[0]}, its newest "
               "checkpoint") if newest else ("pass a run's model.safetensors (written as it finishes), "
                                             "or the run or checkpoint folder that holds one")
        there = "no regular .safetensors file there" if given.exists() else "no such file or folder"
        raise RecipeError(f"--init_from {cfg.init_from}: {there}: {fix}")
    with open(path, "rb") as f:
        sha256 = hashlib.file_digest(f, "sha256").hexdigest()  # a piece at a time, whatever the file's size
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
    return sha256


def torchvision_weights(weights) -> tuple[Path, dict]:
    """torchvision's file for `weights` (a WeightsEnum), in its cache (downloaded there if missing), read from that
    exact file with weights_only=True (tensors only: a file that would run code is refused): (the file, its tensors
    by name). Not through torch.hub's loader: a zip of one entry is its legacy format, extracted beside the file under
    the name inside it, which could overwrite another cached file or make folders."""
    file = Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(weights.url).path).name
    try:
        if not file.exists():
            file.parent.mkdir(parents=True, exist_ok=True)
            torch.hub.download_url_to_file(weights.url, str(file), progress=False)
        check_archive(file)  # from anywhere: a regular file, bounded by its size, its pickles checked
        state = torch.load(file, map_location="cpu", weights_only=True)
    except RecipeError:
        raise
    except Exception as error:
        where = "cannot be read" if file.is_file() else f"is not there and could not be downloaded from {weights.url}"
        raise RecipeError(f"--weights {weights}: {file} {where} ({type(error).__name__}): download it where the "
                          "internet is reachable and copy it there (or set TORCH_HOME), or pass --weights none"
                          ) from None
    # a state dict's names and tensors, whatever else the file holds
    return file, {k: v for k, v in state.items() if isinstance(k, str) and isinstance(v, torch.Tensor)
                  } if isinstance(state, dict) else {}


def load_all_but(model, file: Path, state: dict, head: str, fix: str) -> None:
    """`state`, the tensors of weights `file`, into every layer of `model` but its new classifier (the tensors whose
    names start with `head`): strict=False leaves that one as it was made. Weights of another model are one line
    ending in `fix`, not torch's size-mismatch traceback."""
    if wrong := mismatch(model.state_dict(), {k: tuple(v.shape) for k, v in state.items()}, skip=head):
        raise RecipeError(f"--weights: {file} holds another model's weights ({wrong}): {fix}")
    model.load_state_dict({k: v for k, v in state.items() if not k.startswith(head)}, strict=False)


def mismatch(expected: dict, shapes: dict, skip: str = "\0") -> str:
    """Weights of another model, in words (`expected`: the model's state dict; `shapes`: the file's tensor names and
    shapes): the first of the model's tensors (but those whose names start with `skip`)
    that the file lacks or holds in another shape, and how many more; empty where every one fits."""
    wrong = [name for name, tensor in expected.items()
             if not name.startswith(skip) and shapes.get(name) != tuple(tensor.shape)]
    if not wrong:
        return ""
    found = shapes.get(wrong[0])
    return (f"{wrong[0]!r} is {found if found else 'missing'} in the file, {tuple(expected[wrong[0]].shape)} in the "
            "model" + (f", and {len(wrong) - 1} more tensors differ" if len(wrong) > 1 else ""))


def plain_name(key: str) -> str:
    """A state dict key without the prefixes DDP (`module.`) and torch.compile (`_orig_mod.`) add to it."""
    return re.sub(r"^(module\.|_orig_mod\.)+", "", key)
