"""Findings: sentences generated from the numbers in report.json, never typed by hand.

A difference is stated only when the two confidence intervals do not overlap (a
conservative test at the intervals' level); otherwise the sentence says the difference is
within the intervals and so not shown.
"""

from __future__ import annotations

import math
from typing import Any

# Headline leakage metrics: key -> (label, unit, higher_is_leakier)
METRICS: dict[str, tuple[str, str, bool]] = {
    "exposure_top": ("exposure of the most-repeated canaries", "bits", True),
    "extraction_exact": ("exact extraction rate of member text", "", True),
    "canary_completion": ("canary completion rate", "", True),
    "mia_auc": ("membership-inference AUC (loss attack)", "", True),
    "user_mia_auc": ("user-inference AUC", "", True),
    "pii_extraction": ("PII extraction rate", "", True),
    "audit_epsilon": ("empirical epsilon lower bound", "", True),
}


def _fmt(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return f"{v:.3g}"


def _fmt_eps(e: float | None) -> str:
    return "no DP (epsilon = inf)" if e is None or math.isinf(e) else f"epsilon = {e:g}"


def _bound(cell: dict[str, Any], key: str) -> float:
    v = cell.get(key)
    return cell["value"] if v is None else v


def compare(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str:
    """'less' if a leaks less than b, 'more' if more, 'same' if the intervals overlap, 'n/a'.

    `a` and `b` are {"value", "ci_low", "ci_high"} of a leakier-is-higher metric.
    """
    if not a or not b or a.get("value") is None or b.get("value") is None:
        return "n/a"
    a_lo, a_hi = _bound(a, "ci_low"), _bound(a, "ci_high")
    b_lo, b_hi = _bound(b, "ci_low"), _bound(b, "ci_high")
    if a_hi < b_lo:
        return "less"
    if a_lo > b_hi:
        return "more"
    return "same"


def _cell_numbers(metric: str, left: dict, right: dict) -> str:
    _, unit, _ = METRICS[metric]
    u = f" {unit}" if unit else ""
    return (
        f"{_fmt(left['value'])}{u} vs {_fmt(right['value'])}{u}; 95% CIs "
        f"[{_fmt(left.get('ci_low'))}, {_fmt(left.get('ci_high'))}] and "
        f"[{_fmt(right.get('ci_low'))}, {_fmt(right.get('ci_high'))}]"
    )


def _pair_sentences(cells: dict[str, dict], left_key: str, left_name: str, right_key: str,
                    right_name: str, context: str, group: str) -> list[dict[str, Any]]:
    """One sentence per metric that differs, and one for all metrics whose intervals overlap."""
    out, same = [], []
    for metric in METRICS:
        cell = cells.get(metric)
        if not cell:
            continue
        left, right = cell.get(left_key), cell.get(right_key)
        verdict = compare(left, right)
        if verdict == "n/a":
            continue
        label = METRICS[metric][0]
        if verdict == "same":
            same.append((metric, f"{label} ({_cell_numbers(metric, left, right)})"))
            continue
        word = "less" if verdict == "less" else "more"
        out.append({
            "kind": "comparison", "group": group, "metric": metric, "metrics": [metric],
            "verdict": verdict, "context": context,
            "text": f"{context}: {left_name} leaks {word} than {right_name} on {label} "
                    f"({_cell_numbers(metric, left, right)}).",
        })
    if same:
        out.append({
            "kind": "comparison", "group": group, "metric": same[0][0], "metrics": [m for m, _ in same],
            "verdict": "same", "context": context,
            "text": f"{context}: no difference shown between {left_name} and {right_name} on "
                    + "; ".join(t for _, t in same)
                    + ": the differences are within the confidence intervals.",
        })
    return out


def backend_findings(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Federated vs centralized at each matched epsilon."""
    out = []
    for m in report.get("comparisons", {}).get("matched", []):
        ctx = f"At {_fmt_eps(m.get('epsilon'))}"
        out += _pair_sentences(m.get("metrics", {}), "federated", "federated", "parallel", "centralized",
                               ctx, "backend")
    return out


def effect_findings(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Where DP or Goldfish loss made a difference against the matching baseline."""
    out = []
    for eff in report.get("comparisons", {}).get("effects", []):
        name = eff["treatment"]  # e.g. "DP at epsilon = 4" or "Goldfish loss"
        ctx = f"{eff['backend_label']}, {name}"
        out += _pair_sentences(eff.get("metrics", {}), "treated", f"with {name}", "baseline", "without",
                               ctx, "effect")
    return out


def caveats(report: dict[str, Any]) -> list[str]:
    out = []
    runs = report.get("runs", [])
    for r in runs:
        audit = r.get("leakage", {}).get("audit_epsilon")
        if audit and audit.get("ceiling") is not None:
            out.append(
                f"Run {r['id']}: the one-run audit with r = {audit.get('guesses')} guesses can certify at most "
                f"epsilon = {_fmt(audit['ceiling'])}; its lower bound {_fmt(audit['value'])} is a floor, "
                "not an estimate of the true epsilon."
            )
        per_user = r.get("privacy", {}).get("per_user") or {}
        if r.get("privacy", {}).get("unit") == "example" and per_user.get("max_sequences_per_user", 1) > 1:
            k = per_user["max_sequences_per_user"]
            if per_user.get("vacuous"):
                out.append(
                    f"Run {r['id']}: epsilon is per training sequence; a user with {k} sequences is only "
                    "covered by a group-privacy bound that is vacuous here, so the guarantee says little "
                    "about users."
                )
            else:
                out.append(
                    f"Run {r['id']}: epsilon is per training sequence; for a user with {k} sequences the "
                    f"group-privacy bound is epsilon = {_fmt(per_user.get('epsilon'))}."
                )
    if any(r.get("privacy", {}).get("unit") == "user" for r in runs) and any(
        r.get("privacy", {}).get("unit") == "example" for r in runs
    ):
        out.append(
            "Centralized epsilon protects one training sequence, federated epsilon one user's whole "
            "contribution: equal nominal epsilons are not equal guarantees."
        )
    return out


def generate(report: dict[str, Any]) -> dict[str, Any]:
    """The findings section: {'sentences': [...], 'caveats': [...]}."""
    return {"sentences": backend_findings(report) + effect_findings(report), "caveats": caveats(report)}
