"""Secure aggregation as an aggregator wrapper (host-side, ``jittable=False``).

``deltas`` is a `memaudit.federated.updates.ClientUpdates` (or a clients-placed pytree, taken
as `memaudit.federated.updates.LocalUpdates`); the wrapper never asks where its rows live.
Rows that are ``counted`` (DP-FedAvg's ``clipped(C, count=True)``) also sum one 0/1 indicator
per client as one more integer coordinate of the masked rows: the survivors' count comes back
as the metric ``within_clip`` (adaptive clipping counts the unclipped users this way, Andrew
et al. 2021), no indicator reaches the server alone. With
`memaudit.federated.secagg.remote.ClientRows` (the rows stay on the nodes of a runtime across
machines) each node quantises its own users' rows and runs their protocol clients, the server
object runs here (`memaudit.federated.secagg.remote.run_remote_round`), same values.

Per round: each present client clips its flattened delta, quantises it with conditional
stochastic rounding (quantise.py: the decoded contribution's norm stays <= ``clip``, the
sensitivity DP noise is calibrated to) on a signed integer grid whose scale is chosen so
the sum of n values cannot wrap modulo 2^32, and takes part in one protocol round
(:func:`run_round`) under the round's threat-model :class:`Policy` (policy.py). Simulated
dropouts happen before the masked input is sent. The server decodes the survivors' sum, and
the ``base`` aggregator is applied to the survivors' mean as a single pseudo-client of
weight 1 (for ``mean_aggregator()`` this is the mean over survivors).

An abort never raises out of the round: a cohort below ``min_survivors`` (a cohort of one
would be unmasked as that client's update), a threshold the real holder counts cannot
support, too few answers to unmask, or (malicious-server mode, the default) a detected attack give a
zero update and ``secagg_aborted = 1``; the algorithm then applies nothing (algorithms.py)
and the base aggregator's state does not move. ``secagg_aborted`` and ``survivors`` are
statistics of the private cohort (sensitive, not public metrics).

References:
    Bonawitz et al., CCS 2017; Bell et al., CCS 2020 (SecAgg+); Kairouz, Liu, Steinke,
    ICML 2021 (conditional rounding).
"""

from __future__ import annotations

import hashlib
import math
import struct
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from memaudit.errors import ConfigError
from memaudit.federated.aggregators import AggregateResult, Aggregator
from memaudit.federated.client_ops import flatten_clients, slot_seed
from memaudit.federated.secagg.graph import sparse_degree
from memaudit.federated.secagg.messages import SecAggAbort
from memaudit.federated.secagg.pages import ordinary_pages
from memaudit.federated.secagg.pki import KeyRing
from memaudit.federated.secagg.policy import DEFAULT_MODE, Policy
from memaudit.federated.secagg.protocol import Dropouts
from memaudit.federated.secagg.quantise import (
    ENCODE_CHUNK,
    SecAggEncoding,
    check_bits,
    decode,
    encode,
    quantisation_scale,
    row_norms,
    stochastic_round,
)
from memaudit.federated.updates import ClientUpdates, client_updates

PyTree = Any
AUTO_SPARSE_FROM = 32  # "auto" uses SecAgg+ from this cohort size on


class SecAggState(NamedTuple):
    base: Any
    round: int


def server_rng(key: jax.Array, seed: int | None, salt: int) -> np.random.Generator:
    data = np.asarray(jax.random.key_data(key)).ravel().tolist() if key is not None else []
    return np.random.default_rng([salt, 0 if seed is None else seed + 1, *map(int, data)])


def protocol_round_id(rnd: int, key: jax.Array | None, purpose: bytes = b"") -> int:
    """64-bit protocol round id from the round counter and the round's key: fresh even when an
    aborted round leaves the counter where it was. ``purpose`` tells apart ids made from the
    same key for different uses."""
    data = np.asarray(jax.random.key_data(key)).tobytes() if key is not None else b""
    return int.from_bytes(hashlib.sha256(struct.pack(">Q", rnd) + data + purpose).digest()[:8], "big")


def graph_kind(neighbours: str, n: int) -> str:
    """The graph a cohort of ``n`` runs on: "auto" is SecAgg+ from AUTO_SPARSE_FROM clients."""
    return neighbours if neighbours != "auto" else ("sparse" if n >= AUTO_SPARSE_FROM else "full")


def holders(neighbours: str, n: int, degree: int | None = None) -> int:
    """Holders of each client's shares (neighbours + self) in a cohort of ``n``."""
    if graph_kind(neighbours, n) == "full":
        return n
    k = sparse_degree(n) if degree is None else degree
    return n if k >= n - 1 else k + 1


def _aborted(updates: ClientUpdates, state: SecAggState, n: int, survivors: int) -> AggregateResult:
    """An aborted round: a zero update, the base aggregator's state unchanged, the flag set."""
    zero = updates.zeros()
    metrics = {"secagg_aborted": 1, "survivors": jnp.float32(survivors),
               "aggregated_clients": jnp.float32(0), "cohort": jnp.float32(n)}
    return AggregateResult(zero, SecAggState(state.base, int(state.round)), metrics)


def _check_keys(keys: KeyRing, n: int) -> None:
    """Every cohort slot needs a key pair (a generated ring grows; a loaded one must hold it)."""
    keys.ensure(range(n))
    missing = sorted(set(range(n)) - (keys.ids & keys.signers))
    if missing:
        raise ValueError(f"the verification key directory has no key for cohort slot {missing[0]} "
                         f"(cohort of {n}); add client-{missing[0]}.pub and .key")


def secure_aggregation(base: Aggregator, *, clip: float, threshold: float = 0.6,
                       neighbours: str = "full", bits: int = 20, dropout_rate: float = 0.0,
                       seed: int | None = None, degree: int | None = None, colluding: int = 0,
                       min_survivors: int = 3, mode: str = DEFAULT_MODE,
                       keys: KeyRing | None = None) -> Aggregator:
    """Wrap ``base`` so that the server only sees the survivors' securely aggregated sum.

    Args:
        base: applied to the decoded survivors' mean as one pseudo-client of weight 1.
        clip: L2 bound of each client's decoded contribution (the sensitivity; sets the
            integer range). Under DP-FedAvg, use the DP clip norm.
        threshold: Shamir threshold as a fraction of each client's holders (neighbours + self).
        neighbours: "full" (SecAgg), "sparse" (SecAgg+), or "auto" (sparse from 32 clients).
        bits: quantisation bits per coordinate (reduced automatically so n values cannot wrap);
            bits too few for the model's dimension are refused (quantise.check_bits).
        dropout_rate: simulated probability that a client drops before sending its masked input.
        seed: seed of the simulation's randomness: each slot's rounding draws from its own
            generator (`memaudit.federated.client_ops.slot_seed` of the key, seed, round
            and slot); the simulated dropouts and the SecAgg+ graph from one server generator.
        degree: SecAgg+ degree (default O(log n), see :func:`sparse_degree`).
        colluding: n_C, clients that may collude with the server (policy.py).
        min_survivors: a round with fewer survivors aborts.
        mode: "malicious" (default: signatures, views, consistency check) or
            "honest_but_curious" (no signatures; not safe against a server that forks lists).
        keys: the clients' Ed25519 keys for the malicious mode; default: generated here, on the
            clients' side (the server object never holds them), for the cohort slots as they appear.

    Returns:
        An :class:`Aggregator` (``jittable=False``) with metrics ``secagg_aborted`` (0/1),
        ``survivors``, ``cohort``, and for a completed round ``secagg_bits``,
        ``secagg_degree``, ``secagg_bytes_up``, ``secagg_bytes_down``, ``secagg_norm_bound``
        (the L2 bound of one decoded contribution: the sensitivity, = the smaller of ``clip`` and
        the clip the rows were clipped to this round).
    """
    if neighbours not in ("full", "sparse", "auto"):
        raise ValueError(f"neighbours must be 'full', 'sparse' or 'auto', got {neighbours!r}")
    if not 0 <= dropout_rate < 1:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
    quantisation_scale(clip, bits, 1)  # validate early
    policy = Policy(threshold=threshold, colluding=colluding, min_survivors=min_survivors, mode=mode)
    if policy.malicious:
        keys = keys if keys is not None else KeyRing.generate(())  # held by the clients' side

    def init(params):
        return SecAggState(base.init(params), 0)

    @ordinary_pages()  # fresh arrays of the model's size every round (memaudit.federated.secagg.pages)
    def aggregate(deltas, weights, state, key):
        updates = client_updates(deltas)
        rnd = int(state.round)  # may come back from a jitted server step as a 0-d array
        present = np.flatnonzero(np.asarray(weights) > 0)
        n = len(present)
        if n < policy.min_survivors:  # a cohort of one would be unmasked as its own update
            return _aborted(updates, state, n, n)
        dim = updates.dim
        # the sensitivity: the clip the rows were clipped to this round (DP-FedAvg's, adaptive
        # or not) when below ``clip``; quantising against a larger one lets the rounding lift one
        # row above the clip the noise is calibrated to (issue 29, Found-4)
        bound = clip if updates.clip_bound is None else min(float(clip), float(updates.clip_bound))
        scale, b = quantisation_scale(bound, bits, n)
        # pure and cheap (closed form): recomputed every round rather than cached
        encoding = SecAggEncoding(float(bound), float(scale), check_bits(bound, b, dim, cohort=n))
        # one generator per slot, derived one-way from the round key: a node reproduces its
        # own users' rounding without the key; the server's draws (dropouts, graph) use server_rng
        seeds = [slot_seed(key, seed, rnd, int(s)) for s in present]
        rng = server_rng(key, seed, rnd)
        dropped = set(np.flatnonzero(rng.random(n) < dropout_rate).tolist())
        graph_seed = int(rng.integers(2**31))
        if keys is not None:
            _check_keys(keys, n)
        protocol = {"round_id": protocol_round_id(rnd, key), "neighbours": graph_kind(neighbours, n),
                    "threshold": threshold, "graph_seed": graph_seed, "degree": degree,
                    "dropouts": Dropouts(before_masked=dropped), "colluding": colluding,
                    "min_survivors": min_survivors, "mode": mode, "keys": keys}
        try:
            result = updates.secure_sum(encoding, present, seeds, **protocol)
        except SecAggAbort:
            return _aborted(updates, state, n, n - len(dropped))
        m = len(result.survivors)
        mean = decode(result.total[:dim], scale) / m
        pseudo = jax.tree.map(lambda x: x[None], updates.unflatten(mean))
        res = base.aggregate(pseudo, jnp.ones((1,), jnp.float32), state.base, key)
        metrics = dict(res.metrics)
        metrics.update(secagg_aborted=0, survivors=jnp.float32(m), aggregated_clients=jnp.float32(m),
                       cohort=jnp.float32(n), secagg_bits=b, secagg_degree=result.degree,
                       secagg_bytes_up=result.bytes_up, secagg_bytes_down=result.bytes_down,
                       secagg_bytes_masked=result.bytes_masked,
                       # words per masked input: the model's trained coordinates (+ 1 when the
                       # clip indicators are summed too); kept with the sensitive metrics under DP
                       # all the same (the public file's keys are an allowlist)
                       secagg_words=int(result.total.shape[0]),
                       secagg_norm_bound=float(bound))
        if updates.counted:  # the survivors' indicators, summed under the masks
            metrics["within_clip"] = jnp.float32(int(result.total[dim]))
        return AggregateResult(res.update, SecAggState(res.state, rnd + 1), metrics)

    return Aggregator(init=init, aggregate=aggregate, jittable=False, counts=True)


__all__ = [
    "ENCODE_CHUNK",
    "SecAggState",
    "abort_bit_epsilon",
    "check_secagg_config",
    "decode",
    "encode",
    "flatten_clients",
    "graph_kind",
    "holders",
    "protocol_round_id",
    "quantisation_scale",
    "row_norms",
    "secure_aggregation",
    "secure_aggregation_from_config",
    "sparse_degree",
    "stochastic_round",
]


def check_secagg_config(cfg, *, dim: int | None = None) -> None:
    """Refuse, before anything is written, a secure-aggregation config the threat model rejects
    for the configured cohort (``federated.cohort``), and (with ``dim``, the model's parameter
    count) ``bits`` too few to keep the quantised norm within the clip.

    Raises:
        ConfigError: one line naming the setting and the fix.
    """
    p, sa = cfg.privacy, cfg.privacy.secure_aggregation
    if not math.isfinite(p.clip):
        raise ConfigError(f"privacy.secure_aggregation needs a finite privacy.clip (got {p.clip}); "
                          "set privacy.clip, e.g. 1.0")
    n = int(cfg.federated.cohort)
    policy = Policy(threshold=sa.threshold, colluding=sa.colluding_clients,
                    min_survivors=sa.min_survivors, mode=sa.mode)
    try:
        if n < sa.min_survivors:
            raise ValueError(f"federated.cohort={n} is below privacy.secure_aggregation.min_survivors="
                             f"{sa.min_survivors}: every round would abort; raise the cohort")
        policy.holder_threshold(holders(sa.neighbours, n))
        if dim is not None:
            clip = max(p.clip, p.adaptive_clipping.initial_clip) if p.adaptive_clipping.enabled else p.clip
            check_bits(clip, quantisation_scale(clip, sa.bits, n)[1], dim, cohort=n)
    except ValueError as e:
        raise ConfigError(f"privacy.secure_aggregation: {e}") from None


def abort_bit_epsilon(cfg, population: int) -> float:
    """Pure ε per round of whether a secure-aggregation round aborted, for a
    :class:`memaudit.config.Config` and its population (`memaudit.privacy.aborts`): the floor
    min_survivors, the malicious-server mode's signed quorum and, with simulated dropouts, the
    holder threshold on the graph each cohort size runs on (a rigorous bound on SecAgg+'s)."""
    # lazy: dp_accounting (~1.5 s) and scipy.stats (~0.3 s) only when called
    from memaudit.privacy.aborts import abort_epsilon

    sa, f = cfg.privacy.secure_aggregation, cfg.federated
    return abort_epsilon(population=int(population), cohort=float(f.cohort), min_survivors=int(sa.min_survivors),
                         sampling=f.sampling, dropout=float(sa.dropout), threshold=float(sa.threshold),
                         holders=lambda n: holders(sa.neighbours, n),
                         quorum=int(sa.colluding_clients) if sa.mode == "malicious" else None)


def secure_aggregation_from_config(base: Aggregator, cfg, *, dim: int | None = None) -> Aggregator:
    """``secure_aggregation`` with the settings of a :class:`memaudit.config.Config`.

    Uses ``privacy.secure_aggregation`` (threshold, neighbours, bits, dropout, mode,
    colluding_clients, min_survivors, verification_keys), ``privacy.clip`` as the bound of a
    decoded contribution (must be finite) and ``train.seed`` (mask seeds also mix in the round
    key, which is secret under DP). Checks
    the config first (:func:`check_secagg_config`; pass ``dim`` to check ``bits`` here rather
    than at the first round).
    """
    check_secagg_config(cfg, dim=dim)
    p, sa = cfg.privacy, cfg.privacy.secure_aggregation
    clip = max(p.clip, p.adaptive_clipping.initial_clip) if p.adaptive_clipping.enabled else p.clip
    seed = cfg.train.seed  # mask seeds mix in the round key, which is secret under DP
    keys = None
    if sa.mode == "malicious" and sa.verification_keys is not None:
        try:
            keys = KeyRing.load(sa.verification_keys)
        except ValueError as e:
            raise ConfigError(f"privacy.secure_aggregation.verification_keys: {e}") from None
    return secure_aggregation(base, clip=clip, threshold=sa.threshold, neighbours=sa.neighbours,
                              bits=sa.bits, dropout_rate=sa.dropout, seed=seed,
                              colluding=sa.colluding_clients, min_survivors=sa.min_survivors,
                              mode=sa.mode, keys=keys)
