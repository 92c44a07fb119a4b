"""What comes back from a sweep on a lent machine: the results, never the weights or the data.

A machine lent for a few minutes returns a handful of files of limited size (the project's TPU:
at most 8 files, 16 MiB each). `collect` packs a sweep folder's results into `DEST/results.tar.gz`
beside loose copies of `sweep.json` and `report.json`, each file checked against the limit:

- every run under `runs/` (the points and the public-base references): run.json, probes.json,
  privacy.json, metrics.jsonl, canaries.json (the report counts canaries from it) and the
  prepared data's summary data/meta.json, so that `memaudit report` builds the same report from
  the unpacked folder, and folders unpacked from several machines merge into one study;
- each public base's metrics.jsonl, under `pretrain/<base>/` (no run.json there: the report's
  runs are the fine-tunes and their references);
- sweep.json, report/report.json and report/report.md (the report only when sweep.json names
  it: a sweep run with `--no-report` after an earlier report has none that covers its points).

Left behind: model/ (the weights), state/ (checkpoints), the prepared data's texts and tensors,
split.json and sensitive_metrics.jsonl.

>>> sorted(RUN_FILES)[:3]
['canaries.json', 'data/meta.json', 'metrics.jsonl']
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

from memaudit.errors import MemauditError
from memaudit.io import atomic_write_bytes, atomic_write_json

LIMIT = 16 * 2**20
"""The largest file a lent machine returns (bytes)."""
RUN_FILES = ("run.json", "probes.json", "privacy.json", "metrics.jsonl", "canaries.json", "data/meta.json")
SWEEP_FILES = ("sweep.json", "report/report.json", "report/report.md")
LOOSE = ("sweep.json", "report/report.json")
ARCHIVE = "results.tar.gz"


@dataclass(frozen=True)
class Collected:
    """What `collect` wrote: the files (name, bytes, sha256) and the members of the archive."""

    files: list[dict]
    members: list[str]


def _sweep_files(sweep: Path, names: tuple[str, ...]) -> list[str]:
    """Those of `names` that `sweep` holds, less a report its last summary does not name (one
    written before a later `--no-report` call added points: it would speak for fewer runs than
    the archive holds)."""
    try:
        with_report = bool(json.loads((sweep / "sweep.json").read_text(encoding="utf-8")).get("report"))
    except (OSError, ValueError):
        with_report = False
    return [n for n in names if (sweep / n).is_file() and (with_report or not n.startswith("report/"))]


def _members(sweep: Path) -> list[tuple[str, Path]]:
    """(name in the archive, path) of every result file in `sweep`, in a fixed order."""
    out = [(name, sweep / name) for name in _sweep_files(sweep, SWEEP_FILES)]
    runs = sweep / "runs"
    for rd in sorted(runs.iterdir()) if runs.is_dir() else []:
        out += [(f"runs/{rd.name}/{f}", rd / f) for f in RUN_FILES if (rd / f).is_file()]
    for base in sorted(sweep.glob("base*")):
        if (base / "metrics.jsonl").is_file():
            out.append((f"pretrain/{base.name}/metrics.jsonl", base / "metrics.jsonl"))
    return out


def _archive(members: list[tuple[str, Path]]) -> bytes:
    """A gzipped tar of `members`, reproducible (no owners, times at 0)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for name, path in members:
            data = path.read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o600, 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def collect(sweep: str | os.PathLike, dest: str | os.PathLike, *, limit: int = LIMIT) -> Collected:
    """Pack sweep folder `sweep`'s results into `dest` (see the module doc); every file written is
    at most `limit` bytes, or nothing is written and a MemauditError names the file and the fix."""
    sweep, dest = Path(sweep), Path(dest)
    if not (sweep / "sweep.json").is_file():
        raise MemauditError(f"'{sweep}' is not a sweep folder (no sweep.json); give the --out of a "
                            "memaudit sweep")
    if dest.resolve() == sweep.resolve() or sweep.resolve() in dest.resolve().parents:
        raise MemauditError(f"--to '{dest}' lies inside the sweep folder; choose a folder outside it")
    members = _members(sweep)
    blobs = {ARCHIVE: _archive(members)}
    for name in _sweep_files(sweep, LOOSE):
        blobs[Path(name).name] = (sweep / name).read_bytes()
    for name, data in blobs.items():
        if len(data) > limit:
            raise MemauditError(f"{name} would be {len(data) / 2**20:.1f} MiB, over the {limit / 2**20:g} MiB "
                                "a file may take back; collect after fewer points (run the sweep with "
                                "--backends or --epsilons for a part of the grid) and merge the folders")
    dest.mkdir(parents=True, exist_ok=True)
    files = []
    for name, data in blobs.items():
        atomic_write_bytes(dest / name, data)
        files.append({"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    atomic_write_json(dest / "collected.json", {"files": files, "members": [m for m, _ in members]})
    return Collected(files, [m for m, _ in members])


def unpack(archives: list[str | os.PathLike], dest: str | os.PathLike) -> Path:
    """Unpack one or more results.tar.gz (one per machine) into `dest`, for `memaudit report`.
    A file two archives both hold (each machine's copy of a size's public-base reference, its
    sweep.json) is taken from the first; a member that would land outside `dest` is refused in
    one line."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for archive in archives:
        with tarfile.open(archive, mode="r:gz") as tar:
            for m in tar.getmembers():
                target = (dest / m.name).resolve()
                if not m.isfile() or dest.resolve() not in target.parents:
                    raise MemauditError(f"'{archive}' holds '{m.name}', which is not a plain file inside "
                                        "the folder; give an archive `memaudit collect` wrote")
                if target.is_file():
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(target, tar.extractfile(m).read())  # type: ignore[union-attr]
    return dest
