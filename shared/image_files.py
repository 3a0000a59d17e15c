"""An image file from anywhere, checked before PIL opens it (a regular file, a PNG as its specification reads it, a
JPEG's count of scans): an opt-in module, imported by shared/images.py's decode for the runs that decode image files."""

import io
import struct
import zlib
from pathlib import Path

from PIL import Image

from shared.errors import RecipeError

MAX_PNG_CHUNKS = 100_000  # libpng writes its pixels in chunks of 8 KiB: 800 MB; real files have a few dozen others
# A progressive JPEG is decoded scan by scan, each over the whole image: 10,000 scans of a few bytes each (164 KB) took
# 13.6 s to decode at 2,000 x 2,000 pixels, 1,000 took 22 s at 8,000 x 8,000 (PIL 13). libjpeg writes 1 scan, or 10 when
# progressive (6 in grayscale). NVIDIA's nvImageCodec refuses more than 256 (NVIMGCODEC_MAX_JPEG_SCANS), for this.
MAX_JPEG_SCANS = 256


def check_file(file: bytes | str | Path, where: str) -> None:
    """A path to read must be a regular file on this machine: a FIFO would block the read for ever (bytes pass)."""
    if not isinstance(file, bytes) and not Path(file).is_file():
        if Path(file).exists():
            raise RecipeError(f"{where} is not a regular file (a FIFO, socket, device or folder): replace it by the "
                              "image file")
        raise RecipeError(f"{where}: no such image file on this machine (datasets' paths are read, never fetched)")


def check_png(file: bytes | str | Path) -> None:
    """A PNG, checked before PIL opens it, as the PNG specification reads it (other formats: nothing). IHDR first and
    only once (PIL took a chunk before it, and the last of several); at most MAX_PNG_CHUNKS chunks (PIL keeps every
    private one in memory: 16 million empty ones took 2.4 GB); PIL's pixel limit; and IDAT, inflated, must make every
    row, each pass's if interlaced (PIL leaves the rows they lack black: one row of a 9,400 x 9,400 image decoded
    without an error). Reads the chunks' headers up to IEND, the pixels a piece at a time up to the last row."""
    with io.BytesIO(file) if isinstance(file, bytes) else open(file, "rb") as f:
        if f.read(8) != b"\x89PNG\r\n\x1a\n":
            return
        size, kind, width, height, depth, colour, _, _, interlaced = struct.unpack(">I4sIIBBBBB",
                                                                                   f.read(21).ljust(21, b"\0"))
        if (size, kind) != (13, b"IHDR"):
            raise ValueError("its first chunk is not IHDR, as the PNG specification requires")
        if width * height > Image.MAX_IMAGE_PIXELS:
            raise Image.DecompressionBombError(f"{width}x{height} pixels")
        bits = depth * {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}.get(colour, 0)
        adam7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
        expected = sum(rows * (1 + (cols * bits + 7) // 8) for x, y, dx, dy in (adam7 if interlaced else [(0, 0, 1, 1)])
                       if (rows := -(-(height - y) // dy)) > 0 and (cols := -(-(width - x) // dx)) > 0)
        inflate, made = zlib.decompressobj(), 0
        f.seek(33)  # the chunks after IHDR and its CRC
        for _ in range(MAX_PNG_CHUNKS):
            header = f.read(8)
            left, kind = struct.unpack(">I4s", header) if len(header) == 8 else (0, b"IEND")  # the file's end
            if kind in (b"IHDR", b"IEND"):
                break
            while kind == b"IDAT" and left and made < expected and (piece := f.read(min(left, 2**12))):
                try:
                    made += len(inflate.decompress(piece, expected - made))  # at most 1,032 times a piece: 4 MB
                except zlib.error as error:  # neither an OSError nor a ValueError: the caller's one line needs one
                    raise ValueError(f"its compressed pixels are damaged ({error})") from None
                left -= len(piece)
            f.seek(left + 4, 1)  # the rest of the chunk, then its CRC
        else:
            raise ValueError(f"it has more than {MAX_PNG_CHUNKS:,} chunks")
    if kind == b"IHDR":
        raise ValueError("it has a second IHDR chunk")
    if made < expected:
        raise ValueError("image file is truncated: its compressed pixels end before its last row")


def check_jpeg(file: bytes | str | Path) -> None:
    """A JPEG of at most MAX_JPEG_SCANS scans (other formats: nothing), read a piece at a time. Counted as its start of
    scan markers (FF DA), which compressed data cannot hold (an FF there is followed by 00 or a restart marker): an
    embedded thumbnail's few scans count too."""
    scans, last = 0, b""
    with io.BytesIO(file) if isinstance(file, bytes) else open(file, "rb") as f:
        if f.read(2) != b"\xff\xd8":
            return
        while piece := f.read(2**20):
            scans += (last + piece).count(b"\xff\xda")  # the piece before's last byte: a marker across the two
            last = piece[-1:]
            if scans > MAX_JPEG_SCANS:
                raise ValueError(f"it has more than {MAX_JPEG_SCANS} scans, each decoded over the whole image (libjpeg "
                                 "writes at most 10)")
