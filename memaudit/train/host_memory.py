"""A CPU training run keeps the memory its steps free, for the next step to reuse.

Every training step on the CPU allocates and frees the same large tensors: activations, their
gradients and, under DP-SGD, a layer's per-example gradients (up to 128 MiB each,
`memaudit.train.ghost.MATERIALIZE_BUDGET`). glibc serves each block above its mmap threshold
(at most 32 MiB) with a mapping of its own and unmaps it on free, so the next step faults every
page in again, and the kernel zeroes each one. On a virtual machine whose host takes back the
guest's free memory that is slow and uneven. Measured on this project's 2-core machine
(`benchmarks/dp_overhead.py --presets small --variants nonprivate dp_ghost --repeats 9`, batch
16, sequences of 128, torch 2.13.0, glibc 2.36): with glibc's defaults a DP-SGD step took
1.24-2.32 s (median 1.294 s) and a non-private one 0.81-0.97 s (median 0.879 s), 1.47x; with the
freed memory kept 1.01-1.07 s (1.033 s) and 0.79-0.84 s (0.808 s), 1.27x.

`kept_freed_memory` turns off glibc's mmap for new blocks and its trimming of the heap for the
run (``mallopt``), and afterwards restores glibc's default values and hands the free memory back
(``malloc_trim``). The cost: the process holds its peak memory for the run instead of returning
it between steps, as PyTorch's CUDA allocator does on a GPU. Other C libraries, and CUDA runs,
are left as they are. Federated training in JAX is not changed by it (XLA keeps its own
buffers): in-JAX rounds of the `tiny` model took the same time either way.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import platform
from collections.abc import Iterator
from typing import Any

# glibc's mallopt parameters (malloc.h) and their default values
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
DEFAULT_TRIM_THRESHOLD, DEFAULT_MMAP_MAX = 128 * 1024, 65536


@functools.cache
def glibc() -> Any:
    """The process's C library when it is glibc (its ``mallopt`` and ``malloc_trim``), else None.
    Looked up once: ``platform.libc_ver`` reads the interpreter's executable."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(None)  # the symbols this process already has: its own libc
    except OSError:  # pragma: no cover - a Linux process always has its libc
        return None
    return libc if all(hasattr(libc, f) for f in ("mallopt", "malloc_trim")) else None


@contextlib.contextmanager
def kept_freed_memory(device: Any = "cpu") -> Iterator[bool]:
    """Inside, glibc keeps freed blocks in its heap for reuse (no mmap per large block, no trim
    of the heap); yields whether it applies (glibc, a CPU ``device``). On the way out glibc's
    default values come back and the free memory is returned to the system. A process that set
    its own ``MALLOC_*`` policy gets glibc's default values after the block."""
    libc = glibc() if getattr(device, "type", device) == "cpu" else None
    if libc is None:
        yield False
        return
    # mallopt returns 1 on success; M_TRIM_THRESHOLD's -1 is SIZE_MAX: never trim
    applied = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, -1) == 1
    try:
        yield applied
    finally:
        libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
        libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
        libc.malloc_trim(0)


__all__ = ["glibc", "kept_freed_memory"]
