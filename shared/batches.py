"""A split held as one uint8 tensor, served a whole batch at a time, and the training order, resumable at any
sample. shared/data.py builds the splits; the recipes' DataLoaders read them."""

from __future__ import annotations

import numpy as np
import torch


class ImageTensors(torch.utils.data.Dataset):
    """A whole split in memory: uint8 images (N, C, H, W), int64 labels (N,), class names."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, classes: list[str], name: str):
        self.images, self.labels, self.classes, self.name = images, labels, classes, name

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index], self.labels[index]

    def __getitems__(self, indices):  # a whole batch of indices from the DataLoader: one gather, no stack
        # With --data_on_device the gather runs on the GPU: copy the indices without waiting for the GPU to finish
        # the step in flight (a blocking copy would); on a CPU this is a no-op.
        indices = torch.as_tensor(indices).to(self.labels.device, non_blocking=True)
        # index_select copies whole images; `images[indices]` indexes every pixel (10-20x slower on a CPU here).
        return self.images.index_select(0, indices), self.labels.index_select(0, indices)

    @staticmethod
    def whole_batch(batch):
        """The DataLoader's collate_fn: `__getitems__` already returns the stacked batch."""
        return batch

    def to(self, device) -> ImageTensors:
        """The split moved to `device`: batches are then cut where the model runs, without a copy."""
        return ImageTensors(self.images.to(device), self.labels.to(device), self.classes, self.name)


class EpochOrder(torch.utils.data.Sampler):
    """Each epoch a permutation that depends only on (seed, epoch), served from sample `start` on. Kept in
    samples, not batches, a run can resume mid-epoch on another number of processes or batch size: the rest of
    the epoch is exactly the samples not yet trained on, cut into the new batches. (accelerate's seedable
    sampler seeds epoch e with seed + e, so seed 1 replays seed 0's orders one epoch later; and its resume skips
    batches of the old size: accelerate #784.)"""

    def __init__(self, size: int, seed: int):
        self.size, self.seed, self.epoch, self.start = size, seed, 0, 0

    def set_position(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, min(start, self.size)  # past the end: a smaller --data after a resume

    def __iter__(self):
        # (seed, epoch) hashed into one seed: no two pairs share an order, as seed + epoch would.
        seed = int(np.random.SeedSequence([self.seed, self.epoch]).generate_state(1)[0])
        generator = torch.Generator().manual_seed(seed)
        return iter(torch.randperm(self.size, generator=generator)[self.start:].tolist())

    def __len__(self):
        return self.size - self.start
