"""A CPU training run keeps the memory its steps free (`memaudit.train.host_memory`): a block a
step frees is reused by the next without faulting its pages in again, and the process's
allocator is as before once the run ends."""

from __future__ import annotations

import ctypes
import resource

import pytest
import torch

from memaudit.train.host_memory import glibc, kept_freed_memory

pytestmark = pytest.mark.skipif(glibc() is None, reason="glibc's allocator only (Linux)")
MIB = 1 << 20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mapped_bytes() -> int:
    """Bytes glibc holds in blocks mapped one by one (mallinfo2's hblkhd)."""
    f = glibc().mallinfo2
    f.restype = _Mallinfo2
    return int(f().hblkhd)


def _faults_of_a_step(mib: int = 64) -> tuple[int, int]:
    """(page faults, newly mapped bytes) of allocating and filling a `mib` MiB tensor whose
    twin was allocated, filled and freed just before (as one step's tensors are by the next)."""
    torch.ones(mib * MIB // 4).sum()  # the step before: allocated, touched, freed
    before, mapped = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, _mapped_bytes()
    t = torch.ones(mib * MIB // 4)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    grown = _mapped_bytes() - mapped
    del t
    return faults, grown


def test_a_freed_block_is_reused_without_faulting_its_pages_again():
    """Oracle: glibc's default, in which a 64 MiB block is mapped afresh and its 16,384 pages of
    4 KiB fault in again at every allocation."""
    for _ in range(3):  # steady steps
        default_faults, default_mapped = _faults_of_a_step()
    assert default_faults > 8192 and default_mapped >= 64 * MIB  # one mapping a block, faulted anew
    with kept_freed_memory("cpu") as applied:
        assert applied
        for _ in range(3):  # the heap grows over the first steps, then holds them
            faults, mapped = _faults_of_a_step()
    assert mapped == 0 and faults < 512, (faults, mapped)  # the freed block itself, not a new one
    assert _faults_of_a_step() == pytest.approx((default_faults, default_mapped), rel=0.25)  # defaults back


def test_training_keeps_freed_memory_on_the_cpu_only():
    """`Trainer.running`, the block every training step runs in, keeps freed memory on the CPU.
    Failed before: a step's 64 MiB block faulted its pages in again inside it."""
    from memaudit.config import load_config
    from memaudit.rundir import RunDir
    from memaudit.train.trainer import Trainer

    tr = Trainer(load_config(None, ["train.device=cpu"]), RunDir("/nonexistent"))
    with tr.running(None, resume=False):
        for _ in range(3):
            faults, mapped = _faults_of_a_step()
    assert mapped == 0 and faults < 512, (faults, mapped)
    with kept_freed_memory(torch.device("cuda", 0)) as applied:  # a GPU run: the host left alone
        assert not applied
