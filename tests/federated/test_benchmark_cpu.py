"""The Flower table of benchmarks/federated_round.py counts each federation process's CPU seconds
with its descendants (`_cpu_seconds`): a process tree's CPU against what its processes measured
of themselves."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO_ROOT

_TREE = r"""
import subprocess, sys, time
burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nprint(time.process_time())"
done = subprocess.run([sys.executable, "-c", burn], capture_output=True, text=True)  # waited for
live = subprocess.Popen([sys.executable, "-c", burn + "\nimport sys; sys.stdout.flush(); time.sleep(600)"],
                        stdout=subprocess.PIPE, text=True)  # alive when counted
t = time.process_time()
while time.process_time() - t < 0.3:
    pass
print(done.stdout.strip(), live.stdout.readline().strip(), time.process_time(), flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads Linux /proc")
def test_a_process_trees_cpu_counts_its_waited_and_live_children():
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        import federated_round
    finally:
        sys.path.remove(str(REPO_ROOT / "benchmarks"))
    root = subprocess.Popen([sys.executable, "-c", _TREE], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        own = [float(x) for x in root.stdout.readline().split()]  # each process's own CPU seconds
        got = federated_round._cpu_seconds({"tree": root.pid, "gone": 2**22 + 7})
    finally:
        os.killpg(root.pid, 9)
        root.wait()
    assert got["gone"] == 0.0
    tick = 1 / os.sysconf("SC_CLK_TCK")
    # at least what the three processes measured of themselves (a tick of rounding each), and
    # not the benchmark's own CPU: that is "benchmark"
    # (/proc's utime and stime are charged a tick at a time, by sampling, while each process's own
    # clock is exact: allow a tenth below; a tree that missed its two children would hold a third)
    assert got["tree"] >= 0.9 * sum(own) - 3 * tick, (got, own)
    assert got["benchmark"] >= time.process_time() - tick
