"""Byte identity of the report stage: rebuild the report of probed runs and print its files' sha256.

memaudit's report is a function of what the runs hold (run.json, privacy.json, metrics.jsonl,
probes.json); a change to how the report is computed that is not meant to change it must leave
report.json, report.md and report.html byte for byte as they were. This script rebuilds the report
of the runs under FOLDER (a sweep's output, e.g. the golden sweep of
tests/test_behaviour_golden.py) into a temporary directory and prints, as JSON, each file's sha256
and size, and, with --against FILE (a JSON this script printed before, e.g. on main), whether each
file is identical. It also re-renders the report from its own report.json (`memaudit report
--rerender`, `memaudit.reports.write.rerender`), which must give the same report.md and report.html: report.json is read back
through the one loader.

Usage: python benchmarks/report_identity.py FOLDER [--against BEFORE.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

FILES = ("report.json", "report.md", "report.html")


def _digests(folder: Path) -> dict[str, dict[str, object]]:
    return {name: {"sha256": hashlib.sha256((folder / name).read_bytes()).hexdigest(),
                   "bytes": (folder / name).stat().st_size} for name in FILES}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--against", type=Path, default=None)
    args = ap.parse_args(argv)
    from memaudit.reports.build import build_report
    from memaudit.reports.write import rerender, write_report

    with tempfile.TemporaryDirectory() as tmp:
        built, again = Path(tmp) / "built", Path(tmp) / "rerendered"
        write_report(build_report([args.folder]), built)
        again.mkdir()
        (again / "report.json").write_bytes((built / "report.json").read_bytes())
        rerender(again / "report.json")
        out: dict[str, object] = {"built": _digests(built), "rerendered": _digests(again)}
    out["rerender_identical"] = out["built"] == out["rerendered"]
    if args.against is not None:
        before = json.loads(args.against.read_text(encoding="utf-8"))["built"]
        out["identical_to_before"] = {n: before[n]["sha256"] == out["built"][n]["sha256"] for n in FILES}
    print(json.dumps(out, indent=1))
    ok = out["rerender_identical"] and all((out.get("identical_to_before") or {}).values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
