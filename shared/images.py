"""Images into the recipes' tensors: one file decoded (`decode`, bounded by PIL's pixel limit) into the recipe's
channels, an image or a batch fitted to its size (`fit`: torchvision's resize and centre crop); `conversion` says what
was converted."""

import io
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from shared.errors import RecipeError, first_line

WIDE_MODES = {"I", "I;16", "I;16B", "I;16L", "I;16N", "F"}  # 16/32-bit and float pixels
# The formats decode reads, each decoded by PIL itself. Not EPS: PIL hands it to Ghostscript, a PostScript interpreter,
# so an image file would run a program (an endless loop in one hung a run, another wrote into /tmp); PIL knows an image
# by its bytes, whatever its name. Nor PIL's rarer formats: decoders that few files ever reach.
FORMATS = ("BMP", "GIF", "JPEG", "PNG", "PPM", "TIFF", "WEBP")


def decode(file: bytes | str | Path, channels: int, where: str):
    """One image file (its bytes or a local path) -> uint8 (channels, h, w) at its own size, converted as datasets'
    Image(mode=...) converts (EXIF orientation, then L or RGB), and its own channel count (1 for grayscale). A damaged
    file, one of another format than FORMATS, one over PIL's pixel limit (read from its header, before decoding),
    16-bit pixels: one line naming `where`."""
    from shared.image_files import check_file, check_jpeg, check_png  # checks of files from anywhere: an opt-in module

    check_file(file, where)
    try:
        check_png(file)  # before PIL reads a chunk
        check_jpeg(file)
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)  # over PIL's limit: refused, not warned
            image = Image.open(io.BytesIO(file) if isinstance(file, bytes) else file, formats=FORMATS)
        with image:
            if image.mode in WIDE_MODES:
                raise RecipeError(f"{where} has {image.mode} pixels (16-bit, 32-bit or float), which 8 bits cannot "
                                  "hold without clipping or guessing a range: scale the images to 8-bit L or RGB")
            own = 1 if image.mode in ("1", "L", "LA") else 3
            image.load()
            if image.getexif().get(ExifTags.Base.Orientation) is not None:
                image = ImageOps.exif_transpose(image)
            # A grayscale image stays one channel here, and becomes three below as a view: the same values as
            # PIL's L -> RGB, without PIL's 4 bytes a pixel (a 9,400 px scan: 350 MB); an image already in the mode
            # asked for is not copied by a convert (another 350 MB)
            target = "L" if channels == 1 or own == 1 else "RGB"
            pixels = np.array(image if image.mode == target else image.convert(target))
    except (Image.DecompressionBombWarning, Image.DecompressionBombError):
        raise RecipeError(f"{where} has more than {Image.MAX_IMAGE_PIXELS:,} pixels, PIL's limit against "
                          "decompression bombs: remove it, or shrink it first") from None
    except UnidentifiedImageError:
        raise RecipeError(f"{where} is not a readable image of a format read here ({', '.join(FORMATS)}): convert "
                          "it, or remove it") from None
    except (OSError, ValueError, SyntaxError, MemoryError) as error:
        raise RecipeError(f"{where} is not a readable image ({type(error).__name__}: {first_line(error)[:120]}): "
                          "remove it or replace it") from None
    return torch.from_numpy(pixels).reshape(*pixels.shape[:2], -1).permute(2, 0, 1).expand(channels, -1, -1), own


def conversion(image_shape: tuple[int, int, int], seen: dict) -> str:
    """What was converted, from what the images were (`seen`: their channel counts and sizes), in a line; empty if
    nothing."""
    changes = []
    if seen["channels"] - {image_shape[0]}:
        changes.append("grayscale -> colour" if image_shape[0] == 3 else "colour -> grayscale")
    if seen["sizes"] - {tuple(image_shape[1:])}:
        heights, widths = {h for h, _ in seen["sizes"]}, {w for _, w in seen["sizes"]}
        found = (f"{max(widths)}x{max(heights)}" if len(seen["sizes"]) == 1 else f"{len(seen['sizes'])} sizes, "
                 f"{min(widths)}-{max(widths)} px wide and {min(heights)}-{max(heights)} px high")
        changes.append(f"{found} -> {image_shape[2]}x{image_shape[1]} (shorter side resized with antialiasing, then "
                       "centre-cropped)")
    return "; ".join(changes)


def fit(image: torch.Tensor, height: int, width: int, where: str = "images", interpolation: str = "bilinear"
        ) -> torch.Tensor:
    """uint8 (C, h, w), or a batch (N, C, h, w) -> (..., C, height, width): torchvision's resize of the shorter side
    (bilinear, or as pretrained weights were resized: bicubic for the EfficientNets', with antialiasing) and centre
    crop, bounded by the free memory first."""
    h, w = image.shape[-2:]
    if (h, w) == (height, width):
        return image
    size = max(height, width)  # the shorter side's new length; the longer keeps the aspect ratio
    new_h, new_w = (int(size * h / w), size) if w <= h else (size, int(size * w / h))
    need = image.numel() // (h * w) * new_h * new_w  # the resized images before the crop: a 1 x 10^8 image, 10 GB
    if need > 2**28:
        from shared.bounds import check_resize  # the memory a large resize needs: an opt-in module

        check_resize(need, where, (w, h), (new_w, new_h))
    from torchvision.transforms import InterpolationMode  # here: 2 s of a start, paid only by a decode that resizes
    from torchvision.transforms.v2 import functional

    resized = functional.resize(image, [new_h, new_w], InterpolationMode(interpolation), antialias=True)
    return functional.center_crop(resized, [height, width])
