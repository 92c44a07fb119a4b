"""Group privacy per canary bucket: the epsilon that actually covers a canary repeated r times.

A DP guarantee protects one unit (one training sequence under example-level DP-SGD, one user's
whole contribution under user-level DP-FedAvg). A canary repeated r times is a group of units:

- example-level DP: each copy is a document of its own, shorter than a sequence, so the r copies
  sit in at most r training sequences, each sampled into a step's batch on its own. The guarantee
  that covers the canary is that of the r sequences as one event, at the run's delta: each step a
  mixture of Gaussians over the j ~ Binomial(r, q) copies in the batch, accounted by PLD
  (`memaudit.privacy.ledger.PrivacyLedger.group_epsilon`). The group-privacy lemma's r * epsilon
  holds only at delta' = r e^((r-1) epsilon) delta, vacuous (>= 1) from a few copies on, and read
  at the run's delta it is below the truth;
- user-level DP, canary owned by one user: all r copies are that user's, one unit, so epsilon;
- user-level DP, canary spread over k distinct users: a group of k users, k * epsilon.

For (epsilon, delta)-DP the group bound for k units is (k * epsilon, k * e^((k-1) * epsilon) * delta)
(Dwork and Roth 2014, Lemma 2.2 and its approximate-DP form; Vadhan 2017, Lemma 7.2.2). The
epsilon comes from the ledger, recomputed from its events by the report; nothing here reads a
stored number. Only counts leave canaries.json: no secret, no text.

References:
  Dwork, Roth. The Algorithmic Foundations of Differential Privacy. 2014, Theorem 2.2.
  Vadhan. The Complexity of Differential Privacy. 2017, Lemma 7.2.2.
  Thakkar et al. Understanding unintended memorization in federated learning. 2020.

>>> effective_epsilon(2.0, "example", repetitions=8, owner_kind="user", owners=1)[0]
16.0
>>> effective_epsilon(2.0, "user", repetitions=8, owner_kind="user", owners=1)[0]
2.0
>>> effective_epsilon(2.0, "user", repetitions=8, owner_kind="spread", owners=8)[0]
16.0
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any


def group_size(unit: str | None, *, repetitions: int, owner_kind: str, owners: int) -> int:
    """How many of the guarantee's units one canary occupies."""
    if unit == "example":
        return max(int(repetitions), 1)
    if unit == "user":
        return 1 if owner_kind == "user" else max(int(owners), 1)
    raise ValueError(f"privacy unit '{unit}' is not example or user")


def effective_epsilon(epsilon: float, unit: str | None, *, repetitions: int, owner_kind: str,
                      owners: int, delta: float | None = None,
                      sequences_epsilon: Callable[[int], float | None] | None = None
                      ) -> tuple[float, float | None, str]:
    """(epsilon, delta, rule) of the guarantee that covers one canary.

    `sequences_epsilon(k)`: the ledger's ε at its δ for k sequences as one event (example-level
    runs); where it gives a number, that is the canary's ε at the run's δ. Otherwise the group-
    privacy lemma's (k epsilon, delta'), delta' stated in the rule. No DP (epsilon = inf or no
    unit) gives (inf, None, "no DP"); a model never trained on the private data (the public base,
    epsilon = 0) gives (0, 0, ...).
    """
    if epsilon == 0:
        return 0.0, 0.0, "0 (never trained on the private data)"
    if unit is None or epsilon is None or math.isinf(epsilon):
        return math.inf, None, "no DP"
    k = group_size(unit, repetitions=repetitions, owner_kind=owner_kind, owners=owners)
    exact = sequences_epsilon(k) if unit == "example" and k > 1 and sequences_epsilon is not None else None
    if exact is not None:
        at = "the run's delta" if delta is None else f"delta = {delta:.0e}"
        return float(exact), delta, (f"the {k} copies as one event at {at} (example-level DP: "
                                     f"each copy one sequence, sampled on its own; each step a mixture of "
                                     f"Gaussians over the copies in the batch, PLD)")
    if unit == "example":
        rule = f"{k} x epsilon (example-level DP; the {repetitions} copies lie in at most {k} sequences)"
    elif k == 1:
        rule = "epsilon (user-level DP; one user owns every copy)"
    else:
        rule = f"{k} x epsilon (user-level DP; {k} users hold a copy)"
    eff_delta = None
    if delta is not None:
        log_d = math.log(k) + (k - 1) * epsilon + math.log(delta) if delta > 0 else -math.inf
        eff_delta = 1.0 if log_d >= 0 else math.exp(log_d)
        if k > 1:  # the lemma's epsilon holds only at its own delta
            rule += (f", at delta' = {eff_delta:.2g}" if eff_delta < 1 else
                     ", vacuous: its delta' = k e^((k-1) epsilon) delta is >= 1")
    return k * float(epsilon), eff_delta, rule


CELL_KEYS = ("value", "ci_low", "ci_high", "n", "unit", "note")
BOUND_KEYS = ("lower_bound", "ceiling_units")  # only on a cell at the estimator's ceiling


def canary_buckets(canaries: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Inserted canaries grouped by (repetitions, owner kind): counts and owners, no secrets."""
    groups: dict[tuple[int, str], list[int]] = defaultdict(list)
    for c in (canaries or {}).get("inserted") or []:
        users = c.get("users") or []
        groups[(int(c.get("repetitions") or 0), str(c.get("owner_kind") or "user"))].append(len(set(users)))
    return [{"repetitions": r, "owner_kind": kind, "canaries": len(owners), "owners": max(owners)}
            for (r, kind), owners in sorted(groups.items())]


def group_privacy(canaries: dict[str, Any] | None, *, epsilon: float, unit: str | None,
                  delta: float | None, exposure_by_repetition: dict[str, list] | None = None,
                  sequences_epsilon: Callable[[int], float | None] | None = None
                  ) -> list[dict[str, Any]]:
    """One row per canary bucket: its effective epsilon (and delta) beside its measured exposure.

    `exposure_by_repetition` is the report's plot data ({owner: [{repetitions, value, ...}]});
    `sequences_epsilon` as in `effective_epsilon`.
    """
    exposure = {(int(row["repetitions"]), owner): row
                for owner, rows in (exposure_by_repetition or {}).items() for row in rows}
    out = []
    for b in canary_buckets(canaries):
        eps, dlt, rule = effective_epsilon(epsilon, unit, repetitions=b["repetitions"],
                                           owner_kind=b["owner_kind"], owners=b["owners"], delta=delta,
                                           sequences_epsilon=sequences_epsilon)
        e = exposure.get((b["repetitions"], b["owner_kind"]))
        cell = None if e is None else ({k: e.get(k) for k in CELL_KEYS}
                                       | {k: e[k] for k in BOUND_KEYS if k in e})
        out.append({**b, "effective_epsilon": eps, "effective_delta": dlt, "rule": rule, "exposure": cell})
    return out
