"""Pickles from anywhere, checked before anything unpickles them: a CIFAR batch in Python's format
(shared/dataset_files.py) and a file for torch.load (a checkpoint's .pkl, .bin or .pt; a .pt for predict.py;
torchvision's cached weights). An opt-in module: imported where such a file is read. The limits are listed in
docs/troubleshooting.md."""

import io
import mmap
import pickle
import pickletools
import re
import struct
import warnings
import zipfile
from pathlib import Path

import torch

from shared.errors import RecipeError, first_line

MAX_PICKLE_OPS = 2_000_000  # operations in a pickle: CIFAR-100's train file has about 300,000
MAX_PICKLE_LONGS = 4_096  # integers past 32 bits in a pickle: a checkpoint's Python RNG state holds 625, CIFAR's none
MAX_PICKLE_TUPLES = 50_000  # tuples and frozensets: a state dict has about 4 a tensor (ResNet-50's 1,174)
# A torch.save file's data.pkl: names, shapes and dtypes, 80-230 bytes a tensor (maxvit_t's: 133 KB for 582), and a
# few KB of Python values (a checkpoint's RNG states: 8 KB). Much more is not what torch.save writes of a state.
MAX_PICKLE_BYTES, MAX_PICKLE_BYTES_PER_TENSOR = 2**16, 2**10
# Its records: a tensor each, and 6 more (ResNet-50's state dict: 326; Adam's state of 1,000 parameters: 3,006).
# Parsed here as Python objects, a million empty ones took 0.7 GB and 10 s more than torch.load itself.
MAX_RECORDS = 100_000


def check_pickle(raw: bytes | mmap.mmap) -> None:
    """Before an unpickler runs `raw` (a CIFAR pickle, a torch.save file's data.pkl; of a file's map, its next
    pickle): each length it claims checked against the bytes that follow (genops: the C unpickler allocates first); at
    most MAX_PICKLE_OPS operations, counted as they come, and memo indexes below that (the C unpickler grows its memo
    to twice the index: 4.6 GB at 2^28); at most MAX_PICKLE_LONGS integers past 32 bits, the only dict keys or set
    items whose hashes can be made to collide (a dict of 100,000 of them took minutes to build); at most
    MAX_PICKLE_TUPLES tuples and frozensets, so that none is nested deep enough to crash the interpreter when it is
    hashed as a key (200,000 deep did, here)."""
    longs = tuples = 0
    for count, (opcode, arg, _) in enumerate(pickletools.genops(raw), start=1):
        memo = arg if opcode.name in ("PUT", "BINPUT", "LONG_BINPUT") else 0
        longs += type(arg) is int and abs(arg) >= 2**31
        tuples += opcode.name.startswith("TUPLE") or opcode.name == "FROZENSET"
        if count > MAX_PICKLE_OPS or memo > MAX_PICKLE_OPS:
            raise pickle.UnpicklingError(f"more than {MAX_PICKLE_OPS:,} pickle operations or memo entries")
        if longs > MAX_PICKLE_LONGS:
            raise pickle.UnpicklingError(f"more than {MAX_PICKLE_LONGS:,} integers past 32 bits")
        if tuples > MAX_PICKLE_TUPLES:
            raise pickle.UnpicklingError(f"more than {MAX_PICKLE_TUPLES:,} tuples")


def load_pickled(path: Path, flag: str):
    """torch.load of a file from anywhere (predict.py's .pt/.pth, given as `flag`), checked first as torch.load reads
    it (check_archive: bounded by the file's size, its pickles checked), then with weights_only=True: tensors and
    plain containers only; a pickle that would run code is refused, in one line that says how to convert it."""
    check_archive(path)
    try:
        with warnings.catch_warnings():  # torch's note on a protocol-4 pickle, before the refusal below
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, "cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"GLOBAL (\S+)", str(error))
        raise RecipeError(
            f"{flag} {path} holds pickled Python objects ({found.group(1) if found else 'not only tensors'}), "
            "and loading it could run code: refused. Where the file was made and is trusted, convert it with "
            "`model = torch.load(path, weights_only=False)` then `torch.save(model.state_dict(), 'weights.pt')`"
        ) from None


def check_archive(path: Path, fix: str = "pass the file torch.save wrote") -> None:
    """Before torch.load, what it would allocate and unpickle, bounded, as torch.load itself reads the file: through
    torch's zip reader where the file starts as a zip does, else as torch's format before 1.6 (torchvision's oldest
    downloads: five pickles, then the tensors' bytes). The entries' sizes are read from the central directory
    torch's reader read (`DirectoryReads`), not from another reader's: an archive with two central directories
    reads as two archives to two readers. torch.save stores its entries uncompressed, so together they claim fewer
    bytes than the file holds; more could only inflate, to any size. Each pickle is checked as a CIFAR pickle is
    (check_pickle), and data.pkl holds a few hundred bytes a tensor, not more."""
    if not path.is_file():  # a FIFO would block the first read
        raise RecipeError(f"{str(path)!r} is not a regular file (a FIFO, socket, device or folder): delete it")
    try:
        with DirectoryReads(path) as file:
            if file.read(4) != b"PK\x03\x04":  # how torch.load tells the two formats apart
                # Through a map of the file: a length a pickle claims reads no more than the file holds (a
                # file's read(n) allocates n first: 6 GiB for a claim in a 1 KB file)
                with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as pickles:
                    for _ in range(5):  # magic number, protocol, system info, the object, its storages' keys
                        if pickles.tell() < len(pickles):  # fewer: no torch.save file, as torch.load says
                            check_pickle(pickles)
                return
            file.seek(0)
            archive = torch._C.PyTorchFileReader(file)  # torch.load's own reader (private: no public one)
            sizes = file.entry_sizes(archive)
            claimed = sum(sizes.values())
            if claimed > path.stat().st_size:
                raise RecipeError(f"{str(path)!r} holds entries of {claimed:,} bytes in {path.stat().st_size:,}: "
                                  "compressed or overlapping entries, which torch.save never writes: they could "
                                  f"inflate to any size, so it is not loaded; {fix}")
            tensors = sum(name.startswith("data/") for name in sizes)
            if sizes.get("data.pkl", 0) > MAX_PICKLE_BYTES + tensors * MAX_PICKLE_BYTES_PER_TENSOR:
                raise pickle.UnpicklingError(f"a data.pkl of more than {MAX_PICKLE_BYTES_PER_TENSOR:,} bytes for "
                                             f"each of its {tensors:,} tensors")
            check_pickle(archive.get_record("data.pkl"))
    except (RuntimeError, OSError, ValueError, MemoryError, pickle.UnpicklingError) as error:
        reason = "not an archive torch.save wrote" if isinstance(error, RuntimeError) else first_line(error)[:100]
        raise RecipeError(f"{str(path)!r} is damaged or holds a pickle that is refused ({reason}): {fix}") from None


class DirectoryReads(io.FileIO):
    """A file that torch's zip reader reads through, keeping each read that starts as a zip's central directory does:
    the reader (miniz, in every torch) reads the directory it then uses in one read, when it opens the archive. Its
    record sizes are otherwise not public (torch 2.12 added PyTorchFileReader.get_record_size; 2.11 lacks it)."""

    def __init__(self, path: Path):
        super().__init__(path, "rb")
        self.directories = []

    def readinto(self, buffer) -> int:  # how torch's reader reads a Python file object
        count = super().readinto(buffer)
        if bytes(buffer[:4]) == b"PK\x01\x02":
            self.directories.append(bytes(buffer[:count]))
        return count

    def entry_sizes(self, archive) -> dict[str, int]:
        """Each record's uncompressed size (what torch.load allocates for it), from the central directory the reader
        read: a read here whose names and local header offsets are the reader's (of several such, the largest size
        any claims). Parsed by Python's zipfile behind an end record that says where it is, so that zip64's sizes are
        read as miniz reads them. None: a RuntimeError, as torch's reader says that a file is not its archive."""
        records, sizes = archive.get_all_records(), {}
        if len(records) > MAX_RECORDS:
            raise pickle.UnpicklingError(f"{len(records):,} records, more than the {MAX_RECORDS:,} a file of weights "
                                         "or a checkpoint may hold here")
        for directory in self.directories:
            end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0, 0, len(directory), 0, 0)
            try:
                with zipfile.ZipFile(io.BytesIO(directory + end)) as zipped:
                    entries = zipped.infolist()
            except (zipfile.BadZipFile, ValueError, struct.error, EOFError):  # not a whole directory
                continue
            named = {entry.filename.split("/", 1)[-1]: entry for entry in entries}
            if len(named) == len(entries) == len(records) and all(
                    name in named and named[name].header_offset == archive.get_record_header_offset(name)
                    for name in records):
                sizes = {name: max(sizes.get(name, 0), entry.file_size) for name, entry in named.items()}
        if not sizes:
            raise RuntimeError("no central directory of the reader's records was read")
        return sizes
