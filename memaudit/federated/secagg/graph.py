"""Neighbour graphs for secure aggregation.

``full``: every client masks with every other (Bonawitz et al. 2017).
``sparse``: SecAgg+ (Bell et al. 2020): a Harary-style k-regular graph on a
random permutation of the clients, k = O(log n), drawn from a seed the server
announces, so masks and Shamir shares are exchanged only among neighbours.
"""

from __future__ import annotations

import math

import numpy as np


def sparse_degree(n: int) -> int:
    """Default SecAgg+ degree: the even number >= 3 log2(n), capped at n - 1."""
    k = 2 * math.ceil(1.5 * math.log2(max(n, 2)))
    return min(n - 1, k)


GRAPH_KINDS = ("full", "sparse")


def neighbours_of(i: int, n: int, kind: str = "full", *, seed: int = 0,
                  degree: int | None = None) -> frozenset[int]:
    """Client ``i``'s neighbour set in :func:`neighbours` (n, kind, seed, degree), computed
    alone: what a client recomputes to check the keys the server sent it.

    >>> sorted(neighbours_of(0, 3))
    [1, 2]
    """
    k = sparse_degree(n) if degree is None else degree
    if kind == "full" or (kind == "sparse" and k >= n - 1):
        return frozenset(j for j in range(n) if j != i)
    if kind != "sparse" or k < 2 or k % 2:
        return neighbours(n, kind, seed=seed, degree=degree)[i]  # raises the one-line error
    perm = np.random.default_rng(seed).permutation(n)  # the same draw as `neighbours`
    p = int(np.flatnonzero(perm == i)[0])
    return frozenset(int(perm[(p + o) % n]) for o in range(-k // 2, k // 2 + 1) if o != 0)


def neighbours(n: int, kind: str = "full", *, seed: int = 0, degree: int | None = None) -> list[frozenset[int]]:
    """Neighbour sets (excluding self) for clients 0..n-1.

    Args:
        n: number of clients.
        kind: "full" or "sparse".
        seed: graph seed (shared by the server with all clients) for "sparse".
        degree: even degree for "sparse" (default :func:`sparse_degree`).

    >>> [sorted(s) for s in neighbours(3)]
    [[1, 2], [0, 2], [0, 1]]
    """
    if kind == "full":
        return [frozenset(j for j in range(n) if j != i) for i in range(n)]
    if kind != "sparse":
        raise ValueError(f"neighbours must be 'full' or 'sparse', got {kind!r}")
    k = sparse_degree(n) if degree is None else degree
    if k >= n - 1:
        return neighbours(n, "full")
    if k < 2 or k % 2:
        raise ValueError(f"sparse degree must be an even number >= 2, got {k}")
    perm = np.random.default_rng(seed).permutation(n)
    pos = np.empty(n, dtype=np.int64)
    pos[perm] = np.arange(n)
    out = []
    for i in range(n):
        p = int(pos[i])
        out.append(frozenset(int(perm[(p + o) % n]) for o in range(-k // 2, k // 2 + 1) if o != 0))
    return out
