"""--synthetic: a learnable stand-in with the real data's shapes and classes, generated, never a fallback. An opt-in
module, imported by shared/data.py's load_image_data for --synthetic runs only."""

from pathlib import Path

import torch
import torch.nn.functional as F

from shared import data  # data.CACHE_DIR: read at each call, as data.py reads it
from shared.data import ImageTensors, read_cache, write_cache
from shared.errors import RecipeError


def make_synthetic(image_shape, train_size: int, test_size: int, num_classes: int = 10,
                   source: str = "") -> tuple[ImageTensors, ImageTensors]:
    """Learnable stand-in: a smooth pattern per class at low contrast, over a distractor pattern that carries no
    class, under pixel noise; a small CNN climbs from chance to about 75% in a few hundred steps. A fixed seed:
    every run and process sees the same images, whatever --seed is. Refused where the run's --data (`source`) is
    found on this machine: the README's first run given your folder would train on generated images all the same."""
    if source and Path(source).expanduser().exists():
        raise RecipeError(f"--synthetic generates its images, so --data {source}, found on this machine, would be "
                          "left unused: leave out --synthetic to train on it (a --synthetic run's resume: leave out "
                          "--data, it continues on generated images)")
    channels, height, width = image_shape
    name = f"synthetic-v1-{channels}x{height}x{width}-{train_size}-{test_size}-{num_classes}.safetensors"
    cache = data.CACHE_DIR / name
    if cached := read_cache(cache, "synthetic "):
        return cached
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
    write_cache(cache, tensors, classes, source="synthetic")
    return tuple(ImageTensors(*tensors[split], classes, f"synthetic {split}") for split in ("train", "test"))
