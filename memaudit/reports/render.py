"""Render report.json to a self-contained report.html (inline SVG) and report.md.

Both are rendered from the report dict alone. All text that came from training data is
escaped: jinja2 autoescaping in HTML, entity escaping in Markdown.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import jinja2

from memaudit.reports.cells import METRICS, PAGE, SHORT, fmt, format_cell
from memaudit.reports.plots import all_plots, plot_notes
from memaudit.reports.targets import best_attack, input_text

_TEMPLATES = Path(__file__).parent / "templates"


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
    env.globals.update(fmt=fmt, cell=lambda c: format_cell(c, PAGE), test_cell=test_cell, md=md, md_text=md_text,
                       best_attack=best_attack, input_text=input_text)
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
