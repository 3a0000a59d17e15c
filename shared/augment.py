"""Whole-batch preprocessing on the device: a few tensor ops per batch (N, C, H, W), one random draw per
image, instead of torchvision's per-image transforms in a Python loop on the CPU."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def normalize(images: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """uint8 pixels -> float32 (x / 255 - mean) / std, per channel."""
    if len(mean) != images.shape[1] or len(std) != images.shape[1]:  # broadcasting would silently add channels
        raise ValueError(f"{len(mean)} means and stds for images of {images.shape[1]} channel(s): give one per channel")
    mean_t, std_t = _channel_stats(mean, std, images.device)
    return (images.float() / 255 - mean_t) / std_t


@functools.cache
def _channel_stats(mean, std, device):  # once per device: a host-to-GPU copy in every step would stall the GPU
    return torch.tensor(mean, device=device).view(1, -1, 1, 1), torch.tensor(std, device=device).view(1, -1, 1, 1)


def random_crop(images: torch.Tensor, padding: int) -> torch.Tensor:
    """Pad each side with `padding` zeros, then cut each image at its own random offset."""
    n, c, h, w = images.shape
    # Every possible crop as a view (n, c, 2p+1, 2p+1, h, w), no copy; one gather then picks each image's crop (4x
    # faster on a CPU than indexing every pixel).
    crops = F.pad(images, (padding,) * 4).unfold(2, h, 1).unfold(3, w, 1)
    dy = torch.randint(0, 2 * padding + 1, (n,), device=images.device)
    dx = torch.randint(0, 2 * padding + 1, (n,), device=images.device)
    return crops[torch.arange(n, device=images.device), :, dy, dx]


def random_flip(images: torch.Tensor) -> torch.Tensor:
    """Mirror a random half of the images left to right."""
    return torch.where(torch.rand(len(images), 1, 1, 1, device=images.device) < 0.5, images.flip(3), images)
