"""Wall time of a shipped tier: `memaudit sweep configs/quickstart.yaml` (or the study) here.

Prints JSON: total seconds, the target (quickstart: 600 s on 2 CPU cores; study: 1-2 hours),
and per-point train+probe seconds from sweep.json, plus where the report went. After a sweep that
succeeded it refreshes the figures of docs/results.md and the README: the report becomes docs/snapshots/NAME.report.json
(NAME: the config's stem, quickstart or study; with NAME.meta.json: date, command, wall time,
cores) and `memaudit.reports.snapshots` rewrites the blocks rendered from it
(`--no-snapshot` leaves both alone, e.g. for a trial config).

A sweep directory given with `--keep` resumes: finished points are reused. When the points were
run earlier (e.g. the study in stages), `--measured-wall-s S --note TEXT` records that wall time
in the snapshot instead of this call's, with the note saying how it was measured.

    python benchmarks/quickstart_time.py [--config configs/quickstart.yaml] [--keep DIR] [--no-snapshot]
    python benchmarks/quickstart_time.py --config configs/study.yaml --keep DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

TARGETS_S = {"quickstart": 600.0, "study": 7200.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("--keep", default=None, help="sweep directory to keep (default: a temp dir)")
    ap.add_argument("--no-snapshot", action="store_true",
                    help="do not refresh docs/snapshots/quickstart.* and the blocks of the README and docs/results.md")
    ap.add_argument("--set", action="append", default=[], help="sweep override (marks the snapshot as such)")
    ap.add_argument("--snapshot", default=None, help="snapshot name (default: the config's stem)")
    ap.add_argument("--measured-wall-s", type=float, default=None,
                    help="wall time of the sweep measured earlier (its points were run before this call)")
    ap.add_argument("--note", default="", help="how the wall time was measured (with --measured-wall-s)")
    args = ap.parse_args()
    name = args.snapshot or Path(args.config).stem
    target = TARGETS_S.get(name)
    out = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="memaudit-quickstart-"))
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "memaudit.cli", "sweep", args.config, "--out", str(out)]
    for o in args.set:
        cmd += ["--set", o]
    proc = subprocess.run(cmd,
                          check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if args.measured_wall_s is not None:
        wall = args.measured_wall_s
    summary = json.loads((out / "sweep.json").read_text()) if (out / "sweep.json").is_file() else {}
    snapshot = None
    report_json = out / "report" / "report.json"
    if proc.returncode == 0 and not args.no_snapshot and report_json.is_file():
        from memaudit.reports.snapshots import update_docs, write_snapshot

        shown = " ".join(["memaudit sweep", args.config] + [f"--set {o}" for o in args.set])
        meta = {"date": datetime.now(UTC).strftime("%Y-%m-%d"), "command": shown,
                "wall_s": round(wall, 1), "cpus": os.cpu_count(),
                "note": "; ".join(x for x in (
                    f"with overrides: not the {name} as shipped" if args.set else "", args.note) if x)}
        snapshot = str(write_snapshot(report_json, name, meta))
        update_docs()
    print(json.dumps({
        "benchmark": "quickstart_time",
        "config": args.config,
        "cpus": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
        "exit_code": proc.returncode,
        "wall_s": round(wall, 1),
        "target_s": target,
        "within_target": None if target is None else wall <= target,
        "points": {o["name"]: round(o["seconds"], 1) for o in summary.get("outcomes", [])},
        "report": (summary.get("report") or {}).get("html"),
        "snapshot": snapshot,
        "stderr_tail": proc.stderr[-500:] if proc.returncode else "",
    }, indent=2))


if __name__ == "__main__":
    main()
