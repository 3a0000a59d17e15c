"""Memory: glibc keeping freed memory on a CPU (`keep_freed_memory`), and --auto_batch_size, the largest
per-process batch whose training step fits (`largest_batch_size`).

accelerate's `find_executable_batch_size` retries with a smaller batch after an out-of-memory error. Each try
runs two real steps (forward, backward, optimizer step; the second with the optimizer's state allocated, as every
later step of the run has it) on a fresh, unwrapped model in the run's memory layout, so a failed try frees all
it allocated and no process waits in a DDP all-reduce for one that failed; then the processes compare notes
and all halve if any ran out (one process on another batch size would hang the group). The real run adds
DDP's gradient buckets (about one more copy of the gradients): on a GPU filled to the brim, go one lower.
"""

from __future__ import annotations

import ctypes
import sys

import torch
from accelerate.utils import find_executable_batch_size
from accelerate.utils.memory import should_reduce_batch_size

from shared.errors import RecipeError

# mallopt's parameters, from glibc's <malloc.h>
M_TRIM_THRESHOLD = -1  # free memory at the heap's top kept instead of trimmed (default 128 KiB)
M_MMAP_THRESHOLD = -3  # blocks at least this big get their own mapping, returned to the kernel when freed (128 KiB)
KEEP_FREED_BYTES = 1 << 30  # both raised to 1 GiB: a step's activations reuse the last step's memory


def keep_freed_memory() -> bool:
    """Keep freed memory in the process instead of handing it back to the kernel (glibc on Linux). By default every
    block over 128 KiB is returned when freed, so each step's activations come back as fresh pages the kernel faults
    in and zeroes: up to a quarter of a CPU step (benchmarks/BENCHMARKS.md, "The allocator"). The same as setting
    MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ before the launch (measured equal there). True if glibc took
    both settings; False elsewhere (macOS, musl), where nothing changes."""
    if sys.platform != "linux":
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # glibc's; musl has none
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(parameter, KEEP_FREED_BYTES) == 1 for parameter in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD))


def largest_batch_size(accelerator, start: int, train_set, new_model, new_optimizer, preprocess, loss_fn) -> int:
    """Halve `start` until one training step fits on every process. new_model() -> a fresh model;
    new_optimizer(model) -> its optimizer; preprocess(uint8 batch on the device) -> the model's input;
    loss_fn(logits, labels) -> the recipe's loss."""
    tried = []

    def attempt(batch_size: int) -> int:
        tried.append(batch_size)
        out_of_memory = False
        try:
            model = new_model().to(accelerator.device)
            optimizer = new_optimizer(model)
            images, labels = train_set[torch.arange(batch_size) % len(train_set)]  # the recipe's own inputs
            for _ in range(2):  # the second step is the first with the optimizer's state (momentum, Adam's moments)
                with accelerator.autocast():
                    loss = loss_fn(model(preprocess(images.to(accelerator.device))), labels.to(accelerator.device))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        except RuntimeError as error:  # leaving the except block drops the traceback and the memory it holds
            if not should_reduce_batch_size(error):
                raise
            out_of_memory = True
        model = optimizer = loss = None  # noqa: F841  (free this try's tensors before the next one)
        failed = accelerator.reduce(torch.tensor(int(out_of_memory), device=accelerator.device), "sum").item()
        if failed:  # find_executable_batch_size retries on errors whose text contains " out of memory."
            raise RuntimeError(f"batch {batch_size}: {failed} process(es) ran out of memory.")
        return batch_size

    devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):  # the tries draw random numbers; the run must not notice
            # Called, not used as @decorator(...): older accelerate drops reduce_batch_size_fn in that form.
            batch_size = find_executable_batch_size(attempt, starting_batch_size=start,
                                                    reduce_batch_size_fn=lambda: tried[-1] // 2)()
    except RuntimeError as error:
        if "reached zero" in str(error):
            raise RecipeError("--auto_batch_size: not even a batch of 1 fits in memory: "
                              "use a smaller model, bf16.yaml, or a device with more memory") from None
        raise
    if accelerator.device.type == "cuda":  # summary.json's peak_mem_mb is the run's, not the try that ran out
        torch.cuda.empty_cache()  # the blocks the failed tries split up: the run allocates afresh
        torch.cuda.reset_peak_memory_stats(accelerator.device)
    accelerator.print(f"--auto_batch_size: {batch_size} images per process fit (tried {', '.join(map(str, tried))})")
    return batch_size
