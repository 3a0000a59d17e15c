"""Classify your own images with a trained model: a folder of images in, predictions.csv out.

Takes any weights file the recipes' --eval_only accepts: a run's model.safetensors (which names its recipe, its
flags and its class names), a checkpoint folder (read beside its run's config.json), or a .pt/.pth state dict
(then pass --recipe and --classes). Images may sit in subfolders and have any size, mode or channel count: each
is converted as the training data was (grayscale <-> colour, shorter side resized, centre crop) and
preprocessed by the recipe's own preprocess(). Files that are not images by their extension are skipped.

predictions.csv has one row per image: path (relative to --images), class, confidence (softmax probability)
and the top-k classes with theirs. The first rows and a count per class are printed.

  python recipes/predict.py --weights runs/cifar_cnn-<time>/model.safetensors --images my_photos/
"""

from __future__ import annotations

import csv
import dataclasses
import importlib
import json
import os
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from accelerate import PartialState
from PIL import Image, UnidentifiedImageError
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # find shared/ and recipes/ without installing them
from shared.checkpoints import load_weights
from shared.config import parse_config
from shared.data import WIDE_MODES, fit
from shared.errors import RecipeError, check_launch, one_line_errors

RECIPES = ("cifar_cnn", "resnet18_fmnist", "deep_mlp_ckpt")
IMAGE_EXTENSIONS = {ext for ext, format in Image.registered_extensions().items() if format in Image.OPEN}


@dataclass
class Config:
    weights: str = ""  # model.safetensors of a run, a checkpoint folder, or a .pt/.pth state dict
    images: str = ""  # an image file, or a folder of them (subfolders included)
    output: str = "predictions.csv"  # the CSV file to write
    top_k: int = 3  # classes listed per image, most probable first
    batch_size: int = 256  # images per forward pass
    recipe: str | None = None  # cifar_cnn, resnet18_fmnist or deep_mlp_ckpt; needed only for a .pt/.pth file
    classes: str | None = None  # class names in label order, comma-separated; needed only for a .pt/.pth file
    overwrite: bool = False  # replace --output if it exists

    parse = classmethod(parse_config)

    def __post_init__(self):
        if not self.weights or not self.images:
            raise ValueError("--weights PATH and --images FOLDER are both needed")
        if self.top_k < 1 or self.batch_size < 1:
            raise ValueError(f"--top_k and --batch_size must be > 0, got {self.top_k} and {self.batch_size}")
        if self.recipe is not None and self.recipe not in RECIPES:
            raise ValueError(f"--recipe must be one of {', '.join(RECIPES)}, got {self.recipe}")


def describe_weights(cfg: Config) -> tuple[str, dict, list[str]]:
    """(recipe, training flags, class names) of the weights: from model.safetensors' metadata, from the run's
    config.json beside a checkpoint folder, or from --recipe and --classes."""
    path = Path(cfg.weights)
    if not path.exists():
        raise RecipeError(f"--weights {path}: no such file or folder")
    about, run_config = {}, path.resolve().parents[1] / "config.json"  # runs/<run>/checkpoints/step_<N>
    if path.suffix == ".safetensors" and path.is_file():
        try:
            with safe_open(path, "pt") as f:
                about = f.metadata() or {}
            about = {k: json.loads(about[k]) if k in ("flags", "classes") else about[k] for k in about}
        except Exception:  # unreadable, or not the recipes' metadata: --recipe and --classes, or load_weights' line
            about = {}
    elif path.is_dir() and run_config.exists():
        config = json.loads(run_config.read_text())
        about = {"recipe": config.get("recipe"), "flags": config, "classes": config.get("classes")}
    recipe = about.get("recipe") or cfg.recipe
    if cfg.recipe and recipe != cfg.recipe:
        raise RecipeError(f"--weights {path} were trained by {recipe}, not --recipe {cfg.recipe}: leave out --recipe")
    if recipe is None:
        raise RecipeError(f"--weights {path} does not say which recipe trained it: pass --recipe "
                          f"({', '.join(RECIPES)}) and --classes NAME,NAME,... of that run")
    classes = cfg.classes.split(",") if cfg.classes else about.get("classes")
    if not classes:
        raise RecipeError(f"--weights {path} names no classes: pass --classes NAME,NAME,... in label order")
    return recipe, about.get("flags") or {}, classes


def find_images(root: Path) -> tuple[list[Path], list[Path]]:
    """(images, skipped): files under `root` whose extension PIL reads, and the others."""
    if root.is_file():
        return [root], []
    if not root.is_dir():
        raise RecipeError(f"--images {root}: no such file or folder")
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
    images = [p for p in files if p.suffix.lower() in IMAGE_EXTENSIONS]
    if not images:
        raise RecipeError(f"--images {root} holds no images ({len(files)} other files): pass a folder of .png, "
                          ".jpg, .bmp, .webp or other image files")
    return images, [p for p in files if p.suffix.lower() not in IMAGE_EXTENSIONS]


def read_image(path: Path, image_shape: tuple[int, int, int]) -> torch.Tensor:
    """uint8 (C, H, W) of the recipe's shape, converted as shared/data.py converts a dataset's images."""
    channels, height, width = image_shape
    try:
        with Image.open(path) as image:
            if image.mode in WIDE_MODES:
                raise RecipeError(f"{path} has {image.mode} pixels (16-bit, 32-bit or float), which 8 bits cannot hold "
                                  "without guessing a range: convert it to 8-bit L or RGB")
            pixels = np.array(image.convert("L" if channels == 1 else "RGB"))
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise RecipeError(f"{path} is not a readable image ({type(error).__name__}: {str(error)[:120]}): "
                          "remove it from --images or replace it") from None
    image = torch.from_numpy(pixels).reshape(*pixels.shape[:2], channels).permute(2, 0, 1)
    return fit(image, height, width)


@torch.no_grad()
def predict(cfg: Config) -> None:
    check_launch()  # as the recipes do: a launch of several processes is found, and refused below
    state = PartialState()
    if state.num_processes > 1:
        raise RecipeError("predict.py runs in one process: start it with `python recipes/predict.py ...`")
    recipe_name, flags, classes = describe_weights(cfg)
    recipe = importlib.import_module(f"recipes.{recipe_name}")
    fields = {f.name for f in dataclasses.fields(recipe.Config)}
    model = recipe.make_model(len(classes), recipe.Config(**{k: v for k, v in flags.items() if k in fields}))
    load_weights(model, cfg.weights)  # one line if the file is not this recipe's model
    model.to(state.device).eval()  # float32 and NCHW, whatever --channels_last or precision trained it: same weights
    root = Path(cfg.images)
    images, skipped = find_images(root)
    output = Path(cfg.output)
    if output.exists() and not cfg.overwrite:
        raise RecipeError(f"{output} exists: pass --overwrite to replace it, or another --output")
    if skipped:
        print(f"skipped {len(skipped)} file(s) that are not images by their extension, e.g. {skipped[0]}")

    rows, counts = [], Counter()
    k = min(cfg.top_k, len(classes))
    for start in range(0, len(images), cfg.batch_size):
        paths = images[start:start + cfg.batch_size]
        batch = torch.stack([read_image(p, recipe.IMAGE_SHAPE) for p in paths]).to(state.device)
        probabilities = model(recipe.preprocess(batch, training=False)).float().softmax(dim=1)
        top_p, top_i = probabilities.topk(k, dim=1)
        for path, p, i in zip(paths, top_p.tolist(), top_i.tolist()):
            name = path.relative_to(root) if root.is_dir() else path.name
            rows.append([str(name), classes[i[0]], f"{p[0]:.4f}",
                         "; ".join(f"{classes[c]} {q:.4f}" for c, q in zip(i, p))])
            counts[classes[i[0]]] += 1

    partial = output.with_name(output.name + ".tmp")
    with partial.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["path", "class", "confidence", f"top_{k}"])
        writer.writerows(rows)
    os.replace(partial, output)  # a reader never sees half a file
    print(f"{recipe_name} ({cfg.weights}), {len(classes)} classes, on {state.device}:")
    for row in rows[:5]:
        print(f"  {row[0]}: {row[1]} ({row[2]})")
    print("per class: " + ", ".join(f"{name} {n}" for name, n in counts.most_common()))
    print(f"wrote {output} ({len(rows)} images)")


def main() -> None:
    cfg = Config.parse()
    with one_line_errors():
        predict(cfg)


if __name__ == "__main__":
    main()
