"""The run lifecycle's pieces on their own: the lock under a race, stale and lost locks, sealed
checkpoints and their recovery, overwrite that keeps the old run until the new one exists."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import time
from pathlib import Path

import pytest

from memaudit.checkpoints import checkpoint_candidates, recover_checkpoint, seal, sealed_step
from memaudit.errors import RunDirError
from memaudit.rundir import RunDir


def _contend(path: str, barrier, hold_s: float, q) -> None:
    barrier.wait()
    try:
        with RunDir(path).locked(heartbeat_s=0.05):
            q.put(("won", os.getpid()))
            time.sleep(hold_s)
    except RunDirError:
        q.put(("refused", os.getpid()))


def test_many_simultaneous_starts_one_wins(tmp_path):
    n = 8
    ctx = mp.get_context("spawn")  # not fork: the test process may hold JAX's threads
    barrier, q = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_contend, args=(str(tmp_path / "run"), barrier, 1.5, q)) for _ in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    results = [q.get(timeout=5) for _ in range(n)]
    assert sum(r == "won" for r, _ in results) == 1, results
    assert not (tmp_path / "run" / "run.lock").exists()  # released by the winner


def test_a_dead_holders_lock_is_taken_over_and_a_live_one_is_not(tmp_path):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    run.lock_path.write_text(json.dumps({"pid": dead.pid, "host": host, "heartbeat": time.time()}))
    with run.locked():
        assert run.read_lock()["pid"] == os.getpid()
    # another host: stale only when its heartbeat stopped
    run.lock_path.write_text(json.dumps({"pid": 1, "host": "elsewhere", "heartbeat": time.time() - 1e4}))
    with run.locked():
        pass
    run.lock_path.write_text(json.dumps({"pid": 1, "host": "elsewhere", "heartbeat": time.time()}))
    with pytest.raises(RunDirError, match="elsewhere"), run.locked():
        pass
    assert json.loads(run.lock_path.read_text())["host"] == "elsewhere"  # a live lock is never removed


def test_a_holder_notices_when_its_lock_was_taken(tmp_path):
    run = RunDir(tmp_path / "run")
    with run.locked(heartbeat_s=0.05) as lock:
        run.lock_path.write_text(json.dumps({"pid": 1, "host": "other", "heartbeat": time.time(),
                                             "token": "someone-else"}))
        deadline = time.monotonic() + 5
        while not lock.lost.is_set() and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(RunDirError, match="taken over"):
            lock.check()
    assert run.lock_path.exists()  # the other holder's lock stays


def _ckpt(d: Path, step: int, payload: bytes = b"w") -> Path:
    d.mkdir(parents=True)
    (d / "trainer.json").write_text(json.dumps({"schema": 1, "step": step}))
    (d / "sub").mkdir()
    (d / "sub" / "weights.bin").write_bytes(payload * 100)
    seal(d, step=step)
    return d


def test_a_seal_detects_any_changed_missing_or_extra_file(tmp_path):
    d = _ckpt(tmp_path / "state", 3)
    assert sealed_step(d) == 3
    (d / "sub" / "weights.bin").write_bytes(b"x" * 100)
    assert sealed_step(d) is None
    d = _ckpt(tmp_path / "b", 3)
    (d / "extra").write_text("?")
    assert sealed_step(d) is None
    d = _ckpt(tmp_path / "c", 3)
    (d / "trainer.json").unlink()
    assert sealed_step(d) is None


def test_recovery_takes_the_newest_complete_checkpoint_and_removes_the_rest(tmp_path):
    run = RunDir(tmp_path)
    _ckpt(tmp_path / ".state.old-1-2", 10)          # moved aside by the swap
    _ckpt(tmp_path / ".state.20.tmp", 20)           # sealed, not yet renamed in
    broken = _ckpt(tmp_path / ".state.30.tmp", 30)  # killed while writing: not sealed
    (broken / "COMMIT.json").unlink()
    assert recover_checkpoint(run) == 20
    assert sealed_step(run.state_dir) == 20
    assert checkpoint_candidates(run) == [run.state_dir]


def test_recovery_keeps_state_when_it_is_the_newest(tmp_path):
    run = RunDir(tmp_path)
    _ckpt(tmp_path / "state", 20)
    _ckpt(tmp_path / ".state.old-1-2", 10)
    assert recover_checkpoint(run) == 20 and checkpoint_candidates(run) == [run.state_dir]


def test_recovery_refuses_a_damaged_state_and_deletes_nothing(tmp_path):
    run = RunDir(tmp_path)
    d = _ckpt(tmp_path / "state", 20)
    (d / "sub" / "weights.bin").write_bytes(b"garbage")
    with pytest.raises(RunDirError, match="no complete checkpoint"):
        recover_checkpoint(run)
    assert (d / "sub" / "weights.bin").read_bytes() == b"garbage"


def test_recovery_without_any_checkpoint_starts_over(tmp_path):
    assert recover_checkpoint(RunDir(tmp_path)) is None


PUBLIC_METRICS = frozenset({
    "step", "round", "lr", "noise_std", "noise_multiplier", "clip", "next_clip", "holdout_loss",
    "holdout_perplexity", "effective_noise", "secagg_norm_bound", "server_lr", "epsilon",
    "unclipped_fraction",
})


def merged_metrics(run: Path) -> list[dict]:
    """metrics.jsonl with, under DP, each round's (or step's) sensitive statistics merged in."""
    out = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    sens = run / "sensitive_metrics.jsonl"
    if sens.is_file():
        rows = [json.loads(x) for x in sens.read_text().splitlines()]
        key = "round" if rows and "round" in rows[0] else "step"
        extra = {r[key]: r for r in rows if key in r}
        for m in out:
            m.update(extra.get(m.get(key), {}))
    return out


def scan_public_files(run: Path) -> None:
    """No file of a DP run outside the sensitive ones holds a per-step statistic of the private
    data: metrics.jsonl has no such key, run.json's result no training loss, privacy.json no
    realized batch, cohort, survivor or clip count (central DP: no such field at all)."""
    from memaudit.run.lifecycle import SENSITIVE_KEYS

    for line in (run / "metrics.jsonl").read_text().splitlines():
        assert not set(json.loads(line)) & SENSITIVE_KEYS, line
        # an allowlist, written here independently of SENSITIVE_KEYS: what a DP run may publish
        # (schedules, the privatised noise and clip, evaluation on the holdout, the round counter)
        assert set(json.loads(line)) <= PUBLIC_METRICS, sorted(set(json.loads(line)) - PUBLIC_METRICS)
    result = json.loads((run / "run.json").read_text())["result"]
    assert result["final_train_loss"] is None
    keys: set[str] = set()

    def walk(o) -> None:
        if isinstance(o, dict):
            keys.update(o)
            for v in o.values():
                walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    walk(json.loads((run / "privacy.json").read_text()))
    assert not keys & {"batch_size", "clip_fraction", "clipped", "cohort", "survivors", "loss"}, keys
    assert (run / "sensitive_metrics.jsonl").is_file()


def test_clean_temporaries_removes_leftovers_but_not_checkpoints(tmp_path):
    from memaudit.checkpoints import clean_temporaries

    for name in (".model.abc.tmp", ".data.x.tmp", ".memaudit-staging-999999", ".state.3.tmp"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text("x")
    (tmp_path / ".run.lock.stale-abc").write_text("{}")
    (tmp_path / f".memaudit-staging-{os.getpid()}").mkdir()  # this process's, in use
    (tmp_path / "notes.txt").write_text("mine")
    clean_temporaries(RunDir(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [".state.3.tmp", f".memaudit-staging-{os.getpid()}", "notes.txt"])


def test_sigterm_that_lands_in_a_callback_still_interrupts_and_prints_no_traceback(capsys):
    """A SIGTERM whose handler runs inside a weakref callback or a finaliser (Python cannot raise
    there: it prints "Exception ignored in ..." with a traceback and goes on) still interrupts the
    block, at the next point where Python can raise, and leaves stderr clean. Failed before: a
    sweep's point worker printed that traceback, and the block ran on."""
    import signal
    import weakref

    from memaudit.run.lifecycle import TrainingInterrupted, sigterm_as_interrupt

    class Thing:
        pass

    def in_callback(_):
        signal.raise_signal(signal.SIGTERM)
        return [k for k in range(100)]  # the handler runs here, inside the callback

    ran_on = False
    with pytest.raises(TrainingInterrupted), sigterm_as_interrupt():
        thing = Thing()
        ref = weakref.ref(thing, in_callback)
        del thing  # the callback runs: SIGTERM lands in it
        deadline = time.monotonic() + 30  # the interrupt comes within ms; this only bounds a failure
        while time.monotonic() < deadline:
            time.sleep(0.001)
        ran_on = True
    assert ref() is None and not ran_on
    assert "Traceback" not in capsys.readouterr().err


def test_a_user_level_step_publishes_no_statistic_of_the_private_data():
    """ULS/ELS steps report how many sequences the sampled users held: a count of the private
    data that DP does not privatise, so it goes to sensitive_metrics.jsonl like the batch size."""
    from memaudit.run.lifecycle import SENSITIVE_KEYS
    from memaudit.train.jax_dp import step_metrics

    out = step_metrics({"examples": 7, "loss_sum": 3.5, "clipped": 1}, rows=7, units=2,
                       noise_std=0.1, group=True)
    assert "sequences" in out
    public = set(out) - SENSITIVE_KEYS
    assert public <= PUBLIC_METRICS, sorted(public - PUBLIC_METRICS)
