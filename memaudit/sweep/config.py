"""The sweep grid: backends x privacy levels x seeds (x Goldfish on the centralized side).

A sweep file holds a `base` run config (the same mapping as configs/tiny.yaml), optional
`per_backend` dotted overrides (clip norms and optimizers differ between DP-SGD and
DP-FedAvg), the `grid`, the `audit` runs and the `probe` settings.

>>> s = sweep_config_from_dict({"grid": {"backends": ["parallel"], "epsilons": ["inf", 4]}})
>>> [p.name for p in plan_points(s)]
['parallel-epsinf-s0', 'parallel-eps4-s0']
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from memaudit.config import (
    Config,
    ProbeConfig,
    _format_error,
    _set_dotted,
    config_from_dict,
    load_raw,
    parse_override,
)
from memaudit.errors import ConfigError
from memaudit.sweep.pretrain import PretrainConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GridConfig(_Section):
    backends: list[str] = Field(default_factory=lambda: ["parallel", "federated"])
    epsilons: list[float] | None = Field(None, description="target epsilons; 'inf' = no DP")
    noise_multipliers: list[float] | None = Field(None, description="sigma values; 0 = no DP")
    seeds: int | list[int] = 1
    goldfish: list[bool] = Field(default_factory=lambda: [False], description="centralized only")

    @field_validator("backends")
    @classmethod
    def _backends(cls, v: list[str]) -> list[str]:
        for b in v:
            if b not in ("parallel", "federated"):
                raise ValueError(f"unknown backend '{b}' in the sweep grid; use parallel or federated")
        if not v:
            raise ValueError("the sweep grid needs at least one backend")
        return v

    @model_validator(mode="after")
    def _levels(self) -> GridConfig:
        if self.epsilons is not None and self.noise_multipliers is not None:
            raise ValueError("give privacy levels as grid.epsilons or grid.noise_multipliers, not both")
        for e in self.epsilons or []:
            if not e > 0:
                raise ValueError(f"target epsilon must be > 0 (or inf for no DP), got {e}")
        for s in self.noise_multipliers or []:
            if s < 0:
                raise ValueError(f"noise multiplier must be >= 0, got {s}")
        return self

    @property
    def seed_list(self) -> list[int]:
        return list(range(self.seeds)) if isinstance(self.seeds, int) else list(self.seeds)


class AuditConfig(_Section):
    """Separate runs with audit canaries, so they do not swamp the comparison runs' corpus."""

    enabled: bool = False
    audit_canaries: int = Field(256, ge=2)
    backends: list[str] | None = None
    levels: Literal["all", "dp_only"] = "all"


class SweepProbeConfig(ProbeConfig):
    """The sweep's `probe:` section: a ProbeConfig; a legacy `extra: {...}` merges into it."""

    @model_validator(mode="before")
    @classmethod
    def _merge_extra(cls, data: Any) -> Any:
        if isinstance(data, dict) and "extra" in data:
            data = {**{k: v for k, v in data.items() if k != "extra"}, **(data["extra"] or {})}
        if isinstance(data, dict) and data.get("probes") is None:
            data = {k: v for k, v in data.items() if k != "probes"}
        return data


class SweepConfig(_Section):
    jobs: int = Field(1, ge=1, description="points trained and probed at once, each in its own "
                      "process with cpu_count // jobs threads")
    base: dict[str, Any] = Field(default_factory=dict)
    per_backend: dict[str, dict[str, Any]] = Field(default_factory=dict)
    grid: GridConfig = GridConfig()
    audit: AuditConfig = AuditConfig()
    probe: SweepProbeConfig = SweepProbeConfig()
    # ---- public pretraining (memaudit.sweep.pretrain, owned there): absent = from scratch
    pretrain: PretrainConfig | None = Field(
        None, description="train one public base model first; every point fine-tunes it")

    @field_validator("per_backend")
    @classmethod
    def _per_backend(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for b, overrides in v.items():
            if b not in ("parallel", "federated"):
                raise ValueError(f"unknown backend '{b}' in per_backend; use parallel or federated")
            if b == "federated":
                for key, val in overrides.items():
                    if key.startswith("train.goldfish") and val not in (False, None, {"enabled": False}):
                        raise ValueError(
                            "Goldfish loss is a centralized-only mitigation; remove "
                            f"per_backend.federated.{key} (use grid.goldfish for the parallel side)"
                        )
        return v


@dataclass(frozen=True)
class SweepPoint:
    name: str
    backend: str
    level: float | None  # epsilon or sigma; None = no DP
    level_kind: Literal["epsilon", "noise_multiplier"]
    seed: int
    goldfish: bool
    audit: bool
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def nominal_epsilon(self) -> float | None:
        if self.level is None:
            return math.inf
        return self.level if self.level_kind == "epsilon" else None


def _level_label(level: float | None, kind: str) -> str:
    if level is None:
        return "epsinf" if kind == "epsilon" else "sigma0"
    s = f"{level:g}".replace(".", "p")
    return f"eps{s}" if kind == "epsilon" else f"sigma{s}"


def plan_points(cfg: SweepConfig) -> list[SweepPoint]:
    grid = cfg.grid
    if grid.noise_multipliers is not None:
        kind = "noise_multiplier"
        levels = [None if s == 0 else s for s in grid.noise_multipliers]
    else:
        kind = "epsilon"
        levels = [None if math.isinf(e) else e for e in (grid.epsilons or [math.inf])]
    points = []

    def add(backend: str, level: float | None, seed: int, goldfish: bool, audit: bool) -> None:
        name = f"{backend}-{_level_label(level, kind)}{'-gf' if goldfish else ''}{'-audit' if audit else ''}-s{seed}"
        ov: dict[str, Any] = {"backend": backend, "train.seed": seed, "train.goldfish.enabled": goldfish}
        ov["privacy.target_epsilon"] = level if (kind == "epsilon") else None
        ov["privacy.noise_multiplier"] = level if (kind == "noise_multiplier") else None
        if audit:
            ov["data.audit_canaries"] = cfg.audit.audit_canaries
        points.append(SweepPoint(name, backend, level, kind, seed, goldfish, audit, ov))

    for backend in grid.backends:
        for level in levels:
            for seed in grid.seed_list:
                for gf in grid.goldfish if backend == "parallel" else [False]:
                    add(backend, level, seed, gf, False)
    if cfg.audit.enabled:
        for backend in cfg.audit.backends or grid.backends:
            for level in levels:
                if cfg.audit.levels == "dp_only" and level is None:
                    continue
                add(backend, level, grid.seed_list[0], False, True)
    return points


def point_config(cfg: SweepConfig, point: SweepPoint) -> Config:
    """The full run config of one grid point: base, then per-backend, then the point."""
    raw = _deep_copy(cfg.base)
    for key, value in cfg.per_backend.get(point.backend, {}).items():
        _set_dotted(raw, key, value)
    for key, value in point.overrides.items():
        _set_dotted(raw, key, value)
    return config_from_dict(raw, source=f"sweep point {point.name}")


def _deep_copy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deep_copy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deep_copy(v) for v in d]
    return d


def sweep_config_from_dict(raw: dict[str, Any], *, source: str = "sweep config") -> SweepConfig:
    try:
        cfg = SweepConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_error(e, source)) from None
    # Validate the base and every point's config up front: a bad grid fails before any training.
    points = plan_points(cfg)
    if not points:
        raise ConfigError(f"{source}: the sweep grid is empty (no backend x privacy level x seed); "
                          "give grid.backends and grid.epsilons or grid.noise_multipliers")
    for p in points:
        point_config(cfg, p)
    return cfg


def load_sweep_config(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> SweepConfig:
    raw = load_raw(path)
    base_file = raw.pop("base_config", None)
    if base_file is not None:
        if not isinstance(base_file, str):
            raise ConfigError(f"{path}: base_config must be the path of one run config (e.g. "
                              f"tiny.yaml), not a {type(base_file).__name__}")
        base_path = os.path.join(os.path.dirname(os.fspath(path)), base_file)
        raw["base"] = {**load_raw(base_path), **raw.get("base", {})}
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(raw, key, value)
    return sweep_config_from_dict(raw, source=str(path))


