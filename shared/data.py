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
import math
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from huggingface_hub.constants import HF_HOME
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from shared.batches import ImageTensors
from shared.dataset_files import DatasetFiles, find_dataset_files, free_memory
from shared.errors import RecipeError, first_line, is_main_process

if TYPE_CHECKING:  # for the annotations only
    import datasets

WIDE_MODES = {"I", "I;16", "I;16B", "I;16L", "I;16N", "F"}  # 16/32-bit and float pixels
MAX_PARQUET_RATIO = 100  # what a parquet file may inflate to, times its size (a bomb: 70,000 times)
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


def check_decoded_size(source: str, count: int, image_shape: tuple[int, int, int]) -> None:
    """Every pixel of both splits is held at once, converted to `image_shape` (150 KB a 224-px photo: 15 GB for
    100,000): refuse more than the free memory before a byte is decoded or converted."""
    need, free = count * math.prod(image_shape), free_memory()
    if need > free:
        raise RecipeError(f"{source}: {count:,} images of {'x'.join(map(str, image_shape))} take "
                          f"{need / 2**30:.1f} GiB decoded, more than the {free / 2**30:.1f} GiB of free memory: use "
                          "smaller images (finetune.py: --image_size) or fewer, or a machine with more memory")


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


def check_parquet_files(folder: Path) -> None:
    """A parquet file's footer says how large its columns are once decompressed: a 52 KB file of compressed zeros
    reached 3.6 GB. Refuse a file that claims more than MAX_PARQUET_RATIO times its size (images inside are compressed
    already; raw pixel columns shrink a few times) or than the free memory, before a page is read."""
    import pyarrow.parquet as pq

    for file in sorted(folder.rglob("*.parquet")):
        try:
            meta = pq.read_metadata(file)
            claimed = sum(meta.row_group(i).column(j).total_uncompressed_size
                          for i in range(meta.num_row_groups) for j in range(meta.num_columns))
        except Exception as error:
            raise RecipeError(f"{file} is not a readable parquet file ({type(error).__name__}: "
                              f"{first_line(error)[:100]}): write it again") from None
        size, free = file.stat().st_size, free_memory()
        if claimed > min(MAX_PARQUET_RATIO * size + 2**26, free):
            raise RecipeError(f"{file} claims {claimed:,} bytes once decompressed, from {size:,} on disk (over "
                              f"{MAX_PARQUET_RATIO} times its size plus 64 MiB, or the {free / 2**30:.1f} GiB of free "
                              "memory): a damaged or hostile file; write it again")


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


def read_image(file: bytes | str | Path, image_shape: tuple[int, int, int], where: str) -> torch.Tensor:
    """One image file (its bytes or a local path) -> uint8 (C, H, W) of `image_shape`, converted as datasets'
    Image(mode=...) converts (EXIF orientation, then L or RGB) and fitted at once: memory for one image. A damaged
    file, one over PIL's pixel limit (read from its header, before decoding), 16-bit pixels: one line naming `where`."""
    channels, height, width = image_shape
    if not isinstance(file, bytes) and not Path(file).is_file():
        raise RecipeError(f"{where}: no such image file on this machine (datasets' paths are read, never fetched)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)  # over PIL's limit: refused, not warned
            image = Image.open(io.BytesIO(file) if isinstance(file, bytes) else file)
        with image:
            if image.mode in WIDE_MODES:
                raise RecipeError(f"{where} has {image.mode} pixels (16-bit, 32-bit or float), which 8 bits cannot "
                                  "hold without clipping or guessing a range: scale the images to 8-bit L or RGB")
            image.load()
            if image.getexif().get(ExifTags.Base.Orientation) is not None:
                image = ImageOps.exif_transpose(image)
            pixels = np.array(image.convert("L" if channels == 1 else "RGB"))
    except (Image.DecompressionBombWarning, Image.DecompressionBombError):
        raise RecipeError(f"{where} has more than {Image.MAX_IMAGE_PIXELS:,} pixels, PIL's limit against "
                          "decompression bombs: remove it, or shrink it first") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, MemoryError) as error:
        raise RecipeError(f"{where} is not a readable image ({type(error).__name__}: {first_line(error)[:120]}): "
                          "remove it or replace it") from None
    return fit(torch.from_numpy(pixels).reshape(*pixels.shape[:2], channels).permute(2, 0, 1), height, width, where)


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


def to_channels(images: torch.Tensor, channels: int) -> torch.Tensor:
    """uint8 (N, C, H, W) with 1 or 3 channels -> `channels`, as PIL converts L <-> RGB."""
    if images.shape[1] == channels:
        return images
    if channels == 3:
        return images.expand(-1, 3, -1, -1)
    r, g, b = images.to(torch.int32).unbind(1)  # ITU-R 601-2 luma in PIL's 16-bit fixed point
    return ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16).to(torch.uint8)[:, None]


def check_conversion(source: str, image_shape: tuple[int, int, int], channels: int, size: tuple[int, int]) -> None:
    """Say how images unlike the recipe's are converted, from the first one."""
    changes = ["grayscale -> colour" if image_shape[0] == 3 else "colour -> grayscale"] * (channels != image_shape[0])
    if size != tuple(image_shape[1:]):
        changes.append(f"{size[1]}x{size[0]} -> {image_shape[2]}x{image_shape[1]} (shorter side resized with "
                       "antialiasing, then centre-cropped)")
    if changes and is_main_process():
        print(f"{source}: converting the images to this recipe's {'x'.join(map(str, image_shape))} input: "
              + "; ".join(changes), flush=True)


def fit(image: torch.Tensor, height: int, width: int, where: str = "images") -> torch.Tensor:
    """uint8 (C, h, w), or a batch (N, C, h, w) -> (..., C, height, width): shorter side resized with antialiasing,
    centre crop. The same pixels as torchvision's v2 resize + center_crop (tested), without its import: 1.3 s of
    every start of every process."""
    h, w = image.shape[-2:]
    if (h, w) == (height, width):
        return image
    size = max(height, width)  # the shorter side's new length; the longer keeps the aspect ratio
    new_h, new_w = (int(size * h / w), size) if w <= h else (size, int(size * w / h))
    need = image.numel() // (h * w) * new_h * new_w  # the resized images before the crop: a 1 x 10^8 image, 10 GB
    if need > 2**28 and need > free_memory():
        raise RecipeError(f"{where}: images of {w}x{h} pixels, resized to {new_w}x{new_h} before the centre crop, take "
                          f"{need / 2**30:.1f} GiB, more than the free memory: crop them nearer to a square first")
    if (new_h, new_w) != (h, w):  # bilinear with antialiasing, computed on the uint8 pixels as torchvision does
        batch = F.interpolate(image if image.ndim == 4 else image[None], size=(new_h, new_w), mode="bilinear",
                              align_corners=False, antialias=True)
        image = batch if image.ndim == 4 else batch[0]
    top, left = int(round((new_h - height) / 2.0)), int(round((new_w - width) / 2.0))
    return image[..., top:top + height, left:left + width]


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
