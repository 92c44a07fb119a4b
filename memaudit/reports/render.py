"""Render report.json to a self-contained report.html (inline SVG) and report.md.

Both are rendered from the report dict alone. All text that came from training data is
escaped: jinja2 autoescaping in HTML, entity escaping in Markdown.
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

import jinja2

from memaudit.reports.findings import METRICS, SHORT
from memaudit.reports.plots import all_plots, plot_notes

_TEMPLATES = Path(__file__).parent / "templates"


def fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, str):
        return v
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        if math.isinf(v):
            return "inf"
        return f"{v:.4g}"
    return str(v)


def n_text(c: dict[str, Any]) -> str:
    """"n = 96 documents", or for an attack's AUC both classes: "n = 323 members + 96 non-members
    documents" (the interval's width is set by the smaller class, the test uses both)."""
    unit = c.get("unit") or ""
    if c.get("n_pos") is not None and c.get("n_neg") is not None:
        return f"n = {c['n_pos']} members + {c['n_neg']} non-members {unit}".strip()
    return f"n = {c['n']} {unit}".strip()


def value_text(c: dict[str, Any], num=fmt) -> str:
    """The value with its interval, or ">= value" for a cell that is a lower bound (exposures at
    the estimator's ceiling, `memaudit.reports.probes_adapter.at_ceiling`), which has none."""
    if c.get("lower_bound"):
        return f">= {num(c['value'])}"
    s = num(c["value"])
    if c.get("ci_low") is not None and c.get("ci_high") is not None:
        s += f" [{num(c['ci_low'])}, {num(c['ci_high'])}]"
    return s


def cell(c: dict[str, Any] | None) -> str:
    """Value, interval (or the note saying why there is none) and n with its unit."""
    if not c:
        return "n/a"
    n = f" ({n_text(c)})" if c.get("n") is not None else ""
    if c.get("value") is None:
        return f"{c.get('note') or 'n/a'}{n}"
    s = value_text(c)
    if (c.get("ci_low") is None or c.get("ci_high") is None) and c.get("note"):
        s += f", {c['note']}"
    return s + n


def test_cell(t: dict[str, Any] | None) -> str:
    """A comparison's test in one line: name, sidedness, p and adjusted p."""
    if not t:
        return "not tested (no per-unit scores)"
    adj = f", {t.get('correction', '')} p = {fmt(t['p_adjusted'])}" if "p_adjusted" in t else ""
    return f"{t['test']} ({t['alternative']}), n = {t['n_a']}/{t['n_b']} {t['unit']}, p = {fmt(t['p_value'])}{adj}"


def md_text(text: Any) -> str:
    """Escape memaudit's own sentences for Markdown: no raw HTML, no table breaks."""
    return html.escape(str(text), quote=False).replace("|", "&#124;").replace("\n", " ")


def md(text: Any) -> str:
    """Escape text from training data for Markdown: no raw HTML, no markup of any kind."""
    s = html.escape(str(text), quote=True)
    return s.replace("|", "&#124;").replace("`", "&#96;").replace("\n", " ").replace("*", "&#42;").replace("_", "&#95;").replace("[", "&#91;").replace("]", "&#93;")


def _env(autoescape: bool) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(_TEMPLATES),
        autoescape=autoescape,
        undefined=jinja2.StrictUndefined,
        trim_blocks=False,
        lstrip_blocks=False,
    )
    env.globals.update(fmt=fmt, cell=cell, test_cell=test_cell, md=md, md_text=md_text)
    return env


def _labels() -> list[tuple[str, str]]:
    return [(k, SHORT[k] + (" (bits)" if k == "exposure_top" else "")) for k in METRICS]


def _group_context(report: dict[str, Any]) -> dict[str, Any]:
    """The group-privacy table's rows (repetitions, owner kind) and a cell lookup per run."""
    keys = sorted({(g["repetitions"], g["owner_kind"]) for run in report["runs"]
                   for g in run.get("group_privacy") or []})

    def group_cell(run: dict[str, Any], key: tuple[int, str]) -> dict[str, Any] | None:
        return next((g for g in run.get("group_privacy") or []
                     if (g["repetitions"], g["owner_kind"]) == tuple(key)), None)

    return {"has_group": bool(keys), "group_keys": keys, "group_cell": group_cell}


def render_html(report: dict[str, Any]) -> str:
    return _env(True).get_template("report.html.j2").render(
        r=report, plots=all_plots(report), plot_notes=plot_notes(report), metric_labels=_labels(),
        **_group_context(report),
    )


def render_markdown(report: dict[str, Any]) -> str:
    return _env(False).get_template("report.md.j2").render(
        r=report, plot_notes=plot_notes(report), metric_labels=_labels(), **_group_context(report))
