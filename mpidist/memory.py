"""Keep the CPU memory a training step frees for the next step, instead of giving it back to the
operating system and faulting it in again.

With torch's default `zero_grad(set_to_none=True)` every step frees its gradients and the next
backward allocates them again. glibc's malloc returns the top of its heap to the kernel once
more than its trim threshold is free there (by default twice the largest block it has served
from mmap, so a few MB), and every page of the next allocation is then a fresh, zeroed page:
thousands of page faults per step for a model of a few million parameters, a cost every step
pays (benchmarks/results/heap-cpu.md measures it).

keep_freed_memory() sets two of glibc's malloc parameters, for the whole process:
- M_MMAP_THRESHOLD to 32 MiB, the largest glibc accepts on 64-bit systems: blocks up to that
  size come from the heap, where freed memory can be reused (above it every allocation is a new
  mapping, faulted in afresh as before);
- M_TRIM_THRESHOLD to 2 GiB - 1: free memory at the top of the heap is kept up to that much.
The process then keeps its peak heap size, as torch's CUDA caching allocator keeps GPU memory.
MPIDIST_KEEP_FREED_MEMORY=0 leaves malloc alone. Nothing happens where the C library is not glibc.
"""
from __future__ import annotations

import ctypes

from .runtime import config

__all__ = ["keep_freed_memory"]

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's limit on 64-bit: HEAP_MAX_SIZE / 2
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int

_kept = False


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse (see the module notes); True when the
    settings are in effect. Called by DataParallel and the Horovod-style DistributedOptimizer
    for CPU models; safe to call more than once."""
    global _kept
    if _kept:
        return True
    if not config.value("MPIDIST_KEEP_FREED_MEMORY"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # only glibc has it (not musl, not macOS)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _kept = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return _kept
