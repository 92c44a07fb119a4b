"""Nothing a sweep finished is lost or mixed up: an edited sweep file (or another sweep file on the
same --out) does not delete and retrain complete points without --overwrite; a second sweep on
one --out is refused while the first runs (sweep.lock, with the run lock's stale-lock rule); a
probes.json that measured other weights than the model on disk is stale; a newline in the
executor's strings never reaches the sbatch script.

Training and probing are stubbed and recorded (`recorded` of test_point_action); the CLI runs
in-process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from memaudit.cli import main
from memaudit.errors import ConfigError
from memaudit.io import atomic_write_json
from memaudit.models.init import base_model_record
from memaudit.rundir import RunDir
from memaudit.sweep.config import plan_points, point_config, sweep_config_from_dict
from memaudit.sweep.point import Verb, config_as_written, point_action, probe_reason, probe_settings
from tests.sweep.test_point_action import recorded  # noqa: F401  (the fixture)
from tests.test_bad_input import snapshot


def _raw(tmp_path: Path, lr: float = 0.003) -> dict:
    """A one-point sweep fine-tuning a (stand-in) base model at learning rate `lr`."""
    base = tmp_path / "base"
    base.mkdir(exist_ok=True)
    (base / "model.safetensors").write_bytes(b"base weights")
    return {"grid": {"backends": ["centralized"]}, "probe": {"probes": ["exposure"], "n_boot": 100, "device": "cpu"},
            "base": {"train": {"lr": lr}, "model": {"init_from": str(base)}}}


def _sweep_file(tmp_path: Path, lr: float = 0.003) -> Path:
    path = tmp_path / f"sweep-{lr}.yaml"
    path.write_text(yaml.safe_dump(_raw(tmp_path, lr)))
    return path


def _complete_point(tmp_path: Path, out: Path, lr: float) -> Path:
    """A complete, probed point of the sweep file with learning rate `lr`."""
    cfg = sweep_config_from_dict(_raw(tmp_path, lr))
    (p,) = plan_points(cfg)
    run = out / "runs" / p.name
    run_cfg = point_config(cfg, p)
    atomic_write_json(run / "run.json", {"memaudit_version": "0", "status": "complete", "backend": "parallel",
                                         "config": config_as_written(run_cfg),
                                         "base_model": base_model_record(run_cfg.model.init_from)})
    atomic_write_json(run / "model" / "config.json", {})
    (run / "model" / "model.safetensors").write_bytes(b"weights of the finished point")
    from memaudit.probes.weights import weights_sha256

    atomic_write_json(run / "probes.json", {"schema": 1, "probes": {}, "settings": probe_settings(cfg, RunDir(run)),
                                            "target": {"weights_sha256": weights_sha256(run / "model")}})
    later = time.time() + 5
    os.utime(run / "probes.json", (later, later))
    atomic_write_json(out / "sweep.json", {"plan": None, "outcomes": [], "status": "complete"})
    return run


@pytest.fixture
def no_report(monkeypatch):
    monkeypatch.setattr("memaudit.reports.build.build_report", lambda rds: {"findings": {"caveats": []}})
    monkeypatch.setattr("memaudit.reports.write.write_report", lambda rep, d: {"html": d / "report.html"})


def test_an_edited_sweep_file_does_not_retrain_a_complete_point(tmp_path, recorded, no_report, capsys):  # noqa: F811
    """Re-running after editing the sweep file (or pointing another sweep file at the --out):
    one line naming the point and what changed, exit 2, nothing trained, nothing on disk
    changed; with --overwrite it is retrained."""
    out = tmp_path / "out"
    run = _complete_point(tmp_path, out, lr=0.003)
    edited = _sweep_file(tmp_path, lr=0.006)
    before = snapshot(out)
    assert main(["sweep", str(edited), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("memaudit: error: "), err
    assert run.name in err and "train.lr changed" in err and "--overwrite" in err
    assert recorded["train"] == [] and snapshot(out) == before
    assert main(["sweep", str(edited), "--out", str(out), "--overwrite"]) == 0
    assert recorded["train"] == [False]  # trained anew (not resumed)
    # the edited file again: its point is current now, nothing refused or retrained
    assert main(["sweep", str(edited), "--out", str(out)]) == 0
    assert recorded["train"] == [False]


def _hold_sweep_lock(out: Path, pid: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "sweep.json", {"plan": None, "outcomes": [], "status": "running"})
    (out / "sweep.lock").write_text(json.dumps({"pid": pid, "host": socket.gethostname(),
                                                "heartbeat": time.time(), "token": "first-sweep"}))


def test_a_second_sweep_on_one_out_is_refused_while_the_first_runs(tmp_path, recorded, no_report, capsys):  # noqa: F811
    out = tmp_path / "out"
    _hold_sweep_lock(out, os.getpid())  # a live process holds it (this one)
    before = snapshot(out)
    assert main(["sweep", str(_sweep_file(tmp_path)), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sweep.lock" in err and "in use" in err, err
    assert recorded["train"] == [] and snapshot(out) == before


def test_a_dead_sweeps_lock_is_taken_over(tmp_path, recorded, no_report, capsys):  # noqa: F811
    proc = subprocess.Popen(["true"])
    proc.wait()  # exited and reaped: its pid names no process
    out = tmp_path / "out"
    _complete_point(tmp_path, out, lr=0.003)
    _hold_sweep_lock(out, proc.pid)
    assert main(["sweep", str(_sweep_file(tmp_path)), "--out", str(out)]) == 0, capsys.readouterr().err
    assert recorded["train"] == [] and not (out / "sweep.lock").exists()


def test_probes_of_other_weights_are_stale(tmp_path):
    """The probe-during-overwrite race: probes.json newer than the model and written under the
    sweep's settings, but it measured the weights the run had before it was trained again."""
    cfg = sweep_config_from_dict(_raw(tmp_path))
    (p,) = plan_points(cfg)
    run = _complete_point(tmp_path, tmp_path / "out", lr=0.003)
    assert point_action(cfg, p, run).verb is Verb.SKIP
    weights = run / "model" / "model.safetensors"
    weights.write_bytes(b"the weights of the run trained again")
    later = time.time() + 2
    os.utime(weights, (later, later))  # still older than probes.json
    assert probe_reason(cfg, RunDir(run)).startswith("probes.json measured other weights")
    assert point_action(cfg, p, run).verb is Verb.PROBE


def test_a_report_refuses_probes_of_other_weights(tmp_path, capsys):
    from tests.reports._fixtures import write_run_dir

    run = tmp_path / "run"
    write_run_dir(run, "centralized", ppl=50.0)
    (run / "model").mkdir()
    (run / "model" / "model.safetensors").write_bytes(b"new weights")
    doc = json.loads((run / "probes.json").read_text())
    doc["target"] = {"weights_sha256": "0" * 64}  # the old model's
    (run / "probes.json").write_text(json.dumps(doc))
    assert main(["report", str(run), "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err
    assert "measured other weights" in err and err.count("\n") == 1
    assert not (tmp_path / "rep").exists()


@pytest.mark.parametrize("key", ["partition", "account", "qos", "constraint", "slurm_additional"])
@pytest.mark.parametrize("bad", ["gpu\n#SBATCH --wrap=id", "gpu\r", "gpu\x00"])
def test_control_characters_are_refused_in_executor_strings(key, bad):
    value = {"exclusive": bad} if key == "slurm_additional" else bad
    with pytest.raises(ConfigError, match=f"executor.{key}") as e:
        sweep_config_from_dict({"executor": {"kind": "slurm", key: value}})
    assert "\n" not in str(e.value) and "#SBATCH" not in str(e.value)
    ok = {"exclusive": True} if key == "slurm_additional" else "gpu"
    assert getattr(sweep_config_from_dict({"executor": {key: ok}}).executor, key) == ok
