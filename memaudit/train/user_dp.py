"""DP for centralized training: the sampler, σ and the privacy plan of example-level DP-SGD and
of user-level ELS and ULS, shared by both engines (torch and jax).

Both bound a user's contribution to k sequences (`privacy.max_examples_per_user`; which k is
drawn from train.seed, `memaudit.train.sampling.cap_per_user`) and give a guarantee per *user*,
so a centralized run and a federated one (DP-FedAvg) compare at equal ε per user:

* **ELS**: Poisson sampling of the capped sequences at q = batch_size / N_capped, per-example
  clipping, noise zC on the sum: ordinary DP-SGD, accounted against add/remove-one user by the
  mixture of Gaussians over the j ~ Binomial(k, q) sampled sequences of one user
  (`memaudit.privacy.mechanisms.ExampleSampledUsers`; PLD only).
* **ULS**: Poisson sampling of users at q = (batch_size / k) / U, so a step costs the same
  sequences as ELS at the cap; each sampled user's gradient is the sum over its ≤ k sequences,
  clipped as one unit (`DPSGD.step_gradients(group_size=...)`, the ghost-norm path), noise zC,
  divided by the expected number of users: DP-FedSGD run in the datacenter, accounted as a
  Poisson-sampled Gaussian over users.

References:
    Charles, Ganesh, McKenna, McMahan, Mitchell, Pillutla, Rush, "Fine-Tuning Large Language
    Models with User-Level Differential Privacy", SaTML 2025 (arXiv 2407.07737).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from memaudit.errors import ConfigError
from memaudit.privacy.accounting import default_delta
from memaudit.privacy.calibrate import calibrate_noise, calibration_accountant
from memaudit.privacy.mechanisms import ExampleSampledUsers, SampledGaussian, calibrate
from memaudit.privacy.plan import PrivacyPlan
from memaudit.train.sampling import PoissonSampler, SubsetSampler, UserPoissonSampler

ELS_NAME = "ELS (user-level DP-SGD, example sampling)"
ULS_NAME = "ULS (user-level DP-SGD, user sampling)"


def els_mechanism(*, noise_multiplier: float, population: int, expected: float, k: int) -> ExampleSampledUsers:
    return ExampleSampledUsers(noise_multiplier=noise_multiplier, population=population, expected=expected,
                               max_examples_per_user=k, name=ELS_NAME)


def uls_mechanism(*, noise_multiplier: float, users: int, expected_users: float, k: int) -> SampledGaussian:
    return SampledGaussian(name=ULS_NAME, unit="user", noise_multiplier=noise_multiplier, population=users,
                           expected=expected_users, centralized=True, max_examples_per_user=k)


def _sigma(cfg: Any, mech: Any, delta: float, accountant: str) -> tuple[float, dict[str, Any] | None]:
    """privacy.noise_multiplier, or σ calibrated to the target user-level ε with the mechanism's event."""
    p = cfg.privacy
    if p.noise_multiplier is not None:
        return float(p.noise_multiplier), None
    try:
        sigma = calibrate(p.target_epsilon, lambda z: mech.with_noise(z).dp_event(), steps=cfg.train.steps,
                          delta=delta, accountant=accountant, unit="user", eps_tol=1e-4)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return sigma, {"target_epsilon": p.target_epsilon, "accountant": accountant, "steps": cfg.train.steps,
                   "sampling_rate": mech.sampling_rate, "noise_multiplier": sigma, "unit": "user"}


def _plan(cfg: Any, mech: Any, delta: float, calibration: Any, randomness: Any) -> PrivacyPlan:
    return PrivacyPlan(unit="user", delta=delta, noise_multiplier=mech.noise_multiplier,
                       sampling_rate=mech.sampling_rate, mechanism=mech, calibration=calibration,
                       reproducible_randomness=randomness.reproducible)


def els_setup(cfg: Any, train_set: Any, rows: np.ndarray, randomness: Any
              ) -> tuple[float, SubsetSampler, PrivacyPlan, int]:
    """ELS over the capped `rows`: (σ, sampler, plan, rows per clipped unit = 1)."""
    p, k, m = cfg.privacy, int(cfg.privacy.max_examples_per_user), len(rows)
    if cfg.train.batch_size > m:
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} exceeds the {m} sequences left at "
                          f"privacy.max_examples_per_user={k}; lower train.batch_size or raise k")
    users = int(np.unique(train_set.user_index).size)
    delta = p.delta if p.delta is not None else default_delta(users)
    mech = els_mechanism(noise_multiplier=0.0, population=m, expected=float(cfg.train.batch_size), k=k)
    sigma, calibration = _sigma(cfg, mech, delta, "pld")  # only PLD interprets the mixture
    mech = mech.with_noise(sigma)
    sampler = SubsetSampler(rows, mech.sampling_rate, randomness)
    return sigma, sampler, _plan(cfg, mech, delta, calibration, randomness), 1


def uls_setup(cfg: Any, train_set: Any, rows: np.ndarray, randomness: Any
              ) -> tuple[float, UserPoissonSampler, PrivacyPlan, int]:
    """ULS over the users of the capped `rows`: (σ, sampler, plan, rows per user group)."""
    p, k = cfg.privacy, int(cfg.privacy.max_examples_per_user)
    groups = UserPoissonSampler(train_set.user_index, rows, 1.0, randomness)
    users = groups.num_users
    expected = cfg.train.batch_size / k
    if expected > users:
        raise ConfigError(f"ULS samples train.batch_size / k = {expected:g} users per step but the data has "
                          f"{users}; lower train.batch_size or raise privacy.max_examples_per_user")
    delta = p.delta if p.delta is not None else default_delta(users)
    mech = uls_mechanism(noise_multiplier=0.0, users=users, expected_users=expected, k=k)
    acc = calibration_accountant(p.accountant)
    sigma, calibration = _sigma(cfg, mech, delta, acc)
    mech = mech.with_noise(sigma)
    sampler = UserPoissonSampler(train_set.user_index, rows, mech.sampling_rate, randomness)
    return sigma, sampler, _plan(cfg, mech, delta, calibration, randomness), sampler.group_size


def example_setup(cfg: Any, train_set: Any, rows: np.ndarray, randomness: Any, *,
                  max_sequences_per_document: int | None = None) -> tuple[float, Any, PrivacyPlan, int]:
    """Example-level DP-SGD over `rows` (every row, or k per user): (σ, sampler, plan, 1).

    Poisson sampling at q = batch_size / len(rows), σ given or calibrated to the target ε, and a
    Poisson-sampled Gaussian per step against add/remove-one example (the DP-SGD event of
    `memaudit.train.dpsgd.dpsgd_mechanism`).
    """
    p, n, m = cfg.privacy, len(train_set), len(rows)
    if cfg.train.batch_size > m:  # (checks.check_data refused a batch above every sequence)
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} exceeds the {m} sequences left at "
                          f"privacy.max_examples_per_user; lower train.batch_size or raise k")
    q = cfg.train.batch_size / m
    delta = p.delta if p.delta is not None else default_delta(n)
    sigma, calibration = p.noise_multiplier, None
    if sigma is None:
        acc = calibration_accountant(p.accountant)
        sigma = calibrate_noise(p.target_epsilon, q=q, steps=cfg.train.steps, delta=delta, accountant=acc)
        calibration = {"target_epsilon": p.target_epsilon, "accountant": acc,
                       "steps": cfg.train.steps, "sampling_rate": q, "noise_multiplier": sigma}
    sampler = PoissonSampler(n, q, randomness) if m == n else SubsetSampler(rows, q, randomness)
    mech = SampledGaussian(name="DP-SGD", unit="example", noise_multiplier=float(sigma), population=m,
                           expected=sampler.expected_batch_size)
    counts = np.bincount(train_set.user_index[rows]) if m else np.zeros(1, int)
    plan = PrivacyPlan(unit="example", delta=delta, noise_multiplier=float(sigma), sampling_rate=q,
                       mechanism=mech, calibration=calibration, max_sequences_per_user=int(counts.max()),
                       # of all trained sequences: an upper bound where k caps some
                       max_sequences_per_document=max_sequences_per_document,
                       reproducible_randomness=randomness.reproducible)
    return float(sigma), sampler, plan, 1
