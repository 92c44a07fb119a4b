"""Plots for the report, drawn from report.json alone, returned as inline SVG strings."""

from __future__ import annotations

import io
import math
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

plt.rcParams.update({"svg.hashsalt": "memaudit", "font.size": 9, "figure.dpi": 96})


def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    text = buf.getvalue()
    start = text.find("<svg")
    text = text[start:] if start >= 0 else text
    # drop the RDF metadata block: it only names namespaces, but keep the page free of URLs
    a, b = text.find("<metadata>"), text.find("</metadata>")
    if a >= 0 and b > a:
        text = text[:a] + text[b + len("</metadata>"):]
    return text


def _eps_x(eps: float | None, finite: list[float]) -> float:
    if eps is None or math.isinf(eps):
        return (max(finite) * 4) if finite else 1.0
    return eps


def exposure_vs_repetitions(report: dict[str, Any]) -> str | None:
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    drawn = False
    for run in report["runs"]:
        by = (run.get("probes_summary") or {}).get("exposure_by_repetition") or {}
        for owner, rows in by.items():
            if not rows:
                continue
            xs = [r["repetitions"] for r in rows]
            ys = [r["value"] for r in rows]
            # no error bar where n is too small for an interval (the table says "n too small")
            lo = [r["value"] - (r["value"] if r.get("ci_low") is None else r["ci_low"]) for r in rows]
            hi = [(r["value"] if r.get("ci_high") is None else r["ci_high"]) - r["value"] for r in rows]
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=2, label=f"{run['id']} ({owner})")
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xscale("log", base=2)
    ax.set_xlabel("repetitions in training")
    ax.set_ylabel("exposure (bits)")
    ax.set_title("Canary exposure vs repetitions")
    ax.legend(fontsize=7)
    return _svg(fig)


def extraction_vs_repetition(report: dict[str, Any]) -> str | None:
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    drawn = False
    for run in report["runs"]:
        rows = (run.get("probes_summary") or {}).get("extraction_by_repeats") or []
        by_k: dict[int, list[dict]] = {}
        for r in rows:
            by_k.setdefault(r["prefix_len"], []).append(r)
        for k, rs in sorted(by_k.items()):
            rs = sorted(rs, key=lambda r: r["repeats"])
            ax.plot([r["repeats"] for r in rs], [r["value"] for r in rs], marker="o", label=f"{run['id']} k={k}")
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xscale("log", base=2)
    ax.set_xlabel("times the text was repeated in training")
    ax.set_ylabel("exact extraction rate")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("Discoverable extraction vs repetition and prefix length")
    ax.legend(fontsize=7)
    return _svg(fig)


def roc_curves(report: dict[str, Any], key: str, title: str) -> str | None:
    fig, ax = plt.subplots(figsize=(4.6, 4.0))
    drawn = False
    for run in report["runs"]:
        roc = (run.get("probes_summary") or {}).get(key)
        if not roc or not roc.get("fpr"):
            continue
        fpr = [max(f, 1e-5) for f in roc["fpr"]]
        tpr = [max(t, 1e-5) for t in roc["tpr"]]
        ax.plot(fpr, tpr, label=f"{run['id']} (AUC {roc.get('auc', float('nan')):.2f})")
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.plot([1e-5, 1], [1e-5, 1], "k:", lw=0.8, label="chance")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(1e-4, 1)
    ax.set_ylim(1e-4, 1.05)
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.set_title(title)
    ax.legend(fontsize=7)
    return _svg(fig)


def audit_vs_theory(report: dict[str, Any]) -> str | None:
    pts = []
    for run in report["runs"]:
        a = (run.get("leakage") or {}).get("audit_epsilon")
        if a and a.get("value") is not None:
            pts.append((run["privacy"].get("epsilon"), a["value"], a.get("ceiling"), run["id"]))
    if not pts:
        return None
    finite = [p[0] for p in pts if p[0] is not None and not math.isinf(p[0])]
    fig, ax = plt.subplots(figsize=(4.6, 3.6))
    for eps, lb, ceil, rid in pts:
        x = _eps_x(eps, finite)
        ax.scatter([x], [lb], label=rid)
        if ceil is not None:
            ax.plot([x * 0.9, x * 1.1], [ceil, ceil], "r-", lw=1)
    top = max(finite + [p[1] for p in pts] + [1.0])
    ax.plot([0, top], [0, top], "k:", lw=0.8, label="lower bound = theory")
    ax.set_xlabel("theoretical epsilon (inf drawn at right)")
    ax.set_ylabel("empirical epsilon lower bound")
    ax.set_title("One-run audit vs ledger (red: audit ceiling)")
    ax.legend(fontsize=7)
    return _svg(fig)


def tradeoff_curves(report: dict[str, Any]) -> str | None:
    curves = report.get("comparisons", {}).get("curves") or []
    if not curves:
        return None
    finite = [p["epsilon"] for c in curves for p in c["points"] if p["epsilon"] is not None and not math.isinf(p["epsilon"])]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.4))
    for c in curves:
        pts = sorted(c["points"], key=lambda p: _eps_x(p["epsilon"], finite))
        xs = [_eps_x(p["epsilon"], finite) for p in pts]
        a1.errorbar(xs, [p["perplexity"]["mean"] for p in pts], yerr=[p["perplexity"]["std"] for p in pts],
                    marker="o", capsize=2, label=c["label"])
        a2.errorbar(xs, [p["leakage"]["mean"] for p in pts], yerr=[p["leakage"]["std"] for p in pts],
                    marker="o", capsize=2, label=c["label"])
    for ax in (a1, a2):
        if finite:
            ax.set_xscale("log")
        ax.set_xlabel("epsilon (no DP drawn at right)")
        ax.legend(fontsize=7)
    a1.set_ylabel("holdout perplexity")
    a2.set_ylabel(curves[0].get("leakage_label", "leakage"))
    a1.set_title("Utility")
    a2.set_title("Measured leakage")
    return _svg(fig)


def all_plots(report: dict[str, Any]) -> dict[str, str]:
    plots = {
        "tradeoff": tradeoff_curves(report),
        "exposure": exposure_vs_repetitions(report),
        "extraction": extraction_vs_repetition(report),
        "membership_roc": roc_curves(report, "membership_roc", "Membership inference ROC (log-log)"),
        "user_roc": roc_curves(report, "user_roc", "User inference ROC (log-log)"),
        "audit": audit_vs_theory(report),
    }
    return {k: v for k, v in plots.items() if v}
