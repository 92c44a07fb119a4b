"""Noise-adding mechanisms declare their own privacy event, adjacency and sensitivity.

One object per mechanism builds the per-step (or per-round) event that the ledger records
*and* that calibration to a target ε bisects over, so the two can never disagree:

* :class:`SampledGaussian`: Gaussian noise N(0, (zC)²) on a sum of contributions clipped to
  L2 norm C, one per sampled unit. DP-SGD (unit "example") and central DP-FedAvg (unit
  "user"), optionally with adaptive clipping's noisy count.

  - Poisson sampling, add/remove-one adjacency: the sum moves by at most C, so the
    accounting multiplier is z: ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``.
  - Fixed-size sampling without replacement, replace-one adjacency: one unit's +C becomes
    -C, the sum moves by 2C. dp_accounting's ``SampledWithoutReplacementDpEvent`` RDP takes
    the Gaussian's multiplier relative to the *L2 sensitivity* (its q = 1 case is
    α/(2σ²); google/differential-privacy issue 378), while ``GaussianDpEvent`` elsewhere is
    std / C. The event therefore carries z/2. A test pins this convention.
  - Adaptive clipping (Andrew et al. 2021) also releases a noisy count of unclipped units,
    each indicator encoded as b_i ∈ {-1/2, +1/2} as in the paper, so one unit moves it by
    1/2 (add/remove) or 1 (replace-one). With count noise σ_b the pair (sum, count) is one
    Gaussian mechanism with total multiplier z = (z_Δ⁻² + (2σ_b)⁻²)^(-1/2); the delta noise
    z_Δ is split off that total (:meth:`SampledGaussian.delta_noise_multiplier`).

* :class:`DistributedDiscreteGaussian`: the sum of the survivors' discrete Gaussian shares
  over secure aggregation (KLS 2021), zero-out adjacency, no amplification by sampling; its
  per-round parameters come from ``distributed_dp``'s metrics.

Who the guarantee is against (``server_view``): amplification by sampling holds against an
adversary who sees only what is released. The server selects the cohort and (under secure
aggregation) learns the survivors; under central DP it also sees the clipped sum before it
adds the noise, so there is no DP guarantee against it ("none"). Distributed DP's event uses
no amplification, so it holds against the server as well ("same").

References:
    Abadi et al., "Deep Learning with Differential Privacy", CCS 2016.
    McMahan et al., "Learning Differentially Private Recurrent Language Models", ICLR 2018.
    Wang, Balle, Kasiviswanathan, "Subsampled Rényi Differential Privacy and Analytical
    Moments Accountant", AISTATS 2019 (sampling without replacement, replace-one).
    Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning with Adaptive
    Clipping", NeurIPS 2021.
    Kairouz, Liu, Steinke, "The Distributed Discrete Gaussian Mechanism for Federated
    Learning with Secure Aggregation", ICML 2021.

>>> m = SampledGaussian(name="DP-FedAvg", unit="user", noise_multiplier=1.0, population=1000,
...                     expected=10, sampling="fixed")
>>> m.adjacency, m.sensitivity, m.accounting_multiplier
('replace-one', 2.0, 0.5)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
from dp_accounting import dp_event
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp import RdpAccountant

from memaudit.privacy.accounting import (
    RDP_ORDERS,
    Accountant,
    binomial_pmf,
    check_delta,
    mixture_step_event,
)
from memaudit.privacy.ddg import ddg_rdp
from memaudit.privacy.events import RdpCurveEvent, repeated
from memaudit.privacy.ledger import PrivacyLedger

Unit = Literal["example", "user"]
Adjacency = Literal["add/remove", "replace-one", "zero-out"]
ServerView = Literal["none", "same", "n/a"]
# dp_accounting's sampled-without-replacement RDP is exact at integer orders and slow at large
# ones (~1 s per curve for 2..256); integer orders to 64 cover ε between ~0.3 and ~50.
FIXED_COHORT_ORDERS: tuple[float, ...] = tuple(float(a) for a in [*range(2, 33), 40, 48, 64])
MAX_NOISE_MULTIPLIER = 1000.0


def replace_one_multiplier(noise_multiplier: float) -> float:
    """The multiplier dp_accounting's sampled-without-replacement RDP needs for std zC.

    Replace-one moves a sum of C-clipped contributions by 2C, and that RDP normalises the
    noise by the L2 sensitivity (google/differential-privacy issue 378), so it gets z / 2.
    """
    return float(noise_multiplier) / 2.0


def adaptive_noise_split(noise_multiplier: float, count_noise: float) -> float:
    """z_Δ = (z⁻² - (2σ_b)⁻²)^(-1/2): the delta noise that keeps the total multiplier z.

    Valid for the count encoded as b_i ∈ {-1/2, 1/2} (sensitivity 1/2 per unit, Andrew et
    al. 2021, Sec. 3), which is what ``dp_fedavg`` releases.

    Raises:
        ValueError: when z >= 2σ_b (the count query alone would use up the budget).

    >>> round(adaptive_noise_split(1.0, 5.0), 4)
    1.005
    """
    z, sb = float(noise_multiplier), float(count_noise)
    if z == 0.0:
        return 0.0
    if sb <= 0 or z ** -2 <= (2 * sb) ** -2:
        raise ValueError(
            f"adaptive clipping cannot split noise multiplier {z} with count noise σ_b={sb}: need "
            f"z < 2σ_b; raise privacy.adaptive_clipping.count_noise above {z / 2:g} (or the cohort)"
        )
    return (z ** -2 - (2 * sb) ** -2) ** -0.5


def effective_noise_multiplier(delta_noise: float, count_noise: float) -> float:
    """Total z of (sum of clipped deltas, noisy ±1/2 count): the inverse of the split."""
    if delta_noise == 0.0 or count_noise == 0.0:
        return 0.0
    return (delta_noise ** -2 + (2 * count_noise) ** -2) ** -0.5


def dpsgd_step_event(q: float, noise_multiplier: float) -> dp_event.DpEvent:
    """One Poisson-sampled Gaussian step (add/remove): ``PoissonSampledDpEvent(q, Gaussian(z))``."""
    return dp_event.PoissonSampledDpEvent(float(q), dp_event.GaussianDpEvent(float(noise_multiplier)))


def _rdp_curve_event(event: dp_event.DpEvent, orders, label: str):
    acc = RdpAccountant(list(orders), neighboring_relation=NeighboringRelation.REPLACE_ONE)
    acc.compose(event)
    rdp = np.asarray(acc._rdp, dtype=np.float64)  # dp_accounting exposes no public getter
    return RdpCurveEvent(orders=tuple(float(o) for o in orders), rdp=tuple(float(r) for r in rdp), label=label)


@dataclass(frozen=True, kw_only=True)
class SampledGaussian:
    """Gaussian noise (std zC) on a sum of C-clipped contributions of sampled units.

    Args:
        name: "DP-SGD" or "DP-FedAvg" (shown in the ledger).
        unit: "example" or "user".
        noise_multiplier: z, the *total* multiplier (std of the noise on the sum / C).
        population: N, the number of units sampled from.
        expected: expected batch / cohort size (Poisson), or its exact size (fixed).
        sampling: "poisson" (add/remove) or "fixed" (without replacement, replace-one).
        count_noise: σ_b of adaptive clipping's noisy count (None: no count released).
    """

    name: str
    unit: Unit
    noise_multiplier: float
    population: int
    expected: float
    sampling: Literal["poisson", "fixed"] = "poisson"
    count_noise: float | None = None
    centralized: bool = False  # a user-level mechanism run by the trainer itself (ULS): no server
    max_examples_per_user: int | None = None  # ULS: the contribution bound k, declared

    def __post_init__(self) -> None:
        if not 0 < self.expected <= self.population:
            raise ValueError(f"cohort/batch {self.expected} must be in (0, population={self.population}]; "
                             "lower federated.cohort or train.batch_size")
        if not (self.noise_multiplier >= 0 and math.isfinite(self.noise_multiplier)):
            raise ValueError(f"noise multiplier must be a finite number >= 0, got {self.noise_multiplier}")
        if self.sampling not in ("poisson", "fixed"):
            raise ValueError(f"sampling must be 'poisson' or 'fixed', got {self.sampling!r}")
        if self.sampling == "fixed" and int(self.expected) != self.expected:
            raise ValueError(f"a fixed-size cohort must be a whole number, got {self.expected}")

    @property
    def sampling_rate(self) -> float:
        return self.expected / self.population

    @property
    def adjacency(self) -> Adjacency:
        return "add/remove" if self.sampling == "poisson" else "replace-one"

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of the noised sum under the adjacency, in units of C."""
        return 1.0 if self.sampling == "poisson" else 2.0

    @property
    def accounting_multiplier(self) -> float:
        """std / sensitivity: the multiplier the event carries."""
        return self.noise_multiplier / self.sensitivity

    @property
    def delta_noise_multiplier(self) -> float:
        """z_Δ: std / C of the noise on the sum (z itself without adaptive clipping)."""
        if self.count_noise is None:
            return self.noise_multiplier
        return adaptive_noise_split(self.noise_multiplier, self.count_noise)

    def with_noise(self, noise_multiplier: float) -> SampledGaussian:
        return replace(self, noise_multiplier=float(noise_multiplier))

    def dp_event(self, metrics: Mapping[str, Any] | None = None) -> Any:
        """The event of one step / round (``metrics`` unused: nothing here depends on the data)."""
        z = self.accounting_multiplier
        if self.sampling == "poisson":
            return dpsgd_step_event(self.sampling_rate, z)
        inner = dp_event.SampledWithoutReplacementDpEvent(
            int(self.population), int(self.expected), dp_event.GaussianDpEvent(z))
        if self.noise_multiplier == 0:

            return RdpCurveEvent(orders=FIXED_COHORT_ORDERS, rdp=(math.inf,) * len(FIXED_COHORT_ORDERS),
                                 label=self._fixed_label())
        return _rdp_curve_event(inner, FIXED_COHORT_ORDERS, self._fixed_label())

    def _fixed_label(self) -> str:
        return (f"SampledWithoutReplacementDpEvent(population={int(self.population)}, sample={int(self.expected)}, "
                f"GaussianDpEvent({self.accounting_multiplier:.6g})); noise z={self.noise_multiplier:.6g} on "
                "sensitivity 2C: replace-one adjacency; RDP accountant only")

    def declaration(self) -> dict[str, Any]:
        """What the ledger states about this mechanism (all derived from its parameters)."""
        sampled = "batch" if self.unit == "example" else "cohort"
        hidden = (f"which {self.unit}s were sampled into each {sampled}, the noise, and every "
                  "intermediate (unnoised) sum; only the noised updates and models are seen")
        out = {"mechanism": self.name + (" + adaptive clipping (noisy +-1/2 count)" if self.count_noise else ""),
               "unit": self.unit, "adjacency": self.adjacency, "sampling": self.sampling,
               "sensitivity": f"{self.sensitivity:g} C" + (
                   f" (sum), {self.sensitivity / 2:g} (count)" if self.count_noise else ""),
               "noise_multiplier": self.noise_multiplier, "accounting_multiplier": self.accounting_multiplier,
               "assumes_hidden": hidden, "server_view": self.server_view}
        if self.max_examples_per_user is not None:
            out["max_examples_per_user"] = int(self.max_examples_per_user)
        if self.count_noise is not None:
            out["count_noise"] = self.count_noise
            out["delta_noise_multiplier"] = self.delta_noise_multiplier
        return out

    @property
    def server_view(self) -> ServerView:
        # central DP: the aggregator sees the clipped sum before adding the noise
        return "none" if self.unit == "user" and not self.centralized else "n/a"


@dataclass(frozen=True, kw_only=True)
class ExampleSampledUsers:
    """ELS: example-level Poisson sampling with each user's examples capped at k, per-example
    clipping, Gaussian noise zC on the sum; accounted at the *user* level.

    A user with k capped examples has j ~ Binomial(k, q) of them in a step's batch, which moves
    the clipped sum by at most jC; so against add/remove-one *user* one step is a mixture of
    Gaussians, ``MixtureOfGaussiansDpEvent(z, [0..k], Binomial(k, q))``, which dp_accounting's
    PLD accountant interprets (RDP does not). This is tight where the group-privacy bound of the
    example-level ε (:meth:`example_event`, for comparison only) is vacuous.

    Args:
        noise_multiplier: z (std of the noise on the sum / C).
        population: N, the capped examples sampled from.
        expected: the expected batch size qN.
        max_examples_per_user: k, the contribution bound.

    References:
        Charles, Ganesh, McKenna, McMahan, Mitchell, Pillutla, Rush, "Fine-Tuning Large Language
        Models with User-Level Differential Privacy", SaTML 2025 (arXiv 2407.07737).
        Choquette-Choo, Ganesh, Steinke, Thakurta, "Privacy Amplification for Matrix
        Mechanisms", ICLR 2024 (arXiv 2310.15526; the mixture-of-Gaussians mechanism).

    >>> m = ExampleSampledUsers(noise_multiplier=1.0, population=100, expected=10, max_examples_per_user=2)
    >>> m.dp_event().sensitivities, [round(p, 2) for p in m.dp_event().sampling_probs]
    ([0.0, 1.0, 2.0], [0.81, 0.18, 0.01])
    """

    noise_multiplier: float
    population: int
    expected: float
    max_examples_per_user: int
    name: str = "ELS (user-level DP-SGD, example sampling)"
    unit: Unit = "user"
    sampling: str = "poisson"
    adjacency: Adjacency = "add/remove"
    server_view: ServerView = "n/a"

    def __post_init__(self) -> None:
        if not 0 < self.expected <= self.population:
            raise ValueError(f"batch {self.expected} must be in (0, population={self.population}]; "
                             "lower train.batch_size")
        if not (self.noise_multiplier >= 0 and math.isfinite(self.noise_multiplier)):
            raise ValueError(f"noise multiplier must be a finite number >= 0, got {self.noise_multiplier}")
        if int(self.max_examples_per_user) != self.max_examples_per_user or self.max_examples_per_user < 1:
            raise ValueError(f"max_examples_per_user must be a whole number >= 1, got {self.max_examples_per_user}")

    @property
    def sampling_rate(self) -> float:
        return self.expected / self.population

    @property
    def accounting_multiplier(self) -> float:
        return self.noise_multiplier

    def with_noise(self, noise_multiplier: float) -> ExampleSampledUsers:
        return replace(self, noise_multiplier=float(noise_multiplier))

    def dp_event(self, metrics: Mapping[str, Any] | None = None) -> Any:
        """One step against add/remove-one user: the mixture of Gaussians over j sampled examples."""
        return mixture_step_event(self.sampling_rate, self.noise_multiplier, int(self.max_examples_per_user))

    def example_event(self) -> Any:
        """The same step against add/remove-one *example* (for the group-privacy comparison)."""
        return dpsgd_step_event(self.sampling_rate, self.noise_multiplier)

    def declaration(self) -> dict[str, Any]:
        k = int(self.max_examples_per_user)
        return {"mechanism": self.name, "unit": self.unit, "adjacency": self.adjacency,
                "sampling": "poisson (examples)", "max_examples_per_user": k,
                "sensitivity": f"j C, j ~ Binomial({k}, q) of the user's examples in the batch",
                "noise_multiplier": self.noise_multiplier, "accounting_multiplier": self.noise_multiplier,
                "assumes_hidden": "which examples were sampled into each batch, the noise, and every "
                                  "intermediate (unnoised) sum; only the noised updates and models are seen",
                "server_view": self.server_view}


@dataclass(frozen=True, kw_only=True)
class DistributedDiscreteGaussian:
    """Distributed DP: the survivors' discrete Gaussian shares summed under secure aggregation.

    The per-round parameters (``survivors``, ``ddp_l2``, ``ddp_l1``, ``ddp_local_std``,
    ``ddp_dim``) are read from ``distributed_dp``'s metrics of that round. Zero-out
    adjacency (one survivor's quantised update replaced by 0, its noise share kept); no
    amplification by sampling, so the same event holds against the server.
    """

    name: str = "distributed discrete Gaussian over secure aggregation"
    unit: Unit = "user"
    orders: tuple[float, ...] = RDP_ORDERS

    adjacency: Adjacency = "zero-out"
    server_view: ServerView = "same"

    def dp_event(self, metrics: Mapping[str, Any] | None = None) -> Any:
        if metrics is None:
            raise ValueError("distributed DP's event needs the round's metrics (survivors, ddp_l2, ...)")
        m = round(float(metrics["survivors"]))
        l2, l1 = float(metrics["ddp_l2"]), float(metrics["ddp_l1"])
        std, dim = float(metrics["ddp_local_std"]), int(metrics["ddp_dim"])
        rdp = ddg_rdp(self.orders, l2=l2, l1=l1, local_std=std, n=m, dim=dim)
        label = (f"distributed discrete Gaussian (KLS 2021): survivors={m}, local_std={std:.6g}, l2={l2:.6g}, "
                 f"dim={dim}; zero-out adjacency (the target's own noise share counted); no sampling "
                 "amplification")
        return RdpCurveEvent(orders=tuple(float(o) for o in self.orders), rdp=tuple(float(r) for r in rdp),
                             label=label)

    def declaration(self) -> dict[str, Any]:
        return {"mechanism": self.name, "unit": self.unit, "adjacency": self.adjacency, "sampling": "any",
                "sensitivity": "ddp_l2 of the quantised, rotated update (KLS 2021 Thm. 1), per round",
                "assumes_hidden": "each client's noise share, and every partial sum (secure aggregation "
                                  "reveals only the survivors' total); cohort membership is not assumed hidden",
                "server_view": self.server_view}


Mechanism = SampledGaussian | ExampleSampledUsers | DistributedDiscreteGaussian


def calibrate(target_epsilon: float, make: Callable[[float], Any], *, steps: int, delta: float,
              accountant: Accountant = "rdp", unit: Unit = "example", eps_tol: float = 1e-4,
              max_noise_multiplier: float = MAX_NOISE_MULTIPLIER) -> float:
    """Smallest z (to ``eps_tol`` in ε) with ``steps`` steps of the event ``make(z)`` within target.

    ``make`` is the mechanism's own event builder, e.g. ``lambda z: mech.with_noise(z).dp_event()``.

    The ε is the ledger's own (a :class:`PrivacyLedger` holding exactly the events that run
    would record), so calibration and accounting agree by construction. The z returned
    satisfies target - eps_tol <= ε(z) <= target, unless z hits the bisection floor.

    Raises:
        ValueError: a target that needs z > max_noise_multiplier, or bad arguments.
    """

    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target epsilon must be a finite number > 0, got {target_epsilon}")
    check_delta(delta)
    if int(steps) != steps or steps < 0:
        raise ValueError(f"steps must be a whole number >= 0, got {steps}")
    if steps == 0:
        return 0.0

    def eps(z: float) -> float:
        return PrivacyLedger(unit=unit, delta=delta, events=[repeated(make(z), steps)]).epsilon(accountant)

    lo, hi = 0.0, 1.0
    while eps(hi) > target_epsilon:
        lo, hi = hi, hi * 2
        if hi > max_noise_multiplier:
            floor = eps(max_noise_multiplier)
            if floor > target_epsilon:
                raise ValueError(
                    f"target epsilon {target_epsilon} needs a noise multiplier above {max_noise_multiplier:g} "
                    f"over {steps} steps at delta={delta} (the smallest reachable epsilon is {floor:.4g}); "
                    "raise the target epsilon, or reduce the steps, the sampling rate or "
                    "privacy.max_examples_per_user")
            hi = max_noise_multiplier
            break
    e_hi = eps(hi)
    while target_epsilon - e_hi > eps_tol and hi - lo > 1e-12 * hi:
        mid = 0.5 * (lo + hi)
        e_mid = eps(mid)
        if e_mid > target_epsilon:
            lo = mid
        else:
            hi, e_hi = mid, e_mid
    return hi


__all__ = [
    "FIXED_COHORT_ORDERS",
    "Adjacency",
    "DistributedDiscreteGaussian",
    "ExampleSampledUsers",
    "Mechanism",
    "SampledGaussian",
    "adaptive_noise_split",
    "binomial_pmf",
    "calibrate",
    "dpsgd_step_event",
    "effective_noise_multiplier",
    "repeated",
    "replace_one_multiplier",
]
