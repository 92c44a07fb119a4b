"""The figures of docs/results.md and the README, rendered from committed report snapshots,
never typed by hand.

A snapshot is a sweep's report.json committed under ``docs/snapshots/NAME.report.json`` (the
extracted member text and local paths removed), with ``NAME.meta.json`` saying how it was
measured (date, command, wall time, CPU cores). docs/results.md holds one full block per
snapshot and the README a short summary of the quickstart's::

    <!-- snapshot:quickstart -->      (docs/results.md: every run, the findings, the literature)
    <!-- summary:quickstart -->       (README.md: how it was measured, one line a run)
    ...generated from docs/snapshots/quickstart.report.json...
    <!-- /snapshot -->

``python -m memaudit.reports.snapshots`` rewrites every block from its snapshot; ``--check``
only says which blocks disagree (exit 1), which is what ``tests/test_doc_snapshots.py``
asserts. ``benchmarks/quickstart_time.py`` refreshes a snapshot after its sweep
(`write_snapshot`) and then the documents. A study snapshot joins by adding its block to
docs/results.md. The README's picture of the report's first screen is rendered from the
quickstart snapshot's HTML (`first_screen_html`); docs/report-first-screen.json records that
HTML's sha256, so a changed snapshot or template shows the picture is stale.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memaudit.io import atomic_write_text
from memaudit.reports.blocks import Findings, Section, comparisons_of
from memaudit.reports.cells import README as README_CELL
from memaudit.reports.cells import format_cell, readme_number
from memaudit.reports.entries import Record, RunEntry, entries
from memaudit.reports.literature import (
    audit_sentences,
    contrast_buckets,
    dp_learns_sentences,
    extraction_sentences,
)
from memaudit.reports.render import render_html
from memaudit.reports.write import json_safe, load_report

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOTS = ROOT / "docs" / "snapshots"
README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "results.md"
DOCS = (README, RESULTS)
SCREENSHOT = ROOT / "docs" / "report-first-screen.png"
SCREENSHOT_META = ROOT / "docs" / "report-first-screen.json"
BLOCK = re.compile(r"(<!-- (?P<kind>snapshot|summary):(?P<name>[a-z0-9_-]+) -->\n)(?P<body>.*?)(<!-- /snapshot -->)",
                   re.DOTALL)
COLUMNS = (("exposure_top", "excess exposure, top reps (bits)"), ("mia_auc", "MIA AUC"),
           ("user_mia_auc", "user-inference AUC"))


@dataclass(frozen=True, kw_only=True)
class Meta(Record):
    """How a snapshot was measured (its .meta.json)."""

    command: str | None = None
    date: str = "an unrecorded date"
    wall_s: float | None = None
    cpus: Any = "?"
    note: str | None = None


def _privacy(run: RunEntry) -> str:
    p = run.privacy
    if run.role == "public-base":
        return "public base"
    eps = p.epsilon
    if p.unit is None or eps is None or (isinstance(eps, float) and math.isinf(eps)):
        return "no DP"
    return f"{p.mechanism}, epsilon = {readme_number(eps)} per {p.unit}"


def _measured(meta: dict[str, Any]) -> list[str]:
    if not meta:
        return []
    m = Meta.of(meta)
    how = f"`{m.command}`" if m.command else "a sweep"
    return [f"Measured with {how} on {m.date}: {readme_number(m.wall_s)} s of sweep on {m.cpus} CPU cores"
            + (f" ({m.note})" if m.note else "") + "."]


def _passing_line(findings: dict[str, Any]) -> str:
    f = Findings.of(findings)
    head = f.first_screen()
    shown = len(head)
    passing = shown if f.passing is None else f.passing
    covered = sum(h.covers for h in head)
    return (f"{passing} of {f.tests} tests pass the statistical rules "
            f"({str(f.correction).capitalize()}-corrected over all of them)"
            + ((f"; the report's first screen says {covered} of them in {shown} finding"
                f"{'s' if shown != 1 else ''}:" if passing > shown else ":") if shown else "."))


def _matched_line(report: dict[str, Any]) -> str:
    mu = comparisons_of(report).matched_utility
    pairs = Findings.of(report.get("findings")).matched_pairs or []
    return f"At matched utility: {mu.message}" + (": " + "; ".join(pairs) if pairs else "") + "."


def render_summary(name: str, report: dict[str, Any], meta: dict[str, Any] | None = None) -> str:
    """The README's short block of snapshot `name`: how it was measured, one line a run (utility
    and the membership attack's AUC), the matched-utility line and how many tests pass."""
    lines = [*_measured(meta or {}), "",
             "| run | privacy | holdout perplexity | membership-inference AUC |", "|---|---|---|---|"]
    for r in entries(report.get("runs") or []):
        lines.append(f"| {r.id} | {_privacy(r)} | {readme_number(r.utility.holdout_perplexity)} | "
                     f"{format_cell(r.cell('mia_auc'), README_CELL)} |")
    lines += ["", _matched_line(report), "", _passing_line(report["findings"]).rstrip(":") + "; each finding, "
              "with its test and caveat, is in [docs/results.md](docs/results.md)."]
    return "\n".join(lines) + "\n"


def render_block(name: str, report: dict[str, Any], meta: dict[str, Any] | None = None) -> str:
    """The docs/results.md block of snapshot `name`: how it was measured, each run's utility and
    headline leakage, the matched-utility line and the findings that pass the statistical rules."""
    lines = _measured(meta or {})
    lines.append(f"From `docs/snapshots/{name}.report.json`, {len(report['runs'])} runs:")
    lines.append("")
    lines.append("| run | privacy | holdout perplexity | " + " | ".join(lbl for _k, lbl in COLUMNS) + " |")
    lines.append("|---|---|---|" + "---|" * len(COLUMNS))
    for r in entries(report.get("runs") or []):
        cells = " | ".join(format_cell(r.cell(k), README_CELL) for k, _lbl in COLUMNS)
        lines.append(f"| {r.id} | {_privacy(r)} | {readme_number(r.utility.holdout_perplexity)} | {cells} |")
    f = report.get("findings")
    lines += ["", _matched_line(report), "", _passing_line(f)]
    for h in Findings.of(f).first_screen():
        lines.append(f"- {h.text} ({h.evidence})" + (f"; caveat: {h.caveat}" if h.caveat else "") + ".")
    lit = Section.of(report.get("literature"))
    if lit.sentences:
        lines += ["", *_literature_lines(lit)]
    return "\n".join(lines) + "\n"


def _literature_lines(lit: Section) -> list[str]:
    """The literature section, compact: the trend tests in one line, the group-privacy contrast as a
    table (user-owned canaries at the most repetitions), then extraction, audit and learning."""
    out = [(f"The effects the literature reports ({(lit.correction or 'holm').capitalize()}-"
           f"corrected over the {lit.family or 0} tests of that section):")]
    trends = [(e.label, e.trend) for e in lit.exposure_entries() if e.trend]
    if trends:
        shown = [lbl for lbl, t in trends if t.verdict == "shown"]
        lbl, t = min(trends, key=lambda x: 1.0 if x[1].p_adjusted is None else x[1].p_adjusted)
        out.append(f"- Exposure rises with repetitions (one-sided Spearman, n = {t.n_a} canaries a run): "
                   f"shown in {len(shown)} of {len(trends)} runs{' (' + '; '.join(shown) + ')' if shown else ''}; "
                   f"strongest: {lbl}, rho = {t.rho:.2f}, Holm p = {readme_number(t.p_adjusted)}.")
    rows = [f"| {e.label} | {b.repetitions} | {readme_number(b.effective_epsilon)} | {format_cell(b.excess, README_CELL)} | "
            f"{b.test.verdict} (Holm p = {readme_number(b.test.p_adjusted)}) |"
            for e, b in contrast_buckets(lit.exposure)]
    if rows:
        out += [("- Group privacy on the same canaries (one user owns every copy; Mann-Whitney, inserted > "
                "references):"), "", ("  | run | repetitions | effective epsilon | excess exposure (bits) | "
                "test |"), "  |---|---|---|---|---|", *[f"  {r}" for r in rows], ""]
    out += [f"- {s}." for f in (extraction_sentences, audit_sentences, dp_learns_sentences) for s in f(lit)]
    return out


def load_snapshot(name: str, snapshots: Path = SNAPSHOTS) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(report, meta) of snapshot `name`; the report is checked against report.json's schema."""
    path = snapshots / f"{name}.report.json"
    if not path.is_file():
        raise ValueError(f"a document names snapshot '{name}' but {path} does not exist; run the benchmark "
                         "that writes it or remove the block")
    meta_path = snapshots / f"{name}.meta.json"
    meta = json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.is_file() else None
    return load_report(path), meta


def rendered(text: str, snapshots: Path = SNAPSHOTS) -> str:
    """A document's text with every block rewritten from its snapshot."""
    def sub(m: re.Match) -> str:
        report, meta = load_snapshot(m["name"], snapshots)
        render = render_summary if m["kind"] == "summary" else render_block
        return m.group(1) + render(m["name"], report, meta) + m.group(5)

    return BLOCK.sub(sub, text)


def stale_blocks(doc: Path = RESULTS, snapshots: Path = SNAPSHOTS) -> list[str]:
    """Names (``kind:name``) of the blocks of `doc` that disagree with their snapshots."""
    text = doc.read_text(encoding="utf-8")
    fresh = rendered(text, snapshots)
    now = {(m["kind"], m["name"]): m["body"] for m in BLOCK.finditer(text)}
    return [f"{m['kind']}:{m['name']}" for m in BLOCK.finditer(fresh)
            if now.get((m["kind"], m["name"])) != m["body"]]


def update_doc(doc: Path = RESULTS, snapshots: Path = SNAPSHOTS) -> list[str]:
    """Rewrite the blocks of `doc` (atomically); returns the names of the blocks changed."""
    changed = stale_blocks(doc, snapshots)
    if changed:
        atomic_write_text(doc, rendered(doc.read_text(encoding="utf-8"), snapshots))
    return changed


def update_docs(docs: tuple[Path, ...] = DOCS, snapshots: Path = SNAPSHOTS) -> list[str]:
    """`update_doc` over the README and docs/results.md; names as ``FILE kind:name``."""
    return [f"{d.name} {n}" for d in docs for n in update_doc(d, snapshots)]


def first_screen_html(snapshots: Path = SNAPSHOTS) -> str:
    """The quickstart snapshot's report as HTML: what the README's picture shows."""
    return render_html(load_snapshot("quickstart", snapshots)[0])


# matplotlib names an SVG clip path by a hash of its rectangle at full float precision, and
# numpy's SIMD kernels (AVX-512 or not) move that rectangle in the last bits: the same picture
# gets other ids on another CPU. The digest numbers them in order of appearance instead.
_CLIP_ID = re.compile(r"(?<=[\"#])p[0-9a-f]{10}(?=[\")])")


def html_digest(html: str) -> str:
    """sha256 of the HTML with matplotlib's clip-path ids renumbered (they differ across CPUs for
    the same picture; everything drawn is compared)."""
    ids: dict[str, str] = {}
    canonical = _CLIP_ID.sub(lambda m: ids.setdefault(m.group(0), f"clip{len(ids)}"), html)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def screenshot_stale(html: str | None = None, meta_path: Path = SCREENSHOT_META) -> bool:
    """True when the committed picture was rendered from HTML other than `html` (default: what
    `first_screen_html` renders today)."""
    if not meta_path.is_file():
        return True
    recorded = json.loads(meta_path.read_text(encoding="utf-8")).get("html_sha256")
    return recorded != html_digest(first_screen_html() if html is None else html)


def snapshot_of(report: dict[str, Any]) -> dict[str, Any]:
    """A report as committed: no extracted member text and no local paths."""
    runs = [{**r, "samples": [], "path": r["id"]} for r in report["runs"]]
    return {**report, "runs": runs}


def write_snapshot(report_json: Path, name: str, meta: dict[str, Any], snapshots: Path = SNAPSHOTS) -> Path:
    """Commit-ready snapshot `name` from a sweep's report.json, with how it was measured."""
    snap = json_safe(snapshot_of(load_report(report_json)))
    snapshots.mkdir(parents=True, exist_ok=True)
    out = snapshots / f"{name}.report.json"
    atomic_write_text(out, json.dumps(snap, indent=1, sort_keys=True) + "\n")
    atomic_write_text(snapshots / f"{name}.meta.json", json.dumps(meta, indent=1, sort_keys=True) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m memaudit.reports.snapshots",
                                 description="Re-render the blocks of the README and docs/results.md.")
    ap.add_argument("--doc", type=Path, action="append", default=None,
                    help="a document with blocks (repeatable; default: README.md and docs/results.md)")
    ap.add_argument("--snapshots", type=Path, default=SNAPSHOTS)
    ap.add_argument("--check", action="store_true", help="only report stale blocks (exit 1 if any)")
    args = ap.parse_args(argv)
    docs = tuple(args.doc or DOCS)
    try:
        if args.check:
            names = [f"{d.name} {n}" for d in docs for n in stale_blocks(d, args.snapshots)]
        else:
            names = update_docs(docs, args.snapshots)
    except (ValueError, OSError) as e:
        print(f"memaudit: error: {e}", file=sys.stderr)
        return 2
    verb = "stale" if args.check else "rewritten"
    print(f"{verb}: {', '.join(names)}" if names else "the documents agree with their snapshots")
    return 1 if (args.check and names) else 0


if __name__ == "__main__":
    sys.exit(main())
