"""Is a sweep point finished? The one rule every executor asks (`point_action`).

A point's run directory is trained anew when there is no run yet, or when the run is stale:
trained under another config than the point's now (`config_as_written` of `point_config`),
or from a starting checkpoint (`model.init_from`) whose weights have changed since
(`base_model.weights_sha256` in run.json against `models.init.base_model_record`). An
interrupted or failed run with a checkpoint is resumed. A complete run is probed again unless
its probes.json is newer than its model, was written under the sweep's probe settings on
the device its probes run on (`probe_device`) and records the model's weights
(`memaudit.probes.weights`); otherwise it is skipped.

The `processes` loop (`runner._run_point`) and every submitit job (`executors.point_job`, rank 0
of a multi-task point) act on it; the scheduler driver (`executors.run_jobs`) asks it before
submitting, so a skipped point takes no scheduler slot and any other point gets a job, which
asks again where it runs.

>>> Verb.PROBE.action, PointAction(Verb.PROBE, "probes.json older than the model").probes
('skipped', True)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from memaudit.backends import config_with_backend_name
from memaudit.config import ProbeConfig, dump_config
from memaudit.io import dumps
from memaudit.models.init import base_model_record
from memaudit.probes.document import read_stamp
from memaudit.probes.weights import weights_sha256
from memaudit.rundir import RunDir
from memaudit.sweep.config import point_config

if TYPE_CHECKING:
    from memaudit.config import Config
    from memaudit.sweep.config import SweepConfig, SweepPoint


class Verb(StrEnum):
    """What a point's run directory needs: train it anew, resume it, probe it, or nothing."""

    TRAIN = "train"
    RESUME = "resume"
    PROBE = "probe"
    SKIP = "skip"

    @property
    def action(self) -> str:
        """The training step as a sweep outcome records it (`PointOutcome.action`) and rank 0 of
        a job hands it to the other ranks: trained | resumed | skipped."""
        return {"train": "trained", "resume": "resumed"}.get(self.value, "skipped")


@dataclass(frozen=True)
class PointAction:
    """A point's verb and the one-line reason for it (never a secret: names and settings only)."""

    verb: Verb
    reason: str

    @property
    def action(self) -> str:
        return self.verb.action

    @property
    def probes(self) -> bool:
        """Whether the point is probed (after training, if it trains)."""
        return self.verb is not Verb.SKIP


def config_as_written(cfg: Config) -> dict[str, Any]:
    """A run config as run.json holds it (strict JSON: non-finite numbers become null), for
    comparing a run on disk with the config a point would train it under."""
    return json.loads(dumps(dump_config(cfg)))


def stored_config(m: dict[str, Any]) -> Any:
    """The config run.json `m` holds, in today's backend names (a run written before the
    rename says `parallel`: the same config as `centralized`, not a changed one)."""
    return config_with_backend_name(m.get("config"))


def stale_reason(rd: RunDir, run_cfg: Config) -> str | None:
    """Why the run in `rd` no longer belongs to `run_cfg` (trained under another config, or from
    other starting weights than `model.init_from`'s now), or None when it does."""
    m = rd.read_manifest()
    if stored_config(m) != config_as_written(run_cfg):
        return "trained under another config than the point's"
    if run_cfg.model.init_from is not None:
        recorded = (m.get("base_model") or {}).get("weights_sha256")
        if recorded != base_model_record(run_cfg.model.init_from)["weights_sha256"]:
            return "the base model's weights (model.init_from) changed since it was trained"
    return None


def training_action(rd: RunDir, run_cfg: Config) -> PointAction:
    """The training half of the rule: TRAIN (no run, a stale run, or one that cannot resume),
    RESUME (interrupted or failed with a checkpoint) or SKIP (complete and current)."""
    if not rd.is_run():
        return PointAction(Verb.TRAIN, "no run yet")
    stale = stale_reason(rd, run_cfg)
    if stale is not None:
        return PointAction(Verb.TRAIN, stale)
    status = rd.status()
    if status == "complete":
        return PointAction(Verb.SKIP, "complete")
    if status in ("interrupted", "failed") and rd.state_dir.is_dir() and any(rd.state_dir.iterdir()):
        return PointAction(Verb.RESUME, f"{status} with a checkpoint")
    return PointAction(Verb.TRAIN, f"{status} with no checkpoint to resume")


def probe_device(cfg: SweepConfig) -> str:
    """The device a point's probes run on: `probe.device`, or for `auto` CUDA where the point
    runs has it: in a SLURM job when the executor asks for GPUs (a driver on a login node must
    not judge by its own), elsewhere when this machine has one (local and debug jobs run here)."""
    if cfg.probe.device != "auto":
        return cfg.probe.device
    if cfg.executor.kind == "slurm":
        return "cuda" if cfg.executor.gpus_per_node else "cpu"
    # lazy: torch (~2 s), which `memaudit --help` must not pay: only where a probe is judged
    from memaudit.probes.scoring import resolve_device

    return resolve_device("auto")


def point_probe_config(cfg: SweepConfig, rd: RunDir | None = None) -> ProbeConfig:
    """A point's probe settings: the sweep's `probe:` section, its device resolved, and as the
    membership reference the run's public base (`model.init_from`) unless `probe.reference`
    names one: the fine-tune's own starting point is the cheap strong reference."""
    update: dict[str, Any] = {"device": probe_device(cfg)}
    if cfg.probe.reference is None and rd is not None and rd.is_run():
        # lazy: probes.targets loads numpy (~0.4 s); only a point with a run reads its base
        from memaudit.probes.targets import base_reference

        update["reference"] = base_reference(rd)
    return cfg.probe.model_copy(update=update)


def probe_settings(cfg: SweepConfig, rd: RunDir | None = None) -> dict[str, Any]:
    """The probe settings a point's probes.json records (`point_probe_config`)."""
    return point_probe_config(cfg, rd).model_dump(mode="json")


def probe_reason(cfg: SweepConfig, rd: RunDir) -> str | None:
    """Why the complete run in `rd` must be probed (again), or None when its probes.json is
    newer than its model and was written under `cfg`'s probe settings."""
    model = rd.model_dir / "config.json"
    if not rd.probes_path.is_file():
        return "not probed yet"
    if not model.is_file():
        return "its model is missing"
    if rd.probes_path.stat().st_mtime < model.stat().st_mtime:
        return "probes.json is older than the model"
    stamp = read_stamp(rd.probes_path)
    if stamp.settings != probe_settings(cfg, rd):
        return "probes.json was written under other probe settings"
    if stamp.weights_sha256 != weights_sha256(rd.model_dir):
        return "probes.json measured other weights than the model's (or does not say which)"
    return None


def run_action(cfg: SweepConfig, run_cfg: Config, run_dir: str | os.PathLike) -> PointAction:
    """`point_action` for a run whose config is already built (`run_cfg`)."""
    rd = RunDir(run_dir)
    action = training_action(rd, run_cfg)
    if action.verb is not Verb.SKIP:
        return action
    why = probe_reason(cfg, rd)
    return PointAction(Verb.SKIP, "complete and probed under these settings") if why is None \
        else PointAction(Verb.PROBE, f"complete, {why}")


def point_action(cfg: SweepConfig, point: SweepPoint, run_dir: str | os.PathLike) -> PointAction:
    """What sweep `cfg`'s `point` needs in `run_dir`: TRAIN, RESUME, PROBE or SKIP, with why.

    Args:
      cfg: the sweep (its probe settings and executor decide what "probed" means).
      point: the grid point (its run config is `point_config(cfg, point)`).
      run_dir: the point's run directory (`OUT/runs/<point name>`), which may not exist yet.

    Returns:
      A PointAction; TRAIN and RESUME are followed by probing, PROBE probes only. Raises the
      RunDirError of an unreadable run.json.
    """
    return run_action(cfg, point_config(cfg, point), run_dir)
