"""Tiny image datasets written in the formats users bring: save_to_disk, parquet, imagefolder.

Most are random images, with a per-class brightness so that a label means something, small enough
that a recipe runs through them in seconds. `real_photos` and `real_digits` are small versions of
the real-image sets of benchmarks/real_images.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import datasets
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import real_images  # noqa: E402  (benchmarks/ is not a package)

CLASSES = [f"class_{i}" for i in range(100)]


def image_splits(sizes=None, shape=(3, 32, 32), num_classes=10, seed=0, image_column="img") -> datasets.DatasetDict:
    """A DatasetDict with an Image column (CIFAR-10 on the hub calls it 'img', Fashion-MNIST
    'image') and a ClassLabel column 'label'."""
    sizes = sizes or {"train": 64, "test": 20}
    rng = np.random.default_rng(seed)
    channels, height, width = shape
    features = datasets.Features({image_column: datasets.Image(),
                                  "label": datasets.ClassLabel(names=CLASSES[:num_classes])})
    splits = {}
    for split, size in sizes.items():
        labels = np.arange(size) % num_classes
        images = []
        for label in labels:
            pixels = rng.integers(0, 128, (height, width, channels), dtype=np.uint8) + np.uint8(12 * label % 128)
            images.append(Image.fromarray(pixels[..., 0] if channels == 1 else pixels))
        splits[split] = datasets.Dataset.from_dict({image_column: images, "label": labels.tolist()}, features=features)
    return datasets.DatasetDict(splits)


def save_to_disk_dataset(path: Path, **kwargs) -> Path:
    image_splits(**kwargs).save_to_disk(str(path))
    return path


def parquet_dataset(path: Path, **kwargs) -> Path:
    path.mkdir(parents=True)
    for split, dataset in image_splits(**kwargs).items():
        dataset.to_parquet(str(path / f"{split}.parquet"))  # load_dataset(folder) maps file names to splits
    return path


def imagefolder_dataset(path: Path, **kwargs) -> Path:
    """path/<split>/<class name>/<n>.png: the layout torchvision's ImageFolder also reads."""
    for split, dataset in image_splits(**kwargs).items():
        for n, example in enumerate(dataset):
            folder = path / split / CLASSES[example["label"]]
            folder.mkdir(parents=True, exist_ok=True)
            next(v for v in example.values() if isinstance(v, Image.Image)).save(folder / f"{n}.png")
    return path


def text_dataset(path: Path) -> Path:
    """A dataset with the wrong columns for an image recipe."""
    datasets.DatasetDict(train=datasets.Dataset.from_dict({"text": ["a", "b"], "label": [0, 1]}),
                         test=datasets.Dataset.from_dict({"text": ["c"], "label": [1]})).save_to_disk(str(path))
    return path


def real_photos(path: Path, train_per_class: int, test_per_class: int, size: int = 32, classes: int = 10,
                layout: str = "save_to_disk") -> Path:
    """Crops of real photographs in CIFAR-10's format (benchmarks/real_images.py), the first `classes` of them."""
    splits = real_images.photos(10, train_per_class, test_per_class, size=size)
    if classes < 10:
        splits = splits.filter(lambda label: label < classes, input_columns="label")
    return real_images.write(splits, path, layout)


def real_digits(path: Path, limit: int) -> Path:
    """`limit` of scikit-learn's handwritten digits in Fashion-MNIST's format, a fifth of them for testing."""
    return real_images.write(real_images.digits(test_size=limit // 5, limit=limit), path, "save_to_disk")
