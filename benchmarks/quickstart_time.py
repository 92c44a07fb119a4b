"""Wall time of the main job: `memaudit sweep configs/quickstart.yaml` on this machine.

Prints JSON: total seconds, the target (600 s on 2 CPU cores), and per-point train+probe
seconds from sweep.json, plus where the report went.

    python benchmarks/quickstart_time.py [--config configs/quickstart.yaml] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 600.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("--keep", default=None, help="sweep directory to keep (default: a temp dir)")
    args = ap.parse_args()
    out = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="memaudit-quickstart-"))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "memaudit.cli", "sweep", args.config, "--out", str(out)],
                          check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    summary = json.loads((out / "sweep.json").read_text()) if (out / "sweep.json").is_file() else {}
    print(json.dumps({
        "benchmark": "quickstart_time",
        "config": args.config,
        "cpus": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
        "exit_code": proc.returncode,
        "wall_s": round(wall, 1),
        "target_s": TARGET_S,
        "within_target": wall <= TARGET_S,
        "points": {o["name"]: round(o["seconds"], 1) for o in summary.get("outcomes", [])},
        "report": (summary.get("report") or {}).get("html"),
        "stderr_tail": proc.stderr[-500:] if proc.returncode else "",
    }, indent=2))


if __name__ == "__main__":
    main()
