"""`benchmarks/gpu_check.sh` parses, and in its no-GPU branch prints JSON saying so and exits 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "gpu_check.sh"


def test_gpu_check_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], check=False, capture_output=True).returncode == 0


def test_gpu_check_without_a_gpu_prints_json_and_exits_0() -> None:
    env = os.environ | {"PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO_ROOT)}
    r = subprocess.run(["bash", str(SCRIPT), "--budget-s", "60"], check=False, capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["gpus"] == 0 and out["status"] == "no_gpu" and out["reason"]


def test_the_noise_check_passes_on_the_cpu() -> None:
    """`dp_noise_on`, the GPU check's DP-SGD noise case, run on the CPU: the grid's layout and one
    process draw the same tiles, at the configured std (on a GPU one process draws on the device)."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(REPO_ROOT / "benchmarks"))
    got = gpu_check.dp_noise_on("cpu")
    assert got["status"] == "ok" and got["grid_equals_cpu_tiles"], got
    assert got["normals"] > 1_000_000 and abs(got["one_process_std"] - 0.5) < 0.01
