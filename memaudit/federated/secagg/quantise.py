"""Quantisation of clipped updates for secure aggregation, inside the DP sensitivity.

Each client's flattened delta is clipped, scaled by s = (2^(b-1) - 1) / C (C: the ``clip``
that bounds a client's contribution, so the integer range is [-(2^(b-1)-1), 2^(b-1)-1] and
n such values cannot wrap mod 2^32) and rounded stochastically to integers. Plain stochastic
rounding lifts the norm: the rounding error e has E‖e‖² up to d/4, so ‖q‖/s reaches ~1.02 C
at 12 bits and ~2.5 C at 8 bits for d = 2^20, while DP noise is calibrated to C.

memaudit keeps the decoded contribution within C, as Kairouz, Liu and Steinke (2021) do for
the distributed discrete Gaussian: conditional randomized rounding (re-round until
‖q‖ <= R = s C) of a row first clipped to an inner norm C' < C chosen so that the rounding
bound of their Theorem 1,
    ‖q‖ <= min(‖x‖ + √d,  sqrt(‖x‖² + d/4 + √(2 ln(1/β)) (‖x‖ + √d/2)))  (w.p. >= 1 - β),
is at most R. Then every decoded contribution has norm <= C exactly (a hard bound: the
rounding is repeated until it holds), one client moves the decoded sum by at most C
(add/remove) or 2C (replace-one), and the DP layer's calibration to C stays right.
``bits`` too few for the model's dimension would need C' far below C; such bits are refused
when C' < (1 - MAX_SHRINK) C.

References:
    Kairouz, Liu, Steinke, "The Distributed Discrete Gaussian Mechanism for Federated Learning
    with Secure Aggregation", ICML 2021 (Section 4, Theorem 1: conditional randomized rounding).

>>> round(quantised_norm_bound(1.0, 8, 4096), 3)   # plain clip-then-round bound, in units of C
1.036
>>> inner_clip(1.0, 8, 4096) < 1.0 < quantised_norm_bound(1.0, 8, 4096)
True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from memaudit.federated.client_ops import (
    stochastic_round,  # re-exported: it lives with the client ops
)

BETA = math.exp(-0.5)  # KLS 2021's default β: a re-round happens with probability <= β
MAX_SHRINK = 0.05  # bits whose inner clip loses more than 5% of C are refused
ENCODE_CHUNK = 1 << 14  # float64 work buffers of 128 KiB each: the pipeline stays in L2
MAX_ROUNDING_TRIES = 1000


def quantisation_scale(clip: float, bits: int, n: int) -> tuple[float, int]:
    """Scale s and effective bits b so that |q| <= 2^(b-1) - 1 and n 2^(b-1) <= 2^31."""
    if not (math.isfinite(clip) and clip > 0):
        raise ValueError(f"secure aggregation needs a finite clip norm > 0, got {clip}; set privacy.clip")
    b = min(int(bits), 32 - max(0, math.ceil(math.log2(max(n, 1)))))
    if b < 2:
        raise ValueError(f"cohort of {n} clients leaves no room for quantisation in 32 bits")
    return (2 ** (b - 1) - 1) / clip, b


def rounding_bound(norm: float, dim: int, beta: float = BETA) -> float:
    """KLS 2021 Theorem 1: ‖round(x)‖ for ‖x‖ <= ``norm`` (integer units), w.p. >= 1 - β."""
    det = norm + math.sqrt(dim)  # always: every coordinate moves by < 1
    if beta <= 0:
        return det
    a = math.sqrt(2 * math.log(1 / beta))
    return min(det, math.sqrt(norm ** 2 + dim / 4 + a * (norm + math.sqrt(dim) / 2)))


def quantised_norm_bound(clip: float, bits: int, dim: int, *, cohort: int = 1, beta: float = BETA) -> float:
    """L2 bound (in the units of ``clip``) of one decoded contribution when a row clipped to
    ``clip`` is rounded without shrinking: ``rounding_bound(s clip, dim, beta) / s``.

    This is what the sensitivity would be without the inner clip; :func:`encode` with
    ``inner`` from :func:`inner_clip` keeps it at ``clip``.
    """
    scale, _ = quantisation_scale(clip, bits, cohort)
    return rounding_bound(scale * clip, dim, beta) / scale


def inner_clip(clip: float, bits: int, dim: int, *, cohort: int = 1, beta: float = BETA) -> float:
    """The largest C' with ``rounding_bound(s C', dim, beta) <= s clip``: clip rows to C', round
    conditionally to ‖q‖ <= s clip, and every decoded contribution has norm <= ``clip``.

    Returns 0.0 when no C' > 0 works (far too few bits for ``dim``)."""
    scale, _ = quantisation_scale(clip, bits, cohort)
    r = scale * clip  # = 2^(b-1) - 1, the integer norm budget
    best = r - math.sqrt(dim)
    if beta > 0:
        a = math.sqrt(2 * math.log(1 / beta))
        disc = a * a - 4 * (dim / 4 + a * math.sqrt(dim) / 2 - r * r)
        if disc >= 0:
            best = max(best, (-a + math.sqrt(disc)) / 2)
    # float safety: step down until the bound provably holds
    best *= 1 - 1e-12
    while best > 0 and rounding_bound(best, dim, beta) > r:
        best *= 1 - 1e-9
    return max(best, 0.0) / scale


def check_bits(clip: float, bits: int, dim: int, *, cohort: int = 1, beta: float = BETA) -> float:
    """The inner clip for ``bits``; refuses bits whose inner clip loses more than MAX_SHRINK.

    Raises:
        ValueError: one line naming ``bits``, the dimension and the smallest bits that work.
    """
    inner = inner_clip(clip, bits, dim, cohort=cohort, beta=beta)
    if inner >= (1 - MAX_SHRINK) * clip:
        return inner
    need = next((b for b in range(int(bits) + 1, 31)
                 if inner_clip(clip, b, dim, cohort=cohort, beta=beta) >= (1 - MAX_SHRINK) * clip), None)
    fix = f"raise privacy.secure_aggregation.bits to >= {need}" if need else "use fewer parameters"
    raise ValueError(f"privacy.secure_aggregation.bits={bits} is too few for {dim} parameters: keeping "
                     f"the quantised update's norm within the clip C needs clipping at "
                     f"{inner / clip:.3f} C before rounding (more than {MAX_SHRINK:.0%} lost); {fix}")


def row_norms(rows: np.ndarray) -> np.ndarray:
    """L2 norm of every row of an (n, d) array, accumulated in float64 (no BLAS, no (n, d)
    float64 temporary: einsum casts in buffered chunks)."""
    return np.sqrt(np.einsum("ij,ij->i", rows, rows, dtype=np.float64))


def _round_row(row, factor, dst, bufs, rng) -> float:
    """Scale ``row`` by ``factor``, round stochastically into ``dst`` (int32); return ‖dst‖².

    No BLAS: a node encodes while its other processes hold the cores, and a BLAS call then
    waits for OpenBLAS's threads to get a time slice, at every chunk (4 rows of 1.8M took
    0.9-2.4 s on 2 busy cores with ``np.dot``, 0.04-0.09 s with numpy's own loop)."""
    x, f, u, up = bufs
    sq = 0.0
    d = row.shape[0]
    for s in range(0, d, ENCODE_CHUNK):
        k = min(ENCODE_CHUNK, d - s)
        xs, fs, us, ups = x[:k], f[:k], u[:k], up[:k]
        np.multiply(row[s:s + k], factor, out=xs)  # float64 (factor is an np.float64)
        np.floor(xs, out=fs)
        np.subtract(xs, fs, out=xs)  # fractional part in [0, 1)
        rng.random(out=us)
        np.less(us, xs, out=ups)  # Bernoulli(frac)
        np.add(fs, ups, out=fs)
        dst[s:s + k] = fs  # exact: integers with |q| < 2^31
        sq += float(np.einsum("i,i->", fs, fs))  # numpy's loop, not BLAS: no waiting for its threads
    return sq


def encode(rows: np.ndarray, clip: float, scale: float,
           rng: np.random.Generator | Sequence[np.random.Generator], *,
           inner: float | None = None) -> np.ndarray:
    """Clip each row, quantise, and write it as uint32 (two's complement).

    Args:
        rows: (n, d) float rows.
        clip: C; the integer norm budget is ``scale * clip``.
        scale: s from :func:`quantisation_scale`.
        rng: randomness of the rounding: one generator for all rows (drawn row after row), or
            one generator per row (a client reproduces its own row from its own generator).
        inner: clip rows to this norm (:func:`inner_clip`) and re-round each row until
            ‖q‖ <= s C (conditional rounding, KLS 2021), so the decoded row has norm <= C.
            None: clip to C and round once (the norm may exceed C by the rounding error).

    Vectorised: the row norms are computed once (float64), then every row is scaled, floored
    and stochastically rounded (floor + Bernoulli(frac), unbiased) in float64 over cache-sized
    chunks with preallocated buffers, and written straight into the uint32 output. The integer
    values fit in int32 by the choice of ``scale``, so the int32 view is the two's complement.
    """
    rows = np.asarray(rows)
    if rows.dtype not in (np.float32, np.float64):
        rows = rows.astype(np.float64)
    n, d = rows.shape
    out = np.empty((n, d), dtype=np.uint32)
    if n == 0 or d == 0:
        return out
    target = clip if inner is None else inner
    factors = scale * np.minimum(1.0, target / np.maximum(row_norms(rows), 1e-300))  # float64
    w = min(d, ENCODE_CHUNK)
    bufs = (*(np.empty(w, dtype=np.float64) for _ in range(3)), np.empty(w, dtype=bool))
    signed = out.view(np.int32)
    budget = (scale * clip) ** 2
    rngs = [rng] * n if isinstance(rng, np.random.Generator) else list(rng)
    if len(rngs) != n:
        raise ValueError(f"encode got {len(rngs)} generators for {n} rows")
    for i in range(n):
        for _ in range(MAX_ROUNDING_TRIES):
            sq = _round_row(rows[i], np.float64(factors[i]), signed[i], bufs, rngs[i])
            if inner is None or sq <= budget:
                break
        else:  # probability <= β^MAX_ROUNDING_TRIES with a correct inner clip
            raise RuntimeError(f"conditional rounding missed the norm bound {MAX_ROUNDING_TRIES} times")
    return out


@dataclasses.dataclass(frozen=True)
class SecAggEncoding:
    """One round's client parameters of secure aggregation's encoding: clip to ``inner`` (the
    inner clip, :func:`check_bits`), quantise on the grid of ``scale`` with conditional
    stochastic rounding so the decoded row's norm stays <= ``clip`` (:func:`encode`)."""

    clip: float
    scale: float
    inner: float

    def width(self, dim: int) -> int:
        return dim

    def encode(self, rows: np.ndarray, rngs: Sequence[np.random.Generator]) -> np.ndarray:
        return encode(rows, self.clip, self.scale, rngs, inner=self.inner)

    def to_wire(self) -> dict:
        return {"kind": "secagg", **dataclasses.asdict(self)}

    @classmethod
    def from_wire(cls, d: dict) -> SecAggEncoding:
        return cls(clip=float(d["clip"]), scale=float(d["scale"]), inner=float(d["inner"]))


def decode(total: np.ndarray, scale: float) -> np.ndarray:
    """uint32 sum -> float sum (the sum fits in int32 by the choice of scale)."""
    return total.view(np.int32).astype(np.float64) / scale


__all__ = ["BETA", "ENCODE_CHUNK", "MAX_SHRINK", "SecAggEncoding", "check_bits", "decode", "encode", "inner_clip",
           "quantisation_scale", "quantised_norm_bound", "rounding_bound", "row_norms",
           "stochastic_round"]
