"""Cost of the AUC permutation test (`memaudit.probes.stats.auc_difference_test`), by counting
against sorted non-members and by ranking every permuted row (the first version; the oracle in
tests/probes/ranked_auc.py), side by side on the same draws.

The report refines every test at its permutation floor with enough permutations that the floor
stays below alpha / (10 x the family): 46,800 for the study's family of 234. Its membership tests
compare runs of about 1,100 members and 3,250 held-out messages, paired (the same messages in
both runs) and unpaired (a run against the public base's scores). Prints one JSON object: per
case, the median seconds of --repeats calls of --perms permutations for each variant, the ratio,
that the p-values are equal, and the seconds the count takes for the refinement's 46,800.

    python benchmarks/auc_permutation.py                     # the study's sizes
    python benchmarks/auc_permutation.py --members 355 --nonmembers 1120   # the quickstart's
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.probes.ranked_auc

from memaudit.probes.stats import auc_difference_test
from tests.probes.ranked_auc import ranked_auc_difference_test

REFINED = 46_800  # permutations of a refined test in the study's family of 234


def _median_s(fn, repeats: int) -> tuple[float, float]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, default=1100)
    ap.add_argument("--nonmembers", type=int, default=3250)
    ap.add_argument("--perms", type=int, default=1999, help="permutations a timed call (one chunk)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    n1, n0 = args.members, args.nonmembers
    # scores of two runs of the same messages; rounded, so that there are ties as in real losses
    a = (np.round(rng.normal(0.3, 1, n1), 2), np.round(rng.normal(0, 1, n0), 2))
    b = (np.round(a[0] + rng.normal(0, 0.5, n1), 2), np.round(a[1] + rng.normal(0, 0.5, n0), 2))
    cases = {}
    for paired in (True, False):
        kw = {"paired": paired, "alternative": "greater", "n_perm": args.perms, "seed": 0, "advantage": True}
        count_s, p_count = _median_s(lambda kw=kw: auc_difference_test(a, b, **kw), args.repeats)
        rank_s, p_rank = _median_s(lambda kw=kw: ranked_auc_difference_test(a, b, **kw), args.repeats)
        refined_s, _ = _median_s(lambda kw=kw: auc_difference_test(a, b, **{**kw, "n_perm": REFINED}), 1)
        cases["paired" if paired else "unpaired"] = {
            "count_s": round(count_s, 3), "rank_s": round(rank_s, 3),
            "rank_over_count": round(rank_s / count_s, 2), "same_p_value": p_count == p_rank,
            "p_value": p_count, f"count_s_at_{REFINED}": round(refined_s, 2),
        }
    print(json.dumps({
        "benchmark": "auc_permutation", "members": n1, "nonmembers": n0, "perms": args.perms,
        "repeats": args.repeats, "cpus": os.cpu_count(), "machine": platform.machine(),
        "load_average_1m": os.getloadavg()[0], "cases": cases,
    }, indent=2))


if __name__ == "__main__":
    main()
