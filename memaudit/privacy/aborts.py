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
dropout the rule is S = n >= min_survivors on any graph. On SecAgg+'s graph with dropouts
P(complete | n, S) also depends on which clients dropped; it is only bounded (`_completion`),
and the ε is the largest those bounds allow (`_bounded_ratio`, a linear program): a rigorous
upper bound. Fixed-size cohorts (replace-one adjacency: the cohort size does not depend on who
is in it) and a floor no cohort can fall under cost nothing. docs/secure-aggregation.md
("Aborted rounds in the ledger") derives it.

>>> round(abort_epsilon(population=51, cohort=8, min_survivors=3), 3)
0.135
>>> abort_epsilon(population=51, cohort=8, min_survivors=3, sampling="fixed")
0.0
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import optimize, sparse, stats

from memaudit.privacy.accounting import RDP_ORDERS, rdp_curve
from memaudit.privacy.events import RdpCurveEvent


def abort_epsilon(*, population: int, cohort: float, min_survivors: int, sampling: str = "poisson",
                  dropout: float = 0.0, threshold: float | None = None,
                  holders: Callable[[int], int] | None = None, quorum: int | None = None) -> float:
    """Pure ε of one round's abort bit (module docstring); 0 for fixed-size cohorts.

    Args:
        threshold: the holder threshold fraction (t = ceil(threshold · h)) when dropouts can
            push a client's live holders below t (ignored when ``dropout`` is 0).
        holders: the holders h(n) of each client's shares in a cohort of n (itself and its
            neighbours): n on the complete graph (the default), k + 1 on SecAgg+'s.
        quorum: the malicious-server mode's colluding clients n_C: a round then also needs
            (n + n_C) // 2 + 1 survivors' signatures (None: honest-but-curious, no quorum).

    Where h(n) < n and a drop set with more than h − t dropped clients could go either way
    (`_completion`), the ε is the largest the completion probabilities allowed there can give:
    a rigorous upper bound (`_bounded_ratio`).
    """
    if sampling == "fixed" or population <= 1:
        return 0.0
    q = min(1.0, cohort / population)
    n, dropped, wa, wb = _cells(population, q, dropout)
    th = threshold if dropout > 0 else None
    lo, hi = _completion(n, dropped, min_survivors, th, holders or (lambda k: k), quorum)
    eps = 0.0
    # P(o) for o = complete and o = abort, each as a sum of positive terms (no 1 - P: the
    # probabilities can be 1e-12 from 1)
    for p_lo, p_hi, rising in ((lo, hi, True), (1.0 - hi, 1.0 - lo, False)):
        for sense in ("max", "min"):
            r = _bounded_ratio(wb, wa, p_lo, p_hi, n, dropped, sense, rising)
            if r is None:  # an outcome that never happens in either world
                continue
            if r == math.inf or r <= 0 and q >= 1:
                return math.inf
            eps = max(eps, abs(math.log((1 - q) + q * r)))
    return float(eps)


def _cells(population: int, q: float, dropout: float) -> tuple[np.ndarray, ...]:
    """The cells (n, D) (a cohort of n, D of them dropped) with their probability without the
    target user, P_D(n, D), and when she is sampled too: (n + 1, D) if she survives,
    (n + 1, D + 1) if she drops. Returns (n, D, P_D, P_+) over the cells either world reaches."""
    pn = np.r_[stats.binom.pmf(np.arange(population), population - 1, q), 0.0]
    seen = np.flatnonzero(pn > 1e-300)
    ns = np.arange(seen.min(), seen.max() + 2)  # one more: the cohort with her
    ds = np.arange((ns[-1] if dropout > 0 else 0) + 2)
    without = stats.binom.pmf(ds[None, :], ns[:, None], dropout) * pn[ns][:, None]
    without[without <= 1e-300] = 0.0
    with_her = np.zeros_like(without)
    with_her[1:, :] += without[:-1, :] * (1 - dropout)
    with_her[1:, 1:] += without[:-1, :-1] * dropout
    i, j = np.nonzero((without > 0) | (with_her > 0))
    return ns[i], ds[j], without[i, j], with_her[i, j]


def _completion(n: np.ndarray, dropped: np.ndarray, min_survivors: int, threshold: float | None,
                holders: Callable[[int], int], quorum: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Bounds on P(a round completes | cohort n, D dropped) for each cell, over the uniformly
    random set of the D clients that dropped (each client's holders are a window of h
    consecutive positions of a cycle: itself and its k neighbours; a dropped client's key needs
    t live holders as a live client's seed does, so a round completes iff every window keeps at
    least t live clients, i.e. holds at most z = h − t dropped ones).

    - 0 below the floor: S = n − D < min_survivors, or (malicious mode) S below the signed quorum;
    - 1 when D ≤ z (no window can hold more), and on the complete graph (h = n) 0 when D > z;
    - on a sparse graph with D > z: between 1 − n·P(a window holds > z) (a union bound over
      the n windows) and 1 − P(one given window holds > z) (hypergeometric).
    """
    sizes = np.unique(n)
    h = np.array([int(holders(int(k))) for k in sizes])[np.searchsorted(sizes, n)]
    floor = np.maximum(int(min_survivors), 1 if quorum is None else (n + int(quorum)) // 2 + 1)
    z = n if threshold is None else h - np.maximum(1, np.ceil(threshold * h - 1e-9)).astype(int)
    valid = (n >= 1) & (n - dropped >= floor)
    lo = hi = (valid & (dropped <= z)).astype(float)
    open_ = valid & (dropped > z) & (h < n)
    if open_.any():
        over = stats.hypergeom.sf(z[open_], n[open_], dropped[open_], h[open_])
        lo, hi = lo.copy(), hi.copy()
        lo[open_], hi[open_] = np.maximum(0.0, 1.0 - n[open_] * over), 1.0 - over
    return lo, hi


def _bounded_ratio(num: np.ndarray, den: np.ndarray, lo: np.ndarray, hi: np.ndarray, n: np.ndarray,
                   dropped: np.ndarray, sense: str, rising: bool) -> float | None:
    """max (or min) of (num·c) / (den·c) over an outcome's probabilities c per cell (n, D) with
    lo ≤ c ≤ hi and c(n, D + 1) ≤ c(n, D) (``rising``: completing; a round with fewer dropped
    clients is no less likely to complete) or ≥ (aborting), as a linear program (Charnes and
    Cooper 1962); the exact ratio when lo = hi. Cells whose weight is below 1e-15 take their c
    at the side that helps the bound, outside the program."""
    free = np.flatnonzero(hi > lo)
    fixed = np.flatnonzero(hi <= lo)
    n0 = float(num[fixed] @ lo[fixed])
    d0 = float(den[fixed] @ lo[fixed])
    tiny = free[np.maximum(np.abs(num[free]), np.abs(den[free])) < 1e-15]
    free = np.setdiff1d(free, tiny)
    # a negligible cell moves the ratio's numerator or denominator by at most its weight
    sign = 1.0 if sense == "max" else -1.0
    n0 += float(np.sum(np.where(sign * num[tiny] > 0, num[tiny] * hi[tiny], num[tiny] * lo[tiny])))
    d0 += float(np.sum(np.where(sign * den[tiny] < 0, den[tiny] * hi[tiny], den[tiny] * lo[tiny])))
    if free.size == 0:
        if d0 <= 0:
            return None if n0 <= 0 else math.inf
        return n0 / d0
    m = free.size
    width = int(dropped.max()) + 2
    key = n[free] * width + dropped[free]  # increasing: np.nonzero's row-major order
    nxt = np.searchsorted(key, key + 1)  # the cell (n, D + 1), where it is free too
    has = (nxt < m) & (key[np.minimum(nxt, m - 1)] == key + 1)
    k, k1 = np.flatnonzero(has), nxt[has]
    small, large = (k1, k) if rising else (k, k1)
    eye = sparse.identity(m, format="csr")
    rows = [sparse.hstack([eye, sparse.csr_matrix(-hi[free][:, None])]),
            sparse.hstack([-eye, sparse.csr_matrix(lo[free][:, None])])]
    if k.size:
        r = np.arange(k.size)
        rows.append(sparse.csr_matrix((np.r_[np.ones(k.size), -np.ones(k.size)], (np.r_[r, r], np.r_[small, large])),
                                      shape=(k.size, m + 1)))
    a_ub = sparse.vstack(rows).tocsr()
    objective = np.r_[num[free], n0] * (-sign)
    res = optimize.linprog(objective, A_ub=a_ub, b_ub=np.zeros(a_ub.shape[0]), A_eq=np.r_[den[free], d0][None, :],
                           b_eq=[1.0], bounds=[(0, None)] * (m + 1), method="highs")
    if res.status != 0:  # the denominator can reach 0: no finite bound
        return math.inf if sense == "max" else 0.0
    return float(-res.fun * sign) if sense == "max" else float(res.fun)


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
