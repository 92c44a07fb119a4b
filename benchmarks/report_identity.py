"""Byte identity of the report stage: rebuild the report of probed runs and print its files' sha256.

memaudit's report is a function of what the runs hold (run.json, privacy.json, metrics.jsonl,
probes.json); a change to how the report is computed that is not meant to change it must leave
report.json, report.md and report.html byte for byte as they were. This script rebuilds the report
of the runs under FOLDER (a sweep's output, e.g. the golden sweep of
tests/test_behaviour_golden.py) into a temporary directory and prints, as JSON, each file's sha256
and size, and, with --against FILE (a JSON this script printed before, e.g. on main), whether each
file is identical. It also re-renders the report from its own report.json (`memaudit report
--rerender`, `memaudit.reports.write.rerender`), which must give the same report.md and report.html: report.json is read back
through the one loader. And it reads each committed study snapshot (docs/snapshots/*.report.json)
and writes it again as `python -m memaudit.reports.snapshots` would (`write_snapshot`), printing
each rewritten snapshot's sha256 (compared --against the one before) and whether it equals the
committed file (study-overfit's does not on main either: it was written by an older version).
Last, the probes' statistics (`memaudit.probes.stats`: rates, means, clustered rates, attack
summaries, the tests between runs and between seeds) on fixed inputs, as the JSON probes.json and
report.json store: their sha256, compared --against the one before.

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


def _snapshots(tmp: Path) -> dict[str, dict[str, object]]:
    """Each committed snapshot read and written again: its sha256, and whether it is the committed
    file byte for byte."""
    from memaudit.reports.snapshots import SNAPSHOTS, write_snapshot

    out = {}
    for path in sorted(SNAPSHOTS.glob("*.report.json")):
        name = path.name.removesuffix(".report.json")
        meta = json.loads((SNAPSHOTS / f"{name}.meta.json").read_text(encoding="utf-8"))
        again = write_snapshot(path, name, meta, tmp)
        data = again.read_bytes()
        out[name] = {"sha256": hashlib.sha256(data).hexdigest(), "as_committed": data == path.read_bytes()}
    return out


def _statistics() -> str:
    """sha256 of the probes' statistics on fixed inputs, as the JSON they write."""
    import numpy as np

    from memaudit.probes import stats

    def js(x):  # a typed record writes its JSON; before the records, the statistics were dicts
        return x.to_json() if hasattr(x, "to_json") else x

    rng = np.random.default_rng(0)
    out = []
    for n in (0, 1, 5, 9, 10, 49, 120):
        hits = (rng.random(n) < 0.3).astype(float)
        out += [js(stats.rate_summary(hits, unit="documents", n_boot=200, seed=1)),
                js(stats.rate_summary(rng.beta(1, 3, n), unit="documents", n_boot=200, seed=1)),
                js(stats.mean_summary(rng.exponential(2, n), unit="canaries", n_boot=200, seed=2)),
                js(stats.clustered_rate_summary(hits, [i % 4 for i in range(n)], unit="PII items")),
                js(stats.clustered_rate_summary(hits, [0] * n, unit="PII items"))]
    for n1, n0 in ((12, 12), (40, 1000), (5, 30)):
        out.append(js(stats.attack_summary(rng.normal(1, 1, n1), rng.normal(0, 1, n0), n_boot=100, seed=3)))
    ids = [f"d{i}" for i in range(60)]

    def units(kind, vals, names=ids, **extra):
        return {"kind": kind, "unit": "documents", "ids": names[:len(vals)], "values": list(vals), **extra}

    member = [True] * 30 + [False] * 30
    for alt in ("less", "greater", "two-sided"):
        pairs = [(units("mean", rng.normal(0, 1, 60)), units("mean", rng.normal(0.3, 1, 60)), 499),
                 (units("binary", (rng.random(60) < .3) * 1.0), units("binary", (rng.random(60) < .5) * 1.0), None),
                 (units("auc", rng.normal(0, 1, 60), member=member),
                  units("auc", rng.normal(0, 1, 60), member=member), 199),
                 (units("mean", rng.normal(0, 1, 60)),  # no shared units: unpaired
                  units("mean", rng.normal(0, 1, 60), names=[f"x{i}" for i in range(60)]), 499),
                 (units("mean", rng.normal(0, 1, 8)), units("mean", rng.normal(0, 1, 8)), None)]  # exact
        out += [js(stats.compare_units(a, b, alternative=alt, n_perm=k)) for a, b, k in pairs]
        out += [js(stats.compare_seeds([0.5, 0.6, 0.55], [0.7, 0.65, 0.72], alternative=alt, kind=kind))
                for kind in ("mean", "auc")]
    return hashlib.sha256(json.dumps(out, indent=1).encode()).hexdigest()


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
        out["snapshots"] = _snapshots(Path(tmp) / "snapshots")
    out["statistics"] = _statistics()
    out["rerender_identical"] = out["built"] == out["rerendered"]
    if args.against is not None:
        before = json.loads(args.against.read_text(encoding="utf-8"))
        same = {n: before["built"][n]["sha256"] == out["built"][n]["sha256"] for n in FILES}
        same["statistics"] = before.get("statistics") == out["statistics"]
        same.update({f"snapshot {n}": before["snapshots"].get(n, {}).get("sha256") == d["sha256"]
                     for n, d in out["snapshots"].items()})
        out["identical_to_before"] = same
    print(json.dumps(out, indent=1))
    ok = out["rerender_identical"] and all((out.get("identical_to_before") or {}).values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
