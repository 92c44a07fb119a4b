"""Noise calibration: the smallest σ whose ε at δ stays within a target, by bisection.

ε is decreasing in σ for Poisson-subsampled Gaussian steps, so bisection on σ finds the
boundary; the σ returned always satisfies ε(σ) ≤ target (the upper end of the bracket).

>>> s = calibrate_noise(7.33, q=0.04, steps=2250, delta=1e-5)
>>> 1.45 < s <= 1.5
True
"""

from __future__ import annotations

import math

from memaudit.privacy.accounting import Accountant, check_delta, check_dpsgd, dpsgd_event, epsilon

MAX_NOISE_MULTIPLIER = 1000.0


def calibrate_noise(
    target_epsilon: float,
    *,
    q: float,
    steps: int,
    delta: float,
    accountant: Accountant = "rdp",
    rtol: float = 1e-4,
    max_noise_multiplier: float = MAX_NOISE_MULTIPLIER,
) -> float:
    """σ such that `steps` DP-SGD steps at rate q are (target_epsilon, delta)-DP.

    Args:
      target_epsilon: the ε budget, > 0.
      q: Poisson sampling rate in (0, 1].
      steps: number of steps planned.
      delta: δ in (0, 1).
      accountant: "rdp" or "pld" (PLD gives a smaller σ for the same ε).
      rtol: relative width of the final bracket on σ.
      max_noise_multiplier: give up above this σ (a run that noisy learns nothing).

    Raises:
      ValueError: bad arguments, or a target that needs σ > max_noise_multiplier.
    """
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target epsilon must be a finite number > 0, got {target_epsilon}")
    check_dpsgd(q, 0.0, steps)
    check_delta(delta)
    if steps == 0:
        return 0.0

    def eps(sigma: float) -> float:
        return epsilon(dpsgd_event(q, sigma, steps), delta, accountant)

    lo, hi = 0.0, 1.0
    while eps(hi) > target_epsilon:
        lo, hi = hi, hi * 2
        if hi > max_noise_multiplier:
            if eps(max_noise_multiplier) > target_epsilon:
                raise ValueError(
                    f"target epsilon {target_epsilon} needs a noise multiplier above "
                    f"{max_noise_multiplier:g} at q={q}, steps={steps}, delta={delta}; "
                    "raise the target epsilon, or reduce the steps or the sampling rate"
                )
            hi = max_noise_multiplier
            break
    while hi - lo > rtol * hi:
        mid = 0.5 * (lo + hi)
        if eps(mid) > target_epsilon:
            lo = mid
        else:
            hi = mid
    return hi
