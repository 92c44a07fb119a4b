"""Secure aggregation as an aggregator wrapper (host-side, ``jittable=False``).

Per round: each present client clips its flattened delta to L2 norm ``clip``,
quantises it with stochastic rounding to a signed integer grid whose scale is
chosen so the sum of n clipped values cannot wrap modulo 2^32, and takes part in
one protocol round (:func:`run_round`). Simulated dropouts happen before the
masked input is sent. The server decodes the survivors' sum, and the ``base``
aggregator is applied to the survivors' mean as a single pseudo-client of
weight 1 (for ``mean_aggregator()`` this is the mean over survivors).

If too few clients survive, :class:`SecAggAbort` propagates: the trainer must not
apply any update that round.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from memaudit.federated.aggregators import AggregateResult, Aggregator
from memaudit.federated.secagg.graph import sparse_degree
from memaudit.federated.secagg.protocol import Dropouts, run_round

PyTree = Any
AUTO_SPARSE_FROM = 32  # "auto" uses SecAgg+ from this cohort size on


class SecAggState(NamedTuple):
    base: Any
    round: int


def quantisation_scale(clip: float, bits: int, n: int) -> tuple[float, int]:
    """Scale s and effective bits b so that |q| <= 2^(b-1) - 1 and n 2^(b-1) <= 2^31."""
    if not (math.isfinite(clip) and clip > 0):
        raise ValueError(f"secure aggregation needs a finite clip norm > 0, got {clip}; set privacy.clip")
    b = min(int(bits), 32 - max(0, math.ceil(math.log2(max(n, 1)))))
    if b < 2:
        raise ValueError(f"cohort of {n} clients leaves no room for quantisation in 32 bits")
    return (2 ** (b - 1) - 1) / clip, b


def stochastic_round(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Unbiased rounding to integers: floor(x) + Bernoulli(frac(x)), as int64."""
    f = np.floor(x)
    return (f + (rng.random(x.shape) < (x - f))).astype(np.int64)


def flatten_clients(deltas: PyTree) -> tuple[np.ndarray, Any]:
    """(n, d) float rows (float32 kept as is) and a map from a (d,) vector back to one pytree."""
    leaves, tdef = jax.tree.flatten(deltas)
    arrs = [np.asarray(x) for x in leaves]
    arrs = [a if a.dtype in (np.float32, np.float64) else a.astype(np.float64) for a in arrs]
    n = arrs[0].shape[0]
    rows = np.concatenate([a.reshape(n, -1) for a in arrs], axis=1)
    shapes = [(a.shape[1:], np.asarray(x).dtype) for a, x in zip(arrs, leaves, strict=True)]

    def unflatten(v: np.ndarray) -> PyTree:
        out, o = [], 0
        for shape, dtype in shapes:
            size = int(np.prod(shape))
            out.append(jnp.asarray(v[o:o + size].reshape(shape), dtype=dtype))
            o += size
        return jax.tree.unflatten(tdef, out)

    return rows, unflatten


ENCODE_CHUNK = 1 << 14  # float64 work buffers of 128 KiB each: the pipeline stays in L2


def row_norms(rows: np.ndarray) -> np.ndarray:
    """L2 norm of every row of an (n, d) array, accumulated in float64 (no BLAS, no (n, d)
    float64 temporary: einsum casts in buffered chunks)."""
    return np.sqrt(np.einsum("ij,ij->i", rows, rows, dtype=np.float64))


def encode(rows: np.ndarray, clip: float, scale: float, rng: np.random.Generator) -> np.ndarray:
    """Clip each row to L2 norm ``clip``, quantise, and write it as uint32 (two's complement).

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
    factors = scale * np.minimum(1.0, clip / np.maximum(row_norms(rows), 1e-300))  # float64
    w = min(d, ENCODE_CHUNK)
    x, f, u = (np.empty(w, dtype=np.float64) for _ in range(3))
    up = np.empty(w, dtype=bool)
    signed = out.view(np.int32)
    for i in range(n):
        row, factor, dst = rows[i], np.float64(factors[i]), signed[i]
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
    return out


def decode(total: np.ndarray, scale: float) -> np.ndarray:
    """uint32 sum -> float sum (the sum fits in int32 by the choice of scale)."""
    return total.view(np.int32).astype(np.float64) / scale


def _rng(key: jax.Array, seed: int | None, salt: int) -> np.random.Generator:
    data = np.asarray(jax.random.key_data(key)).ravel().tolist() if key is not None else []
    return np.random.default_rng([salt, 0 if seed is None else seed + 1, *map(int, data)])


def secure_aggregation(base: Aggregator, *, clip: float, threshold: float = 0.6,
                       neighbours: str = "full", bits: int = 20, dropout_rate: float = 0.0,
                       seed: int | None = None, degree: int | None = None) -> Aggregator:
    """Wrap ``base`` so that the server only sees the survivors' securely aggregated sum.

    Args:
        base: applied to the decoded survivors' mean as one pseudo-client of weight 1.
        clip: L2 bound of each client's delta before quantisation (sets the integer range).
            Under DP-FedAvg, use a value >= the DP clip norm.
        threshold: Shamir threshold as a fraction of each client's holders (neighbours + self).
        neighbours: "full" (SecAgg), "sparse" (SecAgg+), or "auto" (sparse from 32 clients).
        bits: quantisation bits per coordinate (reduced automatically so n values cannot wrap).
        dropout_rate: simulated probability that a client drops before sending its masked input.
        seed: seed of the simulation's randomness (rounding, dropouts, SecAgg+ graph).
        degree: SecAgg+ degree (default O(log n), see :func:`sparse_degree`).

    Returns:
        An :class:`Aggregator` (``jittable=False``) with metrics ``survivors``, ``cohort``,
        ``secagg_bits``, ``secagg_degree``, ``secagg_bytes_up``, ``secagg_bytes_down``.

    Raises (from ``aggregate``):
        SecAggAbort: fewer survivors than the threshold; apply no update this round.
    """
    if neighbours not in ("full", "sparse", "auto"):
        raise ValueError(f"neighbours must be 'full', 'sparse' or 'auto', got {neighbours!r}")
    if not 0 <= dropout_rate < 1:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
    quantisation_scale(clip, bits, 1)  # validate early

    def init(params):
        return SecAggState(base.init(params), 0)

    def aggregate(deltas, weights, state, key):
        rnd = int(state.round)  # may come back from a jitted server step as a 0-d array
        w = np.asarray(weights)
        present = np.flatnonzero(w > 0)
        rows, unflatten = flatten_clients(deltas)
        n = len(present)
        if n == 0:  # an empty (Poisson) cohort: nothing to mask; the sum is zero
            zero = jax.tree.map(lambda x: jnp.zeros_like(x[:1]), deltas)
            res = base.aggregate(zero, jnp.zeros((1,), jnp.float32), state.base, key)
            metrics = {**res.metrics, "survivors": jnp.float32(0), "aggregated_clients": jnp.float32(0),
                       "cohort": jnp.float32(0)}
            return AggregateResult(res.update, SecAggState(res.state, rnd + 1), metrics)
        kind = neighbours if neighbours != "auto" else ("sparse" if n >= AUTO_SPARSE_FROM else "full")
        scale, b = quantisation_scale(clip, bits, n)
        rng = _rng(key, seed, rnd)
        q = encode(rows if n == rows.shape[0] else rows[present], clip, scale, rng)
        dropped = set(np.flatnonzero(rng.random(n) < dropout_rate).tolist())
        graph_seed = int(rng.integers(2**31))
        result = run_round(q, round_id=rnd, neighbours=kind, threshold=threshold,
                           graph_seed=graph_seed, degree=degree,
                           dropouts=Dropouts(before_masked=dropped))
        m = len(result.survivors)
        mean = decode(result.total, scale) / m
        pseudo = jax.tree.map(lambda x: x[None], unflatten(mean))
        res = base.aggregate(pseudo, jnp.ones((1,), jnp.float32), state.base, key)
        metrics = dict(res.metrics)
        metrics.update(survivors=jnp.float32(m), aggregated_clients=jnp.float32(m),
                       cohort=jnp.float32(n), secagg_bits=b, secagg_degree=result.degree,
                       secagg_bytes_up=result.bytes_up, secagg_bytes_down=result.bytes_down)
        return AggregateResult(res.update, SecAggState(res.state, rnd + 1), metrics)

    return Aggregator(init=init, aggregate=aggregate, jittable=False)


__all__ = ["SecAggState", "decode", "encode", "quantisation_scale", "row_norms", "secure_aggregation",
           "secure_aggregation_from_config",
           "sparse_degree", "stochastic_round"]


def secure_aggregation_from_config(base: Aggregator, cfg) -> Aggregator:
    """``secure_aggregation`` with the settings of a :class:`memaudit.config.Config`.

    Uses ``privacy.secure_aggregation`` (threshold, neighbours, bits, dropout), ``privacy.clip``
    as the quantisation bound (must be finite) and ``train.seed``.
    """
    from memaudit.errors import ConfigError

    p, sa = cfg.privacy, cfg.privacy.secure_aggregation
    if not math.isfinite(p.clip):
        raise ConfigError(f"privacy.secure_aggregation needs a finite privacy.clip (got {p.clip}); "
                          "set privacy.clip, e.g. 1.0")
    clip = max(p.clip, p.adaptive_clipping.initial_clip) if p.adaptive_clipping.enabled else p.clip
    seed = cfg.train.seed  # mask seeds mix in the round key, which is secret under DP
    return secure_aggregation(base, clip=clip, threshold=sa.threshold, neighbours=sa.neighbours,
                              bits=sa.bits, dropout_rate=sa.dropout, seed=seed)
