"""Tiny image datasets written in the formats users bring: save_to_disk, parquet, imagefolder, IDX files and
CIFAR's binary and Python versions.

Most are random images, with a per-class brightness so that a label means something, small enough
that a recipe runs through them in seconds. `real_photos` and `real_digits` are small versions of
the real-image sets of benchmarks/real_images.py.
"""

from __future__ import annotations

import gzip
import io
import pickle
import struct
import sys
from pathlib import Path

import datasets
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import real_images  # noqa: E402  (benchmarks/ is not a package)

CLASSES = [f"class_{i}" for i in range(100)]


def image_arrays(sizes=None, shape=(3, 32, 32), num_classes=10, seed=0) -> dict:
    """{split: (uint8 images (N, H, W, C), labels)}: random pixels plus a per-class brightness, so that a label
    means something."""
    rng = np.random.default_rng(seed)
    channels, height, width = shape
    arrays = {}
    for split, size in (sizes or {"train": 64, "test": 20}).items():
        labels = np.arange(size) % num_classes
        images = rng.integers(0, 128, (size, height, width, channels), dtype=np.uint8)
        arrays[split] = (images + (12 * labels % 128).astype(np.uint8)[:, None, None, None], labels)
    return arrays


def image_splits(sizes=None, shape=(3, 32, 32), num_classes=10, seed=0, image_column="img") -> datasets.DatasetDict:
    """A DatasetDict with an Image column (CIFAR-10 on the hub calls it 'img', Fashion-MNIST
    'image') and a ClassLabel column 'label'."""
    features = datasets.Features({image_column: datasets.Image(),
                                  "label": datasets.ClassLabel(names=CLASSES[:num_classes])})
    return datasets.DatasetDict({
        split: datasets.Dataset.from_dict({image_column: [Image.fromarray(a[..., 0] if shape[0] == 1 else a)
                                                          for a in images], "label": labels.tolist()},
                                          features=features)
        for split, (images, labels) in image_arrays(sizes, shape, num_classes, seed).items()})


def save_to_disk_dataset(path: Path, **kwargs) -> Path:
    image_splits(**kwargs).save_to_disk(str(path))
    return path


def cifar_binary_dataset(path: Path, sizes=None, seed=0) -> Path:
    """The images of save_to_disk_dataset (the same seed gives the same pixels and labels) in CIFAR-10's binary
    version: a recipe reads these files without importing datasets, about a second less per run for the tests that
    are not about the format."""
    arrays = {split: (images.transpose(0, 3, 1, 2), labels) for split, (images, labels) in
              image_arrays(sizes, seed=seed).items()}
    return cifar_folder(path / "cifar-10-batches-bin", arrays, CLASSES[:10])


def write_idx(path: Path, array: np.ndarray) -> None:
    """The IDX format: 0, 0, 0x08 (unsigned bytes), the number of dimensions, each size as a big-endian uint32."""
    raw = bytes([0, 0, 8, array.ndim]) + np.array(array.shape, ">u4").tobytes() + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)


def idx_folder(folder: Path, splits: dict, suffix: str = ".gz") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split, prefix in (("train", "train"), ("test", "t10k")):
        images, labels = splits[split]
        write_idx(folder / f"{prefix}-images-idx3-ubyte{suffix}", images)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte{suffix}", labels)
    return folder


def cifar_folder(folder: Path, splits: dict, classes: list[str], hundred: bool = False) -> Path:
    """CIFAR's binary version: records of label byte(s) and 3,072 pixel bytes (R, G, B planes); CIFAR-100 writes a
    coarse label, then the fine one."""
    folder.mkdir(parents=True, exist_ok=True)
    files = ({"train": ["train.bin"], "test": ["test.bin"]} if hundred
             else {"train": [f"data_batch_{i}.bin" for i in range(1, 6)], "test": ["test_batch.bin"]})
    for split, names in files.items():
        images, labels = splits[split]
        for name, part in zip(names, np.array_split(np.arange(len(labels)), len(names))):
            label_bytes = [labels[part] // 5, labels[part]] if hundred else [labels[part]]  # coarse: any byte
            rows = np.concatenate([np.stack(label_bytes, 1), images[part].reshape(len(part), -1)], 1)
            (folder / name).write_bytes(rows.astype(np.uint8).tobytes())
    (folder / ("fine_label_names.txt" if hundred else "batches.meta.txt")).write_text("\n".join(classes) + "\n\n")
    return folder


class Python2Pickler(pickle._Pickler):
    """Pickles bytes as Python 2 pickled its str (SHORT_BINSTRING, BINSTRING), as CIFAR's Python version was written:
    its keys, names and the arrays' bytes; Python 3 reads them back as str (latin-1) or bytes, by its `encoding`."""

    dispatch = dict(pickle._Pickler.dispatch)

    def save_str2(self, obj: bytes):
        head = pickle.SHORT_BINSTRING + bytes([len(obj)]) if len(obj) < 256 else pickle.BINSTRING + struct.pack(
            "<i", len(obj))
        self.write(head + obj)
        self.memoize(obj)

    dispatch[bytes] = save_str2


def python2_pickle(value) -> bytes:
    out = io.BytesIO()
    Python2Pickler(out, protocol=2).dump(value)
    return out.getvalue()


def cifar_python_folder(folder: Path, splits: dict, classes: list[str], hundred: bool = False,
                        protocol: int | None = None) -> Path:
    """CIFAR's Python version, as torchvision downloads it: dicts pickled by Python 2, their keys and names Python 2
    str (bytes here), the images one uint8 array of rows of 3,072 bytes (R, G, B planes) per file; or, with a
    `protocol`, as Python 3 pickles the same dicts (str keys and names, a NumPy array)."""
    folder.mkdir(parents=True, exist_ok=True)
    labels_key, names_key = (b"fine_labels", b"fine_label_names") if hundred else (b"labels", b"label_names")
    files = ({"train": ["train"], "test": ["test"]} if hundred
             else {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]})
    for split, names in files.items():
        images, labels = splits[split]
        for name, part in zip(names, np.array_split(np.arange(len(labels)), len(names))):
            batch = {b"batch_label": f"batch {name} \xe9".encode("latin1"), labels_key: labels[part].tolist(),
                     b"data": images[part].reshape(len(part), -1), b"filenames": [f"{i}.png".encode() for i in part]}
            (folder / name).write_bytes(python2_pickle(batch) if protocol is None else pickle.dumps(
                {key.decode(): value for key, value in batch.items()}, protocol=protocol))
    names_file = folder / ("meta" if hundred else "batches.meta")
    names = {names_key: [name.encode("latin1") for name in classes]}
    names_file.write_bytes(python2_pickle(names) if protocol is None else pickle.dumps(
        {names_key.decode(): list(classes)}, protocol=protocol))
    return folder


def random_splits(shape, sizes=(50, 20), classes=10, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    return {split: (rng.integers(0, 256, (size, *shape), dtype=np.uint8), rng.integers(0, classes, size))
            for split, size in zip(("train", "test"), sizes)}


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
