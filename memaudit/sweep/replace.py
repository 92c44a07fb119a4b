"""A sweep never deletes a complete point unless it is asked to (`memaudit sweep --overwrite`).

Re-running a sweep after its file was edited, or running another sweep file on the same --out,
makes complete points stale (`memaudit.sweep.point.stale_reason`): the one rule would train
them anew, which replaces their model, probes and metrics. Before anything is trained, the
sweep lists every complete run it would replace (points, public bases, the zero-fine-tuning
references) with what changed, and stops with that one line unless --overwrite was given.
`memaudit.sweep.work.train_point` and `memaudit.sweep.pretrain` hold the same rule where they
replace a run, so a point planned later (a matched-utility point) is held to it too.

>>> first_difference({"train": {"lr": 1, "steps": 2}}, {"train": {"lr": 1, "steps": 3}})
'train.steps'
>>> first_difference({"a": 1}, {"a": 1}) is None
True
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memaudit.errors import RunDirError
from memaudit.rundir import RunDir
from memaudit.sweep.config import SweepConfig, SweepPoint, point_config
from memaudit.sweep.point import Verb, config_as_written, run_action, stale_reason, stored_config
from memaudit.sweep.pretrain import REFERENCE_RUN, base_models, reference_config

SHOWN = 6  # points named in the message; the rest counted


def first_difference(a: Any, b: Any, prefix: str = "") -> str | None:
    """The first dotted key (in sorted order) where two config mappings differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            d = first_difference(a.get(k), b.get(k), f"{prefix}{k}.")
            if d is not None:
                return d
        return None
    return None if a == b else (prefix.rstrip(".") or "the config")


def _complete(rd: RunDir) -> bool:
    return rd.is_run() and rd.status() == "complete"


def what_changed(rd: RunDir, run_cfg: Any) -> str:
    """Why a complete run is stale, in a few words naming the config key (never its value)."""
    key = first_difference(stored_config(rd.read_manifest()), config_as_written(run_cfg))
    if key is not None:
        return f"{key} changed"
    return "its base model's weights changed"


def replaced_points(cfg: SweepConfig, points: list[SweepPoint], out: Path) -> list[str]:
    """'name (what changed)' of every complete point under `out/runs/` the sweep would train anew."""
    found = []
    for p in points:
        rd = RunDir(out / "runs" / p.name)
        if not _complete(rd):
            continue
        run_cfg = point_config(cfg, p)
        if run_action(cfg, run_cfg, rd.path).verb is Verb.TRAIN:
            found.append(f"{p.name} ({what_changed(rd, run_cfg)})")
    return found


def replaced_references(cfg: SweepConfig, points: list[SweepPoint], out: Path) -> list[str]:
    """The complete zero-fine-tuning reference runs that `ensure_base_reference` would rewrite."""
    found = []
    for size, model in base_models(out, points).items():
        name = REFERENCE_RUN if size is None else f"{REFERENCE_RUN}-{size}"
        rd = RunDir(out / "runs" / name)
        if _complete(rd):
            run_cfg = reference_config(cfg, [p for p in points if p.model == size], model)
            if stale_reason(rd, run_cfg) is not None:
                found.append(f"{name} ({what_changed(rd, run_cfg)})")
    return found


def refuse_replacing(out: Path, found: list[str], *, overwrite: bool) -> None:
    """One line naming the complete runs a sweep would replace, unless `overwrite`."""
    if not found or overwrite:
        return
    shown = ", ".join(found[:SHOWN]) + (f" and {len(found) - SHOWN} more" if len(found) > SHOWN else "")
    raise RunDirError(f"sweep --out '{out}' holds {len(found)} complete run(s) this sweep would train "
                      f"anew: {shown}; pass --overwrite to retrain them, or choose another --out")


def refuse_replacing_point(rd: RunDir, reason: str, *, overwrite: bool) -> None:
    """`work.train_point`'s check: a complete point is trained anew only with --overwrite."""
    if not overwrite and _complete(rd):
        raise RunDirError(f"point '{rd.path.name}' is complete and would be trained anew ({reason}); "
                          "re-run the sweep with --overwrite to retrain it")
