"""Real-image datasets in the formats of CIFAR-10, CIFAR-100 and Fashion-MNIST, built from the
photographs and scans that ship inside pip packages (scikit-image, scikit-learn, matplotlib), so
that the recipes' defaults can be tried on real images where the hub cannot be reached.

  digits     scikit-learn's 1,797 handwritten digits (8x8, 17 gray levels), upsampled to 20x20 and
             centred in 28x28 as in MNIST: Fashion-MNIST's format (1 x 28 x 28, column 'image', 10 classes);
             1,500 train / 297 test; digits_150: the first 150 of those training digits, the same test digits.
  photos10   32x32 RGB crops of 10 colour photographs; the class is the photograph: CIFAR-10's format
             (column 'img', 10 classes); 500 train / 100 test crops per class.
  photos10_small  the same with 150 train / 30 test crops per class, for models too slow for 5,000 images
             on a CPU (the grayscale recipe reads it through its colour -> grayscale, 32 -> 28 px conversion).
  photos100  32x32 RGB crops of 20 photographs (11 colour, 9 grayscale), each cut into 5 horizontal
             strips; the class is the strip, the coarse class the photograph: CIFAR-100's format
             (columns 'img', 'fine_label', 'coarse_label'); 50 train / 10 test crops per class.

Each photograph is cut to a centred square, resized to 400 x 400 and divided into 5 x 5 tiles of 80 px.
One tile per row is kept for testing, the other four for training, so no test crop shares a pixel
with a training crop. A crop is a random square of 32 to 80 px inside one tile, resized to 32 x 32
with an antialiasing filter: objects at several scales, as in photographs taken at several distances.
Everything is drawn from a fixed seed: the same files on every machine.

    python benchmarks/real_images.py              # every set in every format, in the cache folder
    python benchmarks/real_images.py --out DIR    # elsewhere

It prints the folders to pass as `--data`, e.g. ~/.cache/accelerate-recipes/real_images/photos10/save_to_disk.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import os
from pathlib import Path

import datasets
import numpy as np
from PIL import Image

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "accelerate-recipes" / "real_images"
FORMATS = ("save_to_disk", "parquet", "imagefolder")  # and "idx", asked for: grayscale sets only (digits)
SIDE, GRID, CROP = 400, 5, 32  # square photograph side (px), tiles per row and column, output image side (px)
TILE = SIDE // GRID

# (package, path inside it): 10 colour photographs for photos10; photos100 adds the rest.
COLOUR = [("skimage", f"data/{name}") for name in (
    "astronaut.png", "chelsea.png", "coffee.png", "hubble_deep_field.jpg", "ihc.png", "motorcycle_left.png",
    "rocket.jpg")] + [
    ("sklearn", "datasets/images/china.jpg"), ("sklearn", "datasets/images/flower.jpg"),
    ("matplotlib", "mpl-data/sample_data/grace_hopper.jpg")]
MORE = [("skimage", "data/retina.jpg")] + [("skimage", f"data/{name}.png") for name in (
    "camera", "coins", "moon", "brick", "grass", "gravel", "clock_motion", "cell", "page")]


def package_file(package: str, path: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise SystemExit(f"{package} is not installed: pip install scikit-image scikit-learn matplotlib")
    return Path(spec.submodule_search_locations[0]) / path


def square_photo(package: str, path: str) -> Image.Image:
    """The photograph as RGB, its centred square resized to SIDE x SIDE."""
    with Image.open(package_file(package, path)) as image:
        image = image.convert("RGB")
        side = min(image.size)
        left, top = (image.width - side) // 2, (image.height - side) // 2
        return image.crop((left, top, left + side, top + side)).resize((SIDE, SIDE), Image.Resampling.LANCZOS)


def is_test_tile(row: int, column: int) -> bool:
    return column == (2 * row) % GRID  # one tile per row and per column: test crops cover the whole photograph


def crops(photo: Image.Image, rows: list[int], split: str, count: int, rng: np.random.Generator,
          size: int) -> list[Image.Image]:
    """`count` random crops from the `split` tiles of the given tile rows, resized to size x size."""
    tiles = [(r, c) for r in rows for c in range(GRID) if is_test_tile(r, c) == (split == "test")]
    out = []
    for _ in range(count):
        row, column = tiles[rng.integers(len(tiles))]
        side = int(rng.integers(CROP, TILE + 1))
        left = column * TILE + int(rng.integers(TILE - side + 1))
        top = row * TILE + int(rng.integers(TILE - side + 1))
        out.append(photo.crop((left, top, left + side, top + side)).resize((size, size), Image.Resampling.BICUBIC))
    return out


def photos(num_classes: int, train_per_class: int, test_per_class: int, seed: int = 0,
           size: int = CROP) -> datasets.DatasetDict:
    """photos10 (num_classes=10) or photos100 (num_classes=100) of size x size images; see the module docstring."""
    sources = COLOUR if num_classes == 10 else COLOUR + MORE
    names = [Path(path).stem for _, path in sources]
    strips = 1 if num_classes == 10 else GRID  # classes per photograph
    rng = np.random.default_rng(seed)
    columns = {split: {"img": [], "fine_label": [], "coarse_label": []} for split in ("train", "test")}
    for index, source in enumerate(sources):
        photo = square_photo(*source)
        for strip in range(strips):
            rows = list(range(GRID)) if strips == 1 else [strip]
            for split, count in (("train", train_per_class), ("test", test_per_class)):
                images = crops(photo, rows, split, count, rng, size)
                columns[split]["img"] += images
                columns[split]["fine_label"] += [index * strips + strip] * count
                columns[split]["coarse_label"] += [index] * count
    if num_classes == 10:  # CIFAR-10's columns: img, label
        features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=names)})
        for split in columns.values():
            split["label"] = split.pop("fine_label")
            del split["coarse_label"]
    else:  # CIFAR-100's columns: img, fine_label, coarse_label
        fine = [f"{name}_strip{strip}" for name in names for strip in range(strips)]
        features = datasets.Features({"img": datasets.Image(), "fine_label": datasets.ClassLabel(names=fine),
                                      "coarse_label": datasets.ClassLabel(names=names)})
    return datasets.DatasetDict({split: datasets.Dataset.from_dict(values, features=features).shuffle(seed=seed)
                                 for split, values in columns.items()})


def digits(test_size: int = 297, seed: int = 0, limit: int | None = None) -> datasets.DatasetDict:
    """scikit-learn's handwritten digits as 28x28 MNIST-style images (white ink on black)."""
    with gzip.open(package_file("sklearn", "datasets/data/digits.csv.gz")) as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    pixels, labels = table[:, :64].reshape(-1, 8, 8), table[:, 64].astype(int)
    order = np.random.default_rng(seed).permutation(len(labels))[:limit]
    images = []
    for i in order:
        small = Image.fromarray(np.round(pixels[i] * 255 / 16).astype(np.uint8))
        image = Image.new("L", (28, 28))
        image.paste(small.resize((20, 20), Image.Resampling.BICUBIC), (4, 4))  # MNIST: a 20x20 digit, 4 px margin
        images.append(image)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list("0123456789"))})
    data = datasets.Dataset.from_dict({"image": images, "label": labels[order].tolist()}, features=features)
    return datasets.DatasetDict(train=data.select(range(test_size, len(data))), test=data.select(range(test_size)))


def first_train(splits: datasets.DatasetDict, count: int) -> datasets.DatasetDict:
    """The first `count` training images and the whole test split."""
    return datasets.DatasetDict(train=splits["train"].select(range(count)), test=splits["test"])


def write(splits: datasets.DatasetDict, folder: Path, layout: str) -> Path:
    """`splits` written as a save_to_disk folder, parquet files (one per split), an imagefolder, or IDX files (the
    MNIST family's format, for grayscale sets: nothing to install where the recipes read them)."""
    folder.mkdir(parents=True, exist_ok=True)
    if layout == "idx":
        for split, prefix in (("train", "train"), ("test", "t10k")):
            images = np.stack([np.asarray(image.convert("L")) for image in splits[split]["image"]])
            for kind, array in (("images-idx3", images), ("labels-idx1", np.array(splits[split]["label"]))):
                header = bytes([0, 0, 8, array.ndim]) + np.array(array.shape, ">u4").tobytes()
                (folder / f"{prefix}-{kind}-ubyte").write_bytes(header + array.astype(np.uint8).tobytes())
    elif layout == "save_to_disk":
        splits.save_to_disk(str(folder))
    elif layout == "parquet":
        for split, data in splits.items():
            data.to_parquet(str(folder / f"{split}.parquet"))  # load_dataset(folder) maps file names to splits
    else:  # imagefolder: <split>/<class name>/<n>.png, the label read from the folder name
        image_column, label_column = next(iter(splits["train"].features)), next(
            name for name, f in splits["train"].features.items() if isinstance(f, datasets.ClassLabel))
        names = splits["train"].features[label_column].names
        for split, data in splits.items():
            for n, example in enumerate(data):
                path = folder / split / names[example[label_column]] / f"{n}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                example[image_column].save(path)
    return folder


SETS = {  # name -> builder with the sizes of the module docstring
    "digits": lambda: digits(),
    "digits_150": lambda: first_train(digits(), 150),  # a small labeled set (benchmarks/transfer.sh)
    "photos10": lambda: photos(10, 500, 100),
    "photos10_small": lambda: photos(10, 150, 30),
    "photos100": lambda: photos(100, 50, 10),
}


def build(name: str, layout: str = "save_to_disk", root: Path = CACHE) -> Path:
    """The folder of set `name` in `layout`, built on first use."""
    folder = root / name / layout
    if not folder.exists():
        partial = folder.with_name(f"{layout}.partial{os.getpid()}")
        write(SETS[name](), partial, layout)
        partial.rename(folder)  # a build killed half-way never looks complete
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=CACHE, help="folder that receives <set>/<format>/")
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=[*FORMATS, "idx"])
    args = parser.parse_args()
    for name in args.sets:
        for layout in args.formats:
            print(build(name, layout, args.out))


if __name__ == "__main__":
    main()
