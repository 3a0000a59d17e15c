"""The files image datasets are published in, read as they are: the MNIST family's IDX files and CIFAR's batches.

`find_dataset_files(folder)` returns a `DatasetFiles` for a folder (or one below it) that holds
- IDX files, gzipped or not, as the MNIST and Fashion-MNIST authors publish them, torchvision downloads them
  (`<root>/FashionMNIST/raw/`) and Debian installs them (`/usr/share/datasets/fashion-mnist/`):
  `train-images-idx3-ubyte`, `train-labels-idx1-ubyte`, and `t10k-*` (or `test-*`) for the test split;
- CIFAR-10 or CIFAR-100 as torchvision downloads them (`cifar-10-batches-py/`, `cifar-100-python/`). Those
  batches are pickles, and unpickling can run any code: they are read by an unpickler that builds only Python's
  containers, numbers, strings and NumPy arrays, and refuses everything else.
else None. `.read()` returns {"train": (images, labels), "test": ...}, uint8 (N, C, H, W) and int64 (N,), and
the class names.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import pickle
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shared.errors import RecipeError, first_line

FASHION_MNIST = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                 "Ankle boot"]
FASHION_MNIST_TEST_LABELS = "0402a96d92fd2663"  # sha256 of t10k-labels-idx1-ubyte, uncompressed: the names follow
IDX_SPLITS = {"train": ("train",), "test": ("t10k", "test")}
CIFAR_SPLITS = {  # folder -> the files of each split, the meta file, its names key, the labels key
    "cifar-10-batches-py": ({"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]},
                            "batches.meta", "label_names", "labels"),
    "cifar-100-python": ({"train": ["train"], "test": ["test"]}, "meta", "fine_label_names", "fine_labels"),
}


@dataclass
class DatasetFiles:
    kind: str  # "idx", or a CIFAR_SPLITS folder name
    files: dict[str, list[Path]]  # split -> its files (IDX: images then labels)

    def all_files(self) -> list[Path]:
        return [file for files in self.files.values() for file in files]

    def read(self) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], list[str]]:
        if self.kind == "idx":
            return read_idx_splits(self.files)
        return read_cifar_splits(self.kind, self.files)


def find_dataset_files(folder: Path) -> DatasetFiles | None:
    """The IDX or CIFAR files in `folder`, or where torchvision's download puts them below its root folder."""
    candidates = (folder, folder / "raw", *sorted(folder.glob("*/raw")), *sorted(folder.glob("cifar-*")))
    found = [f for candidate in candidates
             if candidate.is_dir() and (f := idx_files(candidate) or cifar_files(candidate))]
    if len({tuple(f.all_files()) for f in found}) > 1:
        places = ", ".join(str(f.all_files()[0].parent) for f in found)
        raise RecipeError(f"--data {folder} holds more than one dataset ({places}): pass --data one of these folders")
    return found[0] if found else None


def idx_files(folder: Path) -> DatasetFiles | None:
    files = {}
    for split, prefixes in IDX_SPLITS.items():
        for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"):
            matches = sorted(folder.glob(f"*{prefixes[0]}-{kind}*")) or sorted(
                file for prefix in prefixes[1:] for file in folder.glob(f"*{prefix}-{kind}*"))
            # torchvision keeps the .gz it downloaded beside the file it unpacked: read the unpacked one
            stems = {file.name.removesuffix(".gz") for file in matches}
            if len(stems) > 1:
                raise RecipeError(f"{folder} holds several IDX sets ({', '.join(sorted(stems))}): keep one per folder")
            if matches:
                files.setdefault(split, []).append(min(matches, key=lambda file: file.suffix == ".gz"))
    if not files:
        return None
    if any(len(files.get(split, [])) != 2 for split in IDX_SPLITS):
        have = ", ".join(file.name for split_files in files.values() for file in split_files)
        raise RecipeError(f"{folder} has IDX files ({have}) but not all four: expected train-images-idx3-ubyte, "
                          "train-labels-idx1-ubyte, t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte (.gz or not)")
    return DatasetFiles("idx", files)


def cifar_files(folder: Path) -> DatasetFiles | None:
    if folder.name not in CIFAR_SPLITS:
        return None
    splits, meta, _, _ = CIFAR_SPLITS[folder.name]
    files = {split: [folder / name for name in names] for split, names in splits.items()}
    files["meta"] = [folder / meta]
    missing = [file.name for file in files["meta"] + files["train"] + files["test"] if not file.is_file()]
    if missing:
        raise RecipeError(f"{folder} lacks {', '.join(missing)}: download the dataset again "
                          "(torchvision.datasets.CIFAR10/CIFAR100(root, download=True))")
    return DatasetFiles(folder.name, files)


def read_idx(path: Path) -> np.ndarray:
    """An IDX file: 0, 0, type 0x08 (unsigned bytes), the number of dimensions, each size (big-endian uint32), data."""
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as error:  # a truncated or corrupt .gz
        raise RecipeError(f"{path} cannot be read ({first_line(error)}): download it again") from None
    if len(raw) < 4 or raw[:2] != b"\0\0" or raw[2] != 0x08:
        raise RecipeError(f"{path} is not an IDX file of unsigned bytes (it starts {raw[:4].hex(' ')}, expected "
                          "00 00 08 and the number of dimensions): download it again")
    header = 4 + 4 * raw[3]
    shape = tuple(int(size) for size in np.frombuffer(raw[4:header], ">u4")) if len(raw) >= header else None
    if shape is None or len(raw) != header + int(np.prod(shape)):
        raise RecipeError(f"{path} is {len(raw):,} bytes, not what its header says ({shape}): the file is truncated "
                          "or damaged; download it again")
    return np.frombuffer(raw, np.uint8, offset=header).reshape(shape)


def read_idx_splits(files: dict[str, list[Path]]):
    splits = {}
    for split, (images_file, labels_file) in files.items():
        images, labels = read_idx(images_file), read_idx(labels_file)
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise RecipeError(f"{images_file.parent}: {images_file.name} holds {images.shape} and {labels_file.name} "
                              f"{labels.shape}: expected (N, height, width) images and N labels; download them again")
        splits[split] = (torch.from_numpy(images.copy())[:, None], torch.from_numpy(labels.astype(np.int64)))
    test_labels = files["test"][1]
    fashion = ("fashion" in str(test_labels.parent).lower()
               or hashlib.sha256(read_idx(test_labels).tobytes()).hexdigest().startswith(FASHION_MNIST_TEST_LABELS))
    count = max(int(labels.max()) for _, labels in splits.values()) + 1
    return splits, FASHION_MNIST if fashion and count == 10 else [str(i) for i in range(count)]


class ArraysOnly(pickle.Unpickler):
    """Builds lists, dicts, tuples, numbers, strings, bytes and NumPy arrays; any other class or function that a
    pickle names (os.system, a model's class, ...) is refused before it is looked up, so it never runs."""

    ALLOWED = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype,
               # the function NumPy pickles arrays with; numpy 2 moved numpy.core to numpy._core
               ("numpy.core.multiarray", "_reconstruct"): np.ndarray.__reduce__(np.empty(0))[0],
               ("numpy._core.multiarray", "_reconstruct"): np.ndarray.__reduce__(np.empty(0))[0],
               ("_codecs", "encode"): codecs.encode}  # how Python 3 writes bytes at pickle protocol 2

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"it would call {module}.{name}")
        return self.ALLOWED[module, name]


def read_batch(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            batch = ArraysOnly(f, encoding="latin1").load()  # written by Python 2: its byte strings as latin-1
    except Exception as error:  # anything a damaged pickle raises
        raise RecipeError(f"{path} is not a plain CIFAR batch, refused ({first_line(error)}): download the dataset "
                          "again from its authors or torchvision") from None
    if not isinstance(batch, dict):
        raise RecipeError(f"{path} holds a {type(batch).__name__}, not a CIFAR batch (a dict): download it again")
    return batch


def read_cifar_splits(kind: str, files: dict[str, list[Path]]):
    _, _, names_key, labels_key = CIFAR_SPLITS[kind]
    classes = read_batch(files["meta"][0]).get(names_key)
    splits = {}
    for split in ("train", "test"):
        batches = [read_batch(path) for path in files[split]]
        try:
            images = np.concatenate([np.asarray(b["data"], np.uint8).reshape(-1, 3, 32, 32) for b in batches])
            labels = np.concatenate([np.asarray(b[labels_key], np.int64).reshape(-1) for b in batches])
        except (KeyError, ValueError, TypeError) as error:
            raise RecipeError(f"{files[split][0].parent}: a {split} batch lacks '{labels_key}' or 3,072 bytes per "
                              f"image ({type(error).__name__}: {first_line(error)}): download it again") from None
        if len(images) != len(labels):
            raise RecipeError(f"{files[split][0].parent}: {len(images)} {split} images but {len(labels)} labels: "
                              "download it again")
        splits[split] = (torch.from_numpy(images), torch.from_numpy(labels))
    if not isinstance(classes, list):
        raise RecipeError(f"{files['meta'][0]} has no '{names_key}' list: download the dataset again")
    return splits, [str(name) for name in classes]
