"""Exposures at the sampling estimator's ceiling are lower bounds everywhere the report shows them.

A canary more likely than every sampled candidate gets the estimator's one-sided bound, not an
estimate: all 20 such canaries of a bucket give the same number, so a mean over them has no spread
("10.1 [10.1, 10.1]"), which reads as certainty where there is only a floor. Every place that shows
such a mean says ">=" and gives no interval: the headline cell, the per-run table, the frontier,
the group-privacy table, the findings and the README block.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from memaudit.probes.exposure import exposure_result
from memaudit.probes.stats import MEAN_MIN_N
from memaudit.reports.cells import FINDING, PAGE, format_cell
from memaudit.reports.probes_adapter import summarize_probes, units_of
from tests.reports._fixtures import write_run_dir

REPS, OWNERS, PER, N_REFS = (1, 4, 64), ("user", "spread"), 10, 40
SPACE = 10**12  # 12-digit secrets: sampled, never enumerated


def _exposure_probe(*, saturated: bool, seed: int = 0) -> dict:
    """The exposure probe's output on constructed log-perplexities: with `saturated`, every canary
    repeated 64 times is more likely than all 2,000 sampled candidates."""
    rng = np.random.default_rng(seed)
    cand = rng.normal(40.0, 3.0, 2000)
    items, lps = [], []
    k = 0
    for rep in REPS:
        for owner in OWNERS:
            for _ in range(PER):
                items.append((f"c{k}", "inserted", rep, owner))
                lps.append(5.0 + rng.normal(0, 0.5) if (rep == 64 and saturated) else rng.normal(40.0 - rep / 8, 3.0))
                k += 1
    for i in range(N_REFS):
        items.append((f"r{i}", "reference", 0, None))
        lps.append(rng.normal(40.0, 3.0))
    return exposure_result(np.asarray(lps), cand, items, space_size=SPACE, method="sampling", n_boot=200)


@pytest.fixture(scope="module")
def probes():
    return {b: {"schema": 1, "probes": {"exposure": _exposure_probe(saturated=b)}} for b in (True, False)}


def test_headline_cell_is_a_bound_without_interval(probes):
    top = summarize_probes(probes[True])["leakage"]["exposure_top"].to_json()
    exp = probes[True]["probes"]["exposure"]
    ins = [s for s in exp["scores"] if s["role"] == "inserted" and s["repetitions"] == 64]
    refs = [s["exposure"] for s in exp["scores"] if s["role"] == "reference"]
    assert all(s["lower_bound"] for s in ins) and len(ins) == 2 * PER
    assert top["lower_bound"] is True and top["ceiling_units"] == 2 * PER
    assert top["ci_low"] is None and top["ci_high"] is None
    assert top["value"] == pytest.approx(np.mean([s["exposure"] for s in ins]) - np.mean(refs))
    assert "20 of 20 canaries" in top["note"]
    assert format_cell(top, PAGE).startswith(">= ") and "20 of 20 canaries" in format_cell(top, PAGE)
    assert format_cell(top, FINDING, "bits").startswith(">= ")
    # the same run without a saturated bucket states no bound (and, with 20 canaries, below
    # MEAN_MIN_N, no interval: "n too small", not the ceiling's note)
    free = summarize_probes(probes[False])["leakage"]["exposure_top"].to_json()
    assert "lower_bound" not in free and free["note"] == "n too small" and free["n"] < MEAN_MIN_N
    assert not format_cell(free, PAGE).startswith(">=")


def test_per_bucket_rows_and_units_carry_the_flag(probes):
    out = summarize_probes(probes[True])
    rows = {r["metric"]: r for r in out["rows"] if r["probe"] == "exposure"}
    assert rows["exposure, 64 repetitions (bits)"].get("lower_bound") is True
    assert format_cell(rows["exposure, 64 repetitions (bits)"], PAGE).startswith(">= ")
    assert not rows["exposure, 1 repetitions (bits)"].get("lower_bound")
    by_owner = out["plots"]["exposure_by_repetition"]
    for owner in OWNERS:
        marks = {r["repetitions"]: bool(r.get("lower_bound")) for r in by_owner[owner]}
        assert marks == {1: False, 4: False, 64: True}
    u = units_of(probes[True])
    assert u["exposure_top"]["lower_bound"] == [True] * (2 * PER)
    flags = dict(zip(u["exposure_canaries"]["ids"], u["exposure_canaries"]["lower_bound"], strict=True))
    assert sum(flags.values()) == 2 * PER and not any(flags[f"r{i}"] for i in range(N_REFS))


def _run_dir(tmp_path, name: str, probe: dict, *, ppl: float):
    path = write_run_dir(tmp_path / name, "centralized", ppl=ppl,
                         canaries=[(f"c{k}", rep, owner, 1) for k, (rep, owner) in
                                   enumerate((r, o) for r in REPS for o in OWNERS for _ in range(PER))])
    doc = json.loads((path / "probes.json").read_text())
    doc["probes"]["exposure"] = probe
    (path / "probes.json").write_text(json.dumps(doc))
    return path


def test_report_and_readme_say_at_least(tmp_path, probes):
    from memaudit.reports.build import build_report
    from memaudit.reports.render import render_html, render_markdown
    from memaudit.reports.snapshots import render_block

    report = build_report([_run_dir(tmp_path, "nodp", probes[True]["probes"]["exposure"], ppl=50.0),
                           _run_dir(tmp_path, "other", probes[False]["probes"]["exposure"], ppl=60.0)])
    run = next(r for r in report["runs"] if r["id"] == "nodp")
    assert run["leakage"]["exposure_top"].lower_bound is True
    # frontier point, group-privacy cell and the literature section's bucket
    pts = [p for s in report["comparisons"].frontier.metrics["exposure_top"].series for p in s.points]
    assert {p.run: p.lower_bound for p in pts} == {"nodp": True, "other": False}
    g = {(x["repetitions"], x["owner_kind"]): x for x in run["group_privacy"]}
    assert g[(64, "user")]["exposure"]["lower_bound"] is True and "lower_bound" not in g[(1, "user")]["exposure"]
    lit = {e.run: e for e in report["literature"].exposure}
    b = {(x.repetitions, x.owner_kind): x for x in lit["nodp"].buckets}
    assert b[(64, "user")].excess.lower_bound is True and b[(64, "user")].excess.ci_low is None
    assert b[(64, "user")].test.p_value < 1e-3  # the test still runs on the per-canary values
    assert not b[(4, "user")].excess.lower_bound and b[(4, "user")].excess.ci_low is not None
    block = render_block("x", report)
    row = next(line for line in block.splitlines() if line.startswith("| nodp |"))
    assert f">= {run['leakage']['exposure_top'].value:.3g}" in row and "[" not in row.split("|")[4]
    other = next(line for line in block.splitlines() if line.startswith("| other |"))
    assert ">=" not in other
    assert ">= " in render_markdown(report) and "&gt;= " in render_html(report)
    assert math.isfinite(run["leakage"]["exposure_top"].value)
