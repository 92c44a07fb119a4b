"""memaudit: measure what a language model memorized, and what privacy-preserving training removes."""

import os

__version__ = "0.1.0"

# numpy asks the kernel for transparent huge pages on every array of 4 MiB or more. On a virtual
# machine whose host takes back the guest's free memory, the first touch of such a page can stall
# in the kernel: secure aggregation's encoder (a 57 MB output a round, tiny preset) took 0.6-0.9 s
# of kernel time in about half the rounds against 0.08 s, and an in-JAX secure round 1.15-2.5 s
# against 1.14-1.20 s without (2 cores; docs/flower.md, Cost). memaudit's processes, and those
# they start, keep numpy's arrays in ordinary pages unless NUMPY_MADVISE_HUGEPAGE is set (=1:
# numpy's default). It acts only where numpy is not imported yet.
os.environ.setdefault("NUMPY_MADVISE_HUGEPAGE", "0")
