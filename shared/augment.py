"""Whole-batch preprocessing on the device: a few tensor ops per batch (N, C, H, W), one random draw per
image, instead of torchvision's per-image transforms in a Python loop on the CPU. Crop and flip move the uint8
pixels before `normalize` makes them floats: a quarter of float32's bytes, and half the time for a CIFAR batch of
128 on a 2-core CPU (benchmarks/BENCHMARKS.md, "On a CPU")."""

import functools
import math

import torch


def normalize(images: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """uint8 pixels -> float32 (x / 255 - mean) / std, per channel."""
    if len(mean) != images.shape[1] or len(std) != images.shape[1]:  # broadcasting would silently add channels
        raise ValueError(f"{len(mean)} means and stds for images of {images.shape[1]} channel(s): give one per channel")
    mean_t, std_t = _channel_stats(mean, std, images.device)
    return images.float().div_(255).sub_(mean_t).div_(std_t)  # in place on the new float tensor: no temporaries


@functools.cache
def _channel_stats(mean, std, device):  # once per device: a host-to-GPU copy in every step would stall the GPU
    return torch.tensor(mean, device=device).view(1, -1, 1, 1), torch.tensor(std, device=device).view(1, -1, 1, 1)


@functools.cache
def fill_colour(fill: tuple[int, ...], channels: int, device) -> torch.Tensor:
    """`fill` (one value, or one per channel) as a uint8 (1, C, 1, 1) tensor on the device, made once: each fill is
    then one operation on every channel, not one per channel."""
    colour = [fill[channel % len(fill)] for channel in range(channels)]
    return torch.tensor(colour, dtype=torch.uint8, device=device).view(1, -1, 1, 1)


def random_crop(images: torch.Tensor, padding: int, fill: tuple[int, ...] = (0,)) -> torch.Tensor:
    """Pad each side with `padding` pixels of colour `fill` (one value, or one per channel), then cut each image at
    its own random offset."""
    n, c, h, w = images.shape
    padded = fill_colour(tuple(fill), c, images.device).expand(n, c, h + 2 * padding, w + 2 * padding).clone()
    padded[:, :, padding:padding + h, padding:padding + w] = images
    # Every possible crop as a view (n, c, 2p+1, 2p+1, h, w), no copy; one gather then picks each image's crop (4x
    # faster on a CPU than indexing every pixel).
    crops = padded.unfold(2, h, 1).unfold(3, w, 1)
    dy, dx = torch.randint(0, 2 * padding + 1, (2, n), device=images.device)  # one draw: one kernel, not two
    return crops[torch.arange(n, device=images.device), :, dy, dx]


def random_flip(images: torch.Tensor) -> torch.Tensor:
    """Mirror a random half of the images left to right."""
    return torch.where(torch.rand(len(images), 1, 1, 1, device=images.device) < 0.5, images.flip(3), images)


def random_resized_crop(images: torch.Tensor, size: int, scale=(0.25, 1.0), ratio=(3 / 4, 4 / 3)) -> torch.Tensor:
    """Each image: a random box of `scale` of its area and an aspect ratio in `ratio` (log-uniform), resized to `size`
    x `size` with bilinear sampling, one roi_align call for the whole batch. Floats out (0-255)."""
    from torchvision.ops import roi_align  # here: only the runs that use this crop pay torchvision's import (2 s)

    n, _, h, w = images.shape
    area_draw, aspect_draw, left_draw, top_draw = torch.rand(4, n, device=images.device)
    area = (scale[0] + (scale[1] - scale[0]) * area_draw) * h * w
    low, high = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(low + (high - low) * aspect_draw)
    box_w, box_h = (area * aspect).sqrt().clamp(max=w), (area / aspect).sqrt().clamp(max=h)
    left, top = left_draw * (w - box_w), top_draw * (h - box_h)
    boxes = torch.stack([torch.arange(n, device=images.device, dtype=torch.float), left, top, left + box_w,
                         top + box_h], dim=1)
    return roi_align(images.float(), boxes, output_size=(size, size), sampling_ratio=2, aligned=True)
