"""A DP backend's privacy plan, and the run's empty ledger made from it.

A backend states its `PrivacyPlan` after it has prepared (unit, δ, noise multiplier, the mechanism
that declares its own `DpEvent`); the training driver (`memaudit.run.driver.fit`) makes the run's
ledger from it with `new_ledger` and records each released step's event there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memaudit.privacy.ledger import PrivacyLedger


@dataclass(frozen=True, kw_only=True)
class PrivacyPlan:
    """What a DP backend adds noise with, stated before the first step.

    Args:
        unit: "example" (one training sequence) or "user".
        delta: the δ of every ε the ledger reports.
        noise_multiplier: σ (calibrated to `privacy.target_epsilon` when that was given).
        sampling_rate: expected share of the units in one step or round.
        mechanism: a `memaudit.privacy.mechanisms` object; it declares its own `DpEvent`.
        calibration: how σ was calibrated (None when it was given).
        max_sequences_per_user: for the ledger's group-privacy note (example-level DP).
        max_sequences_per_document: the most training sequences one document spans, for the
            ledger's per-document ε (example-level DP; None: unknown).
        reproducible_randomness: the DP randomness came from train.seed.
    """

    unit: str
    delta: float
    noise_multiplier: float
    sampling_rate: float
    mechanism: Any
    calibration: dict[str, Any] | None = None
    max_sequences_per_user: int | None = None
    max_sequences_per_document: int | None = None
    reproducible_randomness: bool = False


def new_ledger(plan: PrivacyPlan) -> PrivacyLedger:
    """The run's empty ledger for `plan` (the one place a training ledger is made)."""
    return PrivacyLedger(unit=plan.unit, delta=plan.delta, max_sequences_per_user=plan.max_sequences_per_user,
                         max_sequences_per_document=plan.max_sequences_per_document,
                         calibration=plan.calibration, reproducible_randomness=plan.reproducible_randomness)
