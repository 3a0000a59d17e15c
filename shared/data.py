"""Image-classification data as uint8 tensors (shared/batches.py's ImageTensors): from a hub id, a save_to_disk,
parquet or imagefolder folder, IDX files or CIFAR binary files (shared/dataset_files.py), or generated (synthetic=True,
never a fallback). Images are decoded once into one uint8 (N, C, H, W) tensor, converted to the recipe's channels
and size (one printed line says so), and cached on disk by the dataset's fingerprint (or the files' paths, sizes
and times)."""

from __future__ import annotations

import hashlib
import inspect
import io
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from huggingface_hub.constants import HF_HOME
from PIL import Image
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from shared.batches import ImageTensors
from shared.dataset_files import DatasetFiles, find_dataset_files
from shared.errors import RecipeError, first_line
from shared.images import check_conversion, fit, read_image, to_channels
from shared.limits import check_decoded_size, check_parquet_files

if TYPE_CHECKING:  # for the annotations only
    import datasets

MAX_CLASSES = 100_000  # a label column's classes: ImageNet-21k's 21,841 fit, a label of 2^40 does not
# Beside datasets' own cache (its config.HF_DATASETS_CACHE, found as datasets finds it: datasets is imported only
# where a dataset needs it, not for IDX or CIFAR files and --synthetic; it is 0.6 s of a start).
CACHE_DIR = Path(os.environ.get("HF_DATASETS_CACHE", Path(HF_HOME) / "datasets")) / "decoded"


def load_image_data(source: str, image_shape: tuple[int, int, int], synthetic: bool = False,
                    synthetic_sizes: tuple[int, int] = (50_000, 10_000),
                    synthetic_classes: int = 10) -> tuple[ImageTensors, ImageTensors]:
    """(train, test) with images of `image_shape` (C, H, W); the synthetic stand-in has the real set's sizes."""
    if synthetic:
        return make_synthetic(image_shape, *synthetic_sizes, num_classes=synthetic_classes)
    path = Path(source).expanduser()
    if path.is_dir() and (files := find_dataset_files(path)):
        return load_dataset_files(files, source, image_shape)
    train, test = pick_splits(open_dataset(source), source)
    import datasets

    image_column, label_column, classes = find_columns(train, source)
    check_decoded_size(source, len(train) + len(test), image_shape)
    file, where = image_file(train.cast_column(image_column, datasets.Image(decode=False))[0][image_column], source,
                             "train", 0)
    read_image(file, image_shape, where)  # a bad first image: one line, at once
    with Image.open(io.BytesIO(file) if isinstance(file, bytes) else file) as first:  # its header: mode and size
        check_conversion(source, image_shape, 1 if first.mode in ("1", "L", "LA") else 3, (first.height, first.width))
    return tuple(decode_split(split, name, source, image_column, label_column, classes, image_shape)
                 for name, split in (("train", train), ("test", test)))


def open_dataset(source: str) -> datasets.DatasetDict:
    path = Path(source).expanduser()
    # A local name that is no folder: no hub lookup, no stale cache, and the line before datasets' 0.6 s import.
    if not path.exists() and (source.startswith((".", "/", "~")) or source.count("/") != 1):
        raise RecipeError(f"--data {source}: no such folder (looked for {path.resolve()}), and hub ids are owner/name: "
                          "pass the dataset's folder, a hub id, or --synthetic")
    import datasets

    if path.exists():
        datasets.disable_progress_bars()  # a local folder loads in moments: no bars on stderr
        try:
            if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
                loaded = datasets.load_from_disk(str(path))  # written by save_to_disk
            else:
                check_parquet_files(path)
                loaded = datasets.load_dataset(str(path))  # parquet files or an imagefolder
        except RecipeError:
            raise
        except Exception as error:
            raise RecipeError(f"could not read a dataset from {path} ({type(error).__name__}: {first_line(error)}): "
                              "expected a save_to_disk folder, parquet files, an imagefolder (one subfolder per "
                              "class) with examples in every split, IDX files or CIFAR's files") from None
        return loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict(train=loaded)
    print(f"Loading {source} from the Hugging Face hub (or its local cache)...", flush=True)
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # one line at the end, not a warning per retry
    try:
        return datasets.load_dataset(source)
    except (ConnectionError, OSError, datasets.exceptions.DatasetNotFoundError) as error:
        raise RecipeError(f"--data {source}: not a local folder, and the Hugging Face hub could not provide it "
                          f"({type(error).__name__}: {first_line(error)}): pass --data PATH of a local copy "
                          "(save_to_disk, parquet, imagefolder, IDX or CIFAR binary), or --synthetic for an offline "
                          "run") from None


def pick_splits(splits: datasets.DatasetDict, source: str):
    if "train" not in splits:
        raise RecipeError(f"{source} has no 'train' split (splits: {', '.join(splits) or 'none'}): "
                          "name the training split 'train'")
    train, test = splits["train"], splits.get("test", splits.get("validation"))
    if test is None and len(train) < 2:
        raise RecipeError(f"{source} holds {len(train)} example(s) and no 'test' split: a run needs at least one "
                          "example to train on and one to test on; add examples, or a 'test' split")
    if test is None:  # one split: hold out a fixed 10%, so the run still reports test accuracy
        print(f"{source} has no 'test' split: holding out 10% of 'train' (fixed seed) as the test split")
        train, test = train.train_test_split(test_size=0.1, seed=0).values()
    for name, split in (("train", train), ("test", test)):
        if len(split) == 0:
            raise RecipeError(f"the '{name}' split of {source} is empty: point --data at a dataset with examples in it")
    return train, test


def find_columns(split: datasets.Dataset, source: str) -> tuple[str, str, list[str]]:
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
                          "more (one class, or a folder below the classes, gives no labels); otherwise add a "
                          "ClassLabel column, or an integer column named 'label'")
    feature = features[label_column]
    count = feature.num_classes if isinstance(feature, datasets.ClassLabel) else max(split.unique(label_column)) + 1
    if count > MAX_CLASSES:  # before a name is made for each: one label of 2^40 asked for a 4 GB list
        raise RecipeError(f"{source}: its '{label_column}' column makes {count:,} classes, over the {MAX_CLASSES:,} a "
                          "recipe trains: fix the labels (they number the classes from 0)")
    names = feature.names if isinstance(feature, datasets.ClassLabel) else [str(i) for i in range(count)]
    return image_column, label_column, list(names)


def decode_split(split, name, source, image_column, label_column, classes, image_shape) -> ImageTensors:
    """Decode every image once into uint8 (N, C, H, W); cached on disk by what the tensors come from: the split's
    fingerprint (datasets' own hash of its data; it has no public name), the shape, and the decoding code."""
    import datasets

    channels, height, width = image_shape
    cache = CACHE_DIR / f"{split._fingerprint}-{name}-{channels}x{height}x{width}-{decoder_hash()}.safetensors"
    if cache.exists():
        return ImageTensors(*_read_cache(cache, name), name=name)
    # Decoded here, not by datasets: one image at a time, fitted at once (memory for one image, whatever the files
    # hold), and never a file fetched because a dataset names its path.
    split = split.cast_column(image_column, datasets.Image(decode=False))
    images = torch.empty(len(split), channels, height, width, dtype=torch.uint8)
    labels = torch.empty(len(split), dtype=torch.int64)
    for start in range(0, len(split), 1000):
        batch = split[start:start + 1000]
        for i, stored in enumerate(batch[image_column], start):
            file, where = image_file(stored, source, name, i)
            images[i] = read_image(file, image_shape, where)
        if None in batch[label_column]:
            raise RecipeError(f"{source} '{name}' image {start + batch[label_column].index(None)} has no label: an "
                              "imagefolder needs a subfolder per class (<split>/<class>/<image>); a dataset, a label "
                              "for every image")
        labels[start:start + len(batch[label_column])] = torch.tensor(batch[label_column], dtype=torch.int64)
    bad = labels[(labels < 0) | (labels >= len(classes))]
    if len(bad):
        raise RecipeError(f"{source} '{name}' has labels outside 0..{len(classes) - 1} (e.g. {bad[0].item()}) for its "
                          f"{len(classes)} classes: fix the '{label_column}' column or its ClassLabel names")
    _write_cache(cache, {name: (images, labels)}, classes, source)
    return ImageTensors(images, labels, classes, name)


def image_file(stored: dict, source: str, split: str, index: int) -> tuple[bytes | str, str]:
    """What an undecoded datasets.Image holds (the file's bytes, or its path), and how to name it in an error."""
    where = f"{source} '{split}' image {index}" + (f" ({stored['path']})" if stored.get("path") else "")
    return stored["bytes"] if stored.get("bytes") is not None else stored.get("path") or "", where


def decoder_hash() -> str:
    """Changes whenever the code that turns images into tensors does (the decoders, fit(), torch's resize): a cache
    keyed only by the data would hand back tensors made by the old code."""
    code = "".join(inspect.getsource(f) for f in (decode_split, read_image, load_dataset_files, to_channels, fit))
    code += torch.__version__
    return hashlib.sha256(code.encode()).hexdigest()[:12]


def load_dataset_files(files: DatasetFiles, source: str, image_shape) -> tuple[ImageTensors, ImageTensors]:
    """IDX files or CIFAR binary files, converted to `image_shape` as a dataset's images would be (tested); cached by
    the files' paths, sizes and modification times."""
    stamps = [(str(file.resolve()), file.stat().st_size, file.stat().st_mtime_ns) for file in files.all_files()]
    readers = inspect.getsource(inspect.getmodule(DatasetFiles))  # they name the classes kept in the cache too
    key = hashlib.sha256(json.dumps([stamps, image_shape, decoder_hash(), readers]).encode()).hexdigest()[:16]
    cache = CACHE_DIR / f"files-{key}-{'x'.join(map(str, image_shape))}.safetensors"
    if not cache.exists():
        splits, classes = files.read()
        check_decoded_size(source, sum(len(labels) for _, labels in splits.values()), image_shape)
        images = splits["train"][0]
        check_conversion(source, image_shape, images.shape[1], tuple(images.shape[2:]))
        for name, (_, labels) in splits.items():
            if labels.min() < 0 or labels.max() >= len(classes):
                raise RecipeError(f"{source} '{name}' has labels outside 0..{len(classes) - 1}: download it again")
        fitted = {name: (fit(to_channels(images, image_shape[0]), *image_shape[1:], f"{source} '{name}'").contiguous(),
                         labels) for name, (images, labels) in splits.items()}
        _write_cache(cache, fitted, classes, source)
    return tuple(ImageTensors(*_read_cache(cache, name), name=name) for name in ("train", "test"))


def _read_cache(path: Path, split: str) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    with safe_open(path, "pt") as f:
        return f.get_tensor(f"{split}.images"), f.get_tensor(f"{split}.labels"), json.loads(f.metadata()["classes"])


def _write_cache(path: Path, splits: dict, classes: list[str], source: str) -> None:
    tensors = {f"{split}.{kind}": t for split, pair in splits.items() for kind, t in zip(("images", "labels"), pair)}
    partial = path.with_suffix(f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, partial, metadata={"source": source, "classes": json.dumps(classes)})
        os.replace(partial, path)  # a half-written cache file must never look complete
    except (OSError, SafetensorError) as error:
        if partial.parent.is_dir():  # HF_HOME may be a file
            partial.unlink(missing_ok=True)
        reason = error.strerror if isinstance(error, OSError) else first_line(error)[:100]
        raise RecipeError(f"cannot write the decoded images to {path.parent} ({reason}): set HF_HOME (or "
                          "HF_DATASETS_CACHE) to a writable folder with room") from None


def make_synthetic(image_shape, train_size: int, test_size: int,
                   num_classes: int = 10) -> tuple[ImageTensors, ImageTensors]:
    """Learnable stand-in: a smooth pattern per class at low contrast, over a distractor pattern that carries no
    class, under pixel noise; a small CNN climbs from chance to about 75% in a few hundred steps. A fixed seed:
    every run and process sees the same images, whatever --seed is."""
    channels, height, width = image_shape
    cache = CACHE_DIR / f"synthetic-v1-{channels}x{height}x{width}-{train_size}-{test_size}-{num_classes}.safetensors"
    if cache.exists():
        return tuple(ImageTensors(*_read_cache(cache, split), name=f"synthetic {split}") for split in ("train", "test"))
    generator = torch.Generator().manual_seed(1234)

    def smooth_patterns(count):  # random 4x4 fields upsampled: blobs, in -128..127
        coarse = torch.rand(count, channels, 4, 4, generator=generator)
        fields = F.interpolate(coarse, size=(height, width), mode="bicubic", align_corners=False).clamp(0, 1)
        return ((fields - 0.5) * 255).round().to(torch.int16)

    patterns, distractors = smooth_patterns(num_classes), smooth_patterns(256)
    tensors = {}
    for split, size in (("train", train_size), ("test", test_size)):
        labels = torch.randint(num_classes, (size,), generator=generator)
        images = torch.empty(size, channels, height, width, dtype=torch.uint8)
        for start in range(0, size, 10_000):  # int16 math in chunks: small and fast
            chunk = labels[start:start + 10_000]
            contrast = torch.randint(2, 5, (len(chunk), 1, 1, 1), generator=generator, dtype=torch.int16)
            distractor = distractors[torch.randint(len(distractors), (len(chunk),), generator=generator)]
            noise = torch.randint(-80, 81, (len(chunk), *image_shape), generator=generator, dtype=torch.int16)
            pixels = 128 + patterns[chunk] * contrast // 16 + distractor // 2 + noise
            images[start:start + len(chunk)] = pixels.clamp_(0, 255).to(torch.uint8)
        tensors[split] = (images, labels)
    classes = [f"synthetic_{i}" for i in range(num_classes)]
    _write_cache(cache, tensors, classes, source="synthetic")
    return tuple(ImageTensors(*tensors[split], classes, f"synthetic {split}") for split in ("train", "test"))
