"""--data DIR with the files datasets are published in: the MNIST family's IDX files (the real Fashion-MNIST, as
Debian's dataset-fashion-mnist installs it, when it is there) and CIFAR's binary and Python versions (pickles, read
without running their code). The same images as a save_to_disk dataset give the same tensors."""

from __future__ import annotations

import gzip
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from PIL import Image
from test_errors import one_line

from conftest import ROOT, ok, read_json, run_here
from tiny_data import (
    cifar_binary_dataset,
    cifar_folder,
    cifar_python_folder,
    idx_folder,
    image_splits,
    imagefolder_dataset,
    parquet_dataset,
    random_splits,
    save_to_disk_dataset,
    write_idx,
)

FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
needs_fashion_mnist = pytest.mark.skipif(not FASHION_MNIST.is_dir(), reason=(
    f"no real Fashion-MNIST at {FASHION_MNIST}: apt-get install dataset-fashion-mnist (Debian, Ubuntu)"))


def saved_dataset(folder: Path, splits: dict, classes: list[str], channels_first: bool) -> Path:
    """The same images as a save_to_disk dataset of PIL images: the path every other format takes."""
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=classes)})
    images = {split: [Image.fromarray(a.transpose(1, 2, 0) if channels_first else a) for a in arrays]
              for split, (arrays, _) in splits.items()}
    datasets.DatasetDict({split: datasets.Dataset.from_dict({"image": images[split], "label": labels.tolist()},
                                                            features=features)
                          for split, (_, labels) in splits.items()}).save_to_disk(str(folder))
    return folder


@pytest.fixture
def data_module(tmp_path, monkeypatch):
    from shared import data

    monkeypatch.setattr(data, "CACHE_DIR", tmp_path / "cache")
    return data


def read_by_datasets(folder: Path):
    """What a run reads from a folder of datasets' formats where its decoded images are not cached: the folder
    checked, then read by datasets (shared/data.py's Source, with the splits and classes found)."""
    from shared.data import dataset_source
    from shared.dataset_files import find_dataset_files, open_local

    found = find_dataset_files(folder)
    return dataset_source(open_local(found.folder, found.tables), str(folder))


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)])
def test_idx_files_give_the_tensors_of_the_same_images_saved_as_a_dataset(tmp_path, data_module, shape):
    splits = random_splits((28, 28))
    classes = [str(i) for i in range(10)]
    from_idx = data_module.load_image_data(str(idx_folder(tmp_path / "idx", splits)), shape)
    from_saved = data_module.load_image_data(str(saved_dataset(tmp_path / "saved", splits, classes, False)), shape)
    for idx_split, saved_split in zip(from_idx, from_saved):
        assert idx_split.images.shape[1:] == shape
        assert torch.equal(idx_split.images, saved_split.images) and torch.equal(idx_split.labels, saved_split.labels)
    assert from_idx[0].classes == classes  # not Fashion-MNIST: the label numbers


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)])
def test_cifar_binary_files_give_the_tensors_of_the_same_images_saved_as_a_dataset(tmp_path, data_module, shape):
    splits = random_splits((3, 32, 32), sizes=(60, 20))
    classes = [f"class {i}" for i in range(10)]
    folder = cifar_folder(tmp_path / "cifar-10-batches-bin", splits, classes)
    from_files = data_module.load_image_data(str(folder), shape)
    from_saved = data_module.load_image_data(str(saved_dataset(tmp_path / "saved", splits, classes, True)), shape)
    for files_split, saved_split in zip(from_files, from_saved):
        assert files_split.images.shape[1:] == shape
        assert torch.equal(files_split.images, saved_split.images)
        assert torch.equal(files_split.labels, saved_split.labels)
    assert from_files[0].classes == classes and len(from_files[0]) == 60


def test_the_tests_cifar_binary_folder_holds_the_images_of_their_saved_dataset(tmp_path, data_module):
    """tiny_data.cifar_binary_dataset stands in for save_to_disk_dataset where the format is not what a test checks."""
    files = data_module.load_image_data(str(cifar_binary_dataset(tmp_path / "bin")), (3, 32, 32))
    saved = data_module.load_image_data(str(save_to_disk_dataset(tmp_path / "saved")), (3, 32, 32))
    for files_split, saved_split in zip(files, saved):
        assert torch.equal(files_split.images, saved_split.images)
        assert torch.equal(files_split.labels, saved_split.labels) and files_split.classes == saved_split.classes


def test_idx_files_named_with_a_dot_are_read_beside_folders_of_their_names(tmp_path, data_module):
    """train-images.idx3-ubyte, as many copies of MNIST name the files; and Kaggle's copy, which has beside each file a
    folder of its dashed name with the file inside (train-images-idx3-ubyte/train-images-idx3-ubyte). Both went to
    datasets' imagefolder: the files left out as "of no image format", then "Instruction 'train' corresponds to no
    data"."""
    splits = random_splits((28, 28))
    folder = idx_folder(tmp_path / "mnist", splits, suffix="")
    for file in sorted(folder.iterdir()):
        dotted = file.rename(file.with_name(file.name.replace("-idx", ".idx")))
        file.mkdir()
        shutil.copy(dotted, file / file.name)
    train, test = data_module.load_image_data(str(folder), (1, 28, 28))
    assert torch.equal(train.images[:, 0], torch.from_numpy(splits["train"][0]))
    assert torch.equal(test.labels, torch.from_numpy(splits["test"][1]))


def test_download_folders_are_found_from_their_root(tmp_path, data_module):
    # torchvision: <root>/FashionMNIST/raw/ with each .gz beside the file it unpacked; <root>/cifar-100-binary/.
    from shared.errors import RecipeError

    splits = random_splits((28, 28))
    idx_folder(tmp_path / "fmnist" / "FashionMNIST" / "raw", splits, suffix="")
    idx_folder(tmp_path / "fmnist" / "FashionMNIST" / "raw", splits, suffix=".gz")
    train, test = data_module.load_image_data(str(tmp_path / "fmnist"), (1, 28, 28))
    assert torch.equal(train.images[:, 0], torch.from_numpy(splits["train"][0])) and len(test) == 20
    assert train.classes == [str(i) for i in range(10)]  # random labels: the folder's name does not name them

    hundred = random_splits((3, 32, 32), classes=100)
    cifar_folder(tmp_path / "c100" / "cifar-100-binary", hundred, [f"c{i}" for i in range(100)], hundred=True)
    train, _ = data_module.load_image_data(str(tmp_path / "c100"), (3, 32, 32))
    assert torch.equal(train.labels, torch.from_numpy(hundred["train"][1])) and len(train.classes) == 100
    # Two datasets below one root: which one to train on is not guessed
    idx_folder(tmp_path / "fmnist" / "MNIST" / "raw", splits)
    with pytest.raises(RecipeError, match=re.escape(
            f"--data {tmp_path / 'fmnist'} holds more than one dataset ({tmp_path / 'fmnist/FashionMNIST/raw'}, "
            f"{tmp_path / 'fmnist/MNIST/raw'}): pass --data one of these folders")):
        data_module.load_image_data(str(tmp_path / "fmnist"), (1, 28, 28))


class RunsCode:
    def __reduce__(self):  # what a malicious pickle does: unpickling it calls os.system
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("hundred", [False, True])
def test_cifar_python_version_gives_the_tensors_of_its_binary_version(tmp_path, data_module, hundred):
    splits = random_splits((3, 32, 32), sizes=(60, 20), classes=100 if hundred else 10)
    classes = [f"class {i} \xe9" for i in range(100 if hundred else 10)]  # latin-1, as Python 2 wrote its str
    names = ("cifar-100-python", "cifar-100-binary") if hundred else ("cifar-10-batches-py", "cifar-10-batches-bin")
    python = cifar_python_folder(tmp_path / "py" / names[0], splits, classes, hundred)
    cifar_folder(tmp_path / "bin" / names[1], splits, classes, hundred)
    raw = (python / ("test" if hundred else "test_batch")).read_bytes()
    assert b"data" in pickle.loads(raw, encoding="bytes")  # bytes keys, as Python 2 wrote them
    with pytest.raises(UnicodeDecodeError):
        pickle.loads(raw)  # and latin-1 strings: Python 3's default reading (ASCII) fails on them
    from_python = data_module.load_image_data(str(tmp_path / "py"), (3, 32, 32))
    from_binary = data_module.load_image_data(str(tmp_path / "bin"), (3, 32, 32))
    for python_split, binary_split in zip(from_python, from_binary):
        assert torch.equal(python_split.images, binary_split.images)
        assert torch.equal(python_split.labels, binary_split.labels) and python_split.classes == classes
    assert torch.equal(from_python[0].labels, torch.from_numpy(splits["train"][1]))


@pytest.mark.parametrize("protocol", [2, 5])
def test_cifar_pickles_that_python_3_wrote_are_read_too(tmp_path, data_module, protocol):
    """Protocol 2 from Python 3 stores bytes through _codecs.encode(text, 'latin1'), protocol 5 (Python 3.14's
    default) arrays through numpy's _frombuffer: both were refused with "download the dataset again"."""
    splits = random_splits((3, 32, 32), sizes=(60, 20))
    classes = [f"class {i}" for i in range(10)]
    cifar_python_folder(tmp_path / "py" / "cifar-10-batches-py", splits, classes, protocol=protocol)
    cifar_folder(tmp_path / "bin" / "cifar-10-batches-bin", splits, classes)
    for read, expected in zip(data_module.load_image_data(str(tmp_path / "py"), (3, 32, 32)),
                              data_module.load_image_data(str(tmp_path / "bin"), (3, 32, 32))):
        assert torch.equal(read.images, expected.images) and torch.equal(read.labels, expected.labels)
        assert read.classes == classes


def test_a_cifar_pickle_that_would_run_code_is_refused_in_one_line(env, tmp_path):
    # torchvision's download, as its root folder holds it: pickled batches, one of them hostile.
    folder = cifar_python_folder(tmp_path / "root" / "cifar-10-batches-py", random_splits((3, 32, 32)),
                                 [str(i) for i in range(10)])
    bomb = RunsCode()
    bomb.marker = tmp_path / "code-ran"
    (folder / "data_batch_3").write_bytes(pickle.dumps({"data": bomb}, protocol=2))
    assert pickle.loads((folder / "data_batch_3").read_bytes()) == {"data": 0} and bomb.marker.exists()  # it works
    bomb.marker.unlink()
    line = one_line(run_here("cifar_cnn", "--data", tmp_path / "root", "--tracker", "none"),
                    "data_batch_3 is not a plain CIFAR pickle, refused (it would call", "system)",
                    "download the dataset again, or use its binary version")
    assert not bomb.marker.exists(), line
    # A pickle of another type than a batch (a dict), read as Python 2 wrote it
    (folder / "data_batch_3").write_bytes(pickle.dumps([1, 2, 3], protocol=2))
    one_line(run_here("cifar_cnn", "--data", tmp_path / "root", "--tracker", "none"),
             f"{folder / 'data_batch_3'} holds a list, not a CIFAR batch (a dict): download it again")


@pytest.mark.parametrize("hundred", [False, True])
@pytest.mark.parametrize("make", [cifar_folder, cifar_python_folder])
def test_cifar_files_in_a_folder_of_another_name_are_read_by_their_names(tmp_path, data_module, make, hundred):
    """CIFAR's files copied into data/ (their archive unpacks them into cifar-10-batches-py/ and the like). Before,
    datasets' imagefolder read the folder: its files left out as "of no image format", then "Instruction 'test'
    corresponds to no data", in a line that ended with CIFAR's files among those expected."""
    splits = random_splits((3, 32, 32), classes=100 if hundred else 10)
    classes = [f"class {i}" for i in range(100 if hundred else 10)]
    make(tmp_path / "data", splits, classes, hundred)
    train, test = data_module.load_image_data(str(tmp_path / "data"), (3, 32, 32))
    assert torch.equal(train.labels, torch.from_numpy(splits["train"][1])) and train.classes == classes
    assert torch.equal(test.images.flatten(1), torch.from_numpy(splits["test"][0]).flatten(1))


def test_a_folder_with_both_cifar_versions_reads_the_binary_one(tmp_path, data_module):
    splits = random_splits((3, 32, 32))
    cifar_folder(tmp_path / "root" / "cifar-10-batches-bin", splits, [str(i) for i in range(10)])
    python = cifar_python_folder(tmp_path / "root" / "cifar-10-batches-py", splits, [str(i) for i in range(10)])
    bomb = RunsCode()
    bomb.marker = tmp_path / "code-ran"
    (python / "data_batch_1").write_bytes(pickle.dumps({"data": bomb}, protocol=2))  # so it must not be opened
    train, test = data_module.load_image_data(str(tmp_path / "root"), (3, 32, 32))
    assert torch.equal(test.labels, torch.from_numpy(splits["test"][1])) and not bomb.marker.exists()


def truncated_gz(folder: Path) -> str:
    raw = (folder / "train-images-idx3-ubyte.gz").read_bytes()
    (folder / "train-images-idx3-ubyte.gz").write_bytes(raw[:len(raw) // 2])
    return "train-images-idx3-ubyte.gz cannot be read"


def truncated_raw(folder: Path) -> str:
    (folder / "t10k-labels-idx1-ubyte.gz").unlink()
    write_idx(folder / "t10k-labels-idx1-ubyte", np.zeros(20, np.uint8))
    raw = (folder / "t10k-labels-idx1-ubyte").read_bytes()
    (folder / "t10k-labels-idx1-ubyte").write_bytes(raw[:-3])
    return "is 25 bytes, not what its header says ((20,))"


def not_idx(folder: Path) -> str:
    Image.new("L", (28, 28)).save(folder / "t10k-images-idx3-ubyte", format="PNG")
    (folder / "t10k-images-idx3-ubyte.gz").unlink()
    return "is not an IDX file of unsigned bytes (it starts 89 50 4e 47"


def label_count(folder: Path) -> str:
    write_idx(folder / "train-labels-idx1-ubyte.gz", np.zeros(49, np.uint8))
    return "holds (50, 28, 28) and train-labels-idx1-ubyte.gz (49,)"


def missing_file(folder: Path) -> str:
    (folder / "t10k-labels-idx1-ubyte.gz").unlink()
    return "but not all four"


def two_sets(folder: Path) -> str:  # which is the dataset is not guessed
    shutil.copy(folder / "train-images-idx3-ubyte.gz", folder / "old-train-images-idx3-ubyte.gz")
    return "holds several IDX sets (old-train-images-idx3-ubyte, train-images-idx3-ubyte): keep one per folder"


def test_an_imagefolder_with_its_metadata_in_parquet_is_read_as_an_imagefolder(tmp_path):
    """A local folder is read as parquet when it holds parquet files, but an imagefolder's metadata.parquet (its
    labels, by file name) is not one: the images are the data."""
    data = imagefolder_dataset(tmp_path / "data", sizes={"train": 16, "test": 8})
    for split in ("train", "test"):
        names = sorted(path.relative_to(data / split).as_posix() for path in (data / split).glob("*/*.png"))
        datasets.Dataset.from_dict({"file_name": names, "label": [n % 2 for n in range(len(names))]}).to_parquet(
            str(data / split / "metadata.parquet"))
    ok(run_here("cifar_cnn", "--data", data, "--max_steps", "2", "--batch_size", "4", "--tracker", "none",
                "--output_dir", tmp_path / "run"))
    config = read_json(tmp_path / "run" / "config.json")
    assert config["train_size"] == 16 and config["classes"] == ["0", "1"]


@pytest.mark.parametrize("make", [imagefolder_dataset, parquet_dataset, save_to_disk_dataset])
def test_a_folder_decoded_once_is_read_back_by_its_files_without_datasets(tmp_path, data_module, monkeypatch, make):
    """datasets lists a folder by up to 46 patterns, each a walk of every file below it (datasets #5317): a run on
    60,000 small PNG files took 36-38 s, 8 s without it. The decoded images are cached by the folder's files (paths,
    sizes, times), so a later run does not ask datasets; a file changed, added or removed is read again."""
    data, asked = make(tmp_path / "data", sizes={"train": 8, "test": 4}), []

    def counted(read):
        def reading(*args, **kwargs):
            asked.append(args)
            return read(*args, **kwargs)
        return reading

    for name in ("load_dataset", "load_from_disk"):
        monkeypatch.setattr(datasets, name, counted(getattr(datasets, name)))
    first = data_module.load_image_data(str(data), (3, 32, 32))
    assert len(asked) == 1
    again = data_module.load_image_data(str(data), (3, 32, 32))
    assert len(asked) == 1
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels) and a.classes == b.classes
    file = max(path for path in data.rglob("*") if path.is_file() and path.suffix != ".json")  # a data file
    changes = [lambda: os.utime(file, ns=(0, 0)), lambda: shutil.copy(file, data / f"more{file.suffix}")]
    if make is imagefolder_dataset:
        changes.append(file.unlink)
    for count, change in enumerate(changes, start=2):
        change()
        data_module.load_image_data(str(data), (3, 32, 32))
        data_module.load_image_data(str(data), (3, 32, 32))
        assert len(asked) == count  # read again, then from the cache
    # Files of no format datasets reads there, and hidden ones, which it skips: a Finder window's .DS_Store, Windows'
    # Thumbs.db, a notebook and its checkpoints
    for name in (".DS_Store", "Thumbs.db", "look.ipynb", ".ipynb_checkpoints/look-checkpoint.ipynb"):
        (data / name).parent.mkdir(exist_ok=True)
        (data / name).write_bytes(b"\0")
    data_module.load_image_data(str(data), (3, 32, 32))
    assert len(asked) == len(changes) + 1


def test_a_hub_dataset_is_cached_by_the_hashes_datasets_keeps_of_its_splits(tmp_path, data_module, monkeypatch):
    """A hub id's dataset (datasets' load replaced here: no hub is reachable) has no files of its own to key the cache:
    each split's `_fingerprint`, datasets' hash of its content and history, keys it."""
    splits = image_splits(sizes={"train": 8, "test": 4})
    monkeypatch.setattr(datasets, "load_dataset", lambda name: splits if name == "someone/photos" else None)
    train, test = data_module.load_image_data("someone/photos", (3, 32, 32))
    assert (len(train), len(test)) == (8, 4)
    cached = [path.name for path in (tmp_path / "cache").iterdir()]
    assert len(cached) == 1 and cached[0].startswith(f"{splits['train']._fingerprint}-{splits['test']._fingerprint}-")


def test_a_class_with_no_training_image_is_named(tmp_path, data_module, capsys, monkeypatch):
    """train/cat beside test/Cat: an imagefolder's classes are the folders of every split, so 'Cat' became a class
    that no training image teaches, and the run said nothing."""
    data = imagefolder_dataset(tmp_path / "data", sizes={"train": 16, "test": 8})
    train, _ = data_module.load_image_data(str(data), (3, 32, 32))
    assert "no training image" not in capsys.readouterr().out
    moved = next((data / "test").iterdir())
    moved.rename(data / "test" / f"{moved.name}_misspelled")
    train, _ = data_module.load_image_data(str(data), (3, 32, 32))
    assert capsys.readouterr().out.splitlines()[0] == (
        f"{data}: 1 class(es) with no training image, which the model cannot learn: {moved.name}_misspelled (a folder "
        "named differently in train/ and test/?)")
    assert f"{moved.name}_misspelled" in train.classes
    # Every process finds the source; the others say nothing (the held-out split's line came from each)
    monkeypatch.setattr(data_module, "is_main_process", lambda: False)
    shutil.rmtree(data / "test")
    data_module.load_image_data(str(data), (3, 32, 32))
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("damage", [truncated_gz, truncated_raw, not_idx, label_count, missing_file, two_sets])
def test_damaged_idx_files_are_one_line_each(tmp_path, data_module, damage):
    from shared.errors import RecipeError

    folder = idx_folder(tmp_path / "idx", random_splits((28, 28)))
    needle = damage(folder)
    with pytest.raises(RecipeError, match="again|not all four|keep one") as error:
        data_module.load_image_data(str(folder), (1, 28, 28))
    assert needle in str(error.value) and "\n" not in str(error.value)


def test_damaged_cifar_folders_are_one_line_each(tmp_path, data_module):
    from shared.errors import RecipeError

    folder = cifar_folder(tmp_path / "cifar-10-batches-bin", random_splits((3, 32, 32)), [str(i) for i in range(10)])
    raw = (folder / "test_batch.bin").read_bytes()
    (folder / "test_batch.bin").write_bytes(raw[:-1000])
    with pytest.raises(RecipeError, match=r"test_batch.bin is 60,460 bytes, not whole records of 3,073 \(1 label"):
        data_module.load_image_data(str(folder), (3, 32, 32))
    with open(folder / "test_batch.bin", "wb") as f:  # 5 GiB, sparse: refused by its size, before a byte is read
        f.truncate(5 * 2**30)
    with pytest.raises(RecipeError, match="test_batch.bin claims 5,368,709,120 bytes of data, over the 4 GiB"):
        data_module.load_image_data(str(folder), (3, 32, 32))
    (folder / "test_batch.bin").write_bytes(raw[:3073] * 20)  # 20 records; one label 200 of the 10 classes
    (folder / "data_batch_2.bin").write_bytes(bytes([200]) + raw[1:3073])
    with pytest.raises(RecipeError, match=r"'train' has labels outside 0..9 \(e.g. 200\) for its 10 classes: download "
                                          "the files again"):
        data_module.load_image_data(str(folder), (3, 32, 32))
    for i in range(1, 6):  # whole records, 1 GB each, within the limit; 5.4 GB together: refused before any is read
        with open(folder / f"data_batch_{i}.bin", "wb") as f:
            f.truncate(3073 * 350_000)
    with pytest.raises(RecipeError, match="cifar-10-batches-bin/train files claims 5,377,750,000 bytes of data"):
        data_module.load_image_data(str(folder), (3, 32, 32))
    (folder / "data_batch_5.bin").unlink()
    with pytest.raises(RecipeError, match="lacks data_batch_5.bin: download the dataset again"):
        data_module.load_image_data(str(folder), (3, 32, 32))
    os.mkfifo(folder / "data_batch_5.bin")  # there, but no file to read: said so, not "lacks" (nor a blocked read)
    with pytest.raises(RecipeError, match="data_batch_5.bin' is not a regular file .*: replace it by the downloaded"):
        data_module.load_image_data(str(folder), (3, 32, 32))


def test_a_truncated_download_through_the_recipe(env, tmp_path):
    folder = idx_folder(tmp_path / "idx", random_splits((28, 28)))
    truncated_gz(folder)
    one_line(run_here("resnet18_fmnist", "--data", folder, "--tracker", "none"),
             "train-images-idx3-ubyte.gz cannot be read", "download it again")


# ------------------------------------------------------------------ the real Fashion-MNIST (Debian's package)
def real_arrays(split: str, count: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The first `count` images and labels of the real files, read here without shared/: the reference."""
    prefix = "train" if split == "train" else "t10k"
    images = np.frombuffer(gzip.open(FASHION_MNIST / f"{prefix}-images-idx3-ubyte.gz").read(), np.uint8, offset=16)
    labels = np.frombuffer(gzip.open(FASHION_MNIST / f"{prefix}-labels-idx1-ubyte.gz").read(), np.uint8, offset=8)
    return images.reshape(-1, 28, 28)[:count], labels[:count].astype(np.int64)


@pytest.fixture(scope="module")
def real_subset(tmp_path_factory):
    """The first 2,000 training and 500 test images of the real Fashion-MNIST, as IDX files."""
    if not FASHION_MNIST.is_dir():
        pytest.skip(f"no real Fashion-MNIST at {FASHION_MNIST}: apt-get install dataset-fashion-mnist")
    return idx_folder(tmp_path_factory.mktemp("fmnist") / "fashion-subset",
                      {"train": real_arrays("train", 2000), "test": real_arrays("test", 500)})


@needs_fashion_mnist
def test_real_fashion_mnist_reads_as_its_files_hold_it(data_module):
    train, test = data_module.load_image_data(str(FASHION_MNIST), (1, 28, 28))
    images, labels = real_arrays("train")
    assert (len(train), len(test)) == (60_000, 10_000) and torch.equal(train.labels.bincount(), torch.full((10,), 6000))
    assert torch.equal(train.images[:, 0], torch.tensor(images)) and torch.equal(train.labels, torch.tensor(labels))
    assert torch.equal(test.images[:, 0], torch.tensor(real_arrays("test")[0]))
    assert train.classes[0] == "T-shirt/top" and train.classes[9] == "Ankle boot"


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)])
def test_real_images_as_idx_files_and_as_a_saved_dataset_give_the_same_tensors(real_subset, tmp_path, data_module,
                                                                               shape):
    subset = {"train": real_arrays("train", 2000), "test": real_arrays("test", 500)}
    saved = data_module.load_image_data(str(saved_dataset(tmp_path / "saved", subset, list("0123456789"), False)),
                                        shape)
    files = data_module.load_image_data(str(real_subset), shape)
    for files_split, saved_split in zip(files, saved):
        assert torch.equal(files_split.images, saved_split.images)
        assert torch.equal(files_split.labels, saved_split.labels)


def test_the_data_not_the_path_names_the_fashion_mnist_classes(data_module, tmp_path):
    """Digits in a folder whose path says "fashion" keep digit names (they were given Fashion-MNIST's)."""
    folder = idx_folder(tmp_path / "fashion-mnist" / "my-digits", random_splits((28, 28), sizes=(64, 20)))
    train, test = data_module.load_image_data(str(folder), (1, 28, 28))
    assert train.classes == test.classes == [str(i) for i in range(10)]


@needs_fashion_mnist
def test_the_real_test_labels_name_the_fashion_mnist_classes_in_any_folder(data_module, tmp_path):
    folder = idx_folder(tmp_path / "my-digits", random_splits((28, 28), sizes=(64, 20)))
    for name in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        (folder / name).write_bytes((FASHION_MNIST / name).read_bytes())
    train, test = data_module.load_image_data(str(folder), (1, 28, 28))
    assert len(test) == 10_000 and train.classes[0] == "T-shirt/top" and test.classes[9] == "Ankle boot"


@needs_fashion_mnist
def test_cifar_cnn_learns_the_real_fashion_mnist_from_the_debian_folder(env, tmp_path):
    out = tmp_path / "run"
    result = ok(run_here("cifar_cnn", "--data", FASHION_MNIST, "--max_steps", "60", "--batch_size", "64",
                         "--tracker", "none", "--output_dir", out))
    assert "60000 train / 10000 test images" in result.stdout and "grayscale -> colour; 28x28 -> 32x32" in result.stdout
    summary = read_json(out / "summary.json")
    assert summary["eval_acc"] > 0.7, summary  # chance is 0.1
    assert read_json(out / "config.json")["classes"][9] == "Ankle boot"


def test_resnet_trains_on_real_fashion_mnist_idx_files(env, real_subset, tmp_path):
    # Learning is checked above with the faster CNN: the ResNet's BatchNorm statistics need ~40 steps to settle.
    out = tmp_path / "run"
    ok(run_here("resnet18_fmnist", "--data", real_subset, "--max_steps", "4", "--batch_size", "16", "--tracker",
                "none", "--output_dir", out))
    config = read_json(out / "config.json")
    # A subset: its test labels are not the published file's, so the classes are the labels' numbers.
    assert (config["train_size"], config["test_size"], config["classes"][0]) == (2000, 500, "0")
    assert read_json(out / "summary.json")["eval_samples"] == 500


@pytest.mark.parametrize("names", [("Training", "Test"), ("trainset", "testset")])
def test_split_folders_that_datasets_does_not_know_are_one_line(tmp_path, names):
    """Fruits-360's Training/ and Test/: datasets knows a split's folder by its lowercase name only (and trainset/ not
    at all), so it read them as the classes of one split and held out a random 10% of it, the test images trained on.
    Folders of images are classes, whatever their names."""
    from shared.errors import RecipeError

    photos = imagefolder_dataset(tmp_path / "photos", sizes={"train": 8, "test": 4})
    (photos / "train").rename(photos / names[0])
    (photos / "test").rename(photos / names[1])
    with pytest.raises(RecipeError) as error:
        read_by_datasets(photos)
    assert str(error.value) == (
        f"{photos}: its folders {', '.join(sorted(names))} hold class folders, as splits do, but datasets read a "
        "'train' split alone from them: it knows a split's folder only by its lowercase name (train, test, "
        "validation, ...: docs/data.md); rename them")
    (photos / names[0]).rename(photos / "training")
    (photos / names[1]).rename(photos / "test")
    found = read_by_datasets(photos)
    assert (len(found.splits["train"]), len(found.splits["test"])) == (8, 4)
    # Classes named Test and Val (folders of images), in no split's folder: held out from one split, as any classes
    classes = tmp_path / "classes"
    for name in ("Test", "Val"):
        shutil.copytree(photos / "training" / "class_0", classes / name)
        (classes / name / ".ipynb_checkpoints").mkdir()  # hidden folders, which datasets skips too
    for name in (".git/objects", ".dvc/cache"):
        (classes / name).mkdir(parents=True)
    found = read_by_datasets(classes)
    assert found.classes == ["Test", "Val"]
    assert len(found.splits["train"]) + len(found.splits["test"]) == 2 * len(list(classes.glob("Val/*.png")))


@pytest.mark.parametrize("names", [("Train", "Test"), ("train", "Test"), ("train-0", "Validation-0")],
                         ids=["Train and Test", "train and Test", "train-0 and Validation-0"])
def test_parquet_files_named_for_a_split_datasets_does_not_know_are_one_line(tmp_path, names):
    """Train.parquet and Test.parquet: datasets knows a split's file by its lowercase name only, so it read both as
    one 'train' split and held out a random 10% of it, the test images trained on (beside train.parquet, it left
    Test.parquet out). Nothing is read from the folder but the check; lowercase names are the splits."""
    from shared.errors import RecipeError

    data, splits = tmp_path / "data", image_splits(sizes={"train": 8, "test": 4})
    data.mkdir()
    for name, split in zip(names, ("train", "test"), strict=True):
        splits[split].to_parquet(str(data / f"{name}.parquet"))
    before = sorted(data.rglob("*"))
    with pytest.raises(RecipeError) as error:
        read_by_datasets(data)
    assert str(error.value) == (
        f"{data}: datasets read its parquet files as one 'train' split, {names[1]}.parquet included: it knows a "
        "split's file only by its lowercase name (train, test, validation, ...: docs/data.md); rename them")
    assert sorted(data.rglob("*")) == before
    for name in names:
        (data / f"{name}.parquet").rename(data / f"{name.lower()}.parquet")
    found = read_by_datasets(data)
    assert sorted(map(len, found.splits.values())) == [4, 8]


def test_a_dataset_saved_alone_is_found_without_decoding_an_image(tmp_path):
    """A Dataset saved alone (not a DatasetDict) iterates as its rows: listed for its splits' names, every image would
    be decoded, and a damaged one end in PIL's traceback before the decoder's one line."""
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    datasets.Dataset.from_dict({"image": [{"bytes": b"not an image", "path": None}] * 20, "label": [0, 1] * 10},
                               features=features).save_to_disk(str(tmp_path / "saved"))
    found = read_by_datasets(tmp_path / "saved")
    assert (len(found.splits["train"]), len(found.splits["test"]), found.classes) == (18, 2, ["a", "b"])


def test_an_image_folder_says_which_files_it_leaves_out_and_refuses_an_archive(tmp_path, capsys):
    """datasets' imagefolder left out every file of no image format it reads, unsaid: an iPhone's .heic photos trained
    on by no one. An archive among the images it read as a folder of its own, at another depth than the class folders:
    every label dropped, and the line said the classes' folders were laid out wrong. A linked class folder it left out
    too."""
    from shared.errors import RecipeError

    photos = imagefolder_dataset(tmp_path / "photos", sizes={"train": 8, "test": 4})
    (photos / "train" / "class_0" / "IMG_0001.HEIC").write_bytes(b"ftypheic")
    (photos / "notes.txt").write_text("where the photos came from")
    (photos / ".DS_Store").write_bytes(b"\0")  # a hidden file: no one's photo
    found = read_by_datasets(photos)
    assert capsys.readouterr().out.splitlines()[0] == (
        f"{photos}: 2 file(s) of no image format read here left out, e.g. notes.txt (photos: convert them to JPEG or "
        "PNG)")
    assert len(found.splits["train"]) == 8
    shutil.make_archive(str(photos / "train" / "more"), "zip", photos / "train" / "class_0")
    with pytest.raises(RecipeError) as error:
        read_by_datasets(photos)
    assert str(error.value) == (f"{photos / 'train' / 'more.zip'} is an archive among the images, which datasets "
                                "would read as a folder of its own: unpack it, or move it out of --data")
    # A class folder that is a link: datasets does not follow it ("doesn't contain any data files", or a class gone)
    (photos / "train" / "more.zip").unlink()
    shutil.move(photos / "train" / "class_0", tmp_path / "elsewhere")
    (photos / "train" / "class_0").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(RecipeError) as error:
        read_by_datasets(photos)
    assert str(error.value) == (f"{photos / 'train' / 'class_0'} is a link to a folder, which datasets does not "
                                "follow: copy the folder there, or move the images into --data")


def test_a_folder_without_images_is_one_line_before_datasets_lists_it(tmp_path, monkeypatch):
    """A home folder given for --data: datasets listed every file below it (290,000 in .cache/, .pyenv/ and the
    like), 4 minutes, before it found no image there. Hidden folders, which datasets skips, are not walked."""
    from shared.data import find_source
    from shared.errors import RecipeError

    home = tmp_path / "home"
    imagefolder_dataset(home / ".cache" / "photos", sizes={"train": 4, "test": 2})
    os.mkfifo(home / ".cache" / "photos" / "x.png")
    (home / "notes.txt").write_text("not an image")
    monkeypatch.setattr(datasets, "load_dataset", None)  # never reached
    with pytest.raises(RecipeError) as error:
        find_source(str(home))
    assert str(error.value) == (f"--data {home} holds no images, parquet files or save_to_disk dataset (nor IDX or "
                                "CIFAR files) outside its hidden folders: pass the dataset's folder (docs/data.md)")


@pytest.mark.parametrize("kind", ["a FIFO", "a broken link"])
def test_an_image_folder_entry_named_as_an_image_that_is_no_regular_file_is_one_line(tmp_path, kind):
    """datasets' imagefolder left out a FIFO (or a link to nothing) named x.png, unsaid: 8 training images of 9."""
    from shared.errors import RecipeError

    photos = imagefolder_dataset(tmp_path / "photos", sizes={"train": 8, "test": 4})
    entry = photos / "train" / "class_0" / "x.png"
    os.mkfifo(entry) if kind == "a FIFO" else entry.symlink_to(tmp_path / "nothing.png")
    with pytest.raises(RecipeError) as error:
        read_by_datasets(photos)
    assert str(error.value) == (f"{str(entry)!r} is not a regular file (a FIFO, socket, device or folder): replace it "
                                "by the image file")
    # Beside parquet tables, which are what datasets reads there, it is no image of the dataset: left alone
    data = parquet_dataset(tmp_path / "tables", sizes={"train": 8, "test": 4})
    os.mkfifo(data / "x.png") if kind == "a FIFO" else (data / "x.png").symlink_to(tmp_path / "nothing.png")
    assert len(read_by_datasets(data).splits["train"]) == 8


def test_a_datasets_cache_that_cannot_be_written_is_named_as_the_cause(tmp_path, monkeypatch):
    """A home that is not writable (a container's, say): datasets cannot make its cache, and the line said the folder
    was no dataset ("expected a save_to_disk folder, parquet files, ...") or that the hub could not provide it."""
    from shared.dataset_files import open_local
    from shared.errors import RecipeError

    photos = imagefolder_dataset(tmp_path / "photos", sizes={"train": 4, "test": 2})
    (tmp_path / "home").write_text("a file where a folder is expected")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "home" / ".cache")
    with pytest.raises(RecipeError) as error:
        open_local(photos, tables=[])
    assert str(error.value) == (f"datasets could not write its cache ({tmp_path / 'home' / '.cache'}: Not a "
                                "directory): set HF_HOME (or HF_DATASETS_CACHE) to a writable folder with room")


@pytest.mark.slow  # what a new process imports
def test_the_decode_cache_sits_beside_datasets_own_cache_without_importing_datasets():
    code = ("import sys; from shared import data; import datasets.config; "
            "assert data.CACHE_DIR.parent == datasets.config.HF_DATASETS_CACHE, data.CACHE_DIR")
    for extra in ({}, {"HF_HOME": "/tmp/hf-home"}, {"HF_DATASETS_CACHE": "/tmp/hf-datasets"}):
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HF_DATASETS_CACHE")} | extra
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True)
    # Reading IDX files or --synthetic needs no datasets (0.6 s of a start): only the hub and datasets' folders do.
    code = "import sys, recipes.cifar_cnn, recipes.predict; assert 'datasets' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_free_memory_stays_within_the_cgroups_limit(tmp_path):
    """A container's or a SLURM job's memory limit, less what its cgroup uses beyond page cache it can drop: in cgroup
    v2, memory.max of its cgroup and of each above it; in v1 (where a limit was not seen: 23 GiB free in a cgroup of
    1 GiB), its memory controller's tree, whose memory.stat gives the lowest limit above, and where a container sees its
    own cgroup at the tree's root, named by the host's path. `own` stands for /proc/self/cgroup."""
    from shared.bounds import free_memory

    own, v2 = tmp_path / "cgroup", tmp_path / "v2"
    own.write_text("0::/slurm/job_1\n")
    for folder, limit in ((v2 / "slurm", "max"), (v2 / "slurm" / "job_1", "1073741824")):
        folder.mkdir(parents=True)
        (folder / "memory.stat").write_text("anon 1\ninactive_file 104857600\n")
        (folder / "memory.current").write_text("629145600\n")
        (folder / "memory.max").write_text(f"{limit}\n")
    assert free_memory(v2, own) == 2**30 - 600 * 2**20 + 100 * 2**20
    (v2 / "slurm" / "job_1" / "memory.max").write_text("max\n")  # none here or above: the system's (over 1 GiB here)
    assert free_memory(v2, own) > 2**30
    (v2 / "slurm" / "memory.max").write_text("943718400\n")  # the job's cgroup within a smaller one above it
    assert free_memory(v2, own) == 900 * 2**20 - 500 * 2**20

    v1 = tmp_path / "v1" / "memory"
    for folder in (v1 / "slurm" / "uid_0" / "job_2", v1):  # SLURM's cgroup v1 plugin; then a container of v1
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "memory.stat").write_text("cache 1\nhierarchical_memory_limit 1073741824\n"
                                            "total_inactive_file 104857600\n")
        (folder / "memory.usage_in_bytes").write_text("629145600\n")
        own.write_text("12:pids:/slurm/uid_0/job_2\n4:memory:/slurm/uid_0/job_2\n2:cpu,cpuacct:/slurm\n"
                       if folder != v1 else "4:memory:/docker/0123abcd\n0::/\n")
        assert free_memory(v1.parent, own) == 2**30 - 500 * 2**20
        (folder / "memory.stat").write_text("hierarchical_memory_limit 9223372036854771712\ntotal_inactive_file 0\n")
        assert free_memory(v1.parent, own) > 2**30  # v1's "no limit"


@pytest.mark.slow  # a process of its own, in a cgroup the kernel limits
def test_free_memory_in_a_cgroup_v1_the_kernel_limits(tmp_path):
    """Where this machine has cgroup v1's memory controller and root may make a cgroup in it: a process in a cgroup
    limited to 1 GiB finds less than 1 GiB free (it found 23 GiB, the machine's)."""
    line = next((line for line in Path("/proc/self/cgroup").read_text().splitlines() if ":memory:" in line), "")
    parent = Path("/sys/fs/cgroup/memory") / line.split(":", 2)[-1].strip("/")
    if not line or not (parent / "cgroup.procs").exists() or not os.access(parent, os.W_OK):
        pytest.skip("no cgroup v1 memory controller here that this process may make a cgroup in")
    group = parent / f"recipes-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(f"{2**30}\n")
        code = "from shared.bounds import free_memory; print(free_memory())"
        result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                preexec_fn=lambda: (group / "cgroup.procs").write_text(f"{os.getpid()}\n"))
        assert result.returncode == 0, result.stderr[-2000:]
        assert 0 < float(result.stdout) < 2**30
    finally:
        group.rmdir()


@pytest.mark.parametrize("layout", ["idx", "cifar"])
def test_published_files_too_large_once_converted_are_refused_before_they_are_read(tmp_path, data_module, monkeypatch,
                                                                                     layout):
    """Both splits converted to the recipe's input must fit in the free memory, and that is checked from the files'
    headers and sizes before a file's pixels are read (it was checked after both splits were read whole)."""
    from shared import bounds, dataset_files, errors

    shape = (1, 28, 28) if layout == "idx" else (3, 32, 32)
    splits = random_splits(shape, sizes=(30, 10))
    folder = (idx_folder(tmp_path / "idx", {k: (a[:, 0], lb) for k, (a, lb) in splits.items()}) if layout == "idx"
              else cifar_folder(tmp_path / "cifar-10-batches-bin", splits, [str(i) for i in range(10)]))
    reads = []
    for name in ("read_idx_splits", "read_cifar_splits"):
        real = getattr(dataset_files, name)
        monkeypatch.setattr(dataset_files, name, lambda *args, real=real: reads.append(args) or real(*args))
    monkeypatch.setattr(bounds, "free_memory", lambda: 2**20)  # the files fit; 40 images at 3x224x224 (6 MB) do not
    with pytest.raises(errors.RecipeError, match=r"40 images of 3x224x224 take 0.0 GiB decoded, more than the 0.0 GiB"):
        data_module.load_image_data(str(folder), (3, 224, 224))
    assert not reads
    monkeypatch.setattr(bounds, "free_memory", lambda: 2**30)
    train, test = data_module.load_image_data(str(folder), (3, 224, 224))
    assert (len(train), len(test)) == (30, 10) and len(reads) == 1
