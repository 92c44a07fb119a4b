"""`memaudit report RUN_DIR... --out REPORT_DIR`: one HTML/Markdown/JSON report over runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from memaudit.commands._common import console, print_json
from memaudit.reports.frontier import DEFAULT_TOLERANCE


def register(app: typer.Typer) -> None:
    # typer 0.20 drops an argument's own help from --help: what RUNS may be is said here
    @app.command("report", help="Write report.html, report.md and report.json comparing runs. RUNS: "
                 "run directories, folders holding runs (a sweep), or probe folders: a folder "
                 "holding the probes.json of another model, as `memaudit probe MODEL --out "
                 "FOLDER/probes.json` writes it; each is one probed model, compared with the others.")
    def report(
        runs: Annotated[list[Path], typer.Argument(
            help="Run directories, folders holding runs (a sweep), or probe folders: a folder holding "
            "the probes.json of another model, as `memaudit probe MODEL --out FOLDER/probes.json` "
            "writes it (each such folder is one probed model, compared with the others).")],
        out: Annotated[Path, typer.Option("--out", help="Report directory to write.")] = Path("report"),
        show_secrets: Annotated[
            bool, typer.Option("--show-secrets", help="Include canary secrets in the report.")
        ] = False,
        fmt: Annotated[str, typer.Option("--format", help="table | json: what to print.")] = "table",
        rerender: Annotated[
            bool, typer.Option("--rerender", help="Treat RUNS[0] as a report.json and re-render it.")
        ] = False,
        utility_tolerance: Annotated[
            float, typer.Option("--utility-tolerance",
                                help="Largest |log holdout-perplexity ratio| of a matched-utility pair.")
        ] = DEFAULT_TOLERANCE,
    ) -> None:
        # lazy: `memaudit --help` does not import matplotlib (~0.4 s) and numpy (~0.4 s)
        from memaudit.reports.build import build_report
        from memaudit.reports.write import rerender as do_rerender
        from memaudit.reports.write import write_report

        if fmt not in ("table", "json"):
            raise ValueError(f"--format '{fmt}' is not one of table, json")
        if rerender:
            paths = do_rerender(runs[0], out)
            console.print(f"re-rendered {paths['html']} and {paths['md']}")
            return
        rep = build_report(list(runs), show_secrets=show_secrets, utility_tolerance=utility_tolerance)
        paths = write_report(rep, out)
        if fmt == "json":
            print_json({"report": {k: str(v) for k, v in paths.items()}, "findings": rep["findings"]})
            return
        for t in rep.get("targets", []):
            # the page's verdict, word for word: its attack is chosen by the rate at 1% FPR
            what = (t.get("verdict") or {}).get("sentence") or "no membership attack run"
            console.print(f"target {t['id']} ({t['source']}): {what} Privacy: {t['privacy']['text']}.",
                          markup=False, highlight=False)
            if (t.get("shift") or {}).get("flagged"):
                console.print(f"  WARNING: {t['shift']['note']}", markup=False, highlight=False)
        if rep["runs"]:
            console.print(f"at matched utility: {rep['comparisons'].matched_utility.message}",
                          markup=False, highlight=False)
        for f in rep["findings"]["headline"]:
            console.print(f"- {f['text']} ({f['evidence']})", markup=False, highlight=False)
        same = len(rep["findings"]["no_difference"])
        if same:
            console.print(f"({same} comparison(s) showed no difference; see the report)")
        console.print(f"wrote {paths['html']}, {paths['md']}, {paths['json']}", markup=False)
