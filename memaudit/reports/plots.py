"""Plots for the report, drawn from report.json alone, returned as inline SVG strings.

Legibility rules every plot follows: log axes carry only major ticks with plain labels ("50",
"100", "200"; never "2x10^0 3x10^0"), at most ``MAX_SERIES`` series per panel (small multiples
otherwise), the Okabe-Ito colour-blind-safe palette, a unit on every axis, and no panel that would
be flat at zero (the report says "none extracted" instead, see `plot_notes`).

References:
  Okabe, Ito. Color Universal Design (CUD): how to make figures and presentations that are
  friendly to colorblind people. 2008.
"""

from __future__ import annotations

import io
import math
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib import ticker
from matplotlib.markers import CARETUP

from memaudit.reports.blocks import (
    CurvePoint,
    FrontierMetric,
    FrontierPoint,
    RepetitionPoint,
    Roc,
    comparisons_of,
)
from memaudit.reports.cells import SHORT, number
from memaudit.reports.entries import RunEntry, entries

OKABE_ITO = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#F0E442", "#000000"]
SERIES_COLOURS = {"centralized": "#0072B2", "federated": "#D55E00", "centralized + Goldfish": "#009E73",
                  "federated + Goldfish": "#CC79A7"}
MAX_SERIES = 6
PANEL_W, PANEL_H = 3.6, 3.0

plt.rcParams.update({"svg.hashsalt": "memaudit", "font.size": 9, "figure.dpi": 96,
                     "axes.prop_cycle": matplotlib.cycler(color=OKABE_ITO)})

TITLES = {"exposure_top": "Exposure of the most-repeated canaries", "mia_auc": "Membership inference",
          "user_mia_auc": "User inference", "extraction_exact": "Exact extraction",
          "pii_extraction": "PII extraction", "canary_completion": "Canary completion"}
Y_UNITS = {"exposure_top": "excess exposure (bits)", "mia_auc": "MIA AUC (0.5 = chance)",
           "user_mia_auc": "user-inference AUC (0.5 = chance)",
           "extraction_exact": "exact extraction (fraction of documents)",
           "pii_extraction": "PII extraction (fraction of PII items)",
           "canary_completion": "canary completion (fraction of canaries)"}


# ----------------------------------------------------------------------------- helpers
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


def _plain(v: float, _pos=None) -> str:
    """A tick label as a plain number: 0.001, 0.5, 20, 1,000."""
    return number(v, 4, thousands=True)


def nice_log_ticks(lo: float, hi: float, max_ticks: int = 6) -> list[float]:
    """Major ticks for a log axis over [lo, hi]: the densest of 10^k, {1,3}, {1,2,5} x 10^k that
    gives at most `max_ticks`, thinned to every n-th decade over many decades; at least two ticks.

    >>> nice_log_ticks(60, 800)
    [100.0, 200.0, 500.0]
    >>> nice_log_ticks(1e-4, 1)
    [0.0001, 0.001, 0.01, 0.1, 1.0]
    """
    if not (lo > 0 and hi >= lo):
        raise ValueError(f"log axis range [{lo}, {hi}] must be positive")
    k0, k1 = math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1
    best: list[float] = []
    for subs in ((1,), (1, 3), (1, 2, 5), (1, 2, 3, 5, 7), tuple(range(1, 10))):
        t = [float(f"{m * 10.0 ** k:.6g}") for k in range(k0, k1 + 1) for m in subs]
        t = [x for x in t if lo * (1 - 1e-9) <= x <= hi * (1 + 1e-9)]
        if len(t) > max_ticks:
            if not best:  # many decades: every n-th power of ten
                step = math.ceil(len(t) / max_ticks)
                best = t[::step]
            break
        best = t
        if len(t) >= 3:
            break
    if len(best) < 2:  # narrower than one step of the finest grid: evenly spaced, inside
        best = _even_ticks(lo, hi, max_ticks)
    return best


def _even_ticks(lo: float, hi: float, max_ticks: int) -> list[float]:
    """The widest step of {5, 2.5, 2, 1} x 10^k that puts 3 to `max_ticks` ticks inside [lo, hi]
    (at worst the two ends)."""
    for k in range(math.floor(math.log10(hi - lo)) if hi > lo else 0, -13, -1):
        for m in (5, 2.5, 2, 1):
            step = m * 10.0 ** k
            t = [float(f"{i * step:.12g}") for i in range(math.ceil(lo / step), math.floor(hi / step) + 1)]
            if 3 <= len(t) <= max_ticks:
                return t
    return sorted({lo, hi})


def log_axis(ax, which: str, lo: float, hi: float, pad: float = 1.15) -> None:
    """A readable log axis over [lo, hi] (padded): plain major labels, unlabelled minor ticks."""
    lo, hi = lo / pad, hi * pad
    axis = ax.xaxis if which == "x" else ax.yaxis
    (ax.set_xscale if which == "x" else ax.set_yscale)("log")
    (ax.set_xlim if which == "x" else ax.set_ylim)(lo, hi)
    axis.set_major_locator(ticker.FixedLocator(nice_log_ticks(lo, hi)))
    axis.set_major_formatter(ticker.FuncFormatter(_plain))
    axis.set_minor_locator(ticker.LogLocator(base=10, subs="auto"))
    axis.set_minor_formatter(ticker.NullFormatter())


def _fixed_ticks(ax, which: str, values: list[float]) -> None:
    axis = ax.xaxis if which == "x" else ax.yaxis
    axis.set_major_locator(ticker.FixedLocator(sorted(set(values))))
    axis.set_major_formatter(ticker.FuncFormatter(_plain))
    axis.set_minor_locator(ticker.NullLocator())


def _chunks(items: list, size: int = MAX_SERIES) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)] or [[]]


def _panels(n: int, cols: int = 3):
    rows = math.ceil(n / cols)
    c = min(n, cols)
    fig, axes = plt.subplots(rows, c, figsize=(PANEL_W * c, PANEL_H * rows), squeeze=False)
    flat = [a for row in axes for a in row]
    for a in flat[n:]:
        a.set_visible(False)
    return fig, flat[:n]


def _eps_label(eps: float | None) -> str:
    if eps is None or math.isinf(eps):
        return "no DP"
    return "base" if eps == 0 else f"ε={number(eps)}"


def _backend_label(run: RunEntry) -> str:
    return run.backend + (" + Goldfish" if run.mitigation.goldfish else "") + (
        " + LoRA" if (run.model.trained or "full") != "full" else "")


def _runs(report: dict[str, Any]) -> list[RunEntry]:
    return entries(report.get("runs") or [])


def _real_runs(report: dict[str, Any]) -> list[RunEntry]:
    return [r for r in _runs(report) if r.role != "public-base"]


def _name(run: RunEntry) -> str:
    """A panel's name: the public base, or the run's backend and what it changes."""
    return "public base" if run.role == "public-base" else _backend_label(run)


# ----------------------------------------------------------------------------- figures
def _frontier_panel(ax, key: str, m: FrontierMetric, base: FrontierPoint | None, pairs: list[list[str]]) -> None:
    """One metric's frontier: a series per backend, epsilon on each point, the base as the origin,
    and each matched-utility pair (its two runs) joined by a grey bar (the only pairs that are compared)."""
    xs_all = []
    labels: list[tuple[float, float, str, str | None]] = []
    where: dict[str, tuple[float, float]] = {}
    for s in m.each_series()[:MAX_SERIES]:
        pts = [p for p in s.frontier_points if p.perplexity is not None and p.value is not None]
        colour, label = SERIES_COLOURS.get(s.label), s.label
        line = ([base] if base and base.value is not None else []) + pts
        ax.plot([p.perplexity for p in line], [p.value for p in line], ls=":", lw=0.9,
                color=colour, alpha=0.7)  # a visual guide only, never read as data
        lo = [p.value - (p.ci_low if p.ci_low is not None else p.value) for p in pts]
        hi = [(p.ci_high if p.ci_high is not None else p.value) - p.value for p in pts]
        ax.errorbar([p.perplexity for p in pts], [p.value for p in pts], yerr=[lo, hi],
                    fmt="o", capsize=2, color=colour, label=label)
        _mark_lower_bounds(ax, [(p.perplexity, p.value) for p in pts if p.lower_bound], colour)
        for p in pts:
            labels.append((p.perplexity, p.value, _eps_label(p.epsilon), colour))
            where[p.run] = (p.perplexity, p.value)
        xs_all += [p.perplexity for p in pts]
    for k, runs in enumerate(pairs):
        a, b = (where.get(r) for r in runs)
        if a and b:
            ax.plot([a[0], b[0]], [a[1], b[1]], "-", color="#999999", lw=3, alpha=0.5, zorder=0,
                    label="matched-utility pair" if k == 0 else None)
    if base and base.value is not None:
        ax.plot([base.perplexity], [base.value], "*", ms=10, color="#000000", label="public base")
        xs_all.append(base.perplexity)
    log_axis(ax, "x", min(xs_all), max(xs_all))
    ax.set_xlabel("holdout perplexity (per token, log scale)")
    ax.set_ylabel(Y_UNITS.get(key, m.label))
    ax.set_title(TITLES.get(key, key), fontsize=9)
    return _place_labels(ax, labels)


LOWER_BOUND_LABEL = "lower bound (canaries at the estimator's ceiling)"


def _mark_lower_bounds(ax, xy: list[tuple[float, float]], colour: str | None) -> None:
    """An upward caret over each point that is a lower bound (it has no interval to draw); the
    legend names the caret once per panel."""
    if xy:
        named = LOWER_BOUND_LABEL in ax.get_legend_handles_labels()[1]
        ax.plot([x for x, _ in xy], [y for _, y in xy], ls="none", marker=CARETUP, ms=9, color=colour,
                label=None if named else LOWER_BOUND_LABEL)


# label offsets tried in turn (points; horizontal alignment): right-up, right-down, left-up, ...
_OFFSETS = ((5, 3, "left"), (5, -10, "left"), (-5, 3, "right"), (-5, -10, "right"),
            (0, 7, "center"), (0, -15, "center"))


def _place_labels(ax, labels: list[tuple[float, float, str, str | None]], fontsize: float = 7) -> int:
    """Annotate each point at the first offset whose text box overlaps no label placed before;
    a point with no free offset keeps its marker only. Returns how many labels were left out."""
    fig = ax.figure
    fig.canvas.draw()  # the axes limits and transforms as they will be drawn
    px = fig.dpi / 72.0
    placed: list[tuple[float, float, float, float]] = []
    skipped = 0
    for x, y, text, colour in labels:
        X, Y = ax.transData.transform((x, y))
        w, h = 0.62 * fontsize * len(text) * px, 1.2 * fontsize * px
        for dx, dy, ha in _OFFSETS:
            x0 = X + dx * px - (w if ha == "right" else w / 2 if ha == "center" else 0)
            box = (x0, Y + dy * px, x0 + w, Y + dy * px + h)
            if not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in placed):
                placed.append(box)
                ax.annotate(text, (x, y), fontsize=fontsize, xytext=(dx, dy), textcoords="offset points",
                            color=colour, ha=ha)
                break
        else:
            skipped += 1
    return skipped


def frontier_figure(report: dict[str, Any]):
    """Small multiples, one per headline metric with a non-zero value: leakage against holdout
    perplexity, one series per backend, epsilon on each point, the public base as the origin."""
    comp = comparisons_of(report)
    metrics = {k: m for k, m in comp.frontier_metrics().items() if not m.all_zero}
    if not metrics:
        return None
    origin = comp.origin()
    keys = list(metrics)[:6]
    fig, axes = _panels(len(keys))
    skipped = 0
    for ax, key in zip(axes, keys, strict=True):
        skipped += _frontier_panel(ax, key, metrics[key], origin.get(key), comp.pair_runs())
    handles, names = axes[0].get_legend_handles_labels()
    for ax in axes[1:]:  # one legend for the figure: every series and marker once
        for hd, nm in zip(*ax.get_legend_handles_labels(), strict=True):
            if nm not in names:
                handles.append(hd)
                names.append(nm)
    fig.legend(handles, names, loc="lower center", ncol=len(names), fontsize=7, frameon=False)
    note = "; epsilon labels of crowded points left out, every point is in the runs table" if skipped else ""
    fig.suptitle(f"Privacy-utility-leakage frontier (dotted lines: visual guide only{note})", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def exposure_figure(report: dict[str, Any]):
    """Exposure per repetition bucket: one panel per (backend, canary owner kind), one series per
    run (its epsilon), at most MAX_SERIES per panel."""
    panels: dict[str, list] = {}
    for run in _runs(report):
        for owner, rows in run.plot_rows("exposure_by_repetition", {}).items():
            if rows:
                panels.setdefault(f"{_name(run)}, canary {'of one user' if owner == 'user' else 'spread over users'}",
                                  []).append((run, [RepetitionPoint.of(r) for r in rows]))
    if not panels:
        return None
    flat = []
    for title, series in panels.items():
        parts = _chunks(series)
        flat += [(title + (f" ({i + 1}/{len(parts)})" if len(parts) > 1 else ""), part)
                 for i, part in enumerate(parts)]
    fig, axes = _panels(len(flat))
    for ax, (title, series) in zip(axes, flat, strict=True):
        reps = []
        for run, rows in series:
            xs, ys = [r.repetitions for r in rows], [r.value for r in rows]
            lo, hi = zip(*(r.errors for r in rows), strict=True)
            bar = ax.errorbar(xs, ys, yerr=[list(lo), list(hi)], marker="o", capsize=2,
                              label=_eps_label(run.privacy.epsilon) if run.role != "public-base" else "public base")
            _mark_lower_bounds(ax, [(r.repetitions, r.value) for r in rows if r.lower_bound],
                               bar.lines[0].get_color())
            reps += xs
        _repetition_axes(ax, reps, title, "repetitions in training (log scale)", "exposure (bits)")
    fig.tight_layout()
    return fig


def extraction_figure(report: dict[str, Any]):
    """Exact extraction against repetitions, one panel per backend; None when nothing was extracted."""
    panels: dict[str, list] = {}
    for run in _real_runs(report):
        rows = [RepetitionPoint.of(r) for r in run.plot_rows("extraction_by_repeats", [])]
        if rows:
            panels.setdefault(_backend_label(run), []).append((run, rows))
    if not any(r.value for s in panels.values() for _run, rows in s for r in rows):
        return None  # flat at zero: plot_notes says "none extracted"
    flat = [(t, part) for t, series in panels.items() for part in _chunks(series, MAX_SERIES // 2)]
    fig, axes = _panels(len(flat))
    for ax, (title, series) in zip(axes, flat, strict=True):
        reps = []
        for run, rows in series:
            k = min(r.prefix_len for r in rows)
            rs = sorted((r for r in rows if r.prefix_len == k), key=lambda r: r.repeats)
            ax.plot([r.repeats for r in rs], [r.value for r in rs], marker="o",
                    label=f"{_eps_label(run.privacy.epsilon)}, prefix {k} tokens")
            reps += [r.repeats for r in rs]
        ax.set_ylim(-0.02, 1.02)
        _repetition_axes(ax, reps, title, "times the text was repeated (log scale)",
                         "exact extraction (fraction of documents)")
    fig.tight_layout()
    return fig


def _repetition_axes(ax, reps: list, title: str, xlabel: str, ylabel: str) -> None:
    """A panel against repetitions: log-2 x axis ticked at the repetitions drawn, labels, legend."""
    ax.set_xscale("log", base=2)
    _fixed_ticks(ax, "x", [r for r in reps if r > 0])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def roc_axes(ax, curves: list[tuple[str, list[float], list[float]]], title: str, *, lo: float = 1e-4,
             floor: float = 1e-5, fontsize: float = 9) -> None:
    """ROC curves on log-log axes from `lo` to 1 (`floor`: where a rate of 0 is drawn), the chance
    diagonal, axis labels and legend; `curves` are (label, fpr, tpr)."""
    for label, fpr, tpr in curves:
        ax.plot([max(f, floor) for f in fpr], [max(t, floor) for t in tpr], label=label)
    ax.plot([floor, 1], [floor, 1], "k:", lw=0.8, label="chance")
    log_axis(ax, "x", lo, 1, pad=1.0)
    log_axis(ax, "y", lo, 1, pad=1.0)
    ax.set_xlabel("false positive rate (log scale)")
    ax.set_ylabel("true positive rate (log scale)")
    ax.set_title(title, fontsize=fontsize)
    ax.legend(fontsize=7)


def roc_figure(report: dict[str, Any], key: str, title: str):
    panels: dict[str, list] = {}
    for run in _runs(report):
        roc = run.plot_rows(key, None)
        if roc and Roc.of(roc).fpr:
            panels.setdefault(_name(run), []).append((run, Roc.of(roc)))
    if not panels:
        return None
    flat = [(t, part) for t, series in panels.items() for part in _chunks(series, MAX_SERIES - 1)]
    fig, axes = _panels(len(flat))
    for ax, (name, series) in zip(axes, flat, strict=True):
        curves = []
        for run, roc in series:
            auc = roc.auc
            curves.append((f"{_eps_label(run.privacy.epsilon)} (AUC {auc if auc is not None else float('nan'):.2f})",
                           roc.fpr, roc.tpr))
        roc_axes(ax, curves, f"{title}: {name}")
    fig.tight_layout()
    return fig


TARGET_ROC_SIZE = (2.9, 2.5)  # inches: one model's ROC beside its verdict on the first screen


def target_roc_figure(target: dict[str, Any], fpr: float = 0.01):
    """One probed model's ROC of the attack its verdict names (`targets[].roc`), log-log down to
    the smallest false-positive rate its non-members can show, the verdict's FPR marked; None
    without one."""
    raw = target.get("roc")
    roc = Roc.of(raw)
    if not raw or not roc.fpr:
        return None
    n0 = max(int(roc.n_neg or 1), 1)
    lo = 10.0 ** math.floor(math.log10(1 / n0)) if n0 > 1 else 0.01
    fig, ax = plt.subplots(figsize=TARGET_ROC_SIZE)
    auc = roc.auc
    label = f"{roc.attack} (AUC {auc:.2f})" if auc is not None else str(roc.attack)
    roc_axes(ax, [(label, roc.fpr, roc.tpr)], f"{target['id']}: ROC of {roc.attack}",
             lo=lo, floor=lo / 10, fontsize=8)
    ax.axvline(fpr, color="#999999", lw=0.8, ls="--")
    ax.annotate(f"{number(fpr * 100)}% FPR", (fpr, 1.0), xytext=(3, -9), textcoords="offset points",
                fontsize=7, color="#555555")
    ax.set_xlabel(f"false positive rate (log scale; {roc.n_neg} non-members)", fontsize=8)
    ax.set_ylabel(f"true positive rate (log; {roc.n_pos} members)", fontsize=8)
    fig.tight_layout()
    return fig


def target_plots(report: dict[str, Any]) -> dict[str, str]:
    """Each probed model's ROC (`target_roc_figure`) as inline SVG, by target id."""
    out = {}
    for t in report.get("targets") or []:
        fig = target_roc_figure(t)
        if fig is not None:
            out[t["id"]] = _svg(fig)
    return out


def audit_figure(report: dict[str, Any]):
    pts = []
    for run in _runs(report):
        a = run.cell("audit_epsilon")
        if a and a.value is not None:
            pts.append((run.privacy.epsilon, a.value, a.extra.get("ceiling"), run.id))
    if not pts:
        return None
    finite = [p[0] for p in pts if p[0] is not None and math.isfinite(p[0])]
    right = max(finite) * 2 if finite else 1.0
    fig, ax = plt.subplots(figsize=(4.6, 3.6))
    for eps, lb, ceil, rid in pts[:MAX_SERIES]:
        x = eps if eps is not None and math.isfinite(eps) else right
        ax.scatter([x], [lb], label=rid)
        if ceil is not None:
            ax.plot([x * 0.9, x * 1.1], [ceil, ceil], "-", color="#D55E00", lw=1)
    top = max(finite + [p[1] for p in pts] + [1.0])
    ax.plot([0, top], [0, top], "k:", lw=0.8, label="lower bound = ledger")
    ax.set_xlabel("ledger epsilon (no DP drawn at right)")
    ax.set_ylabel("empirical epsilon lower bound")
    ax.set_title("One-run audit vs ledger (orange: audit ceiling)", fontsize=9)
    ax.legend(fontsize=7)
    return fig


def utility_figure(report: dict[str, Any]):
    """Holdout perplexity against epsilon per backend (no DP drawn at the right)."""
    curves = [(c.label, [CurvePoint.of(p) for p in c.points])
              for c in comparisons_of(report).each_curve()]
    if not curves:
        return None
    finite = [p.epsilon for _label, pts in curves for p in pts if math.isfinite(p.epsilon)]
    right = max(finite) * 4 if finite else 1.0
    fig, ax = plt.subplots(figsize=(4.6, 3.4))
    ys = []
    for label, points in curves[:MAX_SERIES]:
        pts = sorted(points, key=lambda p: p.epsilon)
        xs = [p.epsilon if math.isfinite(p.epsilon) else right for p in pts]
        y = [p.perplexity.mean for p in pts]
        ax.errorbar(xs, y, yerr=[p.perplexity.std for p in pts], marker="o", capsize=2,
                    label=label, color=SERIES_COLOURS.get(label))
        ys += [v for v in y if v and v > 0]
    if finite:
        ax.set_xscale("log")
        _fixed_ticks(ax, "x", finite + [right])
        ax.set_xticklabels([_plain(v) for v in sorted(set(finite))] + ["no DP"])
    if ys:
        log_axis(ax, "y", min(ys), max(ys))
    ax.set_xlabel("target epsilon (per example or per user)")
    ax.set_ylabel("holdout perplexity (per token, log scale)")
    ax.set_title("Utility vs privacy level", fontsize=9)
    ax.legend(fontsize=7)
    return fig


def all_figures(report: dict[str, Any]) -> dict[str, Any]:
    figs = {
        "frontier": frontier_figure(report),
        "utility": utility_figure(report),
        "exposure": exposure_figure(report),
        "extraction": extraction_figure(report),
        "membership_roc": roc_figure(report, "membership_roc", "Membership inference ROC"),
        "user_roc": roc_figure(report, "user_roc", "User inference ROC"),
        "audit": audit_figure(report),
    }
    return {k: v for k, v in figs.items() if v is not None}


def all_plots(report: dict[str, Any]) -> dict[str, str]:
    return {k: _svg(fig) for k, fig in all_figures(report).items()}


def plot_notes(report: dict[str, Any]) -> list[str]:
    """What the plots leave out and why: metrics that are 0 in every run ("none extracted")."""
    metrics = comparisons_of(report).frontier_metrics()
    zero = [(SHORT.get(k, k), m.n_points) for k, m in metrics.items() if m.all_zero]
    notes = []
    if zero:
        notes.append(f"None extracted, so not drawn: {', '.join(z[0] for z in zero)} "
                     f"(0 in every run measured, {max(z[1] for z in zero)} runs).")
    runs = _real_runs(report)
    rows = [RepetitionPoint.of(r) for run in runs for r in run.plot_rows("extraction_by_repeats", [])]
    if rows and not any(r.value for r in rows) and "extraction_exact" not in metrics:
        notes.append("exact extraction: none extracted in any repetition bucket")
    return notes
