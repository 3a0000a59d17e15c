"""Timing and memory of training steps, for the sweeps and benchmarks.

Timings synchronize the GPU before reading the clock (its work is asynchronous), drop warm-up
repeats (allocator growth, kernel selection, compilation) and report the median.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_seconds(step: Callable[[], None], device: torch.device, repeats: int = 3, warmup: int = 1) -> list[float]:
    """Wall time of `step()`, `repeats` times after `warmup` untimed calls."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def median_step_ms(step: Callable[[], None], device: torch.device, repeats: int = 3, warmup: int = 1) -> float:
    return 1000 * statistics.median(step_seconds(step, device, repeats, warmup))


def memory_breakdown(step: Callable[[], None], model: torch.nn.Module, optimizer, device: torch.device) -> dict:
    """CUDA only ({} elsewhere): the peak of one `step()`, split into parameters, gradients,
    optimizer state and the rest (activations and temporary buffers), in MiB.
    Call it after a warm-up step, so that gradients and optimizer state already exist."""
    if device.type != "cuda":
        return {}
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    synchronize(device)
    mib = lambda tensors: sum(t.numel() * t.element_size() for t in tensors if t is not None) / 2**20  # noqa: E731
    parts = {"params_MB": mib(model.parameters()), "grads_MB": mib(p.grad for p in model.parameters()),
             "optimizer_MB": mib(t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t))}
    peak = torch.cuda.max_memory_allocated(device) / 2**20
    return {**parts, "activations_MB": peak - sum(parts.values()), "peak_MB": peak}
