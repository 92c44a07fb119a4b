"""One point's job as every task runs it (memaudit.sweep.executors.point_job): rank 0 decides
and hands the decision to the other ranks, which train with it; a rank 0 that fails before
deciding releases them. Training itself is stubbed: the e2e study test runs it for real."""

from __future__ import annotations

import pytest

from memaudit.sweep import executors, work
from memaudit.sweep.config import plan_points, sweep_config_from_dict

TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def job_env(monkeypatch):
    for key in TORCHRUN:  # point_job exports these; restored after the test
        monkeypatch.setenv(key, "unset")
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    monkeypatch.setattr(work, "limit_threads", lambda n: None)

    def as_rank(rank: int) -> None:
        for k, v in {"SLURM_PROCID": rank, "SLURM_NTASKS": 2, "SLURM_LOCALID": rank, "SLURM_NODEID": 0,
                     "SLURM_NTASKS_PER_NODE": 2, "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": 99}.items():
            monkeypatch.setenv(k, str(v))
    return as_rank


def _point():
    cfg = sweep_config_from_dict({"base": {"parallel": {"data": 2}}, "grid": {"backends": ["centralized"]}})
    return cfg, plan_points(cfg)[0]


def test_rank0_decides_and_rank1_follows(tmp_path, job_env, monkeypatch):
    import os

    cfg, p = _point()
    calls = []

    def fake_run_point(cfg, p, rd, sub, debug, on_action=None, overwrite=False):
        on_action("resumed")
        calls.append(("rank0", os.environ["RANK"], os.environ["MASTER_ADDR"]))
        return work.PointOutcome(p.name, p.backend, "complete", "resumed", True, 1.0)

    monkeypatch.setattr(work, "run_point", fake_run_point)
    monkeypatch.setattr("memaudit.run.dispatch.dispatch",
                        lambda c, rd, *, resume, overwrite: calls.append(("rank1", os.environ["RANK"], resume)))
    job_env(0)
    out0 = executors.point_job(cfg, p, str(tmp_path / "run"), str(tmp_path), 1, nonce="a")
    job_env(1)
    out1 = executors.point_job(cfg, p, str(tmp_path / "run"), str(tmp_path), 1, nonce="a")
    assert out0.action == "resumed" and out1 is None
    assert calls == [("rank0", "0", "n1"), ("rank1", "1", True)]
    job_env(1)  # another submission of the same job id does not read this decision
    with pytest.raises(Exception, match="did not decide"):
        executors._wait_for_action(executors._handoff_path(str(tmp_path), "99", "b"), timeout=0.3)


def test_rank0_failing_before_deciding_releases_the_others(tmp_path, job_env, monkeypatch):
    cfg, p = _point()

    def broken(*a, **kw):
        raise RuntimeError("no data")

    monkeypatch.setattr(work, "run_point", broken)
    trained = []
    monkeypatch.setattr("memaudit.run.dispatch.dispatch", lambda *a, **kw: trained.append(1))
    job_env(0)
    with pytest.raises(RuntimeError):
        executors.point_job(cfg, p, str(tmp_path / "run"), str(tmp_path), None, nonce="c")
    job_env(1)
    assert executors.point_job(cfg, p, str(tmp_path / "run"), str(tmp_path), None, nonce="c") is None
    assert trained == []
