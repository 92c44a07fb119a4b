"""Distributed DP with the distributed discrete Gaussian (DDGauss) mechanism.

Client side, per round: clip the flattened delta to L2 norm c, scale by 1/γ,
rotate with a randomized Hadamard transform (pad to D = 2^k), round to integers
with conditional randomized rounding (retry until the L2 norm is at most Δ₂),
add discrete Gaussian noise N_Z(0, σ_local²) with σ_local² = (z c / γ)² / n_expected,
and reduce modulo M = 2^bits. The integer vectors are summed with secure
aggregation (mod 2^32, then mod M). Server side: map the sum to [-M/2, M/2),
un-rotate, multiply by γ and divide by the expected cohort size.

Accounting (Kairouz, Liu, Steinke 2021, Prop. 14): the sum of m discrete
Gaussians of variance σ² releases, per round, RDP
ε(α) = min{ α/2 Δ₂²/(mσ²) + τD,  α/2 (Δ₂²/(mσ²) + 2Δ₁τ/(√m σ) + τ²D),  α/2 (Δ₂/(√m σ) + τ√D)² }
with τ = 10 Σ_{k=1}^{m-1} exp(-2π²σ² k/(k+1)). m is the number of clients that
survived, so dropouts show up as lost noise. Sampling amplification is not
applied (the per-round curve holds for any cohort), which is conservative.

References:
    Kairouz, Liu, Steinke, "The Distributed Discrete Gaussian Mechanism for
    Federated Learning with Secure Aggregation", ICML 2021.
    Canonne, Kamath, Steinke, "The Discrete Gaussian for Differential Privacy",
    NeurIPS 2020.

>>> x = np.arange(5.0)
>>> np.allclose(unrotate(rotate(x, seed=3), seed=3, dim=5), x)
True
"""

from __future__ import annotations

import math
import random
from fractions import Fraction
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from memaudit.errors import ConfigError
from memaudit.federated.aggregators import AggregateResult, Aggregator, mean_aggregator
from memaudit.federated.client_ops import (
    DDGEncoding,
    conditional_round,
    ddp_encode,
    hadamard,
    padded_dim,
    rotate,
    sample_discrete_gaussian,
    slot_seed,
    unrotate,
)
from memaudit.federated.secagg.aggregator import graph_kind, server_rng
from memaudit.federated.secagg.messages import SecAggAbort
from memaudit.federated.secagg.pages import ordinary_pages
from memaudit.federated.secagg.protocol import Dropouts
from memaudit.federated.updates import client_updates
from memaudit.privacy.ddg import ddg_rdp, ddg_tau
from memaudit.privacy.ledger import RdpCurveEvent
from memaudit.privacy.mechanisms import DistributedDiscreteGaussian

# The client's side (rotation, conditional rounding, the discrete-Gaussian noise share, the
# encoding) lives in memaudit.federated.client_ops, where a node holding its users' rows runs it
# too; re-exported here.

# ----------------------------------------------------------------------------- rounding


def rounded_l2_bound(l2: float, dim: int, beta: float) -> float:
    """Δ₂: norm bound after conditional randomized rounding (KLS 2021, Thm. 1 / eq. 8)."""
    bound1 = l2 + math.sqrt(dim)
    if beta == 0:
        return bound1
    bound2 = math.sqrt(l2 ** 2 + dim / 4 + math.sqrt(2 * math.log(1 / beta)) * (l2 + math.sqrt(dim) / 2))
    return min(bound1, bound2)


# ----------------------------------------------------------------------------- discrete Gaussian


def discrete_gaussian_pmf(support: np.ndarray, sigma: float, tail: int | None = None) -> np.ndarray:
    """Exact pmf of N_Z(0, σ²) at ``support`` (normaliser summed to ±(tail) with tail >> σ)."""
    tail = tail or int(50 * sigma + 50)
    ks = np.arange(-tail, tail + 1, dtype=np.float64)
    z = np.exp(-ks ** 2 / (2 * sigma ** 2)).sum()
    return np.exp(-np.asarray(support, np.float64) ** 2 / (2 * sigma ** 2)) / z


def _bernoulli_exp(gamma: Fraction, rng: random.Random) -> bool:
    """Exact Bernoulli(exp(-γ)) for rational γ >= 0 (CKS 2020, Algorithm 1)."""
    if gamma > 1:
        for _ in range(math.floor(gamma)):
            if not _bernoulli_exp(Fraction(1), rng):
                return False
        return _bernoulli_exp(gamma - math.floor(gamma), rng)
    k = 1
    while True:
        if rng.randrange(gamma.denominator * k) >= gamma.numerator:  # Bernoulli(γ/k) failed
            break
        k += 1
    return k % 2 == 1


def sample_discrete_gaussian_exact(sigma2: Fraction, rng: random.Random) -> int:
    """One exact draw of N_Z(0, σ²) for rational σ² (CKS 2020, Algorithms 1-3), integer arithmetic only."""
    sigma2 = Fraction(sigma2)
    t = math.isqrt(math.floor(sigma2)) + 1
    while True:
        # discrete Laplace with scale t (Algorithm 2, s = 1)
        while True:
            u = rng.randrange(t)
            if not _bernoulli_exp(Fraction(u, t), rng):
                continue
            v = 0
            while _bernoulli_exp(Fraction(1), rng):
                v += 1
            y = u + t * v
            b = rng.randrange(2)
            if b == 1 and y == 0:
                continue
            y = -y if b else y
            break
        gamma = (abs(y) - sigma2 / t) ** 2 / (2 * sigma2)
        if _bernoulli_exp(gamma, rng):
            return y


# ----------------------------------------------------------------------------- accounting


# ddg_tau and ddg_rdp (the accounting) live in memaudit.privacy.ddg; re-exported here.


# ----------------------------------------------------------------------------- aggregator
PLAN_QUANTILE = 0.01  # calibrate for the 1% quantile of the survivor count


class DDPState(NamedTuple):
    base: Any
    round: int


class DDPParams(NamedTuple):
    """The public per-round parameters, in scaled integer units."""

    gamma: float
    dim: int          # D, padded dimension
    l2: float         # Δ₂
    l1: float         # Δ₁
    local_std: float  # σ of each client's discrete Gaussian


def ddp_params(*, clip: float, noise_multiplier: float, expected_cohort: float, cohort: int, dim: int,
               bits: int, beta: float, k_stddevs: float) -> DDPParams:
    """Choose γ so that k standard deviations of a coordinate of the sum fit in [-M/2, M/2)."""
    D = padded_dim(dim)
    M = 2 ** bits
    room = (M / (2 * k_stddevs)) ** 2 - cohort / 4
    if room <= 0:
        raise ValueError(f"bits={bits} too few for a cohort of {cohort}; raise privacy.secure_aggregation.bits")
    signal = cohort * clip ** 2 / D + (noise_multiplier * clip) ** 2
    gamma = math.sqrt(signal / room)
    l2 = rounded_l2_bound(clip / gamma, D, beta)
    local_std = noise_multiplier * clip / gamma / math.sqrt(expected_cohort)
    return DDPParams(gamma, D, l2, min(math.sqrt(D) * l2, l2 ** 2), local_std)


def distributed_dp(base: Aggregator | None = None, *, clip: float, noise_multiplier: float,
                   expected_cohort: float, bits: int = 20, beta: float = math.exp(-0.5),
                   k_stddevs: float = 4.0, secure: bool = True, threshold: float = 0.6,
                   neighbours: str = "full", dropout_rate: float = 0.0, seed: int | None = None,
                   planned_survivors: float | None = None, **protocol_kw: Any) -> Aggregator:
    """Distributed discrete Gaussian mechanism over secure aggregation (``jittable=False``).

    Args:
        base: applied to the decoded estimate (sum / expected cohort) as one pseudo-client.
        clip: L2 clip norm c of each client's delta.
        noise_multiplier: z; the noise of all expected clients together has std z c
            (before rounding), as in central DP-FedAvg.
        expected_cohort: the fixed denominator and the number of noise shares.
        bits: modulus M = 2^bits of the secure sum (<= 32).
        beta: conditional rounding parameter β of KLS 2021.
        k_stddevs: headroom of the modulus in standard deviations of a summed coordinate.
        secure: run the SecAgg protocol (else a plain modular sum, same result, for speed).
        threshold, neighbours, dropout_rate, seed: as in ``secure_aggregation``.
        planned_survivors: the survivors the noise was calibrated for (default: the expected
            cohort); a round with fewer sets the sensitive metric ``ddp_below_plan`` (its noise,
            and so its ledger event, is weaker than planned).
        protocol_kw: more protocol settings (``mode``, ``colluding``, ``min_survivors``).

    Returns:
        An :class:`Aggregator` with metrics ``survivors``, ``cohort``, ``ddp_effective_noise``
        (z of the noise that survivors actually added), ``ddp_noise_std`` (on the averaged
        update; both depend on the survivors, hence sensitive), and ``ddp_gamma``, ``ddp_dim``, ``ddp_l2``, ``ddp_l1``, ``ddp_local_std``
        for :func:`memaudit.privacy.federated.ddp_round_event`.
    """
    base = mean_aggregator() if base is None else base
    if not 2 <= bits <= 32:
        raise ValueError(f"bits must be in 2..32, got {bits}")
    if not (math.isfinite(clip) and clip > 0):
        raise ValueError(f"distributed DP needs a finite clip norm > 0, got {clip}")

    plan = float(expected_cohort if planned_survivors is None else planned_survivors)

    def init(params):
        return DDPState(base.init(params), 0)

    @ordinary_pages()  # fresh arrays of the model's size every round (memaudit.federated.secagg.pages)
    def aggregate(deltas, weights, state, key):
        updates = client_updates(deltas)
        rnd = int(state.round)  # may come back from a jitted server step as a 0-d array
        present = np.flatnonzero(np.asarray(weights) > 0)
        n, d = len(present), updates.dim
        p = ddp_params(clip=clip, noise_multiplier=noise_multiplier, expected_cohort=expected_cohort,
                       cohort=n, dim=d, bits=bits, beta=beta, k_stddevs=k_stddevs)
        rng = server_rng(key, seed, rnd)  # the server's draws: rotation, dropouts, graph
        rot_seed = int(rng.integers(2**31))  # public randomness shared with the clients
        encoding = DDGEncoding(clip=float(clip), gamma=p.gamma, rot_seed=rot_seed, l2=p.l2,
                               local_std=p.local_std, bits=int(bits))
        seeds = [slot_seed(key, seed, rnd, int(s)) for s in present]  # each client's own draws
        M = 2 ** bits
        dropped = set(np.flatnonzero(rng.random(n) < dropout_rate).tolist())
        protocol = {"round_id": rnd, "neighbours": graph_kind(neighbours, n), "threshold": threshold,
                    "graph_seed": int(rng.integers(2**31)), "dropouts": Dropouts(before_masked=dropped),
                    **protocol_kw}
        try:
            res = updates.secure_sum(encoding, present, seeds, secure=secure, **protocol)
        except SecAggAbort:  # released nothing but the abort bit (memaudit.privacy.aborts)
            return AggregateResult(updates.zeros(), DDPState(state.base, rnd), {
                "secagg_aborted": 1, "survivors": jnp.float32(n - len(dropped)),
                "aggregated_clients": jnp.float32(0), "cohort": jnp.float32(n)})
        total, m = res.total, len(res.survivors)
        v = (total.astype(np.int64) % M)
        v = np.where(v >= M // 2, v - M, v).astype(np.float64)
        estimate = unrotate(v, seed=rot_seed, dim=d) * p.gamma / expected_cohort
        pseudo = jax.tree.map(lambda x: x[None], updates.unflatten(estimate))
        out = base.aggregate(pseudo, jnp.ones((1,), jnp.float32), state.base, key)
        metrics = dict(out.metrics)
        eff = math.sqrt(m) * p.local_std * p.gamma / clip
        metrics.update(survivors=jnp.float32(m), aggregated_clients=jnp.float32(m), cohort=jnp.float32(n),
                       # the survivors' noise shares: their size tells how many survived, so these
                       # carry the ddp_ prefix of the sensitive, cohort-dependent metrics
                       ddp_effective_noise=eff, ddp_noise_std=eff * clip / expected_cohort, clip=clip,
                       ddp_gamma=p.gamma, ddp_dim=p.dim, ddp_l2=p.l2, ddp_l1=p.l1, ddp_local_std=p.local_std,
                       ddp_below_plan=int(m < plan), secagg_aborted=0)
        return AggregateResult(out.update, DDPState(out.state, rnd + 1), metrics)

    return Aggregator(init=init, aggregate=aggregate, jittable=False)


__all__ = [
    "DDPParams",
    "conditional_round",
    "ddg_rdp",
    "ddg_tau",
    "ddp_encode",
    "ddp_params",
    "discrete_gaussian_pmf",
    "distributed_dp",
    "distributed_dp_from_config",
    "hadamard",
    "padded_dim",
    "planned_event_of_config",
    "planned_round_event",
    "planned_survivors",
    "planned_survivors_of_config",
    "rotate",
    "rounded_l2_bound",
    "sample_discrete_gaussian",
    "sample_discrete_gaussian_exact",
    "unrotate",
]


def planned_survivors(*, cohort: float, population: int | None, sampling: str = "poisson",
                      dropout: float = 0.0, min_survivors: int = 3, quantile: float = PLAN_QUANTILE) -> float:
    """The survivors distributed DP's noise is calibrated for: the ``quantile`` of the survivor
    count (Poisson sampling thinned by the dropout is Binomial(population, q (1 - d)); a fixed
    cohort Binomial(cohort, 1 - d)), at least ``min_survivors`` (fewer abort). A round with
    fewer survivors adds less noise than calibrated: its own ledger event says so, and its
    metric ``ddp_below_plan`` is set.

    >>> planned_survivors(cohort=50, population=1000)
    35.0
    >>> planned_survivors(cohort=8, population=None, sampling="fixed")
    8.0
    """
    if sampling == "fixed" or population is None:
        m = stats.binom.ppf(quantile, round(cohort), 1 - dropout) if dropout > 0 else round(cohort)
    else:
        m = stats.binom.ppf(quantile, int(population), min(1.0, cohort / population) * (1 - dropout))
    return float(max(min_survivors, m))


def planned_round_event(*, clip: float, noise_multiplier: float, expected_cohort: float, dim: int,
                        bits: int = 20, beta: float = math.exp(-0.5), k_stddevs: float = 4.0,
                        survivors: float | None = None):
    """The ledger event of a round in which ``survivors`` clients (default: all
    ``expected_cohort``) survive, each adding its share of the noise calibrated for the expected
    cohort.

    What calibration to a target ε bisects over: the same ``ddp_params`` the aggregator
    computes and the same :class:`memaudit.privacy.mechanisms.DistributedDiscreteGaussian`
    event the ledger records from its metrics. A multiplier too small for the bound's range
    (local std < 0.5) gives an infinite curve.
    """
    mech = DistributedDiscreteGaussian()
    cohort = max(1, round(expected_cohort))
    p = ddp_params(clip=clip, noise_multiplier=noise_multiplier, expected_cohort=expected_cohort, cohort=cohort,
                   dim=dim, bits=bits, beta=beta, k_stddevs=k_stddevs)
    if p.local_std < 0.5:
        return RdpCurveEvent(orders=mech.orders, rdp=(math.inf,) * len(mech.orders), label="local std < 0.5")
    m = cohort if survivors is None else max(1, math.floor(survivors))
    return mech.dp_event({"survivors": m, "ddp_l2": p.l2, "ddp_l1": p.l1, "ddp_local_std": p.local_std,
                          "ddp_dim": p.dim})


def planned_survivors_of_config(cfg, population: int | None) -> float:
    """:func:`planned_survivors` for a :class:`memaudit.config.Config`."""
    f, sa = cfg.federated, cfg.privacy.secure_aggregation
    return planned_survivors(cohort=float(f.cohort), population=population, sampling=f.sampling,
                             dropout=float(sa.dropout), min_survivors=int(sa.min_survivors))


def planned_event_of_config(cfg, params: Any, population: int | None = None):
    """``z -> planned_round_event(...)`` for a :class:`memaudit.config.Config` and the model's
    params: calibrated for :func:`planned_survivors_of_config` survivors, not all expected."""
    dim = sum(int(np.size(x)) for x in jax.tree.leaves(params))
    p = cfg.privacy
    m = planned_survivors_of_config(cfg, population)
    return lambda z: planned_round_event(clip=p.clip, noise_multiplier=z, expected_cohort=float(cfg.federated.cohort),
                                         dim=dim, bits=p.secure_aggregation.bits, survivors=m)


def distributed_dp_from_config(base: Aggregator | None, cfg, *, noise_multiplier: float,
                               population: int | None = None) -> Aggregator:
    """``distributed_dp`` with the settings of a :class:`memaudit.config.Config`.

    ``base`` must be a plain mean (not ``secure_aggregation``: this mechanism runs its own
    secure sum). ``noise_multiplier`` is the calibrated z; ``privacy.clip`` must be finite.
    """
    p, sa = cfg.privacy, cfg.privacy.secure_aggregation
    if not math.isfinite(p.clip):
        raise ConfigError(f"privacy.mechanism=distributed needs a finite privacy.clip (got {p.clip}); "
                          "set privacy.clip, e.g. 1.0")
    if p.adaptive_clipping.enabled:
        raise ConfigError("adaptive clipping is not implemented for privacy.mechanism=distributed; "
                          "set privacy.adaptive_clipping.enabled=false or use mechanism=central")
    seed = cfg.train.seed  # public; the round key mixed in by server_rng is secret under DP
    return distributed_dp(base, clip=p.clip, noise_multiplier=noise_multiplier,
                          expected_cohort=float(cfg.federated.cohort), bits=sa.bits,
                          secure=True, threshold=sa.threshold,
                          neighbours=sa.neighbours,
                          dropout_rate=sa.dropout, seed=seed,
                          planned_survivors=planned_survivors_of_config(cfg, population),
                          mode=sa.mode, colluding=sa.colluding_clients, min_survivors=sa.min_survivors)
