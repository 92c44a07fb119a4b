"""The release verdict on a probed outside model: one sentence a release manager can act on.

What an attacker who holds candidate documents achieves with the strongest membership attack:
the share of members it picks out at 1% false positives (TPR at 1% FPR, Carlini et al. 2022),
with its interval and n; "n too small" when fewer than 10 / FPR non-members stand behind that
rate, and then the attack's AUC instead. When the shift check fired (members and non-members
differ in their texts alone) the attacks measure the split, not the model, and the verdict says
so first. The next step follows from the verdict: an IID split, more non-members, or a DP
fine-tune at an ε whose bound rules out what the attack achieved here (under (ε, δ)-DP any test
has TPR <= e^ε FPR + δ: Kairouz, Oh, Viswanath 2015).

The report's target entries are dicts (report.json); `release_verdict` reads one into typed values
at once, and the templates show the `Verdict`'s fields.

References:
  Carlini et al. 2022, "Membership Inference Attacks From First Principles" (TPR at low FPR).
  Kairouz, Oh, Viswanath 2015, "The Composition Theorem for Differential Privacy" (DP as a
  hypothesis test: TPR <= e^ε FPR + δ).
  Das, Zhang, Tramèr 2024, "Blind Baselines Beat Membership Inference Attacks for Foundation
  Models" (the shift check).

>>> dp_cap(2.0, 0.01)  # no attack beats 7.4% TPR at 1% FPR against an ε = 2 model (plus δ)
0.0738...
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from memaudit.reports.cells import Cell, as_cell

FPR = 0.01
"""The false-positive rate the verdict is stated at."""
DP_LEVELS = (8.0, 4.0, 2.0, 1.0, 0.5)
"""The ε a DP fine-tune is proposed at: the largest whose bound rules out the observed rate."""
DEFAULT_EPSILON = 2.0
"""The ε proposed when no rate at `FPR` was measured."""


class Level(StrEnum):
    LEAKS = "leaks"
    NO_SIGNAL = "no signal shown"
    SUSPECT = "suspect split"
    NOT_MEASURED = "not measured"


def needed_negatives(fpr: float) -> int:
    """Non-members a rate at `fpr` needs (STYLE.md point 11: ~10 / fpr).

    >>> needed_negatives(0.01)
    1000
    """
    return math.ceil(10 / fpr - 1e-9)


def dp_cap(epsilon: float, fpr: float, delta: float = 0.0) -> float:
    """The largest TPR any attack reaches at `fpr` against an (ε, δ)-DP model."""
    return min(1.0, math.exp(epsilon) * fpr + delta)


def proposed_epsilon(tpr_low: float | None, fpr: float = FPR) -> float:
    """The largest ε of `DP_LEVELS` whose cap at `fpr` is below `tpr_low` (the observed rate's
    lower end); the smallest level when none is; `DEFAULT_EPSILON` without a rate.

    >>> proposed_epsilon(0.18)
    2.0
    >>> proposed_epsilon(None)
    2.0
    """
    if tpr_low is None:
        return DEFAULT_EPSILON
    return next((e for e in DP_LEVELS if dp_cap(e, fpr) < tpr_low), DP_LEVELS[-1])


def _pct(v: float) -> str:
    """A rate as a percentage: 23%, 4.5%, 0.8%."""
    p = 100 * v
    return f"{p:.0f}%" if p >= 10 or p == 0 else f"{p:.1g}%" if p < 1 else f"{p:.2g}%"


def _auc_text(c: Cell) -> str:
    iv = f" [{c.interval[0]:.2f}, {c.interval[1]:.2f}]" if c.interval else ""
    return f"AUC {c.value:.2f}{iv}"


def _count(n: int | None) -> str:
    return "?" if n is None else f"{n:,}"


@dataclass(frozen=True, kw_only=True)
class Attack:
    """One membership attack of a probed model: its AUC and its TPR at `FPR` (None: not measured)."""

    name: str
    auc: Cell
    tpr: Cell | None

    @classmethod
    def of(cls, d: Mapping[str, Any]) -> Attack | None:
        auc = as_cell(d.get("auc"))
        if auc is None or auc.value is None:
            return None
        rates = d.get("tpr_at_fpr") or {}
        tpr = next((as_cell(c) for f, c in rates.items() if math.isclose(float(f), FPR)), None)
        return cls(name=str(d["attack"]), auc=auc, tpr=tpr)

    @property
    def rate(self) -> float | None:
        """TPR at `FPR` when enough non-members stand behind it (at least ~10 / FPR)."""
        if self.tpr is None or (self.auc.n_neg is not None and self.auc.n_neg < needed_negatives(FPR)):
            return None
        return self.tpr.value


def strongest(attacks: list[Attack]) -> Attack | None:
    """The attack an attacker would use: the highest TPR at `FPR` where it was measured, else the
    highest AUC. Chosen after seeing every attack, so it is the best of them on this data."""
    measured = [a for a in attacks if a.rate is not None]
    if measured:
        return max(measured, key=lambda a: (a.rate, a.auc.value))
    return max(attacks, key=lambda a: a.auc.value, default=None)


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """What releasing one model gives an attacker, and what to do about it: `headline` ("leaks
    membership"), `evidence` (what the strongest attack achieves, with its interval and n) and
    `next_step`; `sentence` says all three after the model's name."""

    target: str
    level: Level
    attack: str | None
    attacks: int              # how many attacks the strongest was chosen from
    auc: Cell | None
    tpr: Cell | None          # at `fpr`, when measured
    fpr: float
    members: int | None
    nonmembers: int | None
    needed_nonmembers: int
    shift_auc: float | None   # the shift check's AUC when it fired
    epsilon: float | None     # the model's own ledger ε (None: unknown)
    headline: str
    evidence: str
    next_step: str

    @property
    def shift(self) -> str | None:
        """The shift check's warning, when it fired."""
        if self.shift_auc is None:
            return None
        return (f"{self.target}: the split is not IID: a classifier that never sees the model tells "
                f"its members from its non-members with AUC {self.shift_auc:.2f}, so the attacks' "
                "numbers measure that shift, not memorization.")

    @property
    def sentence(self) -> str:
        return f"{self.target}: {self.headline}. {self.evidence} {self.next_step}"

    def to_json(self) -> dict[str, Any]:
        """report.json's `targets[].verdict`."""
        def cell(c: Cell | None) -> dict[str, Any] | None:
            if c is None:
                return None
            lo, hi = c.interval or (None, None)
            return {"value": c.value, "ci_low": lo, "ci_high": hi, "n": c.n, "unit": c.unit, "note": c.note}
        return {"level": str(self.level), "attack": self.attack, "attacks": self.attacks,
                "fpr": self.fpr, "auc": cell(self.auc), "tpr": cell(self.tpr), "members": self.members,
                "nonmembers": self.nonmembers, "needed_nonmembers": self.needed_nonmembers,
                "shift": self.shift, "headline": self.headline, "evidence": self.evidence,
                "next_step": self.next_step, "sentence": self.sentence}


def _level(best: Attack) -> Level:
    """Leaks when the rate at `FPR` is above `FPR` beyond its interval, or (no rate) when the AUC's
    interval is above chance; no signal shown otherwise."""
    if best.rate is not None and best.tpr.interval is not None:
        return Level.LEAKS if best.tpr.interval[0] > FPR else Level.NO_SIGNAL
    iv = best.auc.interval
    return Level.LEAKS if iv is not None and iv[0] > 0.5 else Level.NO_SIGNAL


def _headline(best: Attack, level: Level) -> str:
    if level is Level.LEAKS:
        return "leaks membership" if best.rate is not None else "leaks membership on average"
    return (f"no membership signal shown at {_pct(FPR)} false positives" if best.rate is not None
            else "no membership signal shown")


def _evidence(best: Attack, k: int, n1: int | None, n0: int | None) -> str:
    """What the strongest attack achieves, with its interval and n."""
    of = f"{best.name} (the strongest of {k} attacks)" if k > 1 else f"the {best.name} attack"
    n = f"n = {_count(n1)} members, {_count(n0)} non-members"
    if best.rate is not None:
        iv = best.tpr.interval
        rate = _pct(best.rate) + (f" [{_pct(iv[0])}, {_pct(iv[1])}]" if iv else "")
        return (f"With {of}, an attacker holding candidate documents picks out {rate} of members "
                f"at {_pct(FPR)} false positives ({_auc_text(best.auc)}; {n}).")
    of = f"The strongest of {k} attacks, {best.name}," if k > 1 else f"The {best.name} attack"
    return (f"{of} reaches {_auc_text(best.auc)} ({n}); its rate at {_pct(FPR)} "
            f"false positives: n too small (needs >= {needed_negatives(FPR):,} non-members).")


def _next_step(level: Level, best: Attack, epsilon: float | None, n0: int | None) -> str:
    if epsilon is not None and math.isfinite(epsilon):
        return (f"Trained with DP at ε = {epsilon:.3g} (ledger): no attack can beat "
                f"{_pct(dp_cap(epsilon, FPR))} at {_pct(FPR)} false positives (plus δ).")
    if level is Level.LEAKS:
        low = best.tpr.interval[0] if best.rate is not None and best.tpr.interval else None
        eps = proposed_epsilon(low)
        cap = dp_cap(eps, FPR)
        seen = f", below the {_pct(low)} seen here" if low is not None and cap < low else ""
        return (f"Next: do not release as is; fine-tune with DP at ε = {eps:g} per user "
                f"(privacy.target_epsilon: {eps:g}), which caps any attack at {_pct(cap)} at "
                f"{_pct(FPR)} false positives (plus δ){seen}; then probe again.")
    if best.rate is None:
        return (f"Next: probe with at least {needed_negatives(FPR):,} non-members (has {_count(n0)}) "
                f"to measure the rate at {_pct(FPR)} false positives; only DP bounds it.")
    return ("Next: finding nothing is no guarantee; only a DP fine-tune (privacy.target_epsilon) "
            "bounds what any attack can reach.")


def release_verdict(entry: Mapping[str, Any]) -> Verdict:
    """The verdict on one report.json target entry (`memaudit.reports.targets.target_entry`)."""
    tid = str(entry["id"])
    attacks = [a for a in (Attack.of(d) for d in entry.get("attacks") or []) if a is not None]
    shift = entry.get("shift") or {}
    shift_auc = float(shift["auc"]) if shift.get("flagged") and shift.get("auc") is not None else None
    eps = (entry.get("privacy") or {}).get("epsilon")
    eps = float(eps) if isinstance(eps, int | float) else None
    best = strongest(attacks)
    common = {"target": tid, "attacks": len(attacks), "fpr": FPR, "needed_nonmembers": needed_negatives(FPR),
              "shift_auc": shift_auc, "epsilon": eps}
    if best is None:
        return Verdict(**common, level=Level.NOT_MEASURED, attack=None, auc=None, tpr=None, members=None,
                       nonmembers=None, headline="membership not measured", evidence="",
                       next_step="Next: probe it with --members FILE and --nonmembers FILE.")
    n1, n0 = best.auc.n_pos, best.auc.n_neg
    measured = {"attack": best.name, "auc": best.auc, "tpr": best.tpr, "members": n1, "nonmembers": n0}
    evidence = _evidence(best, len(attacks), n1, n0)
    if shift_auc is not None:
        return Verdict(**common, **measured, level=Level.SUSPECT,
                       headline=f"no verdict: the split is not IID (shift check AUC {shift_auc:.2f})",
                       evidence=f"As measured on that split: {evidence[0].lower()}{evidence[1:]}",
                       next_step="Next: draw non-members from the members' source and time (an IID "
                                 "split) and probe again.")
    level = _level(best)
    return Verdict(**common, **measured, level=level, headline=_headline(best, level), evidence=evidence,
                   next_step=_next_step(level, best, eps, n0))
