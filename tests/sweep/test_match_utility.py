"""Matched-utility points: the sweep places a centralized run at the epsilon where its utility meets
a federated run's, interpolated from the grid's own runs (memaudit.sweep.match)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from memaudit.cli import main
from memaudit.sweep.config import plan_points, sweep_config_from_dict
from memaudit.sweep.match import interpolate_epsilon, match_line, plan_matches


# ----------------------------------------------------------------------------- interpolation
@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.05, 3.0), min_size=2, max_size=5, unique=True),
       st.floats(0.0, 1.0), st.floats(2.0, 9.0))
def test_inside_the_measured_range_the_interpolated_epsilon_gives_back_the_target(gaps, at, top):
    """Oracle: numpy's piecewise-linear interpolation in (log epsilon, log perplexity)."""
    log_eps = np.cumsum(gaps) - 2.0
    log_ppl = top - np.cumsum(np.r_[0.0, np.abs(np.diff(log_eps)) * 0.7])  # falls with epsilon
    y = log_ppl.max() - at * (log_ppl.max() - log_ppl.min())
    eps = interpolate_epsilon(list(zip(np.exp(log_eps), np.exp(log_ppl), strict=True)), math.exp(y))
    assert eps is not None
    assert np.interp(math.log(eps), log_eps, log_ppl) == pytest.approx(y, abs=1e-9)


def test_outside_the_range_the_end_segment_is_extended_within_the_factor():
    levels = [(1.0, 4000.0), (4.0, 2000.0), (16.0, 1500.0)]
    # above the largest perplexity: the (1, 4) segment, ppl ~ eps^-0.5, so 8000 sits at eps 0.25
    assert interpolate_epsilon(levels, 8000.0) == pytest.approx(0.25)
    assert interpolate_epsilon(levels, 8000.0, max_factor=3.9) is None  # 0.25 is 4x below 1
    # below the smallest: the (4, 16) segment
    slope = math.log(1500 / 2000) / math.log(4)
    assert interpolate_epsilon(levels, 1400.0) == pytest.approx(16 * (1400 / 1500) ** (1 / slope))
    # a flat or rising end segment gives no line to follow; one level is not enough
    assert interpolate_epsilon([(1.0, 100.0), (4.0, 100.0)], 200.0) is None
    assert interpolate_epsilon([(1.0, 100.0), (4.0, 120.0)], 200.0) is None
    assert interpolate_epsilon([(1.0, 100.0)], 100.0) is None
    assert interpolate_epsilon([(1.0, 100.0), (math.inf, 10.0), (4.0, 50.0)], 70.0) == pytest.approx(
        math.exp(math.log(4) * math.log(100 / 70) / math.log(2)))  # no DP is never a level


# ----------------------------------------------------------------------------- planning
def _raw(**match) -> dict:
    return {"base": {"train": {"steps": 3}, "data": {"seq_len": 32}},
            "grid": {"backends": ["parallel", "federated"], "epsilons": ["inf", 32, 8, 2]},
            "match_utility": {"enabled": True, **match}}


PPL = {"parallel": {math.inf: 140.0, 32.0: 1000.0, 8.0: 1450.0, 2.0: 1900.0},
       "federated": {math.inf: 470.0, 32.0: 2300.0, 8.0: 3200.0, 2.0: 5700.0}}


def _write_runs(out, cfg, ppl=PPL, incomplete=()):
    for p in plan_points(cfg):
        d = out / "runs" / p.name
        d.mkdir(parents=True)
        eps = math.inf if p.level is None else p.level
        status = "running" if p.name in incomplete else "complete"
        (d / "run.json").write_text(json.dumps({"status": status, "result": {
            "final_holdout_perplexity": ppl[p.backend][eps]}}))


def test_a_target_without_a_match_gets_one_point_from_the_bracketing_levels(tmp_path):
    cfg = sweep_config_from_dict(_raw(levels=[32, 8]))
    points = plan_points(cfg)
    _write_runs(tmp_path, cfg)
    extra, records = plan_matches(cfg, points, tmp_path)
    by = {r["target"]: r for r in records}
    # federated 2,300 lies beyond centralized 1,900 at eps 2: extended along the (2, 8) segment
    slope = math.log(1450 / 1900) / math.log(4)
    want = float(f"{2 * (2300 / 1900) ** (1 / slope):.3g}")
    assert by["federated-eps32-s0"]["epsilon"] == want and want < 2
    assert by["federated-eps32-s0"]["from"] == {"parallel-eps32-s0": [32.0, 1000.0],
                                                "parallel-eps8-s0": [8.0, 1450.0],
                                                "parallel-eps2-s0": [2.0, 1900.0]}
    (p,) = extra
    assert p.name == by["federated-eps32-s0"]["point"] == f"parallel-eps{want:g}-s0".replace(".", "p")
    assert p.backend == "parallel" and p.level == want and p.matches == "federated-eps32-s0"
    assert p.overrides["privacy.target_epsilon"] == want and p.overrides["backend"] == "parallel"
    assert p.tokens_seen == next(q for q in points if q.name == "parallel-eps2-s0").tokens_seen
    # federated 3,200 needs an epsilon below 2 / 4: out of reach, said and not trained
    assert by["federated-eps8-s0"]["point"] is None and "factor 4" in by["federated-eps8-s0"]["reason"]
    assert "epsilon" not in by["federated-eps8-s0"]
    assert "trained at epsilon" in match_line(by["federated-eps32-s0"])
    assert "no point" in match_line(by["federated-eps8-s0"])


def test_matched_incomplete_and_missing_targets_get_no_point(tmp_path):
    ppl = {**PPL, "parallel": {**PPL["parallel"], 2.0: 2250.0}}  # within 0.1 of federated's 2,300
    cfg = sweep_config_from_dict(_raw(levels=[32, 8, 4]))
    _write_runs(tmp_path, cfg, ppl, incomplete=("federated-eps8-s0",))
    extra, records = plan_matches(cfg, plan_points(cfg), tmp_path)
    by = {r["target"]: r for r in records}
    assert extra == []
    assert by["federated-eps32-s0"]["reason"].startswith("already matched by parallel-eps2-s0")
    assert by["federated-eps8-s0"]["reason"] == "the target run is not complete"
    assert by["federated at epsilon 4"]["reason"].startswith("no such grid point")


def test_the_other_direction_and_the_default_levels(tmp_path):
    cfg = sweep_config_from_dict(_raw(target_backend="parallel"))
    _write_runs(tmp_path, cfg)
    extra, records = plan_matches(cfg, plan_points(cfg), tmp_path)
    assert [r["target"] for r in records] == ["parallel-eps32-s0", "parallel-eps8-s0", "parallel-eps2-s0"]
    by = {r["target"]: r for r in records}
    # centralized 1,900 at eps 2 lies between federated 32 (2,300) and no federated DP run below:
    # beyond the federated range by less than the factor, along its (32, 8) segment
    assert by["parallel-eps2-s0"]["point"] and by["parallel-eps2-s0"]["epsilon"] > 32
    assert all(p.backend == "federated" for p in extra)


def test_bad_levels_are_one_line_exit_2(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(_raw(levels=["inf"])))
    rc = main(["sweep", str(path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "match_utility.levels" in err[0], err
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- the sweep
def test_the_sweep_trains_the_matched_point_and_the_report_compares_it(tmp_path, monkeypatch):
    """run_sweep with each point's training replaced by a constructed run whose perplexity follows
    ppl = 2000 eps^-0.3 (centralized) and 4000 eps^-0.3 (federated): after the grid the sweep plans
    and runs one more centralized point, and the report pairs it with the federated target."""
    from memaudit.rundir import RunDir
    from memaudit.sweep import runner
    from memaudit.sweep.runner import PointOutcome, run_sweep
    from tests.reports._fixtures import write_run_dir

    def ppl(backend, eps):
        return (200.0 if backend == "parallel" else 400.0) * (1.0 if math.isinf(eps) else 10 * eps ** -0.3)

    def fake_point(cfg, p, rd, sub, debug, on_action=None):
        if rd.is_run() and rd.status() == "complete":  # what _decide does with a complete run
            return PointOutcome(p.name, p.backend, "complete", "skipped", False, 0.0)
        eps = math.inf if p.level is None else p.level
        write_run_dir(rd.path, p.backend, ppl=ppl(p.backend, eps), seed=p.seed)
        return PointOutcome(p.name, p.backend, "complete", "trained", True, 0.0)

    monkeypatch.setattr(runner, "_run_point", fake_point)
    cfg = sweep_config_from_dict(_raw(levels=[8]))
    summary = run_sweep(cfg, tmp_path / "sw")
    (rec,) = summary["plan"]["matches"]
    assert rec["target"] == "federated-eps8-s0" and rec["point"] is not None
    # the power law is followed exactly: 2000 eps^-0.3 = 4000 * 8^-0.3
    assert rec["epsilon"] == float(f"{8 * (200 / 400) ** (1 / 0.3):.3g}")
    names = [o["name"] for o in summary["outcomes"]]
    assert names[-1] == rec["point"] and len(names) == 9
    assert [p["name"] for p in summary["plan"]["points"]][-1] == rec["point"]
    assert summary["plan"]["points"][-1]["matches"] == "federated-eps8-s0"
    assert RunDir(tmp_path / "sw" / "runs" / rec["point"]).status() == "complete"
    report = json.loads((tmp_path / "sw" / "report" / "report.json").read_text())
    mu = report["comparisons"]["matched_utility"]
    assert mu["status"] == "pairs"
    assert [rec["point"], "federated-eps8-s0"] in [p["runs"] for p in mu["pairs"]]
    # the same command again: the grid's utilities are unchanged, so it plans the same point and
    # finds it complete
    again = run_sweep(cfg, tmp_path / "sw")
    assert again["plan"]["matches"] == summary["plan"]["matches"]
    assert [o["action"] for o in again["outcomes"]] == ["skipped"] * 9
