"""The checkpoint-directory protocol: sealed checkpoints, their swap into `state/` and recovery.

A checkpoint is written into a temporary directory beside `state/` and is complete when its
commit marker `COMMIT.json` (the sha256 of each of its files, and the step) is written, last.
Then `state/` is moved aside and the new directory renamed in. A kill between those renames
leaves two complete checkpoints under temporary names; on the next start `recover_checkpoint`
takes the newest complete one among `state/`, `.state.old-*` and `.state.*.tmp`, puts it at
`state/` and removes the rest; `clean_temporaries` removes every other leftover temporary
(`.model.*.tmp`, `.data.*.tmp`).

This module sits below the run lifecycle (`memaudit.run.lifecycle`) and the backends' checkpoint
formats (`memaudit.train.checkpoint`, `memaudit.federated.checkpoint`): it knows directories,
never what a backend writes into them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import time
from pathlib import Path

from memaudit.errors import MemauditError, RunDirError
from memaudit.io import atomic_write_json, read_json
from memaudit.rundir import RunDir

COMMIT = "COMMIT.json"


def _files(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file() and p.name != COMMIT)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def seal(d: Path, *, step: int) -> None:
    """Write the commit marker of the checkpoint in `d`: the last file written into it."""
    files = {str(p.relative_to(d)): _sha256(p) for p in _files(d)}
    atomic_write_json(d / COMMIT, {"step": int(step), "files": files})


def sealed_step(d: Path) -> int | None:
    """The step of the complete checkpoint in `d`, or None if it is incomplete or damaged."""
    if not d.is_dir():
        return None
    try:
        marker = read_json(d / COMMIT, what="checkpoint commit marker")
        files = marker["files"]
        step = int(marker["step"])
    except (FileNotFoundError, MemauditError, KeyError, TypeError, ValueError):
        return _legacy_step(d)
    if not isinstance(files, dict) or {str(p.relative_to(d)) for p in _files(d)} != set(files):
        return None
    for name, digest in files.items():
        if _sha256(d / name) != digest:
            return None
    return step


def _legacy_step(d: Path) -> int | None:
    """A checkpoint written before commit markers existed counts as complete at `state/`."""
    if d.name != "state" or (d / COMMIT).exists():
        return None
    try:
        scalars = read_json(d / "trainer.json", what="checkpoint")
        return int(scalars.get("step", scalars.get("round")))
    except (FileNotFoundError, MemauditError, AttributeError, TypeError, ValueError):
        return None


def checkpoint_present(d: Path) -> bool:
    """Cheap check (no hashing) that `d` holds a sealed checkpoint; `recover_checkpoint`, run by
    the writer at start-up, has verified it, so the other ranks need not hash it again."""
    return (d / COMMIT).is_file() or _legacy_step(d) is not None


def _between_renames() -> None:
    """Called between the two renames of a checkpoint swap (tests kill the process here)."""


def swap_in(tmp: Path, target: Path) -> None:
    """Put the sealed directory `tmp` at `target` by renames; the old one goes last."""
    old = None
    if target.exists() or target.is_symlink():
        old = target.with_name(f".{target.name}.old-{os.getpid()}-{time.time_ns()}")
        os.replace(target, old)
        _between_renames()
    os.replace(tmp, target)
    if old is not None:
        remove(old)


def remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def checkpoint_candidates(run: RunDir) -> list[Path]:
    """`state/` and every temporary a checkpoint swap can leave behind."""
    out = [run.state_dir] if run.state_dir.exists() else []
    for p in run.path.glob(".state.*"):
        if p.name.endswith(".tmp") or ".old-" in p.name:
            out.append(p)
    return out


def recover_checkpoint(run: RunDir) -> int | None:
    """Leave the newest complete checkpoint at `state/` and nothing else; return its step.

    Returns None when no complete checkpoint exists (a resume then starts from step 0,
    which the caller reports, never silently).
    """
    best: tuple[int, int, Path] | None = None
    for p in checkpoint_candidates(run):
        step = sealed_step(p)
        if step is not None:
            rank = (step, 1 if p == run.state_dir else 0)
            if best is None or rank > best[:2]:
                best = (*rank, p)
    if best is None and (run.state_dir.exists() or run.state_dir.is_symlink()):
        raise RunDirError(f"'{run.state_dir}' holds no complete checkpoint (damaged, or not "
                          "memaudit's); it was not loaded: start a new run with --out")
    for p in checkpoint_candidates(run):
        if best is None or p != best[2]:
            if p == run.state_dir:
                continue  # replaced below by a rename, never deleted first
            remove(p)
    if best is None:
        return None
    if best[2] != run.state_dir:
        swap_in(best[2], run.state_dir)
    return best[0]


def clean_temporaries(run: RunDir) -> None:
    """Remove what killed writes left (`.model.*.tmp`, `.data.*.tmp`, stale locks, the data
    staging folder of a process that died before adopting it)."""
    mine = f".memaudit-staging-{os.getpid()}"
    for p in run.path.glob(".*"):
        name = p.name
        if name.startswith(".state.") or name == mine:
            continue  # checkpoints are recovered, not cleaned; this process's staging is in use
        if (name.endswith(".tmp") or ".old-" in name or ".stale-" in name
                or name.startswith(".memaudit-staging-")):
            remove(p)
