"""User-level privacy events of federated training (unit "user" in the ledger).

Thin builders over :mod:`memaudit.privacy.mechanisms`, where each mechanism declares its
event, adjacency and sensitivity:

* DP-FedAvg with Poisson cohorts (each user joins a round independently with probability
  q = expected cohort / population), add/remove adjacency:
  ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` per round (RDP and PLD both apply). With
  adaptive clipping, z is the *total* multiplier of the (delta sum, ±1/2 count) pair.
* DP-FedAvg with fixed-size cohorts (``cohort`` users drawn without replacement),
  replace-one adjacency, sensitivity 2C: ``SampledWithoutReplacementDpEvent(population,
  cohort, GaussianDpEvent(z / 2))``, which only the RDP accountant interprets; stored as an
  :class:`RdpCurveEvent` whose label says so, so PLD is reported as unavailable.
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

from collections.abc import Mapping
from typing import Literal

import numpy as np
from dp_accounting import dp_event

from memaudit.privacy.accounting import RDP_ORDERS, epsilon
from memaudit.privacy.ledger import Event, PrivacyLedger, RdpCurveEvent
from memaudit.privacy.mechanisms import (
    FIXED_COHORT_ORDERS,
    DistributedDiscreteGaussian,
    SampledGaussian,
    calibrate,
    repeated,
    replace_one_multiplier,
)

Sampling = Literal["poisson", "fixed"]


def dpfedavg_mechanism(*, cohort: float, population: int, noise_multiplier: float,
                       sampling: Sampling = "poisson", count_noise: float | None = None) -> SampledGaussian:
    """The mechanism ``dp_fedavg`` runs (``count_noise``: adaptive clipping's σ_b)."""
    return SampledGaussian(name="DP-FedAvg", unit="user", noise_multiplier=float(noise_multiplier),
                           population=int(population), expected=cohort, sampling=sampling,
                           count_noise=count_noise)


def poisson_round_event(*, cohort: float, population: int, noise_multiplier: float) -> dp_event.DpEvent:
    """One DP-FedAvg round with Poisson cohorts: PoissonSampled(cohort/population, Gaussian(z))."""
    return dpfedavg_mechanism(cohort=cohort, population=population, noise_multiplier=noise_multiplier).dp_event()


def fixed_cohort_dp_event(*, cohort: int, population: int, noise_multiplier: float) -> dp_event.DpEvent:
    """One fixed-cohort round as dp_accounting sees it: the Gaussian carries z/2 (sensitivity 2C)."""
    dpfedavg_mechanism(cohort=cohort, population=population, noise_multiplier=noise_multiplier, sampling="fixed")
    return dp_event.SampledWithoutReplacementDpEvent(
        population, int(cohort), dp_event.GaussianDpEvent(replace_one_multiplier(noise_multiplier)))


def fixed_cohort_rdp(*, cohort: int, population: int, noise_multiplier: float,
                     orders=FIXED_COHORT_ORDERS) -> np.ndarray:
    """Per-round RDP of a fixed-size cohort round, replace-one adjacency, std zC on sensitivity 2C."""
    mech = dpfedavg_mechanism(cohort=cohort, population=population, noise_multiplier=noise_multiplier,
                              sampling="fixed")
    return np.asarray(mech.dp_event().at(np.asarray(orders, float)), dtype=np.float64)


def fixed_cohort_event(*, cohort: int, population: int, noise_multiplier: float, rounds: int = 1) -> RdpCurveEvent:
    """The ledger event for ``rounds`` fixed-cohort rounds: an RDP curve, stated as replace-one."""
    mech = dpfedavg_mechanism(cohort=cohort, population=population, noise_multiplier=noise_multiplier,
                              sampling="fixed")
    return repeated(mech.dp_event(), rounds)


def dpfedavg_event(*, cohort: float, population: int, noise_multiplier: float, rounds: int,
                   sampling: Sampling = "poisson") -> Event:
    """The event of ``rounds`` DP-FedAvg rounds (adaptive clipping: pass the total z)."""
    if sampling not in ("poisson", "fixed"):
        raise ValueError(f"sampling must be 'poisson' or 'fixed', got {sampling!r}")
    mech = dpfedavg_mechanism(cohort=cohort, population=population, noise_multiplier=noise_multiplier,
                              sampling=sampling)
    return repeated(mech.dp_event(), rounds)


def record_dpfedavg_round(ledger: PrivacyLedger, *, cohort: float, population: int,
                          noise_multiplier: float, sampling: Sampling = "poisson") -> None:
    """Record one completed DP-FedAvg round in a user-level ledger (consecutive rounds coalesce)."""
    if ledger.unit != "user":
        raise ValueError(f"federated privacy is user-level; the ledger's unit is {ledger.unit!r}")
    ledger.record_mechanism(dpfedavg_mechanism(cohort=cohort, population=population,
                                               noise_multiplier=noise_multiplier, sampling=sampling))


def ddp_round_event(metrics: Mapping[str, float], *, orders=RDP_ORDERS) -> RdpCurveEvent:
    """RDP-curve event of one distributed-DP round, from ``distributed_dp``'s metrics.

    Uses ``survivors``, ``ddp_l2``, ``ddp_l1``, ``ddp_local_std``, ``ddp_dim``; the noise
    counted is only what the survivors added (KLS 2021, Prop. 14, with τ), zero-out adjacency.
    """
    return DistributedDiscreteGaussian(orders=tuple(orders)).dp_event(metrics)


def calibrate_dpfedavg_noise(target_epsilon: float, *, cohort: float, population: int, rounds: int,
                             delta: float, sampling: Sampling = "poisson",
                             accountant: Literal["rdp", "pld"] = "rdp", eps_tol: float = 1e-4) -> float:
    """Smallest z such that ``rounds`` DP-FedAvg rounds are (target_epsilon, delta)-DP at user level.

    Bisects over the mechanism's own round event, the one the ledger records.
    """
    mech = dpfedavg_mechanism(cohort=cohort, population=population, noise_multiplier=0.0, sampling=sampling)
    if sampling == "fixed" and accountant != "rdp":
        raise ValueError("fixed-size cohorts (replace-one) are accounted with RDP only; use accountant='rdp'")
    return calibrate(target_epsilon, lambda z: mech.with_noise(z).dp_event(), steps=rounds, delta=delta,
                     accountant=accountant, unit="user", eps_tol=eps_tol)


__all__ = [
    "FIXED_COHORT_ORDERS",
    "calibrate_dpfedavg_noise",
    "ddp_round_event",
    "dpfedavg_event",
    "dpfedavg_mechanism",
    "epsilon",
    "fixed_cohort_dp_event",
    "fixed_cohort_event",
    "fixed_cohort_rdp",
    "poisson_round_event",
    "record_dpfedavg_round",
]
