"""benchmarks/flower_transport.py decides whether a transport layer moves a round by a paired test.

The oracle is the signed-rank statistic's exact null distribution enumerated here (every sign
assignment of the waves' differences), not scipy.
"""

from __future__ import annotations

import importlib
import itertools
import sys

import pytest

from tests.conftest import REPO_ROOT


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        yield importlib.import_module("flower_transport")
    finally:
        sys.path.remove(str(REPO_ROOT / "benchmarks"))


def _runs(medians, cpu):
    return [{"round_s": m, "cpu_s_per_round": {"superlink": c / 2, "supernode_0": c / 2}} for m, c in zip(medians, cpu)]


def _exact_p(diffs):
    """One-sided signed-rank p (off slower): the share of sign flips with W+ at least the observed."""
    ranks = {d: r for r, d in enumerate(sorted(diffs, key=abs), start=1)}
    observed = sum(ranks[d] for d in diffs if d > 0)
    stats = [sum(r for r, s in zip(ranks.values(), signs) if s) for signs in itertools.product((0, 1), repeat=len(diffs))]
    return sum(w >= observed for w in stats) / len(stats)


def _table(bench, runs):
    return {v: bench.summary(r) for v, r in runs.items()}


def test_a_layer_slower_in_most_waves_moves_the_round_though_its_spread_overlaps(bench):
    # the 2026-12-07 held-asks figures: the load drifted, the last waves' all-on runs were slower
    # than some off runs, yet the pairs say the layer helps
    on = [2.66, 2.91, 2.42, 2.87, 2.74, 3.26, 3.55, 3.58]
    off = [3.33, 3.60, 3.80, 3.42, 3.72, 3.27, 3.21, 3.61]
    runs = {"all_on": _runs(on, [5.0] * 8), "held_asks_off": _runs(off, [5.1 + i / 10 for i in range(8)])}
    table = _table(bench, runs)
    bench.decide(table, runs)
    row = table["held_asks_off"]
    assert min(off) < max(on)  # the spreads overlap
    assert row["p_round"] == pytest.approx(_exact_p([b - a for a, b in zip(on, off)]))
    assert row["p_round"] < 0.05 and row["moves_round"] is True
    assert row["moves_round_cpu"] is True and row["p_cpu"] == pytest.approx(1 / 256)


def test_no_effect_under_drift_does_not_move_the_round_and_holm_counts_every_layer(bench):
    drift = [2.0 + 0.2 * i for i in range(8)]
    noise = [0.05, -0.04, 0.03, -0.06, 0.02, -0.01, 0.07, -0.08]
    slower = [0.4, 0.5, 0.3, 0.6, 0.45, 0.35, 0.5, 0.55]
    runs = {"all_on": _runs(drift, [5.0] * 8),
            "short_waits_off": _runs([d + n for d, n in zip(drift, noise)], [5.0 + n for n in noise]),
            "bundled_off": _runs([d + s for d, s in zip(drift, slower)], [6.0] * 8)}
    table = _table(bench, runs)
    bench.decide(table, runs)
    assert table["short_waits_off"]["moves_round"] is False
    assert table["short_waits_off"]["p_round"] == pytest.approx(_exact_p(noise))
    assert table["bundled_off"]["moves_round"] is True
    assert table["bundled_off"]["p_round_holm"] == pytest.approx(2 / 256)  # Holm: the smaller p times 2


def test_too_few_waves_say_n_too_small(bench):
    runs = {"all_on": _runs([1.0, 1.1, 1.2], [5.0] * 3), "held_asks_off": _runs([2.0, 2.1, 2.2], [9.0] * 3)}
    table = _table(bench, runs)
    bench.decide(table, runs)
    assert table["held_asks_off"]["moves_round"] == "n too small"  # 2**-3 = 0.125 is the floor
