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

from memaudit.reports.findings import METRICS
from memaudit.reports.plots import all_plots

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


def cell(c: dict[str, Any] | None) -> str:
    """Value, interval (or the note saying why there is none) and n with its unit."""
    if not c:
        return "n/a"
    n = f" (n = {c['n']} {c.get('unit') or ''})".replace(" )", ")") if c.get("n") is not None else ""
    if c.get("value") is None:
        return f"{c.get('note') or 'n/a'}{n}"
    s = fmt(c["value"])
    if c.get("ci_low") is not None and c.get("ci_high") is not None:
        s += f" [{fmt(c['ci_low'])}, {fmt(c['ci_high'])}]"
    elif c.get("note"):
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
    short = {
        "exposure_top": "excess exposure, top reps (bits)",
        "extraction_exact": "exact extraction",
        "canary_completion": "canary completion",
        "mia_auc": "MIA AUC",
        "user_mia_auc": "user-inference AUC",
        "pii_extraction": "PII extraction",
        "audit_epsilon": "audit epsilon LB",
    }
    return [(k, short[k]) for k in METRICS]


def render_html(report: dict[str, Any]) -> str:
    return _env(True).get_template("report.html.j2").render(
        r=report, plots=all_plots(report), metric_labels=_labels()
    )


def render_markdown(report: dict[str, Any]) -> str:
    return _env(False).get_template("report.md.j2").render(r=report, metric_labels=_labels())
