"""Files from anywhere: what one may claim, checked before anything is allocated (the free memory, what this process
may still allocate; a dataset file's size, a dataset's decoded size, a parquet file's decompressed size), a walk of a
folder tree that no depth breaks, and a write that neither a crash nor a link breaks (`replacing`). The limits are
listed in docs/troubleshooting.md."""

import contextlib
import math
import os
import resource
from collections.abc import Iterator
from pathlib import Path

import psutil

from shared.errors import RecipeError, first_line

MAX_FILE_BYTES = 4 * 2**30  # one dataset file: 4 GiB (the real MNIST family's largest is under 1 GiB)
MAX_PARQUET_RATIO = 100  # what a parquet file may inflate to, times its size (a bomb: 70,000 times)


def free_memory(cgroups: Path = Path("/sys/fs/cgroup")) -> float:
    """Bytes this process may still allocate: the memory the system has available (page cache counts as free, as in
    `free`), within the limit of its cgroup and of every cgroup above it (cgroup v2: a container's or a SLURM job's
    memory limit), and within its address-space limit (`ulimit -v`). psutil (accelerate's) reads the system's figures
    (on Linux, MemAvailable in /proc/meminfo) and this process's address space, on macOS too."""
    room = [psutil.virtual_memory().available]
    with contextlib.suppress(OSError, ValueError, StopIteration):
        lines = Path("/proc/self/cgroup").read_text().splitlines()
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


def walk(folder: Path, skip: Path | None = None) -> Iterator[os.DirEntry]:
    """Every entry below `folder` that is not a folder (files, links, FIFOs, ...), links not followed, and nothing below
    `skip`. Not recursive: rglob and os.walk recurse in Python 3.11, and a tree 1,500 folders deep ended in a
    RecursionError."""
    folders = [Path(folder)]
    while folders:
        try:
            entries = os.scandir(folders.pop())
        except OSError as error:  # a tree deeper than the system's path limit (4,096 bytes), a folder you may not read
            raise RecipeError(f"cannot list the folders under {folder} ({error.strerror}): move the files nearer the "
                              "root, or make their folders readable") from None
        with entries:
            for entry in entries:
                if not entry.is_dir(follow_symlinks=False):
                    yield entry
                elif Path(entry.path) != skip:
                    folders.append(Path(entry.path))


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """Write `path` under a temporary name beside it (what this yields), renamed over it when complete: a reader, a
    run killed while writing, and another name of the file (a hard link from elsewhere) see the old file or the new
    one, never half of one, and the file is never changed in place. A link left at the temporary name is removed,
    never written through."""
    partial = path.with_name(f"{path.name}.tmp{os.getpid()}")
    partial.unlink(missing_ok=True)
    try:
        yield partial
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)  # after a failed write: a full disk, pieces read from a damaged file


def check_size(path: Path, size: int, times: int = 1) -> None:
    """Refuse a file whose header claims more bytes than MAX_FILE_BYTES, or than this machine's free memory holds
    `times` over."""
    free = free_memory()
    if size > min(MAX_FILE_BYTES, free / times):
        raise RecipeError(f"{path} claims {size:,} bytes of data, over the {MAX_FILE_BYTES / 2**30:.0f} GiB a dataset "
                          f"file may hold here (or the {free / 2**30:.1f} GiB of free memory"
                          f"{f' {times} times over' if times > 1 else ''}): a damaged or hostile file; download it "
                          "again")


def check_decoded_size(source: str, count: int, image_shape: tuple[int, int, int]) -> None:
    """Every pixel of both splits is held at once, converted to `image_shape` (150 KB a 224-px photo: 15 GB for
    100,000): refuse more than the free memory before a byte is decoded or converted."""
    need, free = count * math.prod(image_shape), free_memory()
    if need > free:
        raise RecipeError(f"{source}: {count:,} images of {'x'.join(map(str, image_shape))} take "
                          f"{need / 2**30:.1f} GiB decoded, more than the {free / 2**30:.1f} GiB of free memory: use "
                          "smaller images (finetune.py: --image_size) or fewer, or a machine with more memory")


def check_parquet_files(folder: Path) -> None:
    """A parquet file's footer says how large its columns are once decompressed: a 52 KB file of compressed zeros
    reached 3.6 GB. Refuse a file that claims more than MAX_PARQUET_RATIO times its size (images inside are compressed
    already; raw pixel columns shrink a few times) or than the free memory, before a page is read."""
    import pyarrow.parquet as pq

    for file in sorted(Path(entry.path) for entry in walk(folder) if entry.name.endswith(".parquet")):
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
