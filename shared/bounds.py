"""Data from anywhere, checked where it is read, and what reading it may take: the memory this process may still
allocate (`free_memory`) and a dataset's images, decoded and converted, checked against it before a byte is decoded
(`check_decoded_size`); a dataset's classes and labels (`check_class_count`, `check_labels`); datasets' cache and the
decode cache, which must be writable (`check_cache_error`, `cache_write_failed`), and a hub that could not provide a
dataset (`hub_failed`); a walk of a folder tree from anywhere that no depth breaks (`walk`); and the input size
finetune.py's model takes (`check_image_size`). An opt-in module, imported where images are decoded or their labels
checked (shared/data.py), where a resize would take more than 256 MiB (shared/images.py), by shared/dataset_files.py
for the files it reads, where datasets failed to load or the cache to be written, where a folder from anywhere is
walked (shared/resume.py, predict.py), and where finetune.py is given --image_size. The limits:
docs/troubleshooting.md."""

import contextlib
import math
import os
import resource
from collections.abc import Iterator
from pathlib import Path

import psutil

from shared.errors import RecipeError, first_line

MAX_CLASSES = 100_000  # a label column's classes: ImageNet-21k's 21,841 fit, a label of 2^40 does not


def free_memory(cgroups: Path = Path("/sys/fs/cgroup"), own: Path = Path("/proc/self/cgroup")) -> float:
    """Bytes this process may still allocate: the memory the system has available (page cache counts as free, as in
    `free`), within the limit of its cgroup and of every cgroup above it (a container's or a SLURM job's memory limit,
    in cgroup v2 or v1), and within its address-space limit (`ulimit -v`). psutil (accelerate's) reads the system's
    figures (on Linux, MemAvailable in /proc/meminfo) and this process's address space, on macOS too. `own`: this
    process's cgroups, a line each (hierarchy:controllers:path)."""
    room = [psutil.virtual_memory().available]
    with contextlib.suppress(OSError, ValueError, StopIteration):
        lines = own.read_text().splitlines()
        # cgroup v1 (kernels and SLURM set up before v2): the memory controller's own tree, where memory.stat's
        # hierarchical_memory_limit is the lowest limit of the cgroup and of those above it. A container of v1 sees
        # its own cgroup at the tree's root, named by the host's path
        with contextlib.suppress(OSError, ValueError, StopIteration, KeyError):
            path = next(line.split(":", 2)[2] for line in lines if ":memory:" in line)
            folder = cgroups / "memory" / path.strip("/")
            folder = folder if folder.is_dir() else cgroups / "memory"
            stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines())
            used = int((folder / "memory.usage_in_bytes").read_text()) - int(stat["total_inactive_file"])
            room.append(int(stat["hierarchical_memory_limit"]) - used)
        group = cgroups / next(line[3:] for line in lines if line.startswith("0::")).strip("/")
        for folder in [group, *group.parents[:len(group.relative_to(cgroups).parts)]]:
            with contextlib.suppress(OSError, ValueError, KeyError):  # "max": no limit in this cgroup
                stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines())
                used = int((folder / "memory.current").read_text()) - int(stat["inactive_file"])
                room.append(int((folder / "memory.max").read_text()) - used)
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY:
        room.append(limit - psutil.Process().memory_info().vms)
    return max(min(room), 0)


def check_decoded_size(source: str, count: int, image_shape: tuple[int, int, int]) -> None:
    """Every pixel of both splits is held at once, converted to `image_shape` (150 KB a 224-px photo: 15 GB for
    100,000): refuse more than the free memory before a byte is decoded or converted."""
    need, free = count * math.prod(image_shape), free_memory()
    if need > free:
        raise RecipeError(f"{source}: {count:,} images of {'x'.join(map(str, image_shape))} take "
                          f"{need / 2**30:.1f} GiB decoded, more than the {free / 2**30:.1f} GiB of free memory: use "
                          "smaller images (finetune.py: --image_size) or fewer, or a machine with more memory")


def check_cache_error(error: Exception, data: Path) -> None:
    """A file datasets could not make outside --data (its cache, under HF_HOME: a home that is read-only, full, or
    not a folder) is the cause named, not the data's format or the hub."""
    made = error.filename if isinstance(error, OSError) else None
    if isinstance(made, str) and not Path(made).absolute().is_relative_to(data.absolute()):
        raise RecipeError(f"datasets could not write its cache ({made}: {error.strerror}): set HF_HOME (or "
                          "HF_DATASETS_CACHE) to a writable folder with room") from None


def check_resize(need: int, where: str, size: tuple[int, int], resized: tuple[int, int]) -> None:
    """Images of `size` (w, h) resized to `resized` before the centre crop: `need` bytes, within the free memory."""
    if need > free_memory():
        raise RecipeError(f"{where}: images of {size[0]}x{size[1]} pixels, resized to {resized[0]}x{resized[1]} before "
                          f"the centre crop, take {need / 2**30:.1f} GiB, more than the free memory: crop them nearer "
                          "to a square first")


def hub_failed(error: Exception, source: str) -> RecipeError:
    """What stopped datasets' load of --data `source`: its cache (check_cache_error), else the hub."""
    check_cache_error(error, Path(source))
    return RecipeError(f"--data {source}: not a local folder, and the Hugging Face hub could not provide it "
                       f"({type(error).__name__}: {first_line(error)}): pass --data PATH of a local copy "
                       "(save_to_disk, parquet, imagefolder, IDX or CIFAR files), or --synthetic for an offline run")


def cache_write_failed(error: Exception, path: Path) -> RecipeError:
    """The decode cache `path` could not be written (HF_HOME a file, a full disk)."""
    reason = error.strerror if isinstance(error, OSError) else first_line(error)[:100]
    return RecipeError(f"cannot write the decoded images to {path.parent} ({reason}): set HF_HOME (or "
                       "HF_DATASETS_CACHE) to a writable folder with room")


def check_class_count(count: int, labels: set, source: str, column: str) -> None:
    """A dataset's `count` classes, from its label `column` (`labels`: the training split's), checked before a name is
    made for each: integer labels number them from 0, and one label of 2^40 asked for a 4 GB list."""
    if count < 1:
        raise RecipeError(f"{source}: its '{column}' column holds no label of 0 or more (e.g. "
                          f"{min(labels, default='none')}): number the classes from 0")
    if count > MAX_CLASSES:
        raise RecipeError(f"{source}: its '{column}' column makes {count:,} classes, over the {MAX_CLASSES:,} a "
                          "recipe trains: fix the labels (they number the classes from 0)")


def check_labels(found, stored: dict) -> None:
    """Each split's labels (`stored`: split -> (images, labels)), each one of the classes `found` (shared/data.py's
    Source) names."""
    classes = found.classes
    fix = "download the files again" if found.files else f"fix the '{found.columns[1]}' column or its names"
    for split, (_, labels) in stored.items():
        if len(bad := labels[(labels < 0) | (labels >= len(classes))]):
            raise RecipeError(f"{found.name} '{split}' has labels outside 0..{len(classes) - 1} (e.g. "
                              f"{bad[0].item()}) for its {len(classes)} classes: {fix}")


def check_image_size(size: int, model: str, weights: str, chosen) -> None:
    """finetune.py's --image_size `size`, for torchvision's `model` with its `weights` (a name, or none; `chosen`: the
    WeightsEnum, with none the architecture's DEFAULT): at least the smallest input the architecture takes (its
    weights' min_size: 63 px for alexnet) and 32, at most 4,096. MaxViT's partitions fit one input size, and so do a
    pretrained ViT's position embeddings: the weights' own. A new ViT's (--weights none) are made for its size
    (finetune.py's make_model), so the weights' smallest (224 px) is not its own. A ViT's input is a whole number of
    its patches (vit_b_16: of 16 px)."""
    vit = model.startswith("vit_")
    smallest = 32 if vit and weights == "none" else max(32, chosen.meta["min_size"][0])
    one_size = model.startswith("maxvit") or vit and weights != "none"
    # At most 4,096 px: torchvision's largest weights take 518, a float32 image of 4,096 px is 200 MB, and 10^9 px
    # overflowed torch's size arithmetic in the resize (a traceback)
    if not smallest <= size <= 4096 or one_size and size != smallest:
        raise ValueError(f"--image_size must be {smallest if one_size else f'{smallest} to 4,096'} for {model} "
                         f"({weights} weights), got {size}")
    patch = int(model.rsplit("_", 1)[1]) if vit else 1
    if size % patch:
        raise ValueError(f"--image_size must be a multiple of {model}'s {patch}-px patches, got {size}")


def walk(folder: Path, skip: Path | None = None, hidden: bool = True) -> Iterator[os.DirEntry]:
    """Every entry below `folder` that is not a folder (files, links, FIFOs, ...), links not followed, and nothing below
    `skip` (nor below a hidden folder, such as .git/, with `hidden` False). Not recursive: rglob and os.walk recurse in
    Python 3.11, and a tree 1,500 folders deep ended in a RecursionError."""
    folders = [folder]
    while folders:
        try:
            entries = os.scandir(folders.pop())
        except OSError as error:  # a tree deeper than the system's path limit (4,096 bytes), a folder you may not read,
            # a file given for a folder (--checkpoint_dir)
            raise RecipeError(f"cannot list the folders under {folder} ({error.strerror}): it must be a folder, its "
                              "folders readable and its paths under 4,096 bytes (move the files nearer the root)"
                              ) from None
        with entries:
            for entry in entries:
                if not entry.is_dir(follow_symlinks=False):
                    yield entry
                elif Path(entry.path) != skip and (hidden or not entry.name.startswith(".")):
                    folders.append(entry.path)
