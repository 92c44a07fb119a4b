"""configs/scale-reduced.yaml end to end through the SLURM job path (submitit's LocalExecutor):
one job per point, the tiny2x points as two-task parallel jobs (one task per rank, rendezvous
from the emulated SLURM environment), one point killed mid-training and resumed by re-running
the same command; then configs/scale-gpu.yaml checked without running."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from memaudit.cli import main
from memaudit.io import read_json
from memaudit.rundir import RunDir

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
KILLED = "centralized-tiny-epsinf-s0"
TWO_TASK = "centralized-tiny2x-epsinf-s0"


def _last_step(run: RunDir) -> int:
    if not run.metrics_path.is_file():
        return 0
    lines = [ln for ln in run.metrics_path.read_text().splitlines() if ln.strip()]
    return max((json.loads(ln).get("step", 0) for ln in lines), default=0)


def _kill_after_checkpoint(run: RunDir, stop: threading.Event, killed: dict) -> None:
    """SIGKILL the process holding `run` once it has a checkpoint and trained past it."""
    while not stop.is_set():
        lock = run.read_lock()
        if lock and lock["pid"] != os.getpid() and run.state_dir.is_dir() and any(run.state_dir.iterdir()) \
                and _last_step(run) >= 6:
            os.kill(lock["pid"], signal.SIGKILL)
            killed.update(pid=lock["pid"], step=_last_step(run))
            return
        time.sleep(0.02)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale") / "out"
    args = ["sweep", str(CONFIGS / "scale-reduced.yaml"), "--out", str(out), "--executor", "local",
            "--set", "per_model={tiny2x: {parallel.data: 2}}", "--set", "grid.goldfish=[false]",
            "--set", "pretrain.steps=4", "--set", "probe.pii_max_items=4", "--format", "json"]
    # one Goldfish setting and 4 pretraining steps (the file's 20): the suite's time. Sweeps test
    # the Goldfish axis; what is checked of the bases here is which base each size fine-tunes, its
    # tokenizer and its shapes, none of which depends on how long it was pretrained. 4 PII items a
    # group (the file's 20): PII was most of the probes' time (29 of 45 s for the tiny base), and
    # the scale section reads exposure and extraction only (memaudit/reports/scale.py)
    stop, killed = threading.Event(), {}
    watcher = threading.Thread(target=_kill_after_checkpoint, args=(RunDir(out / "runs" / KILLED), stop, killed))
    watcher.start()
    try:
        rc1 = main(args)
    finally:
        stop.set()
        watcher.join()
    first = read_json(out / "sweep.json")
    rc2 = main(args)
    return out, rc1, first, rc2, read_json(out / "sweep.json"), killed


def test_killed_point_fails_alone_then_resumes(study):
    out, rc1, first, rc2, second, killed = study
    assert killed, "the watcher never saw the point train past a checkpoint"
    o1 = {o["name"]: o for o in first["outcomes"]}
    assert rc1 == 1 and first["status"] == "partial"
    assert o1[KILLED]["status"] == "failed" and "\n" not in o1[KILLED]["error"]
    assert all(o["status"] == "complete" for n, o in o1.items() if n != KILLED)
    o2 = {o["name"]: o for o in second["outcomes"]}
    assert rc2 == 0 and second["status"] == "complete"
    assert o2[KILLED]["action"] == "resumed"
    assert {o["action"] for n, o in o2.items() if n != KILLED} == {"skipped"}
    steps = {p["name"]: p["overrides"]["train.steps"] for p in second["plan"]["points"]}
    m = read_json(out / "runs" / KILLED / "run.json")
    assert m["status"] == "complete" and m["result"]["steps"] == steps[KILLED] > killed["step"]


def test_parallel_point_ran_as_one_two_task_job(study):
    out, *_ = study
    m = read_json(out / "runs" / TWO_TASK / "run.json")
    assert m["status"] == "complete" and m["config"]["parallel"]["data"] == 2
    jobs = out / "jobs"
    handoffs = list(jobs.glob("*.action.json"))  # rank 0's decision, read by rank 1
    assert handoffs and {json.loads(h.read_text())["action"] for h in handoffs} <= {"trained", "skipped"}
    by_job: dict[str, set[str]] = {}
    for f in jobs.glob("*_result.pkl"):
        job, task, _ = f.name.split("_", 2)
        by_job.setdefault(job, set()).add(task)
    assert sum(tasks == {"0", "1"} for tasks in by_job.values()) == 1  # tiny2x
    assert sum(tasks == {"0"} for tasks in by_job.values()) >= 1  # tiny


def test_sizes_compared_at_equal_tokens_and_reported(study):
    out, *_, second, _ = study
    points = second["plan"]["points"]
    assert second["plan"]["regime"] == "single-pass"
    assert {p["model"] for p in points} == {"tiny", "tiny2x"}
    assert len({p["tokens_seen"] for p in points}) == 1
    for p in points:
        m = read_json(out / "runs" / p["name"] / "run.json")
        assert m["config"]["model"]["preset"] == p["model"]
        assert m["config"]["train"]["steps"] == p["overrides"]["train.steps"]
        assert m["config"]["train"]["goldfish"]["enabled"] == p["goldfish"]
    rep = json.loads((out / "report" / "report.json").read_text())
    refs = {f"public-base-{size}" for size in ("tiny", "tiny2x")}  # each size's base, unchanged
    assert {r["id"] for r in rep["runs"]} == {p["name"] for p in points} | refs
    # the scale section is computed from the fine-tunes (not the bases) and follows the rules:
    # every comparison is "n too small" or tested, with Holm over every test of the report (one
    # family: the section's tests and the report's other tests together)
    scale = rep["scale"]
    assert len(scale["sizes"]) == 2 and scale["tests"]
    tested = [t for t in scale["tests"] if t["test"] is not None]
    assert {t["verdict"] for t in scale["tests"]} <= {"n too small", "no difference shown", "more", "less"}
    assert scale["family"] == rep["findings"]["tests"] >= len(tested)
    for t in tested:
        assert t["test"]["correction"] == "holm" and t["test"]["family"] == scale["family"]
        assert 0 <= t["test"]["p_value"] <= t["test"]["p_adjusted"] <= 1


def test_each_size_fine_tunes_its_own_public_base_with_one_tokenizer(study):
    """Single-pass from a public base: one base per size (base-tiny, base-tiny2x), both with the
    first base's tokenizer, so every fine-tune reads the same tokens."""
    out, *_, second, _ = study
    for p in second["plan"]["points"]:
        m = read_json(out / "runs" / p["name"] / "run.json")
        assert Path(m["config"]["model"]["init_from"]) == (out / f"base-{p['model']}" / "model").resolve()
        assert m["base_model"]["weights_sha256"]
    tok = [(out / f"base-{size}" / "model" / "tokenizer.json").read_bytes() for size in ("tiny", "tiny2x")]
    assert tok[0] == tok[1]
    shapes = [read_json(out / f"base-{size}" / "model" / "config.json")["hidden_size"]
              for size in ("tiny", "tiny2x")]
    assert shapes == [128, 256]


def test_scale_gpu_config_every_grid_fits_its_model():
    from memaudit.models.presets import llama_config
    from memaudit.parallel.dims import ParallelDims
    from memaudit.sweep.config import load_sweep_config, plan_points, point_config
    from memaudit.sweep.executors import job_resources

    cfg = load_sweep_config(CONFIGS / "scale-gpu.yaml")
    points = plan_points(cfg)
    assert cfg.regime == "single-pass" and cfg.executor.kind == "slurm"
    assert {p.model for p in points} == {"125m", "350m", "1b", "8b"} and any(p.goldfish for p in points)
    worlds = {}
    for p in points:
        c = point_config(cfg, p)
        dims = ParallelDims.from_config(c.parallel)
        dims.check_model(llama_config(c.model.preset))  # the grid divides the model's dimensions
        micro = c.train.micro_batch_size  # global rows per pass: whole rows on every data x z shard
        assert c.train.batch_size % micro == 0 and micro % (dims.data * dims.z) == 0
        res = job_resources(cfg.executor, c)
        assert res.tasks == dims.world_size and res.tasks_per_node <= 4
        worlds[p.model] = dims.world_size
    assert worlds == {"125m": 8, "350m": 8, "1b": 16, "8b": 32}
    assert len({p.tokens_seen for p in points}) == 1  # before the data fixes the steps
