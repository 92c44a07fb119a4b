"""A sweep that is sent SIGTERM (`kill`, a scheduler's cancel) takes its point workers with it.

Before, the spawned workers outlived the sweep and went on training and writing into --out,
where the next sweep started on the same folder would find them writing into its run folders.
The sweep runs as a real process here (the signal and the workers are what is tested).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from memaudit.rundir import _pid_alive as _alive  # a zombie counts as gone


def _children(pid: int) -> list[int]:
    """Live (not zombie) processes whose parent is `pid`, from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            out.append(int(entry.name))
    return out


def test_sigterm_to_the_sweep_ends_its_point_workers(tmp_path):
    cfg = tmp_path / "sweep.yaml"
    cfg.write_text(yaml.safe_dump({
        "jobs": 2,
        "base": {"data": {"synth": {"users": 8, "docs_per_user": 2, "paragraph_sentences": 0}, "seq_len": 32,
                          "canaries": {"repetitions": [1, 2], "owners": ["user"]}},
                 "model": {"preset": "tiny"},
                 "train": {"steps": 100_000, "batch_size": 2, "eval_every": 100_000, "checkpoint_every": 100_000}},
        "grid": {"backends": ["centralized"], "epsilons": ["inf", 8]},
        "probe": {"probes": ["exposure"], "device": "cpu"},
    }))
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sweep = subprocess.Popen([sys.executable, "-m", "memaudit.cli", "sweep", str(cfg), "--out", str(out)],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        # the pool's two workers and the queue's manager, and both points training
        while time.monotonic() < deadline and not (
                len(_children(sweep.pid)) >= 3 and len(list(out.glob("runs/*/run.json"))) >= 2):
            assert sweep.poll() is None, sweep.stderr.read()
            time.sleep(0.2)
        workers = _children(sweep.pid)
        assert len(workers) >= 3, "the sweep's workers never started"
        sweep.send_signal(signal.SIGTERM)  # to the sweep alone, not its process group
        sweep.wait(timeout=60)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(map(_alive, workers)):
            time.sleep(0.2)
        assert not any(map(_alive, workers)), "point workers outlived the sweep"
        assert sweep.returncode != 0
        assert "Traceback" not in sweep.stderr.read()
    finally:  # nothing of this test outlives it, whatever failed
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
        for pid in filter(_alive, workers):
            os.kill(pid, signal.SIGKILL)
