"""Failed-point semantics on the job path (submitit's DebugExecutor, in this process): a point
whose job fails is recorded with a one-line error while the others go on; a complete point
takes no job (complete under the sweep's config and probe settings: `point_action` skips it)."""

from __future__ import annotations

from pathlib import Path

import yaml

from memaudit.io import atomic_write_json, read_json
from memaudit.sweep.config import load_sweep_config, plan_points, point_config
from memaudit.sweep.point import config_as_written, probe_settings
from memaudit.sweep.runner import run_sweep


def test_failed_jobs_are_recorded_and_complete_points_skip_the_scheduler(tmp_path, monkeypatch):
    gone = tmp_path / "gone.jsonl"
    gone.write_text('{"text": "x", "user": "u1"}\n')
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({
        "base": {"data": {"path": str(gone)}},
        "grid": {"backends": ["centralized"], "models": ["tiny", "tiny2x"]},
        "executor": {"kind": "debug"}}))
    cfg = load_sweep_config(path)
    stand_in = plan_points(cfg)[1]
    assert stand_in.name == "centralized-tiny2x-epsinf-s0"
    current = config_as_written(point_config(cfg, stand_in))
    gone.unlink()  # valid when loaded, gone when the jobs run
    out = tmp_path / "out"
    done = Path(out / "runs" / "centralized-tiny2x-epsinf-s0")
    atomic_write_json(done / "run.json", {"status": "complete", "backend": "parallel", "config": current})
    (done / "model").mkdir()
    atomic_write_json(done / "model" / "config.json", {})
    atomic_write_json(done / "probes.json", {"settings": probe_settings(cfg)})
    atomic_write_json(out / "sweep.json", {"plan": None, "outcomes": [], "status": "running"})
    reported = []  # the stand-in complete run has no real probes: record what would be reported
    monkeypatch.setattr("memaudit.reports.build.build_report",
                        lambda rds: reported.append(sorted(Path(r).name for r in rds)) or {"findings": {"caveats": []}})
    monkeypatch.setattr("memaudit.reports.write.write_report", lambda rep, d: {"json": d / "report.json"})
    summary = run_sweep(cfg, out)
    assert reported == [["centralized-tiny2x-epsinf-s0"]]
    o = {x["name"]: x for x in summary["outcomes"]}
    assert o["centralized-tiny-epsinf-s0"]["status"] == "failed"
    err = o["centralized-tiny-epsinf-s0"]["error"]
    assert "\n" not in err and "gone.jsonl" in err
    assert o["centralized-tiny2x-epsinf-s0"] == {**o["centralized-tiny2x-epsinf-s0"], "status": "complete",
                                              "action": "skipped", "probed": False}
    assert summary["status"] == "partial" and read_json(out / "sweep.json")["status"] == "partial"
    jobs = out / "jobs"
    assert not jobs.exists() or not any("tiny2x" in f.read_bytes().decode("latin-1")
                                        for f in jobs.glob("*_submitted.pkl"))
