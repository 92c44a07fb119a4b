"""memaudit's processes keep numpy's arrays in ordinary pages unless the user chose otherwise
(`memaudit/__init__.py`): on a virtual machine whose host takes back the guest's free memory,
numpy's transparent huge pages made secure aggregation's encoder stall in the kernel in about
half the rounds (0.6-0.9 s against 0.08 s). Failed before the default was set."""

import os
import subprocess
import sys

import pytest

PROBE = "import memaudit, numpy._core.multiarray as m; print(m._get_madvise_hugepage())"


@pytest.mark.parametrize("setting, want", [(None, "False"), ("1", "True"), ("0", "False")])
def test_numpy_huge_pages_are_off_in_memaudits_processes_unless_asked(setting, want):
    env = {k: v for k, v in os.environ.items() if k != "NUMPY_MADVISE_HUGEPAGE"}
    if setting is not None:
        env["NUMPY_MADVISE_HUGEPAGE"] = setting
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == want
    # the environment the processes memaudit starts inherit says the same
    child = subprocess.run([sys.executable, "-c", "import memaudit, os; print(os.environ['NUMPY_MADVISE_HUGEPAGE'])"],
                           env=env, capture_output=True, text=True, check=True)
    assert child.stdout.strip() == (setting or "0")
