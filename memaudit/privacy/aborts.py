"""What an aborted secure-aggregation round reveals, as a ledger event.

Whether a round aborted is public (the model did not move) and depends on the realized cohort:
a round completes only when its survivors reach the protocol's floor, and under add/remove
adjacency with Poisson sampling one user changes the cohort by one with probability q. The
abort bit of every round (aborted or not) is therefore a mechanism of its own. For a rule
"complete iff S >= m(n)" (n the sampled cohort, S its survivors after an independent dropout d,
m(n) = max(min_survivors, ceil(threshold * n)) on the complete graph), with the other users'
(n, S) distributed as in the config, D without the target user and D' with it:

    P_D'(o) = (1 - q) P_D(o | n, S) + q (1 - d) P(o | n + 1, S + 1) + q d P(o | n + 1, S)

for both outcomes o, and the round's ε is max_o |ln P_D'(o) / P_D(o)| (pure DP), entered in
the ledger as the RDP curve min(ε, α ε² / 2) (Bun and Steinke 2016, Prop. 1.4). With no
dropout the rule is S = n >= min_survivors on any graph. Fixed-size cohorts (replace-one
adjacency: the cohort size does not depend on who is in it) and a floor no cohort can fall
under cost nothing. docs/secure-aggregation.md ("Aborted rounds in the ledger") derives it.

>>> round(abort_epsilon(population=51, cohort=8, min_survivors=3), 3)
0.135
>>> abort_epsilon(population=51, cohort=8, min_survivors=3, sampling="fixed")
0.0
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats

from memaudit.privacy.accounting import RDP_ORDERS, rdp_curve
from memaudit.privacy.events import RdpCurveEvent


def _floor(n: np.ndarray, min_survivors: int, threshold: float | None) -> np.ndarray:
    m = np.full(n.shape, int(min_survivors))
    return m if threshold is None else np.maximum(m, np.ceil(threshold * n - 1e-9))


def abort_epsilon(*, population: int, cohort: float, min_survivors: int, sampling: str = "poisson",
                  dropout: float = 0.0, threshold: float | None = None) -> float:
    """Pure ε of one round's abort bit (module docstring); 0 for fixed-size cohorts.

    ``threshold``: the complete graph's holder threshold when dropouts can push the
    survivors below it (ignored when ``dropout`` is 0: then every holder survives).
    """
    if sampling == "fixed" or population <= 1:
        return 0.0
    q = min(1.0, cohort / population)
    th = threshold if dropout > 0 else None
    n = np.arange(population)                       # the other users' cohort
    pn = stats.binom.pmf(n, population - 1, q)
    keep = pn > 1e-300
    n, pn = n[keep], pn[keep]
    s = np.arange(int(n.max()) + 2)
    ps = stats.binom.pmf(s[None, :], n[:, None], 1 - dropout) * pn[:, None]  # (n, S) joint
    m0, m1 = _floor(n, min_survivors, th)[:, None], _floor(n + 1, min_survivors, th)[:, None]
    done_d = (ps * (s[None, :] >= m0)).sum()
    done_up = (ps * (s[None, :] + 1 >= m1)).sum()  # the user sampled and survives
    done_dr = (ps * (s[None, :] >= m1)).sum()       # the user sampled and drops
    done_d2 = (1 - q) * done_d + q * (1 - dropout) * done_up + q * dropout * done_dr
    eps = 0.0
    for a, b in ((done_d, done_d2), (1 - done_d, 1 - done_d2)):
        if a <= 0 and b <= 0:
            continue
        if a <= 0 or b <= 0:
            return math.inf
        eps = max(eps, abs(math.log(b / a)))
    return float(eps)


def abort_event(epsilon: float, orders: tuple[float, ...] = RDP_ORDERS) -> RdpCurveEvent:
    """One round's abort bit as an RDP curve: min(ε, α ε²/2) for ε-DP."""
    rdp = tuple(float(min(epsilon, a * epsilon ** 2 / 2)) for a in orders)
    return RdpCurveEvent(orders=tuple(float(a) for a in orders), rdp=rdp,
                         label=f"secure-aggregation abort bit: pure epsilon={epsilon:.6g} per round")


def with_abort_bit(event: Any, epsilon: float) -> RdpCurveEvent:
    """A round's ``event`` (a DpEvent or an RdpCurveEvent) composed with its abort bit."""
    bit = abort_event(epsilon)
    orders = np.asarray(bit.orders)
    rdp = event.at(orders) if isinstance(event, RdpCurveEvent) else rdp_curve(event, bit.orders)
    total = np.asarray(rdp, np.float64) + np.asarray(bit.rdp)
    # orders where the base curve is not computed (dp_accounting gives inf at some small
    # fractional orders) are left out: RdpCurveEvent.at bounds an order by the next larger one
    keep = np.isfinite(total) if np.isfinite(total).any() else np.ones(len(total), bool)
    return RdpCurveEvent(orders=tuple(float(a) for a in orders[keep]), rdp=tuple(float(r) for r in total[keep]),
                         label=f"{getattr(event, 'label', '') or type(event).__name__}; {bit.label}")


@dataclass(frozen=True)
class WithAbortBit:
    """``base`` (a `memaudit.privacy.mechanisms` mechanism) plus the abort bit of a round run
    over secure aggregation: an aborted round's event is the bit alone (nothing else was
    released); a completed round's is the base's RDP curve plus the bit's. RDP only (the
    composed curve has no PLD form)."""

    base: Any
    epsilon: float

    @property
    def name(self) -> str:
        return self.base.name

    @property
    def unit(self) -> str:
        return self.base.unit

    def dp_event(self, metrics: Mapping[str, Any] | None = None) -> RdpCurveEvent:
        if metrics is not None and int(metrics.get("secagg_aborted", 0) or 0):
            return abort_event(self.epsilon)
        return with_abort_bit(self.base.dp_event(metrics), self.epsilon)

    def declaration(self) -> dict[str, Any]:
        return {**self.base.declaration(), "abort_bit_epsilon": self.epsilon}


__all__ = ["WithAbortBit", "abort_epsilon", "abort_event", "with_abort_bit"]
