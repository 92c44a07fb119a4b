"""User-level privacy events of federated training (unit "user" in the ledger).

* DP-FedAvg with Poisson cohorts (each user joins a round independently with
  probability q = expected cohort / population):
  ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` per round, composed over rounds
  (RDP and PLD both apply). With adaptive clipping, z is the *total* noise multiplier
  of the (delta sum, unclipped count) pair; the split in
  :func:`memaudit.federated.dp.adaptive_noise_split` keeps it.
* DP-FedAvg with fixed-size cohorts (``cohort`` users drawn without replacement):
  ``SampledWithoutReplacementDpEvent(population, cohort, GaussianDpEvent(z))`` under
  *replace-one* adjacency, which only the RDP accountant interprets. The ledger stores
  it as an :class:`RdpCurveEvent` (label says so), so PLD is reported as unavailable.
* Distributed DP (discrete Gaussian over secure aggregation): per round an
  :class:`RdpCurveEvent` with the KLS 2021 curve for the clients that survived.

References:
    McMahan et al., "Learning Differentially Private Recurrent Language Models", ICLR 2018.
    Wang, Balle, Kasiviswanathan, "Subsampled Rényi Differential Privacy and Analytical
    Moments Accountant", AISTATS 2019 (sampling without replacement).
    Kairouz, Liu, Steinke, "The Distributed Discrete Gaussian Mechanism for Federated
    Learning with Secure Aggregation", ICML 2021.

>>> ev = dpfedavg_event(cohort=100, population=10_000, noise_multiplier=1.0, rounds=500)
>>> round(epsilon(ev, 1e-6), 2) > 0
True
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

import numpy as np
from dp_accounting import dp_event
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp import RdpAccountant

from memaudit.privacy.accounting import RDP_ORDERS, check_delta, epsilon, epsilon_from_rdp
from memaudit.privacy.calibrate import MAX_NOISE_MULTIPLIER, calibrate_noise
from memaudit.privacy.ledger import Event, PrivacyLedger, RdpCurveEvent

Sampling = Literal["poisson", "fixed"]
# dp_accounting's sampled-without-replacement RDP is exact at integer orders and slow at large
# ones (~1 s per curve for 2..256); integer orders to 64 cover ε between ~0.3 and ~50.
FIXED_COHORT_ORDERS: tuple[float, ...] = tuple(float(a) for a in [*range(2, 33), 40, 48, 64])


def _check(cohort: float, population: int, z: float) -> None:
    if not 0 < cohort <= population:
        raise ValueError(f"cohort {cohort} must be in (0, population={population}]; lower federated.cohort")
    if not z >= 0:
        raise ValueError(f"noise multiplier must be >= 0, got {z}")


def poisson_round_event(*, cohort: float, population: int, noise_multiplier: float) -> dp_event.DpEvent:
    """One DP-FedAvg round with Poisson cohorts: PoissonSampled(cohort/population, Gaussian(z))."""
    _check(cohort, population, noise_multiplier)
    return dp_event.PoissonSampledDpEvent(cohort / population, dp_event.GaussianDpEvent(noise_multiplier))


def fixed_cohort_dp_event(*, cohort: int, population: int, noise_multiplier: float) -> dp_event.DpEvent:
    """One round with a fixed-size cohort drawn without replacement (replace-one adjacency)."""
    _check(cohort, population, noise_multiplier)
    return dp_event.SampledWithoutReplacementDpEvent(population, int(cohort),
                                                     dp_event.GaussianDpEvent(noise_multiplier))


def fixed_cohort_rdp(*, cohort: int, population: int, noise_multiplier: float,
                     orders=FIXED_COHORT_ORDERS) -> np.ndarray:
    """Per-round RDP of a fixed-size cohort round, replace-one adjacency (dp_accounting RDP)."""
    if noise_multiplier == 0:
        return np.full(len(orders), np.inf)
    acc = RdpAccountant(list(orders), neighboring_relation=NeighboringRelation.REPLACE_ONE)
    acc.compose(fixed_cohort_dp_event(cohort=cohort, population=population, noise_multiplier=noise_multiplier))
    return np.asarray(acc._rdp, dtype=np.float64)  # dp_accounting exposes no public getter


def fixed_cohort_event(*, cohort: int, population: int, noise_multiplier: float, rounds: int = 1,
                       orders=FIXED_COHORT_ORDERS) -> RdpCurveEvent:
    """The ledger event for ``rounds`` fixed-cohort rounds: an RDP curve, stated as replace-one."""
    rdp = fixed_cohort_rdp(cohort=cohort, population=population, noise_multiplier=noise_multiplier, orders=orders)
    label = (f"SampledWithoutReplacementDpEvent(population={population}, sample={int(cohort)}, "
             f"GaussianDpEvent({noise_multiplier})); replace-one adjacency; RDP accountant only")
    return RdpCurveEvent(orders=tuple(float(o) for o in orders), rdp=tuple(float(r) for r in rdp),
                         count=int(rounds), label=label)


def dpfedavg_event(*, cohort: float, population: int, noise_multiplier: float, rounds: int,
                   sampling: Sampling = "poisson") -> Event:
    """The event of ``rounds`` DP-FedAvg rounds (adaptive clipping: pass the total z)."""
    if sampling == "poisson":
        return dp_event.SelfComposedDpEvent(
            poisson_round_event(cohort=cohort, population=population, noise_multiplier=noise_multiplier),
            int(rounds))
    if sampling == "fixed":
        return fixed_cohort_event(cohort=int(cohort), population=population,
                                  noise_multiplier=noise_multiplier, rounds=rounds)
    raise ValueError(f"sampling must be 'poisson' or 'fixed', got {sampling!r}")


def record_dpfedavg_round(ledger: PrivacyLedger, *, cohort: float, population: int,
                          noise_multiplier: float, sampling: Sampling = "poisson") -> None:
    """Record one completed DP-FedAvg round in a user-level ledger (consecutive rounds coalesce)."""
    if ledger.unit != "user":
        raise ValueError(f"federated privacy is user-level; the ledger's unit is {ledger.unit!r}")
    ledger.record(dpfedavg_event(cohort=cohort, population=population, noise_multiplier=noise_multiplier,
                                 rounds=1, sampling=sampling))


def ddp_round_event(metrics: Mapping[str, float], *, orders=RDP_ORDERS) -> RdpCurveEvent:
    """RDP-curve event of one distributed-DP round, from ``distributed_dp``'s metrics.

    Uses ``survivors``, ``ddp_l2``, ``ddp_l1``, ``ddp_local_std``, ``ddp_dim``; the noise
    counted is only what the survivors added (KLS 2021, Prop. 14, with τ).
    """
    from memaudit.federated.ddp import ddg_rdp  # lazy: the federated package imports jax

    m = round(float(metrics["survivors"]))
    rdp = ddg_rdp(orders, l2=float(metrics["ddp_l2"]), l1=float(metrics["ddp_l1"]),
                  local_std=float(metrics["ddp_local_std"]), n=m, dim=int(metrics["ddp_dim"]))
    label = (f"distributed discrete Gaussian (KLS 2021): survivors={m}, local_std={float(metrics['ddp_local_std']):.6g}, "
             f"l2={float(metrics['ddp_l2']):.6g}, dim={int(metrics['ddp_dim'])}; no sampling amplification")
    return RdpCurveEvent(orders=tuple(float(o) for o in orders), rdp=tuple(float(r) for r in rdp), label=label)


def calibrate_dpfedavg_noise(target_epsilon: float, *, cohort: float, population: int, rounds: int,
                             delta: float, sampling: Sampling = "poisson",
                             accountant: Literal["rdp", "pld"] = "rdp", rtol: float = 1e-3) -> float:
    """Smallest z such that ``rounds`` DP-FedAvg rounds are (target_epsilon, delta)-DP at user level.

    Poisson cohorts reuse :func:`memaudit.privacy.calibrate.calibrate_noise` with
    q = cohort / population; fixed cohorts bisect on the replace-one RDP curve.
    """
    _check(cohort, population, 0.0)
    if sampling == "poisson":
        return calibrate_noise(target_epsilon, q=cohort / population, steps=rounds, delta=delta,
                               accountant=accountant, rtol=min(rtol, 1e-4))
    if sampling != "fixed":
        raise ValueError(f"sampling must be 'poisson' or 'fixed', got {sampling!r}")
    if accountant != "rdp":
        raise ValueError("fixed-size cohorts (replace-one) are accounted with RDP only; use accountant='rdp'")
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target epsilon must be a finite number > 0, got {target_epsilon}")
    check_delta(delta)

    def eps(z: float) -> float:
        rdp = fixed_cohort_rdp(cohort=int(cohort), population=population, noise_multiplier=z)
        return epsilon_from_rdp(FIXED_COHORT_ORDERS, rdp * rounds, delta)

    lo, hi = 0.0, 1.0
    while eps(hi) > target_epsilon:
        lo, hi = hi, 2 * hi
        if hi > MAX_NOISE_MULTIPLIER:
            raise ValueError(f"target epsilon {target_epsilon} needs a noise multiplier above "
                             f"{MAX_NOISE_MULTIPLIER:g}; raise the target or lower the rounds or cohort")
    while hi - lo > rtol * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if eps(mid) > target_epsilon else (lo, mid)
    return hi


__all__ = [
    "FIXED_COHORT_ORDERS",
    "calibrate_dpfedavg_noise",
    "ddp_round_event",
    "dpfedavg_event",
    "epsilon",
    "fixed_cohort_dp_event",
    "fixed_cohort_event",
    "fixed_cohort_rdp",
    "poisson_round_event",
    "record_dpfedavg_round",
]
