"""Atomic file writes: write to a temporary name in the same directory, fsync, rename.

A crash never leaves a half-written checkpoint, ledger or manifest behind. Every file memaudit
writes here is created 0600 (mkstemp; appends with that mode), and `private_tree` closes what a
library wrote with the umask's modes (torch checkpoints, tokenizer files) to 0600 files in
0700 folders. A failed write names its file (`OSError.filename`), so that the one line the CLI
shows says which file and why (`no space left on device writing state/...`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from memaudit.errors import MemauditError


@contextlib.contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """An OSError in the block without a file name (a failed write(), fsync()) gets `path`."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise type(e)(e.errno, e.strerror or os.strerror(e.errno), os.fspath(path)) from e
        raise


LOW_SPACE = 64 << 20  # bytes free below which a failed write is put down to a full disk


@contextlib.contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """A write into `path` (a file or a folder) by a library: its failure becomes an OSError
    naming `path` and the cause. torch's writer reports a full disk as a RuntimeError without
    errno or file (`[enforce fail at inline_container.cc] ... file write failed`); it is read as
    ENOSPC when the disk has (almost) no space left, else as an I/O error."""
    try:
        with naming(path):
            yield
    except RuntimeError as e:
        text = str(e)
        if "PytorchStreamWriter" not in text and "file write failed" not in text:
            raise
        where = Path(path)
        probe = where if where.is_dir() else where.parent
        try:
            full = shutil.disk_usage(probe).free < LOW_SPACE
        except OSError:
            full = False
        code = errno.ENOSPC if full else errno.EIO
        raise OSError(code, os.strerror(code), os.fspath(path)) from e


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with naming(path), os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 2) -> None:
    atomic_write_text(path, dumps(obj, indent=indent) + "\n")


def dumps(obj: Any, *, indent: int | None = None) -> str:
    """Strict JSON (RFC 8259): NaN and infinities become null, never `NaN`/`Infinity` tokens.

    memaudit's own readers map null back where a value may be non-finite (an epsilon of a run
    without DP is written as null and read as inf).
    """
    return json.dumps(_finite(obj), indent=indent, default=_json_default, allow_nan=False)


def _finite(o: Any) -> Any:
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_finite(v) for v in o]
    if hasattr(o, "tolist") and not isinstance(o, str):
        return _finite(o.tolist())
    return o


def _json_default(o: Any) -> Any:
    # numpy scalars/arrays and Paths show up in results; keep JSON plain.
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, os.PathLike):
        return os.fspath(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def read_json(path: str | os.PathLike, *, what: str = "JSON file") -> Any:
    """Parse a JSON file; a file that is not valid UTF-8 JSON is one line naming it.

    FileNotFoundError passes through (callers decide whether absence is an error).
    """
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise
    except IsADirectoryError:
        raise MemauditError(f"'{path}' is a directory, not a {what}; remove it or restore the file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" (line {e.lineno})" if isinstance(e, json.JSONDecodeError) else ""
        raise MemauditError(f"'{path}' is not a valid {what}{where}; restore it or re-create "
                            "it with the memaudit command that writes it") from None


def append_jsonl(path: str | os.PathLike, record: dict[str, Any], *, mode: int | None = None) -> None:
    """Append one JSON line and fsync (metrics are append-only; resume truncates them). With
    ``mode`` the file is created with (and kept at) those permissions, e.g. 0o600 for a
    sensitive file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # every memaudit file may be sensitive: 0600 unless the caller names another mode
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600 if mode is None else mode)
    with naming(path), os.fdopen(fd, "a", encoding="utf-8") as f:
        if mode is not None:
            os.fchmod(f.fileno(), mode)
        f.write(dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a torn last line from a kill: everything before it is intact
    return out


def truncate_jsonl(path: str | os.PathLike, keep: int) -> None:
    """Keep the first `keep` records (used on resume so metrics are not double counted)."""
    records = read_jsonl(path)[:keep]
    atomic_write_text(path, "".join(dumps(r) + "\n" for r in records))


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory; on success it replaces `path` in one rename.

    The previous contents of `path` survive until the new directory is complete.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def private_tree(path: str | os.PathLike) -> None:
    """`path` and everything under it readable by its owner only: folders 0700, files 0600
    (what a library wrote with the umask's modes: torch.save, a tokenizer's files)."""
    path = Path(path)
    if path.is_symlink() or not path.exists():
        return
    if path.is_file():
        os.chmod(path, 0o600)
        return
    os.chmod(path, 0o700)
    for root, dirs, files in os.walk(path):
        for d in dirs:
            if not os.path.islink(os.path.join(root, d)):
                os.chmod(os.path.join(root, d), 0o700)
        for f in files:
            if not os.path.islink(os.path.join(root, f)):
                os.chmod(os.path.join(root, f), 0o600)


def replace_dir(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Put the complete directory `tmp` at `path` by renames (same file system); the
    previous `path` is moved aside first and removed only after the new one is in place."""
    tmp, path = Path(tmp), Path(path)
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
