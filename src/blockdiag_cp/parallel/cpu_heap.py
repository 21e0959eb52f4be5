"""`keep_cpu_heap`: serve large CPU tensors from glibc's heap and keep freed ones for reuse.

Note [Fresh pages on CPU]
-------------------------
PyTorch's CPU allocator is glibc ``malloc``. A block at or above glibc's mmap threshold
(128 KiB at first, raised to the size of each freed mmapped block, 32 MiB at most) is a
fresh ``mmap``: every page is zero-filled by the kernel on first touch (a minor fault)
and unmapped again on ``free``. A step of attention layers allocates and frees many
``[rows, H, D]`` buffers; past 32 MiB (16k rows of 8 x 64 fp32, the many-documents
benchmark's shard) each one is new pages every time. Measured on this project's 2-core
machine (`benchmarks/many_docs.py`, 300 power-law documents, S = 32,768, cp = 2): about
150k minor faults per layer and rank, 0.3-0.5 s of a 2.5 s layer; the fused kernels'
own temporaries fault too. A per-document loop allocates small blocks that the heap
recycles, so it pays almost none of this.

``keep_cpu_heap()`` sets glibc's mmap threshold and trim threshold (``mallopt``) so that
blocks up to `max_block_bytes` come from the heap and freed memory stays there for the
next allocation, the way CUDA's caching allocator keeps freed blocks: resident memory
stays near the process's peak instead of shrinking between steps, and steps stop
faulting (0-10k faults per layer after the first). It is process-wide C state, so
this library never changes it on import or inside a step: call it once at the start
of a CPU training process (each torchrun rank), or set glibc's environment instead
(``MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=2147483648``); jemalloc or
tcmalloc preloaded does the same job. The project's benchmarks call it on both sides
of each comparison (the CP ranks and the per-document limit).
"""

from __future__ import annotations

import ctypes
import os
import sys

#: glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: blocks up to this size come from the heap by default (1 GiB)
DEFAULT_MAX_BLOCK = 1 << 30


def keep_cpu_heap(max_block_bytes: int = DEFAULT_MAX_BLOCK) -> bool:
    """Keep freed CPU blocks up to `max_block_bytes` in glibc's heap for reuse (Note [Fresh pages on CPU]).

    Returns True when set, False where it does not apply: not Linux with glibc, or the
    process's environment already chose (``MALLOC_MMAP_THRESHOLD_``, a glibc.malloc
    tunable, or a preloaded allocator): that choice is left as it is.
    """
    if not 0 < max_block_bytes <= (1 << 30):
        raise ValueError(f"keep_cpu_heap: max_block_bytes must be in (0, 1 GiB], got {max_block_bytes}")
    if not sys.platform.startswith("linux") or _environment_chose():
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, max_block_bytes)) and bool(mallopt(M_TRIM_THRESHOLD, 2 * max_block_bytes - 1))


def _environment_chose() -> bool:
    """The process was started with its own malloc settings or allocator."""
    preload = os.environ.get("LD_PRELOAD", "")
    return ("MALLOC_MMAP_THRESHOLD_" in os.environ or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")
            or any(name in preload for name in ("jemalloc", "tcmalloc", "mimalloc")))
