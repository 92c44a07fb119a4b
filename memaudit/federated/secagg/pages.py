"""Secure aggregation's large arrays in ordinary pages.

numpy asks the kernel for transparent huge pages on every array of 4 MiB or more. A secure
round allocates several arrays of the model's size afresh each round (the encoded rows, the
masked sums, the decoded total), and on a virtual machine whose host takes back the guest's free
memory the first touch of a fresh huge page can stall in the kernel. Measured on this project's
2-core machine (tiny preset, 1.8M parameters, cohort 8): the encoder took 0.6-0.9 s of system
time in about half the rounds against 0.08 s, and an in-JAX secure round 1.15-2.5 s (median
1.9 s) against 1.14-1.20 s in ordinary pages. Elsewhere memaudit keeps numpy's default: the
report's unpaired AUC permutation test runs 1.3x faster with huge pages on the same machine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

try:  # numpy's own switch (numpy >= 1.20); another numpy keeps its default
    from numpy._core.multiarray import _set_madvise_hugepage
except ImportError:  # pragma: no cover - depends on the numpy installed
    _set_madvise_hugepage = None


@contextlib.contextmanager
def ordinary_pages() -> Iterator[None]:
    """numpy's arrays allocated inside (by any thread) are not advised as huge pages; the
    setting before is restored on the way out. Also a decorator: ``@ordinary_pages()``.

    >>> import numpy._core.multiarray as m
    >>> before = m._get_madvise_hugepage()
    >>> with ordinary_pages():
    ...     m._get_madvise_hugepage()
    False
    >>> m._get_madvise_hugepage() == before
    True
    """
    if _set_madvise_hugepage is None:
        yield
        return
    before = _set_madvise_hugepage(False)
    try:
        yield
    finally:
        _set_madvise_hugepage(before)


__all__ = ["ordinary_pages"]
