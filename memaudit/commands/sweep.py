"""`memaudit sweep CONFIG --out SWEEP_DIR`: train, probe and report over a grid."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from memaudit.commands._common import console, print_json
from memaudit.commands._common import progress as make_progress


def _floats(spec: str, what: str) -> list[float]:
    out = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            out.append(float(item))
        except ValueError:
            raise ValueError(f"--{what} item '{item}' is not a number (use e.g. 1,4,16,inf)") from None
    if not out:
        raise ValueError(f"--{what} is empty; give a comma-separated list such as 1,4,inf")
    return out


STOPPED_EXIT = 3
"""`sweep --stop-after`'s exit code when the time ran out before the sweep ended."""


def _list_points(cfg, fmt: str) -> None:
    """`--dry-run`: the grid's points as the sweep would run them (public bases first)."""
    from memaudit.sweep.config import plan_points  # lazy: as load_sweep_config

    points = plan_points(cfg)
    rows = [{"name": p.name, "backend": p.backend, "model": p.model, "level": p.level,
             "level_kind": p.level_kind, "goldfish": p.goldfish, "audit": p.audit,
             "tokens_seen": p.tokens_seen} for p in points]
    bases = []
    if cfg.pretrain is not None:
        # lazy: the pretraining module loads the run lifecycle; only a listing with bases pays it
        from memaudit.sweep.pretrain import base_dir_name, pretrained_sizes, public_base_config

        for size in pretrained_sizes(cfg, points):
            t = public_base_config(cfg, size=size)
            bases.append({"base": base_dir_name(size), "model": size, "steps": t.train.steps,
                          "tokens": t.train.steps * t.train.batch_size * t.data.seq_len})
    if fmt == "json":
        print_json({"pretrain": bases, "points": rows, "regime": cfg.regime})
        return
    for b in bases:
        console.print(f"pretrain {b['base']}: {b['steps']} steps, {b['tokens']:,} tokens",
                      markup=False, highlight=False)
    for r in rows:
        console.print(f"{r['name']}: {r['tokens_seen']:,} tokens", markup=False, highlight=False)
    console.print(f"{len(rows)} points (regime {cfg.regime})", markup=False, highlight=False)


def register(app: typer.Typer) -> None:
    @app.command("sweep", help="Train, probe and report over backends x model sizes x privacy levels x seeds.")
    def sweep(
        config: Annotated[Path, typer.Argument(help="Sweep YAML, e.g. configs/quickstart.yaml.")],
        out: Annotated[Path, typer.Option("--out", help="Sweep directory (runs/, report/, sweep.json).")] = Path("sweep"),
        epsilons: Annotated[str | None, typer.Option(help="Target epsilons, e.g. 1,4,16,inf.")] = None,
        noise_multipliers: Annotated[str | None, typer.Option(help="Noise multipliers instead, e.g. 0,0.5,1.")] = None,
        backends: Annotated[str | None, typer.Option(help="Backends, e.g. centralized,federated.")] = None,
        seeds: Annotated[int | None, typer.Option(help="Number of seeds per grid point.")] = None,
        goldfish: Annotated[str | None, typer.Option(help="Goldfish axis on the centralized side: off, on or off,on.")] = None,
        jobs: Annotated[int | None, typer.Option(help="Points to run at once, each in its own process "
                                                  "with an equal share of the CPU threads.")] = None,
        executor: Annotated[str | None, typer.Option(
            "--executor", help="Where points run: processes (the default: worker processes, --jobs at once), "
            "slurm (one submitit job per point; resources from the sweep file's executor section), "
            "local (the same jobs through submitit's local executor) or debug (in this process).")] = None,
        set_: Annotated[list[str] | None, typer.Option("--set", help="Override a sweep key, e.g. base.train.steps=50.")] = None,
        fmt: Annotated[str, typer.Option("--format", help="table | json")] = "table",
        overwrite: Annotated[bool, typer.Option(
            "--overwrite", help="Retrain complete points whose config changed (after an edit of the "
            "sweep file, or another sweep file on this --out); without it such a sweep stops and "
            "names them.")] = False,
        stop_after: Annotated[float | None, typer.Option(
            "--stop-after", help="Seconds this invocation may take: training stops at the first checkpoint "
            "after which another stretch would not fit, and no point or probe starts after them; exit "
            "code 3 then, and the same command again goes on where it stopped. Leave a margin below a "
            "hard limit (one checkpoint interval and one point's probes).")] = None,
        only: Annotated[str | None, typer.Option(
            "--only", help="Run only the points whose names match these comma-separated shell patterns, "
            "e.g. 'centralized-125m-*,federated-125m-eps8-*' (one machine's part of a study); the "
            "grid's first size still pretrains, for the shared tokenizer.")] = None,
        no_report: Annotated[bool, typer.Option(
            "--no-report", help="Train and probe the points, write no report (a leased machine's part of "
            "a study: `memaudit collect` takes its results home, where `memaudit report` builds one "
            "report of all parts).")] = False,
        dry_run: Annotated[bool, typer.Option(
            "--dry-run", help="Validate the sweep file and list its points (backend, size, privacy "
            "level, tokens seen); train nothing, write nothing.")] = False,
    ) -> None:
        # lazy: `memaudit --help` does not import the sweep config (pydantic, ~0.3 s)
        from memaudit.sweep.config import load_sweep_config

        if fmt not in ("table", "json"):
            raise ValueError(f"--format '{fmt}' is not one of table, json")
        overrides = list(set_ or [])
        if epsilons is not None:
            overrides.append(f"grid.epsilons={_floats(epsilons, 'epsilons')}")
            overrides.append("grid.noise_multipliers=null")
        if noise_multipliers is not None:
            overrides.append(f"grid.noise_multipliers={_floats(noise_multipliers, 'noise-multipliers')}")
            overrides.append("grid.epsilons=null")
        if backends is not None:
            overrides.append(f"grid.backends=[{backends}]")
        if seeds is not None:
            overrides.append(f"grid.seeds={seeds}")
        if jobs is not None:
            overrides.append(f"jobs={jobs}")
        if only is not None:
            patterns = [p.strip() for p in only.split(",") if p.strip()]
            if not patterns:
                raise ValueError("--only is empty; give comma-separated patterns such as 'centralized-125m-*'")
            overrides.append("select=" + json.dumps(patterns))
        if executor is not None:
            from memaudit.sweep.config import EXECUTORS  # lazy: as load_sweep_config above

            if executor not in EXECUTORS:
                raise ValueError(f"--executor '{executor}' is not one of {', '.join(EXECUTORS)}")
            overrides.append(f"executor.kind={executor}")
        if goldfish is not None:
            vals = [g.strip() for g in goldfish.split(",") if g.strip()]
            bad = [g for g in vals if g not in ("on", "off")]
            if bad or not vals:
                raise ValueError(f"--goldfish '{goldfish}' must be off, on or off,on")
            overrides.append(f"grid.goldfish=[{','.join('true' if g == 'on' else 'false' for g in vals)}]")
        cfg = load_sweep_config(config, overrides)
        if stop_after is not None:
            from memaudit.run.timebox import check_seconds  # lazy: as load_sweep_config above

            check_seconds(stop_after)
        if dry_run:
            _list_points(cfg, fmt)
            return

        # lazy: `memaudit --help` does not import numpy (~0.4 s)
        from memaudit.sweep.runner import run_sweep

        bar = make_progress()
        with bar:
            overall = bar.add_task("sweep", total=None, info="")
            current = bar.add_task("point", total=None, info="")

            def on_progress(i: int, total: int, info: dict) -> None:
                for old, new in (info.get("adopted") or {}).items():  # swept before a backend's rename
                    console.print(f"runs/{old}: found under its name now, runs/{new}", markup=False,
                                  highlight=False)
                if "warning" in info:  # e.g. a public base that memorised its corpus
                    console.print(info["warning"], markup=False, highlight=False)
                    return
                bar.update(overall, completed=i, total=total, info=str(info.get("point", "")))
                if "done" in info:
                    bar.update(current, completed=info["done"], total=info["total"],
                               description=str(info.get("stage", info.get("phase", "train"))),
                               info=str(info.get("point", "")))

            summary = run_sweep(cfg, out, progress=on_progress, overwrite=overwrite, stop_after=stop_after,
                                report=not no_report)
        if fmt == "json":
            print_json(summary)
            if summary["status"] != "complete":
                raise typer.Exit(STOPPED_EXIT if summary["status"] == "stopped" else 1)
            return
        for o in summary["outcomes"]:
            line = f"{o['name']}: {o['status']} ({o['action']}, {o['seconds']:.0f}s)"
            if o["error"]:
                line += f" - {o['error']}"
            console.print(line, markup=False, highlight=False)
        from memaudit.sweep.match import match_line  # lazy: as load_sweep_config above

        for rec in (summary["plan"] or {}).get("matches") or []:
            console.print(match_line(rec), markup=False, highlight=False)
        if summary["report"]:
            console.print(f"report: {summary['report']['html']}", markup=False)
        if summary["status"] == "stopped":
            done = sum(o["status"] == "complete" for o in summary["outcomes"])
            total = len((summary["plan"] or {}).get("points") or [])
            console.print(f"stopped at --stop-after: {done} of {total or 'the'} points complete; run the "
                          "same command again to go on", markup=False, highlight=False)
            raise typer.Exit(STOPPED_EXIT)
        if summary["status"] != "complete":
            raise typer.Exit(1)
