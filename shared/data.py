"""Image-classification data as uint8 tensors, a split as one tensor served a whole batch at a time (ImageTensors),
in the resumable order of EpochOrder. load_image_data runs four stages in order, each in its own file:

1. the source (here the hub; local folders in shared/dataset_files.py, imported only for local data: published
   files, and datasets' folders checked before datasets reads them): a hub id, a save_to_disk, parquet or
   imagefolder folder, IDX files or CIFAR's files; its splits, their sizes and the class names;
2. the bounds (shared/bounds.py, an opt-in module): both splits' images, converted, must fit in the free memory,
   checked before an image is decoded or a published file's pixels are read (their count from the IDX headers or
   CIFAR's sizes);
3. the decoding (shared/images.py): each image into the recipe's channels and size, once (one line says what was
   converted, with the sizes found);
4. the cache (here): the tensors saved by what they came from (a local folder's files: their paths, sizes and times;
   a hub dataset's fingerprints) and the code that made them, so that the next run reads them back in seconds,
   without datasets for a local folder.

--synthetic generates a stand-in instead (shared/synthetic.py, an opt-in module; never a fallback).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from huggingface_hub.constants import HF_HOME
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from shared import images
from shared.errors import RecipeError, first_line, is_main_process, printable, replacing

if TYPE_CHECKING:  # for the annotations only
    import datasets

    from shared.dataset_files import DatasetFiles

# Beside datasets' own cache (its config.HF_DATASETS_CACHE, found as datasets finds it: datasets is imported only
# where a dataset needs it, not for IDX or CIFAR files and --synthetic; it is 0.6 s of a start).
CACHE_DIR = Path(os.environ.get("HF_DATASETS_CACHE", Path(HF_HOME) / "datasets")) / "decoded"


class ImageTensors(torch.utils.data.Dataset):
    """A whole split in memory: uint8 images (N, C, H, W), int64 labels (N,), class names."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, classes: list[str], name: str):
        self.images, self.labels, self.classes, self.name = images, labels, classes, name

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index], self.labels[index]

    def __getitems__(self, indices):  # a whole batch of indices from the DataLoader: one gather, no stack
        # With --data_on_device the gather runs on the GPU: copy the indices without waiting for the GPU to finish
        # the step in flight (a blocking copy would); on a CPU this is a no-op.
        indices = torch.as_tensor(indices).to(self.labels.device, non_blocking=True)
        # index_select copies whole images; `images[indices]` indexes every pixel (10-20x slower on a CPU here).
        return self.images.index_select(0, indices), self.labels.index_select(0, indices)

    @staticmethod
    def whole_batch(batch):
        """The DataLoader's collate_fn: `__getitems__` already returns the stacked batch."""
        return batch

    def to(self, device) -> ImageTensors:
        """The split moved to `device`: batches are then cut where the model runs, without a copy."""
        return ImageTensors(self.images.to(device), self.labels.to(device), self.classes, self.name)


class EpochOrder(torch.utils.data.Sampler):
    """Each epoch a permutation that depends only on (seed, epoch), served from sample `start` on. Kept in
    samples, not batches, a run can resume mid-epoch on another number of processes or batch size: the rest of
    the epoch is exactly the samples not yet trained on, cut into the new batches. (accelerate's seedable
    sampler seeds epoch e with seed + e, so seed 1 replays seed 0's orders one epoch later; and its resume skips
    batches of the old size: accelerate #784.)"""

    def __init__(self, size: int, seed: int):
        self.size, self.seed, self.epoch, self.start = size, seed, 0, 0

    def set_position(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, min(start, self.size)  # past the end: a smaller --data after a resume

    def __iter__(self):
        # (seed, epoch) hashed into one seed: no two pairs share an order, as seed + epoch would.
        seed = int(np.random.SeedSequence([self.seed, self.epoch]).generate_state(1)[0])
        generator = torch.Generator().manual_seed(seed)
        return iter(torch.randperm(self.size, generator=generator)[self.start:].tolist())

    def __len__(self):
        return self.size - self.start


@dataclass
class Source:
    """What --data names, found (stage 1): `key` what its tensors come from, for the cache's name, and either its
    published `files` or its datasets `splits` with their image and label columns."""
    name: str
    key: str
    files: DatasetFiles | None = None
    splits: dict = field(default_factory=dict)  # "train", "test" -> datasets.Dataset
    columns: tuple[str, str] = ("", "")
    classes: list[str] = field(default_factory=list)


def load_image_data(source: str, image_shape: tuple[int, int, int], synthetic: bool = False,
                    synthetic_sizes: tuple[int, int] = (50_000, 10_000), synthetic_classes: int = 10,
                    interpolation: str = "bilinear") -> tuple[ImageTensors, ImageTensors]:
    """(train, test) with images of `image_shape` (C, H, W), resized with `interpolation` (torchvision's names); the
    synthetic stand-in has the real set's sizes."""
    if synthetic:  # what only --synthetic runs need: an opt-in module
        from shared.synthetic import make_synthetic

        return make_synthetic(image_shape, *synthetic_sizes, num_classes=synthetic_classes, source=source)
    found = find_source(source)  # 1
    how = "" if interpolation == "bilinear" else f"-{interpolation}"
    cache = CACHE_DIR / f"{found.key}-{'x'.join(map(str, image_shape))}{how}-{decoder_hash()}.safetensors"
    if not (cached := read_cache(cache)):
        if found.files:  # their arrays and the class names, bounded (2) before any is read, converted whole (3)
            stored, found.classes, seen = found.files.read(source, image_shape, interpolation)
        else:
            stored, seen = decode(found, image_shape, interpolation)  # 2, 3
        from shared.bounds import check_labels  # data from anywhere, checked: an opt-in module

        check_labels(found, stored)
        if is_main_process() and (line := images.conversion(image_shape, seen)):
            print(f"{source}: converted the images to {'x'.join(map(str, image_shape))}, this recipe's decoded "
                  f"size: {line}")
        write_cache(cache, stored, found.classes, source)  # 4
        cached = read_cache(cache)
    if cached is None:  # written whole, and still unreadable: a filesystem safetensors cannot map
        raise RecipeError(f"{cache} cannot be read back: set HF_HOME (or HF_DATASETS_CACHE) to a local folder")
    return cached


def find_source(source: str) -> Source:
    """A local folder's files (published ones, or datasets' formats, read on a cache miss alone), else the hub's
    dataset: checked as far as can be without decoding an image (a bad first image is one line at once)."""
    path = Path(source).expanduser()
    if not path.exists():
        return dataset_source(open_hub(source), source)
    from shared import dataset_files  # local folders, checked: an opt-in module

    files = dataset_files.find_dataset_files(path)
    # One stat a file: a folder may hold 60,000 photos, whose resolve() and second stat took 1.6 s here
    stamps = [(os.path.abspath(file), (stat := file.stat()).st_size, stat.st_mtime_ns) for file in files.all_files()]
    # ... and the code that reads them (which also names the classes kept in the cache)
    readers = [files.kind, inspect.getsource(dataset_files), Path(__file__).read_text()]
    return Source(source, "files-" + hashlib.sha256(json.dumps([stamps, readers]).encode()).hexdigest()[:16],
                  files=files)


def dataset_source(splits: datasets.DatasetDict, source: str) -> Source:
    """A dataset's train and test splits, their image and label columns and its class names."""
    train, test = pick_splits(splits, source)
    image_column, label_column, classes = find_columns(train, source)
    import datasets  # after open_hub's checks: a folder that is not there is one line, before datasets' import

    splits = {name: split.cast_column(image_column, datasets.Image(decode=False))  # decoded here, one at a time
              for name, split in (("train", train), ("test", test))}
    # datasets' own hash of each split's data (it has no public name)
    return Source(source, f"{train._fingerprint}-{test._fingerprint}", splits=splits,
                  columns=(image_column, label_column), classes=classes)


def open_hub(source: str) -> datasets.DatasetDict:
    """The hub's dataset (or datasets' local copy of it)."""
    # A local name that is no folder: no hub lookup, no stale cache, and the line before datasets' 0.6 s import.
    if source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise RecipeError(f"--data {source}: no such folder (looked for {Path(source).expanduser().resolve()}), and "
                          "hub ids are owner/name: pass the dataset's folder, a hub id, or --synthetic")
    import datasets

    print(f"Loading {source} from the Hugging Face hub (or its local cache)...")
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # one line at the end, not a warning per retry
    try:
        return datasets.load_dataset(source)
    # ValueError: an id huggingface_hub refuses (foo/bar., a name over 96 characters), before any lookup
    except (ConnectionError, OSError, ValueError, datasets.exceptions.DatasetNotFoundError) as error:
        from shared.bounds import hub_failed  # only a failed load: an opt-in module

        raise hub_failed(error, source) from None


def pick_splits(splits: datasets.DatasetDict, source: str):
    if "train" not in splits:
        raise RecipeError(f"{source} has no 'train' split (splits: {', '.join(splits) or 'none'}): "
                          "name the training split 'train'")
    train, test = splits["train"], splits.get("test", splits.get("validation"))
    if "test" not in splits and test is not None and is_main_process():  # its accuracy is reported as the test's
        print(f"{source} has no 'test' split: testing on its 'validation' split ({len(test):,} images)")
    if test is None and len(train) < 2:
        raise RecipeError(f"{source} holds {len(train)} example(s) and no 'test' split: a run needs at least one "
                          "example to train on and one to test on; add examples, or a 'test' split")
    if test is None:  # one split: hold out a fixed 10%, so the run still reports test accuracy
        if is_main_process():  # each process finds the source: one line
            print(f"{source} has no 'test' split: holding out 10% of 'train' (fixed seed) as the test split")
        # The split of datasets' train_test_split(test_size=0.1, seed=0), without its indices' file: it wrote that
        # beside the split's own files, into the user's --data folder, and refuses keep_in_memory for such a split
        order, held_out = np.random.default_rng(0).permutation(len(train)), math.ceil(len(train) / 10)
        test = train.select(order[:held_out], keep_in_memory=True)
        train = train.select(order[held_out:], keep_in_memory=True)
    for name, split in (("train", train), ("test", test)):
        if not split:
            raise RecipeError(f"the '{name}' split of {source} is empty: point --data at a dataset with examples in it")
    return train, test


def find_columns(split: datasets.Dataset, source: str):
    """The image column (a datasets.Image feature), the label column and the class names."""
    import datasets

    features = split.features
    columns = ", ".join(f"{name} ({type(feature).__name__})" for name, feature in features.items())
    image_column = next((n for n, f in features.items() if isinstance(f, datasets.Image)), None)
    if image_column is None:
        raise RecipeError(f"{source} has no image column (columns: {columns}): the images need a datasets.Image "
                          "feature, e.g. dataset.cast_column('image', datasets.Image())")
    label_column = next((n for n, f in features.items() if isinstance(f, datasets.ClassLabel)), None)
    if label_column is None:
        label_column = next((n for n in ("label", "labels", "target")
                             if n in features and getattr(features[n], "dtype", "").startswith("int")), None)
    if label_column is None:
        raise RecipeError(f"{source} has no label column (columns: {columns}): in a folder of images, each class's "
                          "images go directly in a folder named after it (train/<class>/<image>), two classes or "
                          "more, in every split (one class, a folder below the classes, or a split of unlabelled "
                          "images, as a competition's test/, gives none: move it out); otherwise add a ClassLabel "
                          "column, or an integer column named 'label' (class names as strings: "
                          "dataset.cast_column('label', datasets.ClassLabel(names=[...every class, in one order...])))")
    feature = features[label_column]
    # The training split's labels (a missing one is named with its image when the split is decoded). Not datasets'
    # unique(): of a held-out split, it writes the split's indices into the --data folder.
    labels = set(split.with_format("arrow")[label_column].unique().to_pylist()) - {None}
    # a ClassLabel names its classes; integers number them, 0 to the largest
    count = feature.num_classes if isinstance(feature, datasets.ClassLabel) else max(labels, default=0) + 1
    from shared.bounds import check_class_count  # data from anywhere, checked: an opt-in module

    check_class_count(count, labels, source, label_column)  # before a name is made for each class
    names = feature.names if isinstance(feature, datasets.ClassLabel) else [str(i) for i in range(count)]
    # An imagefolder's classes are the folders of every split: train/cat beside test/Cat makes a class never trained
    if is_main_process() and (untrained := [name for i, name in enumerate(names) if i not in labels]):
        print(f"{source}: {len(untrained)} class(es) with no training image, which the model cannot learn: "
              f"{printable(', '.join(untrained))[:200]} (a folder named differently in train/ and test/?)")
    return image_column, label_column, list(names)


def decode(found: Source, image_shape, interpolation: str):
    """Stages 2 and 3 for a dataset: every image of both splits in `image_shape` (uint8 (N, C, H, W)) with its label,
    and what the images were (`seen`: channel counts and sizes). The images one at a time, decoded here, not by
    datasets (memory for one image at a time, whatever the files hold; never a file fetched because a dataset names
    its path)."""
    from shared.bounds import check_decoded_size  # what a decode may take: an opt-in module

    count = sum(map(len, found.splits.values()))
    check_decoded_size(found.name, count, image_shape)
    if is_main_process():  # many large photos take minutes (a 12-megapixel JPEG: 0.1 s here)
        print(f"{found.name}: decoding {count:,} images, once: later runs read them from the cache")
    stored, seen, (image_column, label_column) = {}, {"channels": set(), "sizes": set()}, found.columns
    channels, height, width = image_shape
    for name, split in found.splits.items():
        pixels = torch.empty(len(split), *image_shape, dtype=torch.uint8)
        labels = torch.empty(len(split), dtype=torch.int64)
        for start in range(0, len(split), 1000):
            batch = split[start:start + 1000]
            for i, file in enumerate(batch[image_column], start):
                file, where = image_file(file, found.name, name, i)
                image, own_channels = images.decode(file, channels, where)
                seen["channels"].add(own_channels)
                seen["sizes"].add(tuple(image.shape[1:]))
                pixels[i] = images.fit(image, height, width, where, interpolation)
            if None in batch[label_column]:
                raise RecipeError(f"{found.name} '{name}' image {start + batch[label_column].index(None)} has no "
                                  "label: an imagefolder needs a subfolder per class (<split>/<class>/<image>); a "
                                  "dataset, a label for every image")
            labels[start:start + len(batch[label_column])] = torch.tensor(batch[label_column], dtype=torch.int64)
        stored[name] = (pixels, labels)
    return stored, seen


def image_file(stored: dict, source: str, split: str, index: int):
    """What an undecoded datasets.Image holds (the file's bytes, or its path), and how to name it in an error."""
    where = f"{source} '{split}' image {index}" + (f" ({stored['path']})" if stored.get("path") else "")
    return stored["bytes"] if stored.get("bytes") is not None else stored.get("path") or "", where


def decoder_hash() -> str:
    """Changes whenever the code that turns images into tensors does (the decoders, fit(), torch's resize): a cache
    keyed only by the data would hand back tensors made by the old code."""
    code = "".join(inspect.getsource(f) for f in (decode, images.decode, images.fit))
    return hashlib.sha256((code + torch.__version__).encode()).hexdigest()[:12]


def read_cache(path: Path, name: str = ""):
    """(train, test) from a cache file (`name` before each split's name), or None: no such file, or one that cannot be
    read (damaged: it is made again)."""
    if not path.exists():
        return None
    try:
        with safe_open(path, "pt") as f:
            classes = json.loads(f.metadata()["classes"])
            return tuple(ImageTensors(f.get_tensor(f"{split}.images"), f.get_tensor(f"{split}.labels"), classes,
                                      f"{name}{split}") for split in ("train", "test"))
    except (OSError, SafetensorError, KeyError, TypeError, ValueError) as error:
        print(f"the cache {path} cannot be read ({type(error).__name__}: {first_line(error)[:100]}): made again")
        return None


def write_cache(path: Path, splits: dict, classes: list[str], source: str) -> None:
    tensors = {f"{split}.{kind}": t for split, pair in splits.items() for kind, t in zip(("images", "labels"), pair)}
    try:  # a half-written cache file must never look complete
        path.parent.mkdir(parents=True, exist_ok=True)
        with replacing(path) as partial:
            save_file(tensors, partial, metadata={"source": source, "classes": json.dumps(classes)})
    except (OSError, SafetensorError) as error:  # HF_HOME a file, a full disk
        from shared.bounds import cache_write_failed  # only a failed write: an opt-in module

        raise cache_write_failed(error, path) from None
