"""Process settings that make a step faster on its device, each measured there (benchmarks/BENCHMARKS.md): on a CPU,
glibc keeping the memory a step frees for the next step; on a GPU, TF32, the uint8 dataset held in GPU memory, and
cuDNN's autotuning when --cudnn_benchmark asks for it."""

import ctypes
import sys
from pathlib import Path

import torch

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
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None) if sys.platform == "linux" else None  # musl has none
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(parameter, KEEP_FREED_BYTES) == 1 for parameter in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD))


def cpu_has_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU computes bf16 in hardware: Linux lists avx512_bf16 or amx_bf16 among its x86 flags. Elsewhere
    (no x86 flags to read: macOS, ARM), it is not said otherwise."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return True
    return "avx512_bf16" in text or "amx_bf16" in text or "\nflags" not in text


def device_settings(accelerator, cfg) -> dict:
    """What the run's device gains from, set for this process; returns what was set. On a CPU, keep_freed_memory(), and
    a line where bf16 would be emulated (on a CPU without its instructions, several times slower: BENCHMARKS.md).
    On a GPU, TF32 runs float32 matmuls and convolutions on the tensor cores with a 10-bit mantissa: the ResNet's
    float32 steps 2.9x faster than with neither in TF32 (one H100; torch's own default is TF32 for convolutions
    only); --no-tf32 for full float32. --cudnn_benchmark times cuDNN's algorithms for each new shape and keeps the
    fastest: steps 1.26-1.47x faster (the ResNet in bf16 at batch 512), but its 702-step run took 12.2 s with it
    against 10.2 s without (19.1 s in the first process on a fresh machine). Off by default: by these figures it
    pays beyond about 1,400 steps. BENCHMARKS.md, "GPU speed"."""
    device = accelerator.device
    if device.type == "cpu":
        if accelerator.mixed_precision == "bf16" and accelerator.is_main_process and not cpu_has_bf16():
            print("warning: this CPU has no bf16 instructions (no avx512_bf16 or amx_bf16 in lscpu), so bf16 is "
                  "emulated here, several times slower than float32: accelerate_configs/cpu.yaml is faster", flush=True)
        return {"keep_freed_memory": keep_freed_memory()}
    if device.type != "cuda":
        return {}
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
    # The legacy flags, not fp32_precision: mixing the two APIs makes a later read of allow_tf32 raise.
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.tf32
    return {"cudnn_benchmark": cfg.cudnn_benchmark, "tf32": cfg.tf32}


def data_on_device(device: torch.device, wanted: bool | None, *splits) -> bool:
    """Whether to hold the uint8 splits in the device's memory: --data_on_device or --no-data_on_device, and by
    default on a GPU when they take at most a quarter of its free memory (one H100, the ResNet in bf16 at batch 512:
    1.35-1.59x samples/s against a host-to-GPU copy per batch). Fashion-MNIST takes 55 MB, CIFAR-10 184 MB."""
    if wanted is not None or device.type != "cuda":
        return bool(wanted)
    size = sum(split.images.nbytes + split.labels.nbytes for split in splits)
    return size <= torch.cuda.mem_get_info(device)[0] / 4
