"""`memaudit collect`: a sweep's results packed to bring back from a lent machine, and unpacked."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from memaudit.commands._common import console, print_json


def register(app: typer.Typer) -> None:
    @app.command("collect", help="Pack a sweep folder's results (probes.json, run.json, metrics, report.json; "
                 "no weights, no data) into DEST/results.tar.gz, each file at most 16 MiB; or, given "
                 "results.tar.gz files, unpack them into one folder for `memaudit report`.")
    def collect(
        paths: Annotated[list[Path], typer.Argument(help="A sweep's --out folder, or results.tar.gz files.")],
        to: Annotated[Path, typer.Option("--to", help="The folder written.")],
        fmt: Annotated[str, typer.Option("--format", help="table | json")] = "table",
    ) -> None:
        # lazy: `memaudit --help` does not import the sweep package (pydantic, ~0.3 s)
        from memaudit.sweep.collect import collect as pack
        from memaudit.sweep.collect import unpack

        if fmt not in ("table", "json"):
            raise ValueError(f"--format '{fmt}' is not one of table, json")
        archives = [p for p in paths if p.is_file()]
        if archives:
            if len(archives) != len(paths):
                raise ValueError("give either one sweep folder or results.tar.gz files, not both")
            out = unpack(archives, to)
            rows = {"unpacked": [str(a) for a in archives], "to": str(out)}
            if fmt == "json":
                print_json(rows)
            else:
                console.print(f"unpacked {len(archives)} archive(s) into {out}; `memaudit report {out}` "
                              "reports them", markup=False, highlight=False)
            return
        if len(paths) != 1:
            raise ValueError(f"give one sweep folder to pack (got {len(paths)})")
        done = pack(paths[0], to)
        if fmt == "json":
            print_json({"files": done.files, "members": len(done.members)})
            return
        for f in done.files:
            console.print(f"{to / f['name']}: {f['bytes'] / 2**20:.2f} MiB", markup=False, highlight=False)
        console.print(f"{len(done.members)} result files packed", markup=False, highlight=False)
