"""A CPU training run keeps the memory its steps free (`memaudit.train.host_memory`): a block a
step frees is reused by the next without faulting its pages in again, and the process's
allocator is as before once the run ends.

The measurements run in a fresh interpreter. A test worker's heap holds what earlier tests left:
after a training test's run, glibc's heap keeps the holes the run's blocks left (their pages
handed back, `malloc_trim`), and glibc serves a later block that fits one from there, not from a
mapping of its own. In the suite a 64 MiB block was served so, without a fault, and the oracle
below needs glibc's defaults on a heap without such holes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from memaudit.train.host_memory import glibc

pytestmark = pytest.mark.skipif(glibc() is None, reason="glibc's allocator only (Linux)")
MIB = 1 << 20

MEASURE = r'''
import ctypes, json, resource
import torch
from memaudit.config import load_config
from memaudit.rundir import RunDir
from memaudit.train.host_memory import glibc, kept_freed_memory
from memaudit.train.trainer import Trainer

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

info = glibc().mallinfo2
info.restype = Mallinfo2

def step(mib=64):
    """(page faults, newly mapped bytes) of allocating and filling a block whose twin was
    allocated, filled and freed just before, as a step's tensors are by the next step's."""
    torch.ones(mib * 2**20 // 4).sum()
    faults, mapped = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, info().hblkhd
    t = torch.ones(mib * 2**20 // 4)
    out = [resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults, info().hblkhd - mapped]
    del t
    return out

def steady():  # the heap grows over the first steps, then holds them
    return [step() for _ in range(3)][-1]

out = {"default": steady()}
with kept_freed_memory("cpu") as applied:
    out["applied"], out["kept"] = applied, steady()
# glibc's defaults back: a block larger than any the heap freed inside (two 64 MiB blocks at most)
# is mapped on its own again (with mmap still off it would come from the heap, faulted once)
out["after"] = step(192)
tr = Trainer(load_config(None, ["train.device=cpu"]), RunDir("/nonexistent"))
with tr.running(None, resume=False):
    out["trainer"] = steady()
with kept_freed_memory(torch.device("cuda", 0)) as applied:
    out["cuda_applied"] = applied
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def measured() -> dict:
    done = subprocess.run([sys.executable, "-c", MEASURE], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_freed_block_is_reused_without_faulting_its_pages_again(measured):
    """Oracle: glibc's default, in which a 64 MiB block is mapped afresh and its 16,384 pages of
    4 KiB fault in again at every allocation."""
    default_faults, default_mapped = measured["default"]
    assert default_faults > 8192 and default_mapped >= 64 * MIB  # one mapping a block, faulted anew
    assert measured["applied"]
    faults, mapped = measured["kept"]
    assert mapped == 0 and faults < 512, (faults, mapped)  # the freed block itself, not a new one
    faults, mapped = measured["after"]  # glibc's defaults back: a 192 MiB block mapped and faulted anew
    assert mapped >= 192 * MIB and faults > 3 * 8192, (faults, mapped)


def test_training_keeps_freed_memory_on_the_cpu_only(measured):
    """`Trainer.running`, the block every training step runs in, keeps freed memory on the CPU.
    Failed before: a step's 64 MiB block faulted its pages in again inside it (16,388 faults,
    67,112,960 bytes newly mapped)."""
    faults, mapped = measured["trainer"]
    assert mapped == 0 and faults < 512, (faults, mapped)
    assert measured["cuda_applied"] is False  # a GPU run: the host's allocator left alone
