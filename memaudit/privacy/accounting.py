"""ε of DP-SGD and friends, interpreted from `dp_accounting` DpEvents.

One DP-SGD run is `SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(σ)), T)`;
an accountant turns it into ε at a δ. Two accountants are offered:

* ``"rdp"``: Rényi DP (Mironov 2017; subsampled Gaussian of Mironov, Talwar, Zhang 2019)
  over a fine grid of orders, the usual conservative figure.
* ``"pld"``: privacy loss distributions (Koskela et al. 2020; Doroshenko et al. 2022),
  tighter. dp_accounting's PLD is a pessimistic estimate, so it is still an upper bound.

References:
  Abadi et al., "Deep Learning with Differential Privacy", CCS 2016.
  Mironov, "Rényi Differential Privacy", CSF 2017.
  Doroshenko et al., "Connect the Dots: Tighter Discrete Approximations of Privacy Loss
  Distributions", PETS 2022.

>>> round(epsilon(dpsgd_event(0.04, 1.5, 2250), 1e-5, accountant="rdp"), 3)
7.329
>>> default_delta(60_000)
1e-06
"""

from __future__ import annotations

import logging
import math
from typing import Literal

import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

Accountant = Literal["rdp", "pld"]

# dp_accounting logs (through absl) every RDP order whose series does not converge and is
# dropped from the minimum; that is expected at small sigma and floods the terminal.
logging.getLogger("absl").setLevel(logging.ERROR)

# 156 orders: a grid at step 0.1 below 10 (where the optimum of a low-ε run lies), step 1 to
# 64, then sparse large orders; finer than dp_accounting's default grid.
RDP_ORDERS: tuple[float, ...] = tuple(
    sorted(
        set(
            np.round(np.concatenate([
                np.arange(1.05, 10.0, 0.1),
                np.arange(10.0, 64.0, 1.0),
                [1.01, 1.02, 1.03, 80, 96, 128, 192, 256, 384, 512, 768, 1024],
            ]), 6).tolist()
        )
    )
)
# value_discretization_interval of the PLD accountant: ~0.1 s per ε. The estimate is pessimistic
# at any interval; at 1e-3 it is within 0.1 % (ε ≈ 7) to 1.5 % (ε ≈ 1) of the 1e-4 figure,
# which costs ten times as long.
PLD_DISCRETIZATION = 1e-3
# dp_accounting builds a mixture-of-Gaussians PLD (user-level ELS) ~10x slower than a sampled
# Gaussian's (~15 s at z = 1 on 1e-3); at 1e-2 it takes ~1 s and is still a pessimistic bound.
MIXTURE_PLD_DISCRETIZATION = 1e-2


def check_delta(delta: float) -> float:
    if not (isinstance(delta, int | float) and 0 < delta < 1):
        raise ValueError(f"delta must be in (0, 1), got {delta}; use e.g. 1e-5 (below 1/N)")
    return float(delta)


def check_dpsgd(q: float, sigma: float, steps: int) -> None:
    if not 0 < q <= 1:
        raise ValueError(f"sampling rate must be in (0, 1], got {q}; use batch_size / N")
    if not sigma >= 0:
        raise ValueError(f"noise multiplier must be >= 0, got {sigma}")
    if int(steps) != steps or steps < 0:
        raise ValueError(f"steps must be a whole number >= 0, got {steps}")


def dpsgd_event(q: float, sigma: float, steps: int) -> dp_event.DpEvent:
    """The DpEvent of `steps` DP-SGD steps with Poisson rate q and noise multiplier σ."""
    check_dpsgd(q, sigma, steps)
    if steps == 0:
        return dp_event.NoOpDpEvent()
    return dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(float(q), dp_event.GaussianDpEvent(float(sigma))), int(steps)
    )


def binomial_pmf(k: int, q: float) -> tuple[float, ...]:
    """P[j of k examples are sampled] for j = 0..k, each independently with probability q.

    >>> [round(p, 4) for p in binomial_pmf(2, 0.5)]
    [0.25, 0.5, 0.25]
    """
    return tuple(math.comb(k, j) * q ** j * (1 - q) ** (k - j) for j in range(k + 1))


def mixture_step_event(q: float, sigma: float, k: int) -> dp_event.DpEvent:
    """One Poisson-sampled Gaussian step against add/remove of a group of k examples sampled
    independently at rate q: j ~ Binomial(k, q) of them are in the batch and move the clipped sum
    by at most jC, so the step is ``MixtureOfGaussiansDpEvent(σ, [0..k], Binomial(k, q))``
    (PLD only). The event of user-level ELS (`memaudit.privacy.mechanisms.ExampleSampledUsers`)
    and of a document spanning k packed sequences (`PrivacyLedger.document`).
    """
    k = int(k)
    return dp_event.MixtureOfGaussiansDpEvent(float(sigma), [float(j) for j in range(k + 1)],
                                              list(binomial_pmf(k, q)))


def rdp_curve(event: dp_event.DpEvent, orders: tuple[float, ...] = RDP_ORDERS) -> np.ndarray:
    """RDP ε(α) of `event` at `orders` (add/remove-one neighbouring)."""
    acc = RdpAccountant(list(orders))
    acc.compose(event)
    return np.asarray(acc.rdp, dtype=np.float64)


def epsilon_from_rdp(orders, rdp, delta: float) -> float:
    """ε at δ from an RDP curve (the conversion of Canonne, Kamath, Steinke 2020)."""
    check_delta(delta)
    rdp = np.asarray(rdp, dtype=np.float64)
    if not np.isfinite(rdp).any():
        return math.inf
    eps, _ = compute_epsilon(np.asarray(orders, dtype=np.float64), rdp, delta)
    return float(eps)


def _is_zero_noise(event: dp_event.DpEvent) -> bool:
    if isinstance(event, dp_event.GaussianDpEvent):
        return event.noise_multiplier == 0
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return event.count > 0 and _is_zero_noise(event.event)
    if isinstance(event, dp_event.PoissonSampledDpEvent):
        return event.sampling_probability > 0 and _is_zero_noise(event.event)
    if isinstance(event, dp_event.ComposedDpEvent):
        return any(_is_zero_noise(e) for e in event.events)
    if isinstance(event, dp_event.MixtureOfGaussiansDpEvent):
        return event.standard_deviation == 0 and any(c > 0 and p > 0 for c, p in
                                                     zip(event.sensitivities, event.sampling_probs, strict=True))
    return isinstance(event, dp_event.NonPrivateDpEvent)


def has_mixture(event: dp_event.DpEvent) -> bool:
    """The event holds a mixture of Gaussians (ELS): only the PLD accountant interprets it."""
    if isinstance(event, dp_event.MixtureOfGaussiansDpEvent):
        return True
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return has_mixture(event.event)
    if isinstance(event, dp_event.ComposedDpEvent):
        return any(has_mixture(e) for e in event.events)
    return False


def epsilon(event: dp_event.DpEvent, delta: float, accountant: Accountant = "rdp", *,
            pld_discretization: float = PLD_DISCRETIZATION) -> float:
    """ε at δ of `event`, from the RDP or PLD accountant. σ = 0 gives +inf.

    The PLD figure is a pessimistic estimate at any discretisation (coarser = larger ε).
    """
    check_delta(delta)
    if _is_zero_noise(event):
        return math.inf
    if has_mixture(event):
        if accountant != "pld":
            raise ValueError("a mixture-of-Gaussians event (user-level ELS) has no RDP accounting in "
                             "dp_accounting; use accountant 'pld'")
        pld_discretization = max(pld_discretization, MIXTURE_PLD_DISCRETIZATION)
    if accountant == "rdp":
        acc = RdpAccountant(list(RDP_ORDERS))
    elif accountant == "pld":
        acc = PLDAccountant(value_discretization_interval=pld_discretization)
    else:
        raise ValueError(f"unknown accountant '{accountant}'; use 'rdp' or 'pld'")
    acc.compose(event)
    return float(acc.get_epsilon(delta))


def group_privacy_bound(event: dp_event.DpEvent, delta: float, k: int, accountant: Accountant = "pld") -> float:
    """The group-privacy ε for k units at δ of an event that is DP per unit.

    (ε₁, δ₁) per unit gives (kε₁, δ₁·Σ_{i<k} e^{iε₁}) for k (`group_epsilon`); δ₁ is solved so
    that the group's δ is `delta` (a fixed point: δ₁ falls as ε₁ grows). For comparison only:
    a user-level accountant (`memaudit.privacy.mechanisms.ExampleSampledUsers`) is tighter.
    """
    check_delta(delta)
    if k == 1:
        return epsilon(event, delta, accountant)
    if _is_zero_noise(event):
        return math.inf
    acc = RdpAccountant(list(RDP_ORDERS)) if accountant == "rdp" else PLDAccountant(
        value_discretization_interval=PLD_DISCRETIZATION)
    acc.compose(event)
    d1, eps1 = delta / k, 0.0
    for _ in range(50):
        eps1 = float(acc.get_epsilon(d1))
        if not math.isfinite(eps1):
            return math.inf
        log_sum = k * eps1 + math.log(-math.expm1(-k * eps1)) - eps1 - math.log(-math.expm1(-eps1)) if eps1 else math.log(k)
        nxt = delta * math.exp(-log_sum)
        if abs(nxt - d1) <= 1e-9 * d1:
            break
        d1 = nxt
    return k * eps1


def default_delta(n: int) -> float:
    """The largest power of ten ≤ 1/(10·n), for a data set of n units."""
    if n < 1:
        raise ValueError(f"data set size must be >= 1, got {n}")
    exp = math.floor(math.log10(1.0 / (10.0 * n)) + 1e-12)
    return float(f"1e{exp}")


# An (ε', δ') guarantee bounds a membership test by TPR ≤ e^ε'·FPR + δ'. It is flagged vacuous
# when that bound is ≥ 1 already at FPR = VACUOUS_FPR, i.e. it rules out no attack that is right
# about everyone while wrong on fewer than 1 in 1000 non-members.
VACUOUS_FPR = 1e-3


def is_vacuous(eps: float, delta: float, *, fpr: float = VACUOUS_FPR) -> bool:
    if not math.isfinite(eps) or delta >= 1:
        return True
    return eps + math.log(fpr) >= math.log1p(-delta)


def group_epsilon(eps: float, delta: float, k: int) -> dict:
    """Group-privacy bound for a user who contributed k sequences.

    Uses the (ε, δ) group-privacy lemma (Dwork & Roth 2014, Lemma 2.2 generalised; Vadhan
    2017): an (ε, δ)-DP mechanism is (kε, δ·Σ_{i<k} e^{iε})-DP for groups of k, and
    Σ_{i<k} e^{iε} ≤ k·e^{(k-1)ε}.

    Returns:
      {"k", "epsilon", "delta", "vacuous", "bound"}; delta is capped at 1 when it overflows.
    """
    if k < 1:
        raise ValueError(f"group size must be >= 1, got {k}")
    if k == 1:
        e, d = float(eps), float(delta)
    elif not math.isfinite(eps):
        e, d = math.inf, 1.0
    elif eps == 0:
        e, d = 0.0, min(1.0, k * delta)
    else:
        e = k * eps
        # log Σ_{i<k} e^{iε} = log((e^{kε} - 1) / (e^ε - 1)), computed stably
        log_sum = k * eps + math.log(-math.expm1(-k * eps)) - eps - math.log(-math.expm1(-eps))
        log_d = math.log(delta) + log_sum
        d = 1.0 if log_d >= 0 else math.exp(log_d)
    return {
        "k": int(k),
        "epsilon": e,
        "delta": d,
        "vacuous": is_vacuous(e, d),
        "bound": "group privacy: (k*eps, delta*sum_{i<k} e^(i*eps))",
    }
