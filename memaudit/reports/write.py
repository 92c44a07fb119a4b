"""Write report.json, report.html and report.md into a report directory, atomically; read
report.json back.

This module is report.json's one reader and writer: in memory the report's measured cells and
tests are the typed records of `memaudit.probes.records` (`Cell`, `Test`), and its comparisons and
sections the records of `memaudit.reports` (`memaudit.reports.entries.Record`: the comparisons'
blocks, the scale and literature sections); only here do they become JSON objects (`json_safe`,
through their `to_json`) and records again (`load_report`, through `Record.of` and `from_json`)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from memaudit.backends import backend_name
from memaudit.io import atomic_write_text
from memaudit.probes.records import Cell, Test
from memaudit.reports.blocks import Comparisons, Section
from memaudit.reports.entries import Record
from memaudit.reports.render import render_html, render_markdown
from memaudit.reports.scale import ScaleSection
from memaudit.reports.schema import validate_report


def json_safe(o: Any) -> Any:
    """`o` with its records (cells, tests, the sections' records) as JSON objects, infinities as "inf"/"-inf" and NaN as null: what
    report.json stores."""
    if isinstance(o, Cell | Test | Record):
        o = o.to_json()
    if isinstance(o, float) and (math.isinf(o) or math.isnan(o)):
        return None if math.isnan(o) else ("inf" if o > 0 else "-inf")
    if isinstance(o, dict):
        return {k: json_safe(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [json_safe(v) for v in o]
    return o


def _json_restore(o: Any) -> Any:
    if o == "inf":
        return math.inf
    if o == "-inf":
        return -math.inf
    if isinstance(o, dict):
        return {k: _json_restore(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_json_restore(v) for v in o]
    return o


def write_report(report: dict[str, Any], out_dir: str | os.PathLike) -> dict[str, Path]:
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out '{out}' exists and is not a directory; choose another path")
    safe = json_safe(report)
    validate_report(safe)
    js, page, md = out / "report.json", out / "report.html", out / "report.md"
    # the report can hold per-canary scores and (--show-secrets) member text: its owner's only,
    # a folder it makes and one it wrote before (an existing folder of the user's keeps its mode)
    if not out.exists():
        out.mkdir(parents=True, mode=0o700)
    if js.is_file() or not any(out.iterdir()):
        os.chmod(out, 0o700)
    atomic_write_text(js, json.dumps(safe, indent=2) + "\n")
    restored = typed(_json_restore(safe))  # render from exactly what report.json holds
    atomic_write_text(page, render_html(restored))
    atomic_write_text(md, render_markdown(restored))
    return {"json": js, "html": page, "md": md}


def backend_renamed(o: Any, *, keys: bool = False) -> Any:
    """A report written before the centralized backend was renamed, in today's names: every
    `backend` value, and (`keys`, the comparisons) the centralized side's key, `parallel` ->
    `centralized`."""
    if isinstance(o, dict):
        return {(backend_name(k) if keys else k):
                backend_name(v) if k == "backend" else backend_renamed(v, keys=keys) for k, v in o.items()}
    if isinstance(o, list):
        return [backend_renamed(v, keys=keys) for v in o]
    return o


def load_report(path: str | os.PathLike) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    if isinstance(raw, dict):
        raw = {k: backend_renamed(v, keys=k == "comparisons") for k, v in raw.items()}
    validate_report(raw)
    return typed(_json_restore(raw))


def typed(report: dict[str, Any]) -> dict[str, Any]:
    """A report.json's content with its records typed: each run's and target's leakage cells
    (`Cell.from_json`), the comparisons (`memaudit.reports.blocks.Comparisons`: each block's
    sides, verdicts and tests), the scale section (`memaudit.reports.scale.ScaleSection`) and the
    literature section (`memaudit.reports.blocks.Section`). A key an older report lacks reads as
    its record's default; the keys a record leaves out while unset are written back only when set."""
    for r in report.get("runs", []) + report.get("targets", []):
        r["leakage"] = {k: Cell.from_json(c) for k, c in r["leakage"].items()}
    report["comparisons"] = Comparisons.of(report.get("comparisons"))
    for key, kind in SECTIONS:
        if report.get(key):
            report[key] = kind.of(report[key])
    return report


SECTIONS = (("scale", ScaleSection), ("literature", Section))
"""report.json's sections that are records, by their key."""


def rerender(report_json: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> dict[str, Path]:
    """Re-render HTML and Markdown from report.json alone."""
    report = load_report(report_json)
    return write_report(report, out_dir or Path(report_json).parent)
