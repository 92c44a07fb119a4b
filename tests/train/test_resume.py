"""Exact resume: SIGKILL a training process after a checkpoint, resume, compare bit for bit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from memaudit.cli import main
from memaudit.io import read_json, read_jsonl
from memaudit.rundir import RunDir


def _retrain_env(tiny_run) -> dict[str, str]:
    """A subprocess that retrains `tiny_run`: this checkout, on the fixture's CPU threads (the
    thread count changes the float reductions, so the bits)."""
    return {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": str(tiny_run["threads"])}


def _other_threads(tiny_run):
    """Run the resume on another thread count than the interrupted run: it must adopt the
    checkpoint's to end bit-identical (a test session sets threads in-process as it goes)."""
    from memaudit.train.trainer import cpu_threads

    return cpu_threads(2 if tiny_run["threads"] == 1 else 1)


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model" / "model.safetensors"))


def test_sigkill_then_resume_matches_uninterrupted(tiny_run, tmp_path, capsys):
    import torch

    out = tmp_path / "killed"
    args = list(tiny_run["args"])
    args[args.index("--out") + 1] = str(out)
    env = _retrain_env(tiny_run)
    proc = subprocess.Popen([sys.executable, "-m", "memaudit.cli", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        state = out / "state" / "trainer.json"
        while time.monotonic() < deadline and proc.poll() is None:
            if state.is_file() and read_json(state)["step"] >= 10:
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    run = RunDir(out)
    assert read_json(out / "run.json")["status"] == "running"  # what the killed process left
    assert run.status() == "interrupted"  # ... reads as interrupted: its lock names a dead process
    saved_step = read_json(out / "state" / "trainer.json")["step"]
    assert 10 <= saved_step < 40

    with _other_threads(tiny_run):
        assert main(["train", "--resume", str(out)]) == 0
    capsys.readouterr()
    manifest = read_json(out / "run.json")
    assert manifest["status"] == "complete" and manifest["result"]["resumed_from_step"] == saved_step
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == list(range(1, 41))

    ref, got = _weights(tiny_run["path"]), _weights(out)
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    assert manifest["result"]["final_holdout_loss"] == read_json(tiny_run["path"] / "run.json")["result"]["final_holdout_loss"]


SWAP_KILL = """
import os, signal, sys
import memaudit.checkpoints as lc
from memaudit.cli import main
lc._between_renames = lambda: os.kill(os.getpid(), signal.SIGKILL)
main(sys.argv[1:])
"""


def test_sigkill_inside_the_checkpoint_swap_resumes_from_the_newer_checkpoint(tiny_run, tmp_path, capsys):
    """A kill between the swap's two renames leaves both checkpoints under temporary names; the
    resume takes the newer complete one (step 20, not a restart at 0) and ends bit-identical."""
    import torch

    out = tmp_path / "swap"
    args = list(tiny_run["args"])
    args[args.index("--out") + 1] = str(out)
    env = _retrain_env(tiny_run)
    proc = subprocess.run([sys.executable, "-c", SWAP_KILL, *args], env=env, capture_output=True, timeout=400, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert not (out / "state").exists()
    names = sorted(p.name for p in out.glob(".state.*"))
    assert len(names) == 2 and names[0] == ".state.20.tmp" and names[1].startswith(".state.old-"), names
    with _other_threads(tiny_run):
        assert main(["train", "--resume", str(out)]) == 0
    capsys.readouterr()
    manifest = read_json(out / "run.json")
    assert manifest["status"] == "complete" and manifest["result"]["resumed_from_step"] == 20
    assert not list(out.glob(".state.*")) and not list(out.glob(".*.tmp"))
    ref, got = _weights(tiny_run["path"]), _weights(out)
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
