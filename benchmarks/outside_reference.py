"""Membership inference on an outside LoRA fine-tune with and without its base as reference.

Builds the tests' outside model (tests/probes/outside_models.py: a GPT-2 with a byte-level BPE,
pretrained on public random-word text, LoRA-fine-tuned on members) at a size where TPR at 1% FPR
has the >= 1000 non-members it needs, probes it with `memaudit probe` twice (--reference none,
and the default: the adapter's base), and prints JSON: AUC and TPR at 1% FPR of the loss attack
and of the ratio to the base, with the wall time.

    python benchmarks/outside_reference.py --members 100 --nonmembers 1000 --steps 400

Measured (2 shared CPU cores): loss attack AUC 0.951 [0.932, 0.967], TPR at 1% FPR 0.45
[0.34, 0.61]; ratio to the base AUC 0.969 [0.952, 0.983], TPR at 1% FPR 0.72 [0.54, 0.87]
(n = 100 members, 1000 non-members; 95% bootstrap intervals).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from memaudit.cli import main
from tests.probes.outside_models import build


def run(n: int, n_non: int, steps: int) -> dict:
    root = Path(tempfile.mkdtemp())
    t0 = time.perf_counter()
    o = build(root, n=n, ft_steps=steps, n_nonmembers=n_non)
    out = {"members": n, "nonmembers": n_non, "finetune_steps": steps,
           "build_s": round(time.perf_counter() - t0, 1)}
    for label, extra in (("without_reference", ["--reference", "none"]), ("with_base", [])):
        t0 = time.perf_counter()
        p = root / f"{label}.json"
        assert main(["probe", str(o.adapter_dir), "--out", str(p), "--members", str(o.members),
                     "--nonmembers", str(o.nonmembers), "--probes", "membership", "--device",
                     "cpu", "--bootstrap", "200", *extra]) == 0
        s = json.loads(p.read_text())["probes"]["membership"]["summary"]
        out[label] = {a: {"auc": s[a]["auc"], "tpr_at_1pct_fpr": s[a]["tpr_at_fpr"]["0.01"]}
                      for a in s if a in ("loss", "min_k", "zlib", "reference")}
        out[label]["probe_s"] = round(time.perf_counter() - t0, 1)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--members", type=int, default=100)
    ap.add_argument("--nonmembers", type=int, default=1000)  # TPR at 1% FPR needs >= 1000
    ap.add_argument("--steps", type=int, default=400)
    a = ap.parse_args()
    print(json.dumps(run(a.members, a.nonmembers, a.steps), indent=1))
