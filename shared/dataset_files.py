"""The files image datasets are published in, read as they are: the MNIST family's IDX files and CIFAR's two versions.

`find_dataset_files(folder)` returns a `DatasetFiles` (or None) for a folder, or one below it, that holds
- IDX files, gzipped or not, as the MNIST and Fashion-MNIST authors publish them, torchvision downloads them
  (`<root>/FashionMNIST/raw/`) and Debian installs them (`/usr/share/datasets/fashion-mnist/`):
  `train-images-idx3-ubyte`, `train-labels-idx1-ubyte`, and `t10k-*` (or `test-*`) for the test split;
- CIFAR-10 or CIFAR-100 in the authors' binary version (`cifar-10-batches-bin/`, `cifar-100-binary/`): records of
  label bytes and 3,072 pixel bytes, nothing to interpret; or in their Python version, which torchvision downloads
  (`cifar-10-batches-py/`, `cifar-100-python/`): pickles. Unpickling can run any code, so these are read by an
  unpickler that builds only dicts, lists, numbers, strings and uint8 arrays made of the file's own bytes, and counts
  the operations first (`read_pickled_batch`). A folder holding both versions is read in the binary one.
Every reader checks the size a file or header claims against MAX_FILE_BYTES and the free memory before it
allocates. `.read()` returns {"train": (images, labels), "test": ...}, uint8 (N, C, H, W) and int64 (N,), and the
class names. `open_local` reads a folder of datasets' formats (save_to_disk, parquet, imagefolder) after
`check_datasets_folder` checks, in one walk, what datasets' readers will read from it: what its parquet files claim once
decompressed (`check_parquet_files`), and an imagefolder's files (`check_image_folder`).
"""

import functools
import gzip
import hashlib
import io
import math
import os
import pickle
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shared.bounds import check_cache_error, check_decoded_size, check_labels, free_memory, walk
from shared.config import MAX_JSON_BYTES, read_json
from shared.errors import RecipeError, first_line, is_main_process, printable
from shared.images import fit
from shared.pickles import check_pickle

FASHION_MNIST = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                 "Ankle boot"]
# sha256 of its 10,000 test labels (t10k-labels-idx1-ubyte after its 8-byte header, gzipped or not): they, not the
# folder's name, say that the files are Fashion-MNIST's.
FASHION_MNIST_TEST_LABELS = "3d0e6c6ea990b53b"
# Limits for files from anywhere (docs/troubleshooting.md): what a file or its header may claim.
MAX_FILE_BYTES = 4 * 2**30  # one dataset file: 4 GiB (the real MNIST family's largest is under 1 GiB)
MAX_INFLATE_RATIO = 100  # what a compressed file (parquet, gzip) may inflate to, times its size (bombs: 1,000s)
MAX_NAMES_BYTES = 2**20  # a file of class names: CIFAR-100's is under 1 KiB
MAX_PICKLE_BYTES = 2**28  # one CIFAR pickle (its text costs 6 times its size to read): 400 MB of text took 3.3 GB
IDX_SPLITS = {"train": ("train",), "test": ("t10k", "test")}
# A word of a file's name by which datasets knows a split other than 'train' (its SPLIT_KEYWORDS and NON_WORDS_CHARS),
# in any case: datasets' own match is in lowercase alone
OTHER_SPLIT = re.compile(r"(^|[-._ 0-9])(validation|valid|dev|val|test|testing|eval|evaluation)[-._ 0-9]", re.I)
CIFAR_BINARY = {  # folder -> the files of each split, the class names' file, the label bytes before each image
    "cifar-10-batches-bin": ({"train": [f"data_batch_{i}.bin" for i in range(1, 6)], "test": ["test_batch.bin"]},
                             "batches.meta.txt", 1),
    "cifar-100-binary": ({"train": ["train.bin"], "test": ["test.bin"]}, "fine_label_names.txt", 2),  # coarse, fine
}
CIFAR_PICKLED = {  # folder -> the files of each split, the class names' file, its key for them, the labels' key
    "cifar-10-batches-py": ({"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]},
                            "batches.meta", "label_names", "labels"),
    "cifar-100-python": ({"train": ["train"], "test": ["test"]}, "meta", "fine_label_names", "fine_labels"),
}
BINARY_OF = {"cifar-10-batches-py": "cifar-10-batches-bin", "cifar-100-python": "cifar-100-binary"}


def check_size(path: Path, size: int, times: int = 1) -> None:
    """Refuse a file whose header claims more bytes than MAX_FILE_BYTES, or than this machine's free memory holds
    `times` over."""
    free = free_memory()
    if size > min(MAX_FILE_BYTES, free / times):
        raise RecipeError(f"{path} claims {size:,} bytes of data, over the {MAX_FILE_BYTES / 2**30:.0f} GiB a dataset "
                          f"file may hold here (or the {free / 2**30:.1f} GiB of free memory"
                          f"{f' {times} times over' if times > 1 else ''}): a damaged or hostile file; download it "
                          "again")


def check_regular(file: Path, what: str) -> None:
    """Refuse a file that is not a regular one (after its links): a FIFO blocks its first read forever."""
    if not file.is_file():
        raise RecipeError(f"{str(file)!r} is not a regular file (a FIFO, socket, device or folder): replace it by "
                          f"{what}")


@dataclass
class DatasetsFolder:
    """A folder of datasets' formats, checked, and its files, by which its decoded images are cached: datasets reads it
    on a cache miss alone. It lists a folder by up to 46 patterns, each a walk of every file (datasets #5317): a run
    on 60,000 small PNG files, their images cached, took 36-38 s from the command, 8 s without datasets (a 2-core
    Intel Xeon; 6 s on --synthetic). The files' names take memory as datasets' own list does: 39 MB at the most
    for those 60,000, with their key."""
    folder: Path
    tables: list[Path]  # its parquet files, none in an imagefolder or a save_to_disk folder
    files: list[Path]  # the files of its formats below it, hidden ones aside
    kind: str  # datasets' release, which decides the splits a folder's files make

    def all_files(self) -> list[Path]:
        return self.files

    def read(self, source: str, image_shape: tuple[int, int, int], interpolation: str) -> tuple[dict, list[str], dict]:
        """As DatasetFiles.read, with datasets' reader and shared/data.py's decoder."""
        from shared import data

        found = data.dataset_source(open_local(self.folder, self.tables), source)
        stored, seen = data.decode(found, image_shape, interpolation)
        check_labels(found, stored)
        return stored, found.classes, seen


def open_local(folder: Path, tables: list[Path]):
    """A local folder's dataset, as a DatasetDict, once checked (`check_datasets_folder`, which finds its `tables`):
    save_to_disk's, or the parquet files or imagefolder that datasets' builder of that name reads."""
    import datasets

    datasets.disable_progress_bars()  # a local folder loads in moments: no bars on stderr
    try:
        if (folder / "dataset_dict.json").exists() or (folder / "state.json").exists():
            loaded = datasets.load_from_disk(str(folder))  # written by save_to_disk
        else:
            # By the files' names alone (train/, test.parquet, ...): load_dataset(folder) would also follow a
            # README.md's `configs`, whose data_files may name files anywhere, on the hub (hf://) too
            loaded = datasets.load_dataset("parquet" if tables else "imagefolder", data_dir=str(folder))
    except Exception as error:
        from shared.failures import process_limit  # only a failed read: an opt-in module

        if limit := process_limit(error):
            raise RecipeError(f"reading {folder}, this process reached its limit on {limit}: raise it, then run "
                              "again") from None
        check_cache_error(error, folder)
        error = error.__cause__ or error  # datasets' DatasetGenerationError says only that an error occurred
        raise RecipeError(f"could not read a dataset from {folder} ({type(error).__name__}: "
                          f"{first_line(error)[:300]}): expected a save_to_disk folder, parquet files, an "
                          "imagefolder (one subfolder per class) with examples in every split, IDX files or CIFAR's "
                          "files") from None
    loaded = loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict(train=loaded)
    # A split's folder holds class folders (train/cat/), a class's folder images. datasets knows a split by its folder's
    # lowercase name alone: Fruits-360's Training/ and Test/, or trainset/ and testset/, were read as one split, a
    # random 10% of it held out, the test images trained on. Hidden folders (.git/, .ipynb_checkpoints/) it skips.
    # os.walk: a folder's listing alone, not a stat of each photo in it.
    if not tables and list(loaded) == ["train"] and len(splits := [
            child.name for child in sorted(folder.iterdir()) if child.is_dir() and not child.name.startswith(".")
            and any(not name.startswith(".") for name in next(os.walk(child))[1])]) > 1:
        raise RecipeError(f"{folder}: its folders {printable(', '.join(splits))} hold class folders, as splits do, "
                          "but datasets read a 'train' split alone from them: it knows a split's folder only by its "
                          "lowercase name (train, test, validation, ...: docs/data.md); rename them")
    # Parquet files the same: Train.parquet and Test.parquet were read as one 'train' split
    if list(loaded) == ["train"] and (named := [file.name for file in tables if OTHER_SPLIT.search(file.name)]):
        raise RecipeError(f"{folder}: datasets read its parquet files as one 'train' split, "
                          f"{printable(', '.join(named))} included: it knows a split's file only by its lowercase name "
                          "(train, test, validation, ...: docs/data.md); rename them")
    return loaded


def check_datasets_folder(folder: Path) -> tuple[list[Path], list[Path]]:
    """What datasets will read from a local folder, checked first, in one walk: a save_to_disk folder's files, its
    parquet files' sizes once read, or an imagefolder's files. Returns the parquet tables datasets' parquet builder
    reads (none in a save_to_disk folder), and the files of the formats datasets reads there, which key the decoded
    images' cache: not notes.txt, a notebook or Windows' Thumbs.db, which change with no image changed."""
    from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder

    saved = check_saved_dataset(folder)
    known = (*ImageFolder.EXTENSIONS, *ImageFolder.METADATA_FILENAMES)
    parquet, linked, others, irregular, images = [], [], [], [], []
    for entry in walk(folder, hidden=False):  # datasets skips hidden folders (.git/, .ipynb_checkpoints/) too
        if entry.name.endswith(".parquet"):
            parquet.append(Path(entry.path))
        if entry.name.startswith("."):  # .DS_Store, which a Finder window rewrites
            continue
        if entry.is_dir():  # walk follows no link: datasets neither
            linked.append(entry.path)
        elif Path(entry.name).suffix.lower() not in known and entry.name not in known:
            others.append(Path(entry.path))
        elif not entry.is_file():  # a FIFO or a broken link named as an image
            irregular.append(Path(entry.path))
        else:  # an image, or an imagefolder's metadata file
            images.append(Path(entry.path))
    check_parquet_files(sorted(parquet))
    # metadata.parquet: an imagefolder's labels, not a table
    tables = [] if saved else [file for file in parquet if file.name != "metadata.parquet"]
    if not saved and not tables:
        check_image_folder(folder, linked, sorted(others), sorted(irregular))
        if not images:  # datasets would list every file below it first: minutes in a home folder
            raise RecipeError(f"--data {folder} holds no images, parquet files or save_to_disk dataset (nor IDX or "
                              "CIFAR files) outside its hidden folders: pass the dataset's folder (docs/data.md)")
    # and a save_to_disk folder's arrow and JSON files (after links: a FIFO or a broken link is no file it reads)
    saved_files = [file for file in others if saved and file.suffix in (".arrow", ".json") and file.is_file()]
    return tables, images + parquet + saved_files


def check_parquet_files(files: list[Path]) -> None:
    """A parquet file's footer says how large its columns are once decompressed: a 52 KB file of compressed zeros
    reached 3.6 GB. Refuse a file that claims more than MAX_INFLATE_RATIO times its size (images inside are compressed
    already; raw pixel columns shrink a few times) or than the free memory, before a page is read."""
    import pyarrow.parquet as pq

    for file in files:
        check_regular(file, "the parquet file")  # datasets' read after this one would block too
        size, free = file.stat().st_size, free_memory()
        limit = min(MAX_INFLATE_RATIO * size + 2**26, free)
        try:
            meta = pq.read_metadata(file)
            # What its pages claim once decompressed; within the limit, what its values take once read
            claimed = sum(meta.row_group(i).column(j).total_uncompressed_size
                          for i in range(meta.num_row_groups) for j in range(meta.num_columns))
            need = claimed if claimed > limit else read_size(file, meta, limit)
        except Exception as error:
            raise RecipeError(f"{file} is not a readable parquet file ({type(error).__name__}: "
                              f"{first_line(error)[:100]}): write it again") from None
        if need > limit:
            raise RecipeError(f"{file} takes {need:,} bytes or more once read (decompressed, then its values), from "
                              f"{size:,} on disk (over {MAX_INFLATE_RATIO} times its size plus 64 MiB, or the "
                              f"{free / 2**30:.1f} GiB of free memory): a damaged or hostile file; write it again")


def read_size(file: Path, meta, limit: int) -> int:
    """The bytes of values datasets' reader makes of a parquet file, counted until past `limit`: the fixed-size values
    from the footer's counts, then the strings' and binaries' own bytes, read a batch of rows at a time with their
    dictionaries kept. The footer's sizes are of encoded pages, where a run of one value takes a few bytes, and a
    dictionary holds a value once for any number of rows: a 121 KB file of one 120 KB image in 20,000 rows took
    5.7 GB to read."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    columns = [meta.schema.column(j) for j in range(meta.num_columns)]
    total = sum(meta.row_group(i).column(j).num_values * (column.length or 8)  # length: a fixed-size binary's
                for i in range(meta.num_row_groups) for j, column in enumerate(columns))
    texts = [column.path for column in columns if column.physical_type == "BYTE_ARRAY"]
    if total > limit or not texts:
        return total
    for batch in pq.ParquetFile(file, read_dictionary=texts).iter_batches(columns=texts):
        arrays = list(batch.columns)
        while arrays and total <= limit:
            array = arrays.pop()
            if pa.types.is_dictionary(array.type):  # each row's value, as the reader writes it out
                total += pc.sum(pc.binary_length(array.dictionary).take(array.indices)).as_py() or 0
            elif pa.types.is_struct(array.type):
                arrays += array.flatten()
            elif pa.types.is_nested(array.type):  # a list's values, a map's entries
                arrays.append(array.values)
            else:
                total += array.nbytes
    return total


def check_image_folder(folder: Path, linked: list[str], others: list[Path], irregular: list[Path]) -> None:
    """What datasets' imagefolder would make of a folder's files, said first (its links to folders, its files of no
    image format datasets reads, and those named as images that are no regular file, each sorted): a file of no image
    format (an iPhone's .heic, notes.txt) it leaves out, unsaid, and so a FIFO or a broken link named as an image, and
    a link to a folder (its images gone, or "doesn't contain any data files"); an archive (.zip) it reads as a folder
    of its own, at another depth than the class folders, which drops every label ("no label column")."""
    if linked:
        raise RecipeError(f"{min(linked)} is a link to a folder, which datasets does not follow: copy the folder "
                          "there, or move the images into --data")
    if irregular:
        check_regular(irregular[0], "the image file")
    if archives := [file for file in others if file.suffix.lower() == ".zip"]:
        raise RecipeError(f"{archives[0]} is an archive among the images, which datasets would read as a folder of "
                          "its own: unpack it, or move it out of --data")
    if others and is_main_process():
        print(f"{folder}: {len(others)} file(s) of no image format read here left out, e.g. "
              f"{printable(others[0].relative_to(folder))} (photos: convert them to JPEG or PNG)")


def check_saved_dataset(folder: Path) -> bool:
    """A save_to_disk folder, before load_from_disk reads it: its JSON files within MAX_JSON_BYTES, and the split
    folders and data files they name, each once, a name inside its folder and a regular file. datasets reads any file
    a state.json names (an absolute path, ../), as often as it is named, and blocked for ever on a FIFO there. Returns
    whether `folder` is one."""
    listing = folder / "dataset_dict.json"
    if listing.exists():  # a DatasetDict: its splits, each a Dataset's folder
        splits = [folder / name for name in saved_names(listing, lambda saved: saved["splits"])]
    elif (folder / "state.json").exists():  # one Dataset
        splits = [folder]
    else:
        return False
    for split in splits:
        data = saved_names(split / "state.json", lambda state: [file["filename"] for file in state["_data_files"]])
        for name in data:
            check_regular(split / name, "the dataset's file, written again with save_to_disk")
            check_uncompressed(split / name)
        saved_names(split / "dataset_info.json", lambda info: [] if isinstance(info, dict) else None)
    return True


def check_uncompressed(file: Path) -> None:
    """save_to_disk writes its arrow files uncompressed and without dictionaries (datasets has no feature for one), and
    load_from_disk maps them in place. A compressed one would be inflated whole, whatever it holds (46 KB of zstd took
    1.5 GB); a dictionary, one value shared by many rows, would be written out for each row (one 120 KB image in 20,000
    rows, a 444 KB file, took 2.8 GB before an error). Refused from its messages' headers, before a buffer is read."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(file)) as source:
            if any(message.type == "dictionary" or message.type != "schema" and compressed(message)
                   for message in pa.ipc.MessageReader.open_stream(source)):
                raise RecipeError(f"{file} is compressed or holds a dictionary, which save_to_disk never writes and "
                                  "datasets would write out whole: a damaged or hostile file; write the dataset again "
                                  "with save_to_disk")
            source.seek(0)
            for batch in pa.ipc.open_stream(source):  # mapped, not read: pyarrow trusts the offsets into its buffers
                batch.validate(full=True)  # an offset past them read outside the file (a MemoryError, or a crash)
    except (pa.ArrowException, OSError, struct.error) as error:  # OSError: flatbuffers that fail pyarrow's check
        raise RecipeError(f"{file} is not a readable arrow file ({type(error).__name__}: {first_line(error)[:100]}): "
                          "write the dataset again with save_to_disk") from None


def compressed(message) -> bool:
    """Whether an arrow message's record batch is compressed: RecordBatch's 4th field, `compression`, is set (the Arrow
    format's Message.fbs). A flatbuffer table begins with the offset back to its vtable, which holds each field's
    position in the table (0: absent); a field that is a table holds the offset forward to it."""
    meta = memoryview(message.metadata)  # in the file's map, not copied: a hostile header may be the whole file

    def fields(at: int) -> list[int]:
        vtable = at - struct.unpack_from("<i", meta, at)[0]
        count = (struct.unpack_from("<H", meta, vtable)[0] - 4) // 2
        return [at + offset if offset else 0 for offset in struct.unpack_from(f"<{count}H", meta, vtable + 4)]

    def table(field: int) -> list[int]:
        return fields(field + struct.unpack_from("<I", meta, field)[0])

    header = table(fields(struct.unpack_from("<I", meta, 0)[0])[2])  # Message.header: a RecordBatch
    return len(header) > 3 and header[3] != 0


def saved_names(file: Path, names) -> list:
    """What `names` takes from a save_to_disk JSON file (split folders, data files): names inside its folder."""
    try:
        found = names(read_json(file))
    except (TypeError, KeyError):
        found = None
    if not isinstance(found, list):
        raise RecipeError(f"{file} is missing, damaged or over {MAX_JSON_BYTES:,} bytes, not as save_to_disk writes "
                          "it: write the dataset again with save_to_disk")
    seen = set()
    for name in found:
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
            raise RecipeError(f"{file} names {name!r}, which is not a name inside its folder (datasets would read it "
                              "wherever it is): write the dataset again with save_to_disk")
        if name in seen:  # read twice: its examples twice; and a list of one name can be millions long
            raise RecipeError(f"{file} names {name!r} twice: write the dataset again with save_to_disk")
        seen.add(name)
    return found


@dataclass
class DatasetFiles:
    kind: str  # "idx", or a CIFAR_BINARY or CIFAR_PICKLED folder name
    files: dict[str, list[Path]]  # split -> its files (IDX: images then labels)

    def all_files(self) -> list[Path]:
        return [file for files in self.files.values() for file in files]

    def read(self, source: str, image_shape: tuple[int, int, int], interpolation: str) -> tuple[dict, list[str], dict]:
        """{"train": (images, labels), "test": ...} converted to `image_shape` (uint8 (N, C, H, W), int64 (N,)) with
        `interpolation`, the class names, and what the images were (`seen`: channel counts and sizes, as data.decode
        says). Bounded first: each split's files by their size, and both splits converted to `image_shape` by how many
        images the files hold (IDX: the headers; CIFAR: at most one per 3,072 bytes)."""
        for file in self.all_files():
            check_regular(file, "the downloaded file")
        stored = 0  # the bytes of both splits' files
        for split in ("train", "test"):  # its files together, before any is read: they become one array
            files = self.files[split]
            size = sum(file.stat().st_size for file in files)
            check_size(files[0] if len(files) == 1 else files[0].parent / f"{split} files", size)
            stored += size
        count = (sum(read_idx(self.files[split][0], count_only=True) for split in IDX_SPLITS) if self.kind == "idx"
                 else stored // 3072)
        check_decoded_size(source, count, image_shape)
        splits, classes = (read_idx_splits(self.files) if self.kind == "idx"
                           else read_cifar_splits(self.kind, self.files))
        seen = {"channels": {images.shape[1] for images, _ in splits.values()},  # the published arrays: one size
                "sizes": {tuple(images.shape[2:]) for images, _ in splits.values()}}
        return {split: (fit(to_channels(pixels, image_shape[0]), *image_shape[1:], f"{source} '{split}'",
                            interpolation).contiguous(), labels) for split, (pixels, labels) in splits.items()
                }, classes, seen


def to_channels(images: torch.Tensor, channels: int) -> torch.Tensor:
    """uint8 (N, C, H, W) with 1 or 3 channels -> `channels`, as PIL converts L <-> RGB."""
    if images.shape[1] == channels:
        return images
    if channels == 3:
        return images.expand(-1, 3, -1, -1)
    r, g, b = images.to(torch.int32).unbind(1)  # ITU-R 601-2 luma in PIL's 16-bit fixed point
    return ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16).to(torch.uint8)[:, None]


def find_dataset_files(folder: Path) -> DatasetFiles | DatasetsFolder:
    """The IDX or CIFAR files in `folder`, or where torchvision's download puts them below its root folder; else the
    folder of datasets' formats, checked."""
    if not folder.is_dir():  # a dataset is a folder of files (or a hub id), whatever its format
        raise RecipeError(f"--data {folder} is a file, not a folder (an archive? extract it): pass the folder of the "
                          "dataset's files (parquet files, class folders of images, IDX or CIFAR files), or a hub id")
    candidates = (folder, folder / "raw", *sorted(folder.glob("*/raw")), *sorted(folder.glob("cifar-*")))
    found = [f for candidate in candidates
             if candidate.is_dir() and (f := idx_files(candidate) or cifar_files(candidate))]
    # torchvision's root may hold both CIFAR versions of one dataset (a download of each): the binary one is read
    found = [f for f in found if BINARY_OF.get(f.kind) not in {other.kind for other in found}]
    if len({tuple(f.all_files()) for f in found}) > 1:
        places = ", ".join(str(f.all_files()[0].parent) for f in found)
        raise RecipeError(f"--data {folder} holds more than one dataset ({places}): pass --data one of these folders")
    if found:
        return found[0]
    import datasets  # only here: IDX and CIFAR files need no datasets

    return DatasetsFolder(folder, *check_datasets_folder(folder), f"datasets {datasets.__version__}")


def idx_files(folder: Path) -> DatasetFiles | None:
    files = {}
    for split, prefixes in IDX_SPLITS.items():
        for kind in ("images[-.]idx3-ubyte", "labels[-.]idx1-ubyte"):  # train-images.idx3-ubyte: many copies' name
            matches = sorted(folder.glob(f"*{prefixes[0]}-{kind}*")) or sorted(
                file for prefix in prefixes[1:] for file in folder.glob(f"*{prefix}-{kind}*"))
            # Kaggle's copy of MNIST also has a folder of each file's dashed name, the file inside: the file is read
            matches = [file for file in matches if not file.is_dir()]
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
    """CIFAR's files, known by the folder's name as the authors' archives unpack it, or by the files' own names (copied
    into a folder of another name: data/, say), the binary version first."""
    kinds = {**CIFAR_BINARY, **CIFAR_PICKLED}
    kind = next((kind for kind, (splits, names_file, *_) in kinds.items() if folder.name == kind
                 or (folder / splits["test"][0]).is_file() and (folder / names_file).is_file()), None)
    if kind is None:
        return None
    splits, names_file, *_ = kinds[kind]
    files = {split: [folder / name for name in names] for split, names in splits.items()}
    files["names"] = [folder / names_file]
    found = DatasetFiles(kind, files)
    # A file there that is no regular one (a FIFO) is not missing: DatasetFiles.read refuses it (check_regular)
    if missing := [file.name for file in found.all_files() if not file.exists()]:
        raise RecipeError(f"{folder} lacks {', '.join(missing)}: download the dataset again")
    return found


def read_idx(path: Path, count_only: bool = False) -> np.ndarray | int:
    """An IDX file: 0, 0, type 0x08 (unsigned bytes), the number of dimensions, each size (big-endian uint32), data.
    Reads the header first and then exactly the bytes it claims: a gzip bomb costs no more than its claimed size,
    and a claim over the limit (or the free memory) is refused before anything is allocated. `count_only`: the
    first size in its header (how many images or labels), and nothing more is read."""
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            magic = f.read(4)
            if len(magic) < 4 or magic[:3] != b"\0\0\x08" or not 1 <= magic[3] <= 3:
                raise RecipeError(f"{path} is not an IDX file of unsigned bytes (it starts {magic.hex(' ')}, expected "
                                  "00 00 08 and 1 to 3 dimensions): download it again")
            dims = f.read(4 * magic[3])
            whole = len(dims) == 4 * magic[3]  # every size the header names is there
            shape = struct.unpack(f">{magic[3]}I", dims) if whole else ()
            size = math.prod(shape)
            if size == 0 and whole:
                raise RecipeError(f"{path} holds no data (its header says {shape}): download it again")
            if count_only and whole:
                return shape[0]
            check_size(path, size)
            stored = path.stat().st_size  # a gzip bomb inflates thousands of times (1 MB to 1.5 GB)
            if path.suffix == ".gz" and size > MAX_INFLATE_RATIO * stored + 2**26:
                raise RecipeError(f"{path} claims {size:,} bytes of data in {stored:,} bytes (a gzip file may hold "
                                  f"{MAX_INFLATE_RATIO} times its size plus 64 MiB): damaged or hostile; download it "
                                  "again")
            raw, extra = f.read(size), f.read(1)  # gzip: decompresses only what it returns
    except (OSError, EOFError, zlib.error, MemoryError) as error:  # a truncated or corrupt .gz; no memory left
        raise RecipeError(f"{path} cannot be read ({first_line(error)}): download it again") from None
    if not whole or len(raw) != size or extra:
        size = f"more than {len(magic + dims + raw):,}" if extra else f"{len(magic + dims + raw):,}"
        raise RecipeError(f"{path} is {size} bytes, not what its header says ({shape or 'cut short'}): the file is "
                          "truncated or damaged; download it again")
    return np.frombuffer(raw, np.uint8).reshape(shape)


def read_idx_splits(files: dict[str, list[Path]]):
    splits = {}
    for split, (images_file, labels_file) in files.items():
        images, labels = read_idx(images_file), read_idx(labels_file)
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise RecipeError(f"{images_file.parent}: {images_file.name} holds {images.shape} and {labels_file.name} "
                              f"{labels.shape}: expected (N, height, width) images and N labels; download them again")
        splits[split] = (torch.from_numpy(images.copy())[:, None], torch.from_numpy(labels.astype(np.int64)))
    test_labels = splits["test"][1].to(torch.uint8).numpy().tobytes()  # the file's bytes: read once, above
    # The data names Fashion-MNIST, not the path: digits in a folder called "fashion" keep digit names, and a subset
    # of Fashion-MNIST, whose test labels are not the published file, gets the labels' numbers. With its ten names, a
    # label outside them is refused, not taken as an eleventh class.
    if hashlib.sha256(test_labels).hexdigest().startswith(FASHION_MNIST_TEST_LABELS):
        return splits, FASHION_MNIST
    return splits, [str(i) for i in range(max(int(labels.max()) for _, labels in splits.values()) + 1)]


def read_cifar_splits(kind: str, files: dict[str, list[Path]]):
    """CIFAR's binary or Python version (`kind`: its folder's name): each split's images and labels, the class names."""
    pickled, names_file = kind in CIFAR_PICKLED, files["names"][0]
    if pickled:
        _, _, names_key, labels_key = CIFAR_PICKLED[kind]
        classes, layout = read_pickled_batch(names_file).get(names_key), f"its '{names_key}' list"
    else:
        with open(names_file, "rb") as f:
            text = f.read(MAX_NAMES_BYTES + 1)  # no more than a names file may hold, whatever the file's size
        lines = [line.strip() for line in text.decode("utf-8", "replace").splitlines() if line.strip()]
        classes, layout = lines if len(text) <= MAX_NAMES_BYTES else None, "one per line"
    # Lengths first: a pickled list may name one long text 256 times, and each decode would copy it
    if not (isinstance(classes, list) and 0 < len(classes) <= 256
            and all(isinstance(name, (str, bytes)) and len(name) <= 100 for name in classes)):
        raise RecipeError(f"{names_file} is not up to 256 class names of up to 100 characters ({layout}): download "
                          "the dataset again")
    classes = [as_text(name) for name in classes]
    splits = {}
    for split in ("train", "test"):
        batches = [read_pickled_images(path, labels_key, len(classes)) if pickled
                   else read_records(path, CIFAR_BINARY[kind][2]) for path in files[split]]
        images, labels = (np.concatenate(arrays) for arrays in zip(*batches))  # one array a split, copied once
        splits[split] = (torch.from_numpy(images), torch.from_numpy(labels))
    return splits, classes


def read_records(path: Path, label_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """A file of the binary version: records of `label_bytes` label bytes (CIFAR-100: coarse, then fine), then a
    3x32x32 image. Its size is within the limit: DatasetFiles.read checked each split's files together."""
    record, size = label_bytes + 3 * 32 * 32, path.stat().st_size
    if size == 0 or size % record:
        raise RecipeError(f"{path} is {size:,} bytes, not whole records of {record:,} ({label_bytes} label "
                          "byte(s), then a 3x32x32 image): the file is truncated or damaged; download it again")
    rows = np.fromfile(path, np.uint8, count=size).reshape(-1, record)
    return rows[:, label_bytes:].reshape(-1, 3, 32, 32), rows[:, label_bytes - 1].astype(np.int64)  # the fine label


class CifarUnpickler(pickle.Unpickler):
    """Builds what a CIFAR pickle holds, nothing else: dicts, lists, numbers, strings, and uint8 arrays whose bytes are
    in the file. Every class or function a pickle names is refused before it is looked up (os.system, a model's class,
    numpy.ndarray itself, which would allocate any size), but for stand-ins that check what they are given."""

    def find_class(self, module, name):
        if (module, name) not in STAND_INS:
            raise pickle.UnpicklingError(f"it would call {module}.{name}")
        return STAND_INS[module, name]


class NDArrayName:
    """numpy.ndarray as a pickle names it: an argument of _reconstruct, refused as a call (it allocates any size)."""

    def __init__(self, *args):
        raise pickle.UnpicklingError("it would call numpy.ndarray")


class PickledDtype:
    def __init__(self, kind, align=False, copy=True):
        self.kind = kind

    def __setstate__(self, state):
        pass  # byte order and alignment: nothing to say for single bytes, and other types are refused


@functools.cache  # one copy of each text however often the pickle reuses it (8 of a 400 MB text: 3.3 GB); per file
def latin1_bytes(text, encoding) -> bytes:
    if not (isinstance(text, str) and encoding in ("latin1", "latin-1")):
        raise pickle.UnpicklingError("a _codecs.encode that is not bytes written as latin-1 text")
    return text.encode("latin1")  # as many bytes as the text's characters: no more than the file holds


def array_from_buffer(buffer, dtype, shape, order) -> "PickledArray":
    array = PickledArray(NDArrayName)
    array.__setstate__((1, shape, dtype, order != "C", buffer))
    return array


class PickledArray:
    """An array as NumPy pickles it: _reconstruct(ndarray, ...), then its state (shape, dtype, the bytes). Only uint8
    arrays in C order whose bytes are all in the file: a shape never allocates more than the file holds."""

    array = None  # until its state comes: also made without __init__ (NEWOBJ), or never given a state (no BUILD)

    def __init__(self, cls, shape=(0,), typecode=b"b"):
        if cls is not NDArrayName:
            raise pickle.UnpicklingError("it would build an array of another class")

    def __setstate__(self, state):
        _, shape, dtype, fortran_order, raw = state if isinstance(state, tuple) and len(state) == 5 else [None] * 5
        raw = latin1_bytes(raw, "latin1") if isinstance(raw, str) else raw  # Python 2 wrote the bytes as a str
        if not (isinstance(dtype, PickledDtype) and dtype.kind in ("u1", "uint8", b"u1") and not fortran_order
                and isinstance(raw, (bytes, bytearray)) and isinstance(shape, tuple) and len(shape) <= 4
                and all(type(n) is int and 0 <= n <= len(raw) for n in shape) and len(raw) == math.prod(shape)):
            raise pickle.UnpicklingError("an array that is not uint8 bytes of its own shape")
        self.array = np.frombuffer(raw, np.uint8).reshape(shape)


# Every name a CIFAR pickle may call, and the stand-in CifarUnpickler gives it (numpy 2 moved numpy.core to numpy._core)
STAND_INS = {
    ("numpy.core.multiarray", "_reconstruct"): PickledArray,  # how NumPy pickles an array
    ("numpy._core.multiarray", "_reconstruct"): PickledArray,
    ("numpy", "ndarray"): NDArrayName,
    ("numpy", "dtype"): PickledDtype,
    ("_codecs", "encode"): latin1_bytes,  # how Python 3 pickles bytes at protocol 2
    # how NumPy pickles an array at protocol 5 (Python 3.14's default)
    ("numpy.core.numeric", "_frombuffer"): array_from_buffer,
    ("numpy._core.numeric", "_frombuffer"): array_from_buffer,
}


def read_pickled_batch(path: Path) -> dict:
    """A CIFAR pickle as a dict with str keys, read whole first (bounded by check_size), checked (check_pickle)
    before any operation is run."""
    try:
        # Read, checked and unpickled, a text with one 4-byte character takes 4 bytes a character: the peak was 6 times
        check_size(path, size := path.stat().st_size, times=6)  # the file's size (100 MB of text: 590 MB)
        if size > MAX_PICKLE_BYTES:
            raise RecipeError(f"{path} is {size:,} bytes, more than a CIFAR pickle holds ({MAX_PICKLE_BYTES >> 20} "
                              "MiB; CIFAR-100's train file, the largest, is 155 MB): download the dataset again; a "
                              "file you made: split it into data_batch_1, data_batch_2, ...")
        with open(path, "rb") as f:
            raw = f.read(size)  # the size checked, not a bound (read allocates what it is asked for: 4 GiB, untouched)
        check_pickle(raw)
        batch = CifarUnpickler(io.BytesIO(raw), encoding="latin1").load()  # Python 2 wrote its strings as latin-1
    except RecipeError:
        raise
    except Exception as error:  # anything a damaged pickle raises
        raise RecipeError(f"{path} is not a plain CIFAR pickle, refused ({first_line(error)[:200]}): download the "
                          "dataset again, or use its binary version; a file you made: pickle a dict of 'data' (a NumPy "
                          "uint8 array, a row of 3,072 bytes per image) and 'labels' (a list of ints)") from None
    finally:
        latin1_bytes.cache_clear()
    if not isinstance(batch, dict):
        raise RecipeError(f"{path} holds a {type(batch).__name__}, not a CIFAR batch (a dict): download it again")
    # Keys and names are str when Python 2 wrote them (read as latin-1), bytes when Python 3 wrote bytes
    return {as_text(key): value for key, value in batch.items()}


def as_text(value):
    return value.decode("latin1") if isinstance(value, bytes) else value


def read_pickled_images(path: Path, labels_key: str, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """A batch of the Python version: its 'data', uint8 rows of 3,072 bytes, and a label in 0..num_classes - 1 each."""
    batch = read_pickled_batch(path)
    data = batch.get("data")
    data = data.array if isinstance(data, PickledArray) else None
    if data is None or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise RecipeError(f"{path}: its 'data' is not uint8 rows of 3,072 bytes: download it again")
    labels = batch.get(labels_key)
    if not (isinstance(labels, list) and len(labels) == len(data)
            and all(type(label) is int and 0 <= label < num_classes for label in labels)):
        raise RecipeError(f"{path}: its '{labels_key}' are not {len(data)} labels in 0..{num_classes - 1}, one per "
                          "image: download it again")
    return data.reshape(-1, 3, 32, 32), np.array(labels, np.int64)
