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


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model" / "model.safetensors"))


def test_sigkill_then_resume_matches_uninterrupted(tiny_run, tmp_path, capsys):
    import torch

    out = tmp_path / "killed"
    args = list(tiny_run["args"])
    args[args.index("--out") + 1] = str(out)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
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
