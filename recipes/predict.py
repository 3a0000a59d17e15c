"""Use a trained model: predictions for a folder of your images (--images), or the test metrics of a labelled
split (--evaluate).

Takes a run's model.safetensors (which records its recipe, flags, class names and data), a checkpoint folder or
its model.safetensors (read beside its run's config.json), or a .pt/.pth state dict (then pass --classes too). The
recipe is the script that trained them: the one here whose RECIPE is the name they record, or --recipe PATH (e.g.
my_project/train.py). A recipe is code and weights come from anywhere: a path or file they name is never imported
or fetched. Its own make_model, preprocess, load_data and evaluate are used, so an edited copy works as is.

--images: any image files (subfolders included), any size, mode or channel count, each converted as the training
data was. The CSV (--output; by default predictions-<images>.csv in the weights' run folder, -step_<N>.csv for a
checkpoint's, replaced there if this script wrote it): a row per image, its path (relative to --images), class,
confidence (softmax probability), the top-k classes with theirs; a cell starting as a formula gets an apostrophe.
--evaluate: the recipe's evaluate() on the test split of --data, or of the data the weights were trained on where
that is a folder on this machine, as one JSON line; under `accelerate launch` it runs on every process and
precision of the config.

  python recipes/predict.py --weights runs/cifar_cnn-<time>/model.safetensors --images my_photos/
  python recipes/predict.py --weights runs/cifar_cnn-<time>/model.safetensors --evaluate --data DIR
  python recipes/predict.py --weights my_project/runs/<run>/model.safetensors --recipe my_project/train.py --evaluate
"""

import csv
import importlib.util
import inspect
import json
import re
import sys
import types
import typing
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # find shared/ without installing it
from shared.checkpoints import list_checkpoints
from shared.config import parse_config, read_json
from shared.errors import RecipeError, first_line, one_line_errors, printable, replacing
from shared.images import FORMATS, decode, fit

RECIPES = Path(__file__).resolve().parent  # where a recipe named by its name is looked for
RECIPE_NAME = re.compile(r"[a-z0-9_]+")  # a name in recipes/, never a path
IMAGE_EXTENSIONS = {ext for ext, format in Image.registered_extensions().items() if format in FORMATS}


@dataclass
class Config:
    weights: str = ""  # model.safetensors of a run, a checkpoint folder, or a .pt/.pth state dict
    images: str = ""  # an image file, or a folder of them (subfolders included): a CSV of predictions
    output: str | None = None  # the CSV --images writes; default: predictions-<images>.csv in the weights' run folder
    evaluate: bool = False  # instead of --images: test loss and accuracy on the test split, one JSON line
    data: str | None = None  # --evaluate on this data (hub id or folder); default: the weights' data if a local folder
    tta: bool = False  # --images and --evaluate with each image's logits averaged with its mirror's (recipes that flip)
    top_k: int = 3  # classes listed per image, most probable first
    batch_size: int = 256  # images per forward pass
    recipe: str | None = None  # the script that trained the weights (a path, or a name in recipes/); default: theirs
    classes: str | None = None  # class names in label order, comma-separated; needed only for a .pt/.pth file
    overwrite: bool = False  # replace --output if it exists (a .csv file: any other is kept)

    parse = classmethod(parse_config)

    def __post_init__(self):
        if not self.weights or bool(self.images) == self.evaluate:
            raise ValueError("pass --weights PATH and either --images FOLDER or --evaluate")
        if self.evaluate and (self.output or self.overwrite):  # what --images writes: ignored, they would mislead
            raise ValueError("--evaluate prints one JSON line and writes no file: leave out --output and --overwrite")
        if self.top_k < 1 or self.batch_size < 1:
            raise ValueError(f"--top_k and --batch_size must be > 0, got {self.top_k} and {self.batch_size}")


def describe_weights(cfg: Config) -> dict:
    """What the weights say about themselves: recipe, flags, classes, from model.safetensors' metadata or from the
    run's config.json beside a checkpoint folder; {} for a bare state dict. Untrusted text: checked by its users,
    and never a file to import or a dataset to fetch."""
    path = Path(cfg.weights)
    if not path.exists():
        raise RecipeError(f"--weights {path}: no such file or folder")
    if (path.parent / "custom_checkpoint_0.pkl").is_file():  # a file of a checkpoint (what every one holds)
        path = path.parent  # its model.safetensors records nothing of the run; the folder's config.json does
    if path.suffix == ".safetensors" and path.is_file():
        try:
            with safe_open(path, "pt") as f:
                about = f.metadata() or {}
        except Exception as error:  # empty, truncated, not safetensors: what it is matters more than its classes
            raise RecipeError(f"--weights {path} cannot be read ({type(error).__name__}: {first_line(error)[:120]}): "
                              "it may be truncated or not a weights file; pass a model.safetensors written by a run"
                              ) from None
        try:
            return {k: json.loads(about[k]) if k in ("flags", "classes") else about[k] for k in about}
        except (ValueError, RecursionError):  # not the recipes' metadata: --recipe and --classes say what it is
            return {}
    if path.is_dir():  # a checkpoint or a run folder: the config.json saved in it (--checkpoint_dir's have one too)
        if newest := list_checkpoints(path)[-1:]:  # a folder of checkpoints (a run's checkpoints/, a --checkpoint_dir)
            raise RecipeError(f"--weights {path} is a folder of checkpoints: pass one, e.g. {newest[0]}, the newest")
        run = path.resolve().parent.parent  # of checkpoints/<step> and of an extended run's finished/<N>_steps
        older = [run / "config.json"] if path.resolve().parent.name in ("checkpoints", "finished") else []
        # older checkpoints: their run's beside checkpoints/; none readable: --recipe and --classes say what it is
        config = next((c for c in map(read_json, [path / "config.json", *older]) if isinstance(c, dict)), None)
        if config:  # a run's config.json: its recipe and classes beside its flags
            return {**config, "flags": config}
    return {}


def load_recipe(cfg: Config, about: dict):
    """The recipe that trained the weights, as a module: --recipe PATH or a name in recipes/, or without it the recipe
    the weights name where it is one of the recipes beside this script. Weights come from anywhere and importing a
    file runs it, so what they name only picks among the recipes you have: never a path, never a file elsewhere.
    (Importing runs only its definitions: main() is behind __main__.)"""
    trained_by = about.get("recipe")
    if not isinstance(trained_by, str) or not RECIPE_NAME.fullmatch(trained_by):
        trained_by = None
    name = cfg.recipe
    if name is None:
        # The script beside this one that names itself so (its text read, nothing run): recipes/<name>.py, or the
        # train.py of a project made by tools/new_project.py, whose RECIPE is the project's name
        beside = [path for path in sorted(RECIPES.glob("*.py")) if trained_by and path.is_file()
                  and f'\nRECIPE = "{trained_by}"'.encode() in path.read_bytes()]
        if not beside:
            raise RecipeError(f"--weights {cfg.weights}: which recipe builds the model? They name none of the recipes "
                              "beside predict.py (a run's model.safetensors names its own; a .pt, none): pass --recipe "
                              "PATH of the script that trained them (a file the weights name is never imported)")
        name = str(beside[0])
    path = Path(name) if name.endswith(".py") else RECIPES / f"{name}.py"
    if not (name.endswith(".py") or RECIPE_NAME.fullmatch(name)) or not path.is_file():
        raise RecipeError(f"--recipe {name}: no such recipe: pass the path of the script that trained the "
                          f"weights, or one of {', '.join(sorted(p.stem for p in RECIPES.glob('*.py')))}")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        raise RecipeError(f"--recipe {path} cannot be imported ({type(error).__name__}: {first_line(error)}): "
                          "run predict.py where the recipe's own imports work") from None
    missing = [name for name in ("Config", "make_model", "preprocess", "IMAGE_SHAPE", "load_data", "evaluate")
               if not hasattr(module, name)]
    if missing:
        raise RecipeError(f"--recipe {path} does not define {', '.join(missing)}: pass a recipe script")
    # A copy may name itself otherwise (a project's train.py, tools/new_project.py): the model's shapes decide
    if trained_by and getattr(module, "RECIPE", path.stem) != trained_by:
        PartialState().print(printable(f"warning: --weights {cfg.weights} were trained by {trained_by}, not by "
                                       f"--recipe {name}: its model is built as asked (a copy, renamed?)"))
    return module


def recipe_config(recipe, flags, **overrides):
    """The recipe's Config with the flags the weights were trained with (those it still has, each checked against
    the field's type: the metadata is untrusted text), and `overrides`."""
    if not isinstance(flags, dict):
        raise RecipeError("the weights' metadata holds no flags (a dict): pass weights written by a recipe")
    hints = typing.get_type_hints(recipe.Config)
    kept = {k: v for k, v in flags.items() if k in hints and k not in ("output_dir", "resume", "overwrite")}
    for name, value in kept.items():
        if not fits(value, hints[name]):
            raise RecipeError(f"the weights' metadata gives {name} = {str(value)[:40]!r}, not a {hints[name]}: "
                              "pass weights written by this recipe")
    if overrides.get("tta") and "tta" not in hints:  # the MLP: its training flips no images
        raise RecipeError(f"{recipe.__name__} has no --tta (its training flips no images): run it without --tta")
    try:  # overrides too only where the recipe has the flag (the MLP has no --tta)
        return recipe.Config(**{**kept, **{k: v for k, v in overrides.items() if k in hints}})
    except (ValueError, TypeError) as error:
        raise RecipeError(f"the weights' flags do not fit {recipe.__name__}.Config ({first_line(error)[:120]}): "
                          "pass weights written by this recipe") from None


def fits(value, kind) -> bool:
    """Whether a JSON value is of a Config field's type (a bool is no int here; an int is a float)."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return any(fits(value, k) for k in typing.get_args(kind))
    if typing.get_origin(kind) is typing.Literal:
        return value in typing.get_args(kind)
    return type(value) in ((int, float) if kind is float else (kind,))


def load_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Load a .safetensors file, a torch.save'd state dict (plain, under 'model'/'state_dict'/'model_state_dict' or
    the one key whose value is one; keys prefixed 'module.' or '_orig_mod.') or an accelerate checkpoint folder into
    `model`, on any device."""
    path = Path(path)
    path = path / "model.safetensors" if path.is_dir() else path
    if not path.is_file():  # missing, or a FIFO that would block the read
        # A run folder without its weights yet (stopped, or still running): its newest checkpoint holds them
        newest = list_checkpoints(path.parent / "checkpoints")[-1:] if path.name == "model.safetensors" else []
        fix = (f"the run has not written it (stopped, or still running): pass --weights {newest[0]}, its newest "
               "checkpoint, or finish the run with --resume latest") if newest else (
               "pass a model.safetensors (a run writes it as it finishes), a .pt/.pth file or a checkpoint folder")
        raise RecipeError(f"--weights {path}: {'not a regular file' if path.exists() else 'no such file'}: {fix}")
    from shared.pickles import load_pickled  # a .pt/.pth from anywhere, checked: an opt-in module

    try:
        state = load_file(path) if path.suffix == ".safetensors" else load_pickled(path, "--weights")
    except RecipeError:
        raise
    except Exception as error:
        raise RecipeError(f"--weights {path} cannot be read ({type(error).__name__}: {first_line(error)}): "
                          "it may be truncated or not a weights file; pass a model.safetensors or a .pt state dict"
                          ) from None
    for key in ("model_state_dict", "state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if isinstance(state, dict) and not is_state_dict(state):
        nested = [value for value in state.values() if is_state_dict(value)]  # {"model_dict": ..., "epoch": 3}
        state = nested[0] if len(nested) == 1 else state
    if not is_state_dict(state):
        keys = f" (its keys: {', '.join(map(str, list(state)[:5]))[:200]})" if isinstance(state, dict) else ""
        raise RecipeError(f"--weights {path} holds no state dict, names to tensors{keys}: pass a .pt of "
                          "model.state_dict(), alone or under 'model', 'state_dict' or 'model_state_dict'")
    from shared.init_from import mismatch, plain_name  # weights from anywhere, checked: an opt-in module

    state = {plain_name(k): v for k, v in state.items()}
    expected = model.state_dict()
    if wrong := mismatch(expected, {k: tuple(v.shape) for k, v in state.items()}):
        raise RecipeError(f"--weights {path} does not fit this model ({wrong}): pass weights written by this recipe, "
                          "with the model flags they were trained with (see config.json beside them), and --classes, "
                          "where given, with as many names as their classes")
    if not all(torch.isfinite(state[k]).all() for k in expected if state[k].is_floating_point()):
        raise RecipeError(f"--weights {path} holds NaN or infinite weights (a run that diverged): pass an earlier "
                          "checkpoint's weights, or train again with a lower --lr")
    model.load_state_dict({k: state[k] for k in expected})


def is_state_dict(value) -> bool:
    return isinstance(value, dict) and bool(value) and all(
        isinstance(key, str) and isinstance(tensor, torch.Tensor) for key, tensor in value.items())


def read_image(file: Path, image_shape: tuple[int, int, int], interpolation: str) -> torch.Tensor:
    """One image file -> uint8 (C, H, W) of `image_shape`: decoded, then fitted (memory for one image)."""
    return fit(decode(file, image_shape[0], str(file))[0], *image_shape[1:], str(file), interpolation)


def find_images(root: Path) -> tuple[list[Path], list[Path]]:
    """(images, skipped): the files and links under `root` whose extension names a format decode reads, and the
    others."""
    if root.is_file():
        return [root], []
    if not root.is_dir():
        raise RecipeError(f"--images {root}: {'not a regular file' if root.exists() else 'no such file or folder'}")
    from shared.bounds import walk  # a folder from anywhere, walked whatever its depth: an opt-in module

    # Links too: one to a folder is not followed (a loop, or a walk outside --images), but said with the other files
    # skipped; one whose file is gone, with the files that cannot be read.
    files = sorted(Path(entry.path) for entry in walk(root) if not entry.name.startswith("."))
    images = [p for p in files if p.suffix.lower() in IMAGE_EXTENSIONS]
    if not images:
        raise RecipeError(f"--images {root} holds no images ({len(files)} other files): pass a folder of .png, "
                          ".jpg, .bmp, .webp or other image files")
    return images, [p for p in files if p.suffix.lower() not in IMAGE_EXTENSIONS]


def evaluate(cfg: Config, recipe, flags: dict, classes: list[str]) -> None:
    """--evaluate: the recipe's own evaluate() of the weights on a test split, as one JSON line."""
    overrides = {"data": cfg.data, "synthetic": False} if cfg.data else {}
    recipe_cfg = recipe_config(recipe, flags, **overrides, tta=cfg.tta, batch_size=cfg.batch_size)
    model = recipe.make_model(len(classes), recipe_cfg)
    load_weights(model, cfg.weights)  # before the data: a wrong file is one line at once, not after a download
    if not (cfg.data or recipe_cfg.synthetic or Path(recipe_cfg.data).is_dir()):  # weights never choose a download
        raise RecipeError("--evaluate without --data reads the weights' data (recorded; for a .pt/.pth, the "
                          f"recipe's default): {recipe_cfg.data[:80]!r}, no folder here (a relative path is read from "
                          "the folder predict.py is started in): pass --data (a hub id or a folder) to evaluate on")
    accelerator = Accelerator()  # the processes and precision of `accelerate launch`, else one process
    with accelerator.local_main_process_first():  # the decode cache is per machine
        _, test_set = recipe.load_data(recipe_cfg)
    if len(test_set.classes) != len(classes):
        raise RecipeError(f"{recipe_cfg.data} has {len(test_set.classes)} classes, the weights {len(classes)}: "
                          "pass --data of the kind they were trained on")
    if test_set.classes != classes:  # the accuracy compares label numbers: they may stand for other classes here
        accelerator.print(printable(f"warning: {recipe_cfg.data} names its classes {', '.join(test_set.classes[:3])}, "
                                    f"..., the weights {', '.join(classes[:3])}, ...: the accuracy below compares "
                                    "label numbers only"))  # names from elsewhere, a newline in one escaped
    if getattr(recipe_cfg, "channels_last", False):  # the layout evaluate() gives the inputs
        model = model.to(memory_format=torch.channels_last)
    loader = DataLoader(test_set, cfg.batch_size, collate_fn=test_set.whole_batch)
    model, loader = accelerator.prepare(model, loader)
    metrics, _ = recipe.evaluate(model, loader, accelerator, recipe_cfg)
    data = "SYNTHETIC data" if recipe_cfg.synthetic else recipe_cfg.data
    accelerator.print(json.dumps({"weights": cfg.weights, "data": data, **metrics}))
    # Leave together: gloo's teardown race at exit (docs/troubleshooting.md) is rarer then, though not gone.
    accelerator.wait_for_everyone()
    accelerator.end_training()


@torch.no_grad()
def predict(cfg: Config, recipe, flags: dict, classes: list[str]) -> None:
    """--images: a CSV of predictions for a folder of images."""
    state = PartialState()
    if state.num_processes > 1:
        raise RecipeError("predict.py --images runs in one process: start it with `python recipes/predict.py ...`")
    recipe_cfg = recipe_config(recipe, flags, tta=cfg.tta)
    model = recipe.make_model(len(classes), recipe_cfg)
    load_weights(model, cfg.weights)  # one line if the file is not this recipe's model
    model.to(state.device).eval()  # float32 and NCHW, whatever --channels_last or precision trained it: same weights
    # The size the model was trained at and its resize filter: a recipe with an --image_size flag says them
    # (finetune.py's input_sizes), and crops on the device from what its preprocess() is given (it takes cfg)
    shape, _, how = recipe.input_sizes(recipe_cfg) if hasattr(recipe, "input_sizes") else (
        recipe.IMAGE_SHAPE, 0, "bilinear")
    options = {"cfg": recipe_cfg} if "cfg" in inspect.signature(recipe.preprocess).parameters else {}
    root = Path(cfg.images)
    images, skipped = find_images(root)
    output = Path(cfg.output) if cfg.output else default_output(Path(cfg.weights), root)
    # Never renamed over a folder, a device or a FIFO (as root, --output /dev/null --overwrite made /dev/null a file),
    # nor over a file that is no CSV: --output model.safetensors --overwrite replaced the weights with the predictions
    if (exists := output.exists()) and not (output.is_file() and output.suffix == ".csv") or not output.parent.is_dir():
        raise RecipeError(
            f"--output {output}: {'exists and is no .csv file (kept)' if exists else 'its folder is missing'}: "
            "pass another file name in an existing folder")
    if exists and not cfg.overwrite:
        from shared.resume import predictions  # the CSVs predict.py wrote in a run folder: an opt-in module

        if cfg.output or output not in predictions(output.parent):  # the default --output: replaced if written here
            raise RecipeError(f"{output} exists: pass --overwrite to replace it, or another --output")
    if skipped:
        print(f"skipped {len(skipped)} file(s) whose extension names none of the formats read here "
              f"({', '.join(FORMATS)}), or links to folders (not followed), e.g. {printable(skipped[0])}")

    rows, unreadable = [], []
    k = min(cfg.top_k, len(classes))
    for start in range(0, len(images), cfg.batch_size):
        pixels, paths = [], []
        for path in images[start:start + cfg.batch_size]:
            try:  # a damaged or unsupported file among many new photos is skipped and said, not the end of the run
                pixels.append(read_image(path, shape, how))
                paths.append(path)
            except RecipeError as error:
                unreadable.append(str(error))
        if not paths:
            continue
        inputs = recipe.preprocess(torch.stack(pixels).to(state.device), training=False, **options)
        logits = model(inputs)
        if cfg.tta:  # as the recipe's evaluate() does it (eval_acc_tta); recipe_config refused it where it has none
            logits = (logits + model(inputs.flip(3))) / 2
        top_p, top_i = logits.float().softmax(dim=1).topk(k, dim=1)
        for path, p, i in zip(paths, top_p.tolist(), top_i.tolist()):
            name = path.relative_to(root) if root.is_dir() else path.name
            rows.append([cell(str(name)), cell(classes[i[0]]), f"{p[0]:.4f}",
                         cell("; ".join(f"{classes[c]} {q:.4f}" for c, q in zip(i, p)))])

    if not rows:  # nothing to write: the first file's problem
        raise RecipeError(f"none of the {len(images)} image file(s) of --images could be read: {unreadable[0]}")
    if unreadable:
        print(f"skipped {len(unreadable)} image file(s) that could not be read, e.g. {printable(unreadable[0])}")
    try:  # under a temporary name, renamed when complete: see shared/errors.py
        # A file name that is no UTF-8 (Latin-1's 0xe9) is written as its own bytes, so that the file can be found by it
        with replacing(output) as partial, partial.open("x", newline="", encoding="utf-8",
                                                        errors="surrogateescape") as f:
            writer = csv.writer(f)
            writer.writerow(["path", "class", "confidence", f"top_{k}"])  # what shared.resume.predictions knows it by
            writer.writerows(rows)
    except OSError as error:
        raise RecipeError(f"cannot write {output} ({error.strerror}): pass --output in a writable folder with room"
                          ) from None
    print(f"{recipe.__name__} ({cfg.weights}), {len(classes)} classes, on {state.device}:")
    for row in rows[:5]:
        print(f"  {printable(row[0])}: {printable(row[1])} ({row[2]})")
    print("per class: " + ", ".join(f"{printable(name)} {n}"
                                    for name, n in Counter(row[1] for row in rows).most_common()))
    # Said: a default CSV is named by the images folder's name alone, so photos/ of another place replaces it
    print(f"wrote {printable(output)} ({len(rows)} images{', replacing the file there before' if exists else ''})")


def cell(text: str) -> str:
    """A CSV cell a spreadsheet shows as text: one that starts as a formula would (`=cmd|' /C calc'!A0` from a class
    name or a file name) starts with an apostrophe (OWASP's CSV injection advice)."""
    return "'" + text if text.startswith(("=", "+", "-", "@", "\t", "\r")) else text


def default_output(weights: Path, images: Path) -> Path:
    """predictions-<images>.csv in the run the weights belong to: beside a model.safetensors or .pt; for a checkpoint,
    in its run (checkpoints/step_<N>) or beside it (--checkpoint_dir), never in the checkpoint, which a later save may
    prune; never in the working folder (a repository). Weights other than a run's model.safetensors add their name
    (predictions-<images>-step_<N>.csv), so that one's CSV never replaces, or reads as, another's."""
    folder, tag = (weights, "model") if weights.is_dir() else (weights.parent, weights.stem)
    if (folder / "custom_checkpoint_0.pkl").is_file():  # what every checkpoint holds (Progress)
        folder, tag = folder.parent.parent if folder.parent.name == "checkpoints" else folder.parent, folder.name
    name = images.stem if images.is_file() else images.resolve().name
    tag = b"" if tag == "model" else f"-{tag}".encode(errors="surrogateescape")[:60]
    name = name.encode(errors="surrogateescape")[:150] + tag  # a file name: at most 255 bytes
    return folder / f"predictions-{name.decode(errors='ignore')}.csv"


def run(cfg: Config) -> None:
    from shared.launch import check_launch  # the launch's settings, checked: an opt-in module

    check_launch()  # as the recipes do: a broken launch is one line
    about = describe_weights(cfg)
    recipe = load_recipe(cfg, about)
    classes = cfg.classes.split(",") if cfg.classes else about.get("classes")
    # The count first, then each a name, once: a name twice would give two labels one name in the CSV
    if not (isinstance(classes, list) and 0 < len(classes) <= 100_000 and all(isinstance(c, str) for c in classes)
            and len(set(classes)) == len(classes)):
        raise RecipeError(f"--weights {cfg.weights} names no classes, or a class twice: pass --classes NAME,NAME,... "
                          "in label order, each name once")
    (evaluate if cfg.evaluate else predict)(cfg, recipe, about.get("flags") or {}, classes)


def main() -> None:
    cfg = Config.parse()
    with one_line_errors():
        run(cfg)


if __name__ == "__main__":
    main()
