"""Every executor asks one rule whether a sweep point is finished (memaudit.sweep.point): a
complete point trained under another config than the sweep's, from other base weights than
model.init_from's now, or probed under other probe settings is trained or probed again, never
skipped with its old numbers. The scheduler executors used to skip any complete point whose
probes.json was newer than its model (status and file times only).

The run directories are written by hand; training and probing are stubbed and recorded, so each
case is a decision through the executor's own driver (the `processes` loop, submitit's
DebugExecutor, and for `local` and `slurm` the job driver with an executor that runs each job at
once in this process). The sweep e2e test trains for real.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from memaudit.config import with_overrides
from memaudit.io import atomic_write_json
from memaudit.models.init import base_model_record
from memaudit.rundir import RunDir
from memaudit.sweep import executors, runner, work
from memaudit.sweep.config import plan_points, point_config, sweep_config_from_dict
from memaudit.sweep.point import config_as_written

EXECUTOR_KINDS = ["processes", "debug", "local", "slurm"]
CASES = {  # case -> (outcome action, probed, trainings, probings)
    "fresh": ("skipped", False, 0, 0),
    "stale-config": ("trained", True, 1, 1),
    "stale-base": ("trained", True, 1, 1),
    "stale-probe": ("skipped", True, 0, 1),
    "interrupted": ("resumed", True, 1, 1),
}


def _sweep(tmp_path: Path, kind: str):
    base = tmp_path / "base"
    base.mkdir(exist_ok=True)
    (base / "model.safetensors").write_bytes(b"weights")
    return sweep_config_from_dict({
        "base": {"model": {"init_from": str(base)}},
        "grid": {"backends": ["centralized"]},
        "probe": {"probes": ["exposure"], "n_boot": 100, "device": "auto"},
        "executor": {"kind": kind}})


def _settings(cfg, **changes) -> dict:
    """probes.json's settings as a probe of `cfg` on this CPU machine writes them."""
    return cfg.probe.model_copy(update={"device": "cpu", **changes}).model_dump(mode="json")


def _write_point(cfg, p, run: Path, case: str) -> None:
    """A point's run directory as a sweep leaves it, made stale the way `case` says."""
    run_cfg = point_config(cfg, p)
    written = with_overrides(run_cfg, {"train.lr": run_cfg.train.lr * 2}) if case == "stale-config" else run_cfg
    sha = base_model_record(run_cfg.model.init_from)["weights_sha256"]
    status = "interrupted" if case == "interrupted" else "complete"
    atomic_write_json(run / "run.json", {
        "memaudit_version": "0", "status": status, "backend": p.backend, "config": config_as_written(written),
        "base_model": {"path": run_cfg.model.init_from, "weights_sha256": "0" * 64 if case == "stale-base" else sha}})
    atomic_write_json(run / "model" / "config.json", {})
    if case == "interrupted":
        atomic_write_json(run / "state" / "step.json", {"step": 3})
        return
    probes = run / "probes.json"
    atomic_write_json(probes, {"schema": 1, "probes": {},
                               "settings": _settings(cfg, **({"n_boot": 50} if case == "stale-probe" else {}))})
    later = (run / "model" / "config.json").stat().st_mtime + 5
    os.utime(probes, (later, later))  # newer than the model, whatever the file system's clock grain


class _InlineJob:
    """A finished submitit job: the point's job ran when it was submitted."""

    def __init__(self, result):
        self.job_id, self._result = "1", result

    def done(self) -> bool:
        return True

    def task(self, i: int):
        return SimpleNamespace(result=lambda: self._result)


class _InlineExecutor:
    """Stands in for SlurmExecutor / LocalExecutor: each job (executors.point_job) runs at once
    in this process, so the stubs below see it."""

    def update_parameters(self, **kw) -> None:
        pass

    def submit(self, fn, *args):
        return _InlineJob(fn(*args))


@pytest.fixture
def recorded(monkeypatch):
    """Training and probing replaced by records; no SLURM or submitit variables from outside."""
    for key in list(os.environ):
        if key.startswith(("SLURM_", "SUBMITIT_")):
            monkeypatch.delenv(key)
    monkeypatch.setattr(work, "limit_threads", lambda n: None)
    calls: dict[str, list] = {"train": [], "probe": []}

    def fake_dispatch(cfg, rd, *, resume, overwrite, progress=None):
        calls["train"].append(resume)
        atomic_write_json(rd.model_dir / "config.json", {})  # a new model, newer than old probes
        later = (rd.probes_path.stat().st_mtime + 5) if rd.probes_path.is_file() else None
        if later is not None:
            os.utime(rd.model_dir / "config.json", (later, later))
        m = rd.read_manifest()
        atomic_write_json(rd.manifest_path, {**m, "status": "complete", "config": config_as_written(cfg),
                                             "base_model": base_model_record(cfg.model.init_from)})

    def fake_run_probes(target, settings, progress=None, partial=None, cache=None, keep_target_scores=False):
        calls["probe"].append(settings)
        return SimpleNamespace(document={"schema": 1, "settings": settings.model_dump(mode="json"), "probes": {}})

    monkeypatch.setattr("memaudit.run.dispatch.dispatch", fake_dispatch)
    monkeypatch.setattr("memaudit.probes.runner.run_probes", fake_run_probes)
    monkeypatch.setattr("memaudit.probes.targets.resolve_target", lambda path: SimpleNamespace(path=path))
    monkeypatch.setattr("memaudit.probes.scoring.resolve_device", lambda d: "cpu" if d == "auto" else d)
    monkeypatch.setattr(executors, "make_executor",
                        lambda ex, folder: _InlineExecutor() if ex.kind in ("local", "slurm")
                        else __import__("submitit").DebugExecutor(folder=str(folder)))
    return calls


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", EXECUTOR_KINDS)
def test_every_executor_holds_a_complete_point_to_the_same_rule(tmp_path, recorded, kind, case):
    cfg = _sweep(tmp_path, kind)
    (p,) = plan_points(cfg)
    out = tmp_path / "out"
    _write_point(cfg, p, out / "runs" / p.name, case)
    outcomes = []
    # --overwrite: a stale complete point is trained again (without it, see the next test)
    runner._run_points(cfg, [p], out, lambda i, o: outcomes.append(o), None, False, True)
    (o,) = outcomes
    action, probed, trainings, probings = CASES[case]
    assert (o.status, o.error, o.action, o.probed) == ("complete", None, action, probed)
    assert (len(recorded["train"]), len(recorded["probe"])) == (trainings, probings)
    assert recorded["train"] == [case == "interrupted"] * trainings  # resume=True only when resumed
    if probings:  # probed under the sweep's settings now
        assert RunDir(out / "runs" / p.name).read_manifest()["status"] == "complete"
        assert recorded["probe"][0].n_boot == 100


@pytest.mark.parametrize("case", ["stale-config", "stale-base"])
@pytest.mark.parametrize("kind", EXECUTOR_KINDS)
def test_no_executor_retrains_a_complete_point_without_overwrite(tmp_path, recorded, kind, case):
    """A complete point the rule finds stale is refused by every executor unless the sweep was
    given --overwrite: its outcome fails with the one line, nothing is trained or probed and its
    run directory is unchanged (executors used to delete and retrain it)."""
    from tests.test_bad_input import snapshot

    cfg = _sweep(tmp_path, kind)
    (p,) = plan_points(cfg)
    out = tmp_path / "out"
    _write_point(cfg, p, out / "runs" / p.name, case)
    before = snapshot(out / "runs")
    outcomes = []
    runner._run_points(cfg, [p], out, lambda i, o: outcomes.append(o), None, False)
    (o,) = outcomes
    assert o.status == "failed" and "--overwrite" in o.error and "\n" not in o.error
    assert (recorded["train"], recorded["probe"]) == ([], [])
    assert snapshot(out / "runs") == before


@pytest.mark.parametrize("case", list(CASES))
def test_point_action_names_what_to_do_and_why(tmp_path, recorded, case):
    from memaudit.sweep.point import Verb, point_action

    cfg = _sweep(tmp_path, "processes")
    (p,) = plan_points(cfg)
    run = tmp_path / "runs" / p.name
    _write_point(cfg, p, run, case)
    a = point_action(cfg, p, run)
    verb = {"fresh": Verb.SKIP, "stale-config": Verb.TRAIN, "stale-base": Verb.TRAIN,
            "stale-probe": Verb.PROBE, "interrupted": Verb.RESUME}[case]
    assert a.verb is verb and a.action == CASES[case][0] and a.probes == CASES[case][1]
    word = {"fresh": "complete", "stale-config": "config", "stale-base": "base model",
            "stale-probe": "probe settings", "interrupted": "interrupted"}[case]
    assert word in a.reason and "\n" not in a.reason
    assert point_action(cfg, p, tmp_path / "runs" / "none").verb is Verb.TRAIN


def test_a_slurm_driver_resolves_auto_probes_by_the_jobs_gpus_not_the_login_node(tmp_path, recorded, monkeypatch):
    """The driver decides on a login node: `device: auto` is where the job runs (CUDA when the
    executor asks for GPUs), so a point probed on a GPU node is not re-probed for it, and the
    login node's torch is never asked (nor an explicit `cuda` resolved there)."""
    from memaudit.sweep.point import Verb, point_action, probe_device

    def no_torch_here(d):
        raise AssertionError("the driver resolved the probe device on this machine")

    monkeypatch.setattr("memaudit.probes.scoring.resolve_device", no_torch_here)
    cfg = _sweep(tmp_path, "slurm")
    gpu = cfg.model_copy(update={"executor": cfg.executor.model_copy(update={"gpus_per_node": 4})})
    assert (probe_device(cfg), probe_device(gpu)) == ("cpu", "cuda")
    (p,) = plan_points(gpu)
    run = tmp_path / "runs" / p.name
    _write_point(gpu, p, run, "fresh")
    assert point_action(gpu, p, run).verb is Verb.PROBE  # probed on cpu, the job probes on cuda
    atomic_write_json(run / "probes.json", {"settings": _settings(gpu, device="cuda")})
    later = (run / "model" / "config.json").stat().st_mtime + 5
    os.utime(run / "probes.json", (later, later))
    assert point_action(gpu, p, run).verb is Verb.SKIP
    explicit = gpu.model_copy(update={"probe": gpu.probe.model_copy(update={"device": "cuda"})})
    assert point_action(explicit, p, run).verb is Verb.SKIP


def test_submitits_local_executor_gives_a_stale_complete_point_a_job(tmp_path, monkeypatch):
    """End to end through submitit's LocalExecutor (a job in its own process, nothing stubbed):
    a complete point trained under another config gets a job, whose training fails on the
    data file removed after loading, instead of being skipped as complete."""
    for key in list(os.environ):
        if key.startswith(("SLURM_", "SUBMITIT_")):
            monkeypatch.delenv(key)
    gone = tmp_path / "gone.jsonl"
    gone.write_text('{"text": "x", "user": "u1"}\n')
    cfg = sweep_config_from_dict({"base": {"data": {"path": str(gone)}}, "grid": {"backends": ["centralized"]},
                                  "executor": {"kind": "local", "cpus_per_task": 1}})
    (p,) = plan_points(cfg)
    gone.unlink()
    run = tmp_path / "out" / "runs" / p.name
    atomic_write_json(run / "run.json", {"memaudit_version": "0", "status": "complete", "backend": "parallel",
                                         "config": {}})
    atomic_write_json(run / "model" / "config.json", {})
    from memaudit.sweep.point import probe_settings

    atomic_write_json(run / "probes.json", {"settings": probe_settings(cfg)})
    outcomes = []
    runner._run_points(cfg, [p], tmp_path / "out", lambda i, o: outcomes.append(o), None, False, True)
    (o,) = outcomes
    assert (o.status, o.action) == ("failed", "trained") and "gone.jsonl" in o.error


def test_a_point_is_probed_with_its_public_base_as_the_membership_reference(tmp_path):
    """The fine-tune's own starting point is its reference model (the sweep used to probe every
    point without one); a probes.json written without it is stale, and `probe.reference` wins."""
    from memaudit.sweep.point import probe_reason, probe_settings

    cfg = _sweep(tmp_path, "processes")
    p = plan_points(cfg)[0]
    base = Path(point_config(cfg, p).model.init_from)
    (base / "config.json").write_text("{}")  # a model directory on disk
    run = tmp_path / "runs" / p.name
    _write_point(cfg, p, run, "current")
    rd = RunDir(run)
    assert probe_settings(cfg, rd)["reference"] == str(base)
    assert probe_reason(cfg, rd) == "probes.json was written under other probe settings"
    atomic_write_json(run / "probes.json", {"schema": 1, "probes": {}, "settings": probe_settings(cfg, rd)})
    os.utime(run / "probes.json", (time.time() + 5, time.time() + 5))
    assert probe_reason(cfg, rd) is None
    other = cfg.model_copy(update={"probe": cfg.probe.model_copy(update={"reference": "/elsewhere"})})
    assert probe_settings(other, rd)["reference"] == "/elsewhere"


@pytest.mark.parametrize("kind", EXECUTOR_KINDS)
def test_a_point_run_before_the_backend_rename_is_found_not_trained_again(tmp_path, recorded, kind):
    """A sweep --out written before the centralized backend's rename holds its points in
    runs/parallel-...; the sweep adopts them under their names now (runs/centralized-...), so a
    complete one is skipped with its numbers, not trained a second time. A folder already under the
    new name is never replaced."""
    cfg = _sweep(tmp_path, kind)
    (p,) = plan_points(cfg)
    assert p.name.startswith("centralized-")
    out = tmp_path / "out"
    old = out / "runs" / p.name.replace("centralized-", "parallel-", 1)
    _write_point(cfg, p, old, "fresh")
    atomic_write_json(out / "sweep.json", {"plan": None, "outcomes": [], "status": "complete"})
    points, _ = runner._prepare_points(cfg, out, None, False)
    outcomes = []
    runner._run_points(cfg, points, out, lambda i, o: outcomes.append(o), None, False)
    (o,) = outcomes
    assert (o.status, o.action) == ("complete", "skipped")
    assert (recorded["train"], recorded["probe"]) == ([], [])
    assert not old.exists() and (out / "runs" / p.name / "probes.json").is_file()


def test_adopting_old_point_names_never_replaces_a_folder_under_the_new_name(tmp_path):
    runs = tmp_path / "runs"
    for name in ("parallel-eps8-s0", "centralized-eps8-s0", "parallel-epsinf-s0", "federated-eps8-s0"):
        (runs / name).mkdir(parents=True)
        (runs / name / "mark").write_text(name, encoding="utf-8")
        atomic_write_json(runs / name / "run.json", {"status": "complete", "backend": name.split("-")[0]})
    moved = runner.adopt_renamed_points(tmp_path)
    assert moved == {"parallel-epsinf-s0": "centralized-epsinf-s0"}
    assert (runs / "centralized-eps8-s0" / "mark").read_text(encoding="utf-8") == "centralized-eps8-s0"
    assert (runs / "parallel-eps8-s0" / "mark").read_text(encoding="utf-8") == "parallel-eps8-s0"
    assert (runs / "centralized-epsinf-s0" / "mark").read_text(encoding="utf-8") == "parallel-epsinf-s0"
    assert sorted(p.name for p in runs.iterdir()) == ["centralized-eps8-s0", "centralized-epsinf-s0",
                                                      "federated-eps8-s0", "parallel-eps8-s0"]
    assert runner.adopt_renamed_points(tmp_path / "none") == {}


def test_adopting_old_point_names_moves_only_memaudit_runs(tmp_path):
    """Issue 61, item 6: the sweep renamed any runs/parallel-* folder, a user's `parallel-notes`
    (no run.json) to `centralized-notes`. The inputs: a folder without run.json, one whose run.json
    is not a memaudit manifest, and one whose run.json is not JSON; only the real run moves."""
    runs = tmp_path / "runs"
    for name in ("parallel-notes", "parallel-other", "parallel-broken", "parallel-eps2-s0"):
        (runs / name).mkdir(parents=True)
        (runs / name / "mark").write_text(name, encoding="utf-8")
    atomic_write_json(runs / "parallel-other" / "run.json", {"name": "not memaudit's"})
    (runs / "parallel-broken" / "run.json").write_text("{", encoding="utf-8")
    atomic_write_json(runs / "parallel-eps2-s0" / "run.json", {"status": "complete", "backend": "parallel"})
    assert runner.adopt_renamed_points(tmp_path) == {"parallel-eps2-s0": "centralized-eps2-s0"}
    assert sorted(p.name for p in runs.iterdir()) == ["centralized-eps2-s0", "parallel-broken",
                                                      "parallel-notes", "parallel-other"]
    assert (runs / "parallel-notes" / "mark").read_text(encoding="utf-8") == "parallel-notes"
