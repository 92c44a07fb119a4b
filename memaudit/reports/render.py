"""Render report.json to a self-contained report.html (inline SVG) and report.md.

Both are rendered from the report dict alone. All text that came from training data is
escaped: jinja2 autoescaping in HTML, entity escaping in Markdown.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import jinja2

from memaudit.reports.cells import METRICS, PAGE, SHORT, Test, fmt, format_cell
from memaudit.reports.plots import all_plots, plot_notes, target_plots
from memaudit.reports.targets import STRONGEST, input_text
from memaudit.reports.verdict import Verdict, release_verdict

_TEMPLATES = Path(__file__).parent / "templates"


def test_cell(t: Test | dict[str, Any] | None) -> str:
    """A comparison's test in one line: name, sidedness, p and adjusted p (the scale section's
    tests are still the JSON objects of its section: read as a `Test`)."""
    if not t:
        return "not tested (no per-unit scores)"
    if isinstance(t, dict):
        t = Test.from_json(t)
    adj = f", {t.correction or ''} p = {fmt(t.p_adjusted)}" if t.p_adjusted is not None else ""
    return f"{t.name} ({t.alternative}), n = {t.n_a}/{t.n_b} {t.unit}, p = {fmt(t.p_value)}{adj}"


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
                       input_text=input_text, count=count)
    return env


def count(n: int, noun: str) -> str:
    """ "1 probed model", "4 probed models"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _labels() -> list[tuple[str, str]]:
    """The runs' headline metrics (the strongest attack is the outside models' own)."""
    return [(k, SHORT[k] + (" (bits)" if k == "exposure_top" else "")) for k in METRICS if k != STRONGEST]


def _target_context(report: dict[str, Any]) -> dict[str, Any]:
    """Each probed model with its verdict (`memaudit.reports.verdict`), the shift warnings that
    lead the page, and the labels of the metrics each model measured."""
    targets = report.get("targets") or []
    verdicts: list[Verdict] = [release_verdict(t) for t in targets]
    labels = {k: label for k, label in _labels()}
    return {"verdicts": list(zip(targets, verdicts, strict=True)),
            "shifted": [v for v in verdicts if v.shift_auc is not None],
            "target_metric_labels": labels | {STRONGEST: SHORT[STRONGEST]}}


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
        target_plots=target_plots(report), **_group_context(report), **_target_context(report),
    )


def render_markdown(report: dict[str, Any]) -> str:
    return _env(False).get_template("report.md.j2").render(
        r=report, plot_notes=plot_notes(report), metric_labels=_labels(), **_group_context(report),
        **_target_context(report))
