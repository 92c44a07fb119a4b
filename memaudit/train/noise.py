"""DP-SGD's Gaussian noise, drawn in fixed tiles so that any block of a parameter can be drawn alone.

Step t's noise of trained parameter i is defined on the parameter read as a matrix
(`matrix_shape`: its first dimension by the product of the rest; a vector is one column). The
matrix is cut into tiles (`tile_shape`, about ``TILE_SIDE`` x ``TILE_SIDE`` elements, set by the
logical shape alone), and tile (a, b) holds std x ``torch.randn`` of the tile's shape (drawn as
``torch.normal(0, std)``, the same bits) from a CPU generator seeded with keyed BLAKE2b of
(a, b) under the parameter's key, HKDF of the run's secret at ("dpsgd-noise-tile", t, i)
(`memaudit.privacy.randomness`). So:

- the noise is the same bits in any layout: one process draws every tile, a rank of the
  tensor-parallel grid only the tiles that hold its own elements (`noise_block` of its block,
  `memaudit.parallel.layers.ShardSpec.local_of`), and a grid of G ranks draws about 1/G of
  the noise on each rank instead of every logical tensor;
- tiles are small enough to stay in cache: 64k normals drew at 2.8 ns each on this project's
  machine (torch 2.13.0, one core) against 7.0 ns in one draw of 4M;
- a tile's seed is a PRF of the secret, so the noise cannot be recomputed without it.

A gradient on a GPU in one process is the exception: it gets one draw of the whole tensor on
the device, from a CUDA generator keyed at ("dpsgd-noise", t, i) (`memaudit.train.dpsgd`).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

TILE_SIDE = 256  # a tile holds at most TILE_SIDE² normals; part of the noise's definition
PURPOSE = "dpsgd-noise-tile"

Span = tuple[int, int]  # [start, stop) along one dimension of the matrix view
Apply = Callable[[], None]  # what a draw leaves for the calling thread (`for_each_draw`)


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The matrix a parameter of ``shape`` is read as: (first dimension, product of the rest)."""
    if len(shape) == 0:
        return 1, 1
    return int(shape[0]), math.prod(int(n) for n in shape[1:])


def tile_shape(rows: int, cols: int) -> tuple[int, int]:
    """The tile of a (rows x cols) matrix: TILE_SIDE square where both sides allow it, else as
    long along the other side as TILE_SIDE² elements allow (a vector's tiles are runs of 65,536)."""
    area = TILE_SIDE * TILE_SIDE
    tr = min(rows, TILE_SIDE) if cols >= TILE_SIDE else min(rows, max(1, area // cols))
    return tr, min(cols, max(1, area // tr))


def tile_seed(key: bytes, a: int, b: int) -> int:
    """Tile (a, b)'s 63-bit generator seed: keyed BLAKE2b of its coordinates (a PRF under ``key``)."""
    digest = hashlib.blake2b(a.to_bytes(8, "little") + b.to_bytes(8, "little"), key=key, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def parameter_key(randomness: Any, step: int, index: int) -> bytes:
    """The key of parameter ``index``'s tiles at ``step`` (32 bytes of HKDF; `DPRandomness.key`)."""
    return randomness.key(PURPOSE, step, index, 32)


def _tiles(key: bytes, shape: Sequence[int], rows: Span, cols: Span,
           std: float) -> Iterator[tuple[tuple[slice, slice], torch.Tensor]]:
    """For each tile that meets rows x cols of the matrix view: where its part lies in the block,
    and that part, N(0, std²) (each tile drawn whole, scaled, then cut)."""
    big_r, big_c = matrix_shape(shape)
    (r0, r1), (c0, c1) = rows, cols
    if not (0 <= r0 <= r1 <= big_r and 0 <= c0 <= c1 <= big_c):
        raise ValueError(f"block {rows} x {cols} is outside a {big_r} x {big_c} matrix")
    if r1 == r0 or c1 == c0:
        return
    tr, tc = tile_shape(big_r, big_c)
    gen = torch.Generator()
    for a in range(r0 // tr, -(-r1 // tr)):
        ta0, ta1 = a * tr, min(a * tr + tr, big_r)
        ra, rb = max(ta0, r0), min(ta1, r1)
        for b in range(c0 // tc, -(-c1 // tc)):
            tb0, tb1 = b * tc, min(b * tc + tc, big_c)
            ca, cb = max(tb0, c0), min(tb1, c1)
            gen.manual_seed(tile_seed(key, a, b))
            tile = torch.normal(0.0, std, (ta1 - ta0, tb1 - tb0), generator=gen)  # randn x std, bit for bit
            yield (slice(ra - r0, rb - r0), slice(ca - c0, cb - c0)), tile[ra - ta0:rb - ta0, ca - tb0:cb - tb0]


def noise_block(key: bytes, shape: Sequence[int], rows: Span, cols: Span, std: float) -> torch.Tensor:
    """N(0, std²) of rows x cols of the matrix view of a parameter of ``shape``, float32 on the
    CPU, drawn from the tiles that meet the block."""
    out = torch.empty((rows[1] - rows[0], cols[1] - cols[0]), dtype=torch.float32)
    for where, part in _tiles(key, shape, rows, cols, std):
        out[where] = part
    return out


def add_tiled_noise_(grad: torch.Tensor, key: bytes, std: float) -> None:
    """``grad`` (a whole parameter's gradient on the CPU) += its noise, tile by tile: the same
    bits as ``grad += noise_block(...)`` of the whole matrix, without a tensor of noise."""
    rows, cols = matrix_shape(grad.shape)
    view = grad.view(rows, cols)
    for where, part in _tiles(key, grad.shape, (0, rows), (0, cols), std):
        view[where].add_(part.to(grad.dtype))  # in place: `view[where] += part` copies back through __setitem__


def full_noise(key: bytes, shape: Sequence[int], std: float) -> torch.Tensor:
    """The whole parameter's noise, shaped like it (what one process adds)."""
    r, c = matrix_shape(shape)
    return noise_block(key, shape, (0, r), (0, c), std).view(tuple(shape))


@functools.cache
def _draw_pool(threads: int, pid: int) -> ThreadPoolExecutor:
    """Process ``pid``'s threads for noise draws, made once for each thread count. Keyed by the
    process: a child forked after the parent drew noise holds the parent's pool, whose threads
    do not exist in it, and its draws would wait for ever."""
    return ThreadPoolExecutor(threads, thread_name_prefix="memaudit-noise")


def added(grad: torch.Tensor, noise: torch.Tensor) -> Apply | None:
    """``grad += noise`` (noise on the CPU): done here for a gradient on the CPU; for one on a
    GPU, returned for `for_each_draw` to run on its caller's thread."""
    if grad.device.type == "cpu":
        grad.add_(noise.to(grad.dtype))
        return None
    return lambda: grad.add_(noise.to(device=grad.device, dtype=grad.dtype))


def _run(then: Apply | None) -> None:
    if then is not None:
        then()


def for_each_draw(draw: Callable[[int], Apply | None], grads: Sequence[torch.Tensor]) -> None:
    """``draw(i)`` for each gradient i, on `torch.get_num_threads` threads at once; what a draw
    returns (the part that touches a GPU) runs on this thread, in the order of i.

    torch's CPU normal draws one tensor on one thread, whatever its intra-op threads, so the
    noise of `small` (15.7M parameters, 57 tensors) took 70-75 ms a step drawn one after the
    other and 48 ms on two threads (2 cores). A parameter's noise depends on its index and
    tiles only, so the bits are those of the draws one after the other. A draw for a gradient on
    a GPU makes its noise on the CPU and returns the copy and add (`added`), so every CUDA
    operation stays in order on one thread; then at most 4 x threads draws are ahead of it.
    """
    threads = min(torch.get_num_threads(), len(grads))
    if threads < 2:
        for i in range(len(grads)):
            _run(draw(i))
        return
    pool = _draw_pool(threads, os.getpid())
    on_cpu = all(g.device.type == "cpu" for g in grads)  # nothing waits: no noise is held back
    window = len(grads) if on_cpu else 4 * threads
    pending: deque[Future] = deque()
    for i in range(len(grads)):
        pending.append(pool.submit(draw, i))
        if len(pending) > window:
            _run(pending.popleft().result())  # a draw's error is raised here
    while pending:
        _run(pending.popleft().result())
