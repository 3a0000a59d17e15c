"""Memory on a CPU: glibc keeping the memory a step frees for the next step (`keep_freed_memory`)."""

import ctypes
import sys

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
