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
from memaudit.sweep.config import plan_points, point_config, sweep_config_from_dict
from memaudit.sweep.match import interpolate_noise, match_line, plan_matches


# ----------------------------------------------------------------------------- interpolation
@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.05, 3.0), min_size=2, max_size=5, unique=True),
       st.floats(0.0, 1.0), st.floats(2.0, 9.0))
def test_inside_the_measured_range_the_interpolated_noise_gives_back_the_target(gaps, at, low):
    """Oracle: numpy's piecewise-linear interpolation in (log sigma, log perplexity)."""
    log_sigma = np.cumsum(gaps) - 2.0
    log_ppl = low + np.cumsum(np.r_[0.0, np.abs(np.diff(log_sigma)) * 0.7])  # rises with the noise
    y = log_ppl.min() + at * (log_ppl.max() - log_ppl.min())
    sigma = interpolate_noise(list(zip(np.exp(log_sigma), np.exp(log_ppl), strict=True)), math.exp(y))
    assert sigma is not None
    assert np.interp(math.log(sigma), log_sigma, log_ppl) == pytest.approx(y, abs=1e-9)


def test_outside_the_range_the_end_segment_is_extended_within_the_factor():
    levels = [(0.25, 1500.0), (1.0, 2000.0), (4.0, 4000.0)]
    # above the largest perplexity: the (1, 4) segment, ppl ~ sigma^0.5, so 8000 sits at sigma 16
    assert interpolate_noise(levels, 8000.0) == pytest.approx(16.0)
    assert interpolate_noise(levels, 8000.0, max_factor=3.9) is None  # 16 is 4x beyond 4
    # below the smallest: the (0.25, 1) segment
    slope = math.log(2000 / 1500) / math.log(4)
    assert interpolate_noise(levels, 1400.0) == pytest.approx(0.25 * (1400 / 1500) ** (1 / slope))
    # a flat or falling end segment gives no line to follow; one level is not enough
    assert interpolate_noise([(1.0, 100.0), (4.0, 100.0)], 200.0) is None
    assert interpolate_noise([(1.0, 120.0), (4.0, 100.0)], 200.0) is None
    assert interpolate_noise([(1.0, 100.0)], 100.0) is None
    assert interpolate_noise([(1.0, 100.0), (0.0, 10.0), (4.0, 200.0)], 141.4) == pytest.approx(
        2.0, rel=1e-3)  # no noise is never a level


# ----------------------------------------------------------------------------- planning
def _raw(**match) -> dict:
    return {"base": {"train": {"steps": 3}, "data": {"seq_len": 32}},
            "grid": {"backends": ["centralized", "federated"], "epsilons": ["inf", 32, 8, 2]},
            "match_utility": {"enabled": True, **match}}


PPL = {"centralized": {math.inf: 140.0, 32.0: 1000.0, 8.0: 1450.0, 2.0: 1900.0},
       "federated": {math.inf: 470.0, 32.0: 2300.0, 8.0: 4500.0, 2.0: 9000.0}}
SIGMA = {"centralized": {32.0: 0.36, 8.0: 0.61, 2.0: 1.06}, "federated": {32.0: 0.44, 8.0: 0.79, 2.0: 1.71}}


def _write_runs(out, cfg, ppl=PPL, incomplete=()):
    """run.json with the perplexity, and for DP runs privacy.json with the calibrated sigma (the
    federated ledger records it in its mechanism, as DP-FedAvg's does)."""
    for p in plan_points(cfg):
        d = out / "runs" / p.name
        d.mkdir(parents=True)
        eps = math.inf if p.level is None else p.level
        status = "running" if p.name in incomplete else "complete"
        (d / "run.json").write_text(json.dumps({"status": status, "result": {
            "final_holdout_perplexity": ppl[p.backend][eps]}}))
        if p.level is not None:
            sigma = SIGMA[p.backend][eps]
            led = ({"calibration": {"noise_multiplier": sigma}, "mechanisms": []} if p.backend == "centralized"
                   else {"calibration": None, "mechanisms": [{"mechanism": "DP-FedAvg", "noise_multiplier": sigma}]})
            (d / "privacy.json").write_text(json.dumps(led))


def test_a_target_without_a_match_gets_one_point_from_the_bracketing_levels(tmp_path):
    cfg = sweep_config_from_dict(_raw(levels=[32, 8]))
    points = plan_points(cfg)
    _write_runs(tmp_path, cfg)
    extra, records = plan_matches(cfg, points, tmp_path)
    by = {r["target"]: r for r in records}
    # federated 2,300 lies beyond centralized 1,900 at sigma 1.06: the (0.61, 1.06) segment extended
    slope = math.log(1900 / 1450) / math.log(1.06 / 0.61)
    want = float(f"{1.06 * (2300 / 1900) ** (1 / slope):.3g}")
    assert by["federated-eps32-s0"]["noise_multiplier"] == want and want > 1.06
    assert by["federated-eps32-s0"]["from"] == {"centralized-eps32-s0": [0.36, 1000.0],
                                                "centralized-eps8-s0": [0.61, 1450.0],
                                                "centralized-eps2-s0": [1.06, 1900.0]}
    (p,) = extra
    assert p.name == by["federated-eps32-s0"]["point"] == f"centralized-sigma{want:g}-s0".replace(".", "p")
    assert p.backend == "centralized" and p.level == want and p.level_kind == "noise_multiplier"
    assert p.matches == "federated-eps32-s0" and p.overrides["backend"] == "centralized"
    assert p.overrides["privacy.noise_multiplier"] == want and p.overrides["privacy.target_epsilon"] is None
    assert p.tokens_seen == next(q for q in points if q.name == "centralized-eps2-s0").tokens_seen
    run_cfg = point_config(cfg, p)  # the run it trains: DP-SGD at that sigma, no epsilon target
    assert run_cfg.privacy.noise_multiplier == want and run_cfg.privacy.target_epsilon is None
    # federated 4,500 needs a sigma beyond 4 x 1.06: out of reach, said and not trained
    assert by["federated-eps8-s0"]["point"] is None and "factor 4" in by["federated-eps8-s0"]["reason"]
    assert "noise_multiplier" not in by["federated-eps8-s0"]
    assert "trained at noise multiplier" in match_line(by["federated-eps32-s0"])
    assert "no point" in match_line(by["federated-eps8-s0"])


def test_matched_incomplete_and_missing_targets_get_no_point(tmp_path):
    ppl = {**PPL, "centralized": {**PPL["centralized"], 2.0: 2250.0}}  # within 0.1 of federated's 2,300
    cfg = sweep_config_from_dict(_raw(levels=[32, 8, 4]))
    _write_runs(tmp_path, cfg, ppl, incomplete=("federated-eps8-s0",))
    extra, records = plan_matches(cfg, plan_points(cfg), tmp_path)
    by = {r["target"]: r for r in records}
    assert extra == []
    assert by["federated-eps32-s0"]["reason"].startswith("already matched by centralized-eps2-s0")
    assert by["federated-eps8-s0"]["reason"] == "the target run is not complete"
    assert by["federated at epsilon 4"]["reason"].startswith("no such grid point")


def test_a_match_at_the_targets_epsilon_is_named_before_a_closer_one_at_another(tmp_path):
    """As the report pairs runs (equal guarantees first, `memaudit.reports.frontier`): the final
    quickstart of 2026-12-05 said federated epsilon 8 was "already matched by" centralized
    epsilon 2 (|log ratio| 0.046) while centralized epsilon 8 lay within the tolerance too."""
    ppl = {**PPL, "centralized": {**PPL["centralized"], 32.0: 2400.0, 2.0: 2300.0}}
    cfg = sweep_config_from_dict(_raw(levels=[32]))
    _write_runs(tmp_path, cfg, ppl)
    extra, (rec,) = plan_matches(cfg, plan_points(cfg), tmp_path)
    assert extra == []
    assert rec["reason"] == "already matched by centralized-eps32-s0 (|log ratio| 0.0426, equal epsilon)"
    # with none at its epsilon within the tolerance, the closest run
    ppl["centralized"][32.0] = 1000.0
    _write_runs(tmp_path / "b", cfg, ppl)
    _, (rec,) = plan_matches(cfg, plan_points(cfg), tmp_path / "b")
    assert rec["reason"] == "already matched by centralized-eps2-s0 (|log ratio| 0)"


def test_the_other_direction_and_the_default_levels(tmp_path):
    cfg = sweep_config_from_dict(_raw(target_backend="centralized"))
    _write_runs(tmp_path, cfg)
    extra, records = plan_matches(cfg, plan_points(cfg), tmp_path)
    assert [r["target"] for r in records] == ["centralized-eps32-s0", "centralized-eps8-s0", "centralized-eps2-s0"]
    by = {r["target"]: r for r in records}
    # centralized 1,900 lies below federated 2,300 at sigma 0.44: along the federated (0.44, 0.79)
    # segment, within the factor; the federated sigma read from its mechanism's record
    slope = math.log(4500 / 2300) / math.log(0.79 / 0.44)
    want = float(f"{0.44 * (1900 / 2300) ** (1 / slope):.3g}")
    assert by["centralized-eps2-s0"]["noise_multiplier"] == want < 0.44
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
    """run_sweep with each point's training replaced by a constructed run: a grid point at epsilon
    e trains with sigma = 2 / sqrt(e) and reaches perplexity 1000 sigma^0.6 (centralized) or
    2000 sigma^0.6 (federated), with a real ledger. After the grid the sweep plans and runs one
    more centralized point at the sigma that meets the federated target, and the report pairs them."""
    from memaudit.rundir import RunDir
    from memaudit.sweep import runner
    from memaudit.sweep.runner import PointOutcome, run_sweep
    from tests.reports._fixtures import write_run_dir

    # one canary, seen once: a repeated canary's group epsilon costs a mixture-of-Gaussians PLD
    # per DP run and report (most of this test's time), and matching does not read it
    # (tests/reports test the group epsilon)
    once = [("c0", 1, "user", 1)]

    def fake_point(cfg, p, rd, sub, debug, on_action=None, overwrite=False):
        if rd.is_run() and rd.status() == "complete":  # what point_action does with a complete, current run
            return PointOutcome(p.name, p.backend, "complete", "skipped", False, 0.0)
        scale = 1000.0 if p.backend == "centralized" else 2000.0
        if p.level is None:
            write_run_dir(rd.path, p.backend, ppl=scale / 5, seed=p.seed, canaries=once)
        else:
            sigma = p.level if p.level_kind == "noise_multiplier" else 2 / math.sqrt(p.level)
            write_run_dir(rd.path, p.backend, ppl=scale * sigma**0.6, seed=p.seed, dp=(sigma, 1000, 32, 10),
                          canaries=once)
        return PointOutcome(p.name, p.backend, "complete", "trained", True, 0.0)

    monkeypatch.setattr(runner, "run_point", fake_point)
    cfg = sweep_config_from_dict(_raw(levels=[8]))
    summary = run_sweep(cfg, tmp_path / "sw")
    (rec,) = summary["plan"]["matches"]
    assert rec["target"] == "federated-eps8-s0" and rec["point"] is not None
    # the power law is followed exactly: 1000 s^0.6 = 2000 (2 / sqrt(8))^0.6
    assert rec["noise_multiplier"] == float(f"{2 / math.sqrt(8) * 2 ** (1 / 0.6):.3g}")
    names = [o["name"] for o in summary["outcomes"]]
    assert names[-1] == rec["point"] and len(names) == 9
    # what the planning reads runs first; the rest of the grid runs beside the matched point
    assert set(names[:4]) == {"federated-eps8-s0", "centralized-eps32-s0", "centralized-eps8-s0", "centralized-eps2-s0"}
    assert [p["name"] for p in summary["plan"]["points"]][-1] == rec["point"]
    assert summary["plan"]["points"][-1]["matches"] == "federated-eps8-s0"
    assert RunDir(tmp_path / "sw" / "runs" / rec["point"]).status() == "complete"
    report = json.loads((tmp_path / "sw" / "report" / "report.json").read_text())
    mu = report["comparisons"]["matched_utility"]
    assert mu["status"] == "pairs"
    assert [rec["point"], "federated-eps8-s0"] in [p["runs"] for p in mu["pairs"]]
    placed = next(r for r in report["runs"] if r["id"] == rec["point"])
    assert placed["privacy"]["noise_multiplier"] == pytest.approx(rec["noise_multiplier"])
    # the same command again: the grid's utilities are unchanged, so it plans the same point and
    # finds it complete
    # (the constructed runs record no real config, so the one rule finds them stale: --overwrite
    # lets the stand-in points decide, and they find their runs complete)
    again = run_sweep(cfg, tmp_path / "sw", overwrite=True)
    assert again["plan"]["matches"] == summary["plan"]["matches"]
    assert [o["action"] for o in again["outcomes"]] == ["skipped"] * 9
