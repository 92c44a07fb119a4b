"""Noise calibration of DP-SGD: the smallest σ whose ε at δ stays within a target, by bisection.

ε is decreasing in σ for Poisson-subsampled Gaussian steps, so bisection on σ finds the
boundary; the σ returned always satisfies target - 1e-4 <= ε(σ) <= target. It bisects over
the very event the ledger records (:func:`memaudit.privacy.mechanisms.calibrate`).

>>> s = calibrate_noise(7.33, q=0.04, steps=2250, delta=1e-5)
>>> 1.45 < s <= 1.5
True
"""

from __future__ import annotations

from memaudit.privacy.accounting import Accountant, check_delta, check_dpsgd
from memaudit.privacy.mechanisms import MAX_NOISE_MULTIPLIER, calibrate, dpsgd_step_event


def calibrate_noise(
    target_epsilon: float,
    *,
    q: float,
    steps: int,
    delta: float,
    accountant: Accountant = "rdp",
    eps_tol: float = 1e-4,
    max_noise_multiplier: float = MAX_NOISE_MULTIPLIER,
) -> float:
    """σ such that `steps` DP-SGD steps at rate q are (target_epsilon, delta)-DP.

    Args:
      target_epsilon: the ε budget, > 0.
      q: Poisson sampling rate in (0, 1].
      steps: number of steps planned.
      delta: δ in (0, 1).
      accountant: "rdp" or "pld" (PLD gives a smaller σ for the same ε).
      eps_tol: how far below the target the returned σ's ε may be.
      max_noise_multiplier: give up above this σ (a run that noisy learns nothing).

    Raises:
      ValueError: bad arguments, or a target that needs σ > max_noise_multiplier.
    """
    check_dpsgd(q, 0.0, steps)
    check_delta(delta)
    return calibrate(target_epsilon, lambda s: dpsgd_step_event(q, s), steps=steps, delta=delta,
                     accountant=accountant, eps_tol=eps_tol, max_noise_multiplier=max_noise_multiplier)


def calibration_accountant(accountant: str) -> Accountant:
    """The accountant that sets a run's σ under ``privacy.accountant``: with ``both`` the ledger
    reports RDP and PLD and the report states the tighter (PLD, for Poisson-sampled Gaussian steps
    and their mixtures), so PLD sets σ and the ε a reader sees is the target, as ``memaudit
    epsilon --target-epsilon`` computes it. Calibrating against RDP instead left the stated ε
    about 15% below the target, with more noise than the guarantee needs (and ELS, which only PLD
    accounts, at its target beside it)."""
    return "pld" if accountant == "both" else accountant  # type: ignore[return-value]
