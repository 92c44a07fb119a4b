"""The sweep grid: backends x model sizes x privacy levels x seeds (x Goldfish, centralized).

A sweep file holds a `base` run config (the same mapping as configs/tiny.yaml), optional
`per_backend` and `per_model` dotted overrides (clip norms and optimizers differ between
DP-SGD and DP-FedAvg; each model size has its own parallel grid), `per_backend_dp` for a
backend's DP points only (their clip and step sizes), the `grid`, the `regime`
(`multi-epoch`: the configured steps; `single-pass`: one epoch over the training documents,
steps derived from the data by `memaudit.sweep.regime`), the `audit` runs, the `probe`
settings and the `executor` the points run on (`memaudit.sweep.executors`).

Model sizes are compared at equal tokens seen: `per_model` may not change what a step
trains on (steps, batch, sequence length, the data), and every point records its
`tokens_seen`. Sizes must share one tokenizer (the same vocabulary, or one `data.tokenizer`).

References:
  Singh et al., "Democratizing AI: Open-source Scalable LLM Training on GPU-based
  Supercomputers", SC 2024 (AxoNN; its memorization-vs-model-size study).

>>> s = sweep_config_from_dict({"grid": {"backends": ["centralized"], "epsilons": ["inf", 4]}})
>>> [p.name for p in plan_points(s)]
['centralized-epsinf-s0', 'centralized-eps4-s0']
>>> s = sweep_config_from_dict({"grid": {"backends": ["centralized"], "models": ["tiny", "tiny2x"]}})
>>> [p.name for p in plan_points(s)]
['centralized-tiny-epsinf-s0', 'centralized-tiny2x-epsinf-s0']
"""

from __future__ import annotations

import fnmatch
import math
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from memaudit.backends import BACKENDS, CENTRALIZED, backend_name
from memaudit.config import (
    Config,
    ProbeConfig,
    config_from_dict,
    format_error,
    load_raw,
    parse_override,
    set_dotted,
    set_leaves,
)
from memaudit.errors import ConfigError
from memaudit.models.presets import get_preset


class PretrainConfig(BaseModel):
    """The sweep's `pretrain:` section (absent: every point trains from the preset's init)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int = Field(300, ge=1, description="optimizer steps of the public pretraining")
    users: int = Field(64, ge=2, description="authors of the synthetic public corpus")
    docs_per_user: int = Field(8, ge=1, description="public documents per author")
    seed: int = Field(1, description="seed of the synthetic public corpus")
    paragraph_sentences: int | None = Field(
        None, ge=0, description="sentences closing each public document; default: the private "
        "corpus's data.synth.paragraph_sentences")
    path: str | None = Field(None, description="a public corpus file or directory instead of the "
                             "synthetic one (data.path rules); checked against the private data")
    shared_language: bool = Field(
        True, description="the synthetic public corpus writes in the private users' language: "
        "their topics and vocabulary, kinds of message and formats, with its own authors, facts "
        "and values (memaudit.data.synth.synthesize_public); false: faker English only")
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="dotted overrides of the base's run config, e.g. "
        "train.lr: 3e-3 (applied after the sweep's base config)")
    per_model: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="dotted overrides of one size's base, after `overrides`, "
        "e.g. {125m: {train.steps: 380}}: public pretraining scaled to the size (tokens per parameter)")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GridConfig(_Section):
    backends: list[str] = Field(default_factory=lambda: list(BACKENDS))
    units: list[Literal["example", "user"]] | None = Field(
        None, description="the privacy unit of the centralized points (privacy.unit); federated "
        "points are always user-level. Default: the base config's unit")
    user_sampling: list[Literal["els", "uls"]] | None = Field(
        None, description="the centralized per-user DP algorithms (privacy.user_sampling) of the "
        "user-level points: els samples examples (at most k a user, each clipped), uls samples users "
        "(each user's gradient over at most k sequences clipped); needs user in grid.units. Absent: "
        "the base config's")
    epsilons: list[float] | None = Field(None, description="target epsilons; 'inf' = no DP")
    noise_multipliers: list[float] | None = Field(None, description="sigma values; 0 = no DP")
    seeds: int | list[int] = 1
    goldfish: list[bool] = Field(default_factory=lambda: [False], description="centralized only")
    finetune: list[Literal["full", "lora"]] | None = Field(
        None, description="what each point trains: full weights, or LoRA adapters with base.model.lora's "
        "settings (its defaults when the base has none); absent: the base config's choice")
    models: list[str] | None = Field(None, description="model-size axis: presets compared at equal "
                                     "tokens seen; absent: the base config's model")
    only: list[str] | None = Field(
        None, description="keep only the points whose names match one of these shell patterns, e.g. "
        "['*-epsinf-gf-*', '*-eps8-*'] (a mitigation at one setting); absent: every point")

    @field_validator("models")
    @classmethod
    def _models(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v

        if not v:
            raise ValueError("grid.models is empty; list presets such as [tiny, tiny2x] or drop it")
        for name in v:
            get_preset(name)  # one line naming the unknown preset and the known ones
        if len(set(v)) != len(v):
            raise ValueError(f"grid.models {v} names a preset twice; list each size once")
        return v

    @field_validator("backends", mode="before")
    @classmethod
    def _backend_alias(cls, v: Any) -> Any:
        return [backend_name(b) for b in v] if isinstance(v, list) else v  # `parallel`: the old name

    @field_validator("backends")
    @classmethod
    def _backends(cls, v: list[str]) -> list[str]:
        for b in v:
            if b not in BACKENDS:
                raise ValueError(f"unknown backend '{b}' in the sweep grid; use centralized or federated")
        if not v:
            raise ValueError("the sweep grid needs at least one backend")
        return v

    @field_validator("finetune")
    @classmethod
    def _finetune(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (not v or len(set(v)) != len(v)):
            raise ValueError(f"grid.finetune {v} must list full and/or lora once each")
        return v

    @model_validator(mode="after")
    def _units(self) -> GridConfig:
        if self.units is not None:
            if not self.units or len(set(self.units)) != len(self.units):
                raise ValueError(f"grid.units {self.units} must list example and/or user once each")
            if "federated" in self.backends and "user" not in self.units:
                raise ValueError("grid.units lacks user but the grid has the federated backend, which is "
                                 "always user-level; add user to grid.units or drop federated")
        if self.user_sampling is not None:
            if not self.user_sampling or len(set(self.user_sampling)) != len(self.user_sampling):
                raise ValueError(f"grid.user_sampling {self.user_sampling} must list els and/or uls once each")
            if "user" not in (self.units or []) or CENTRALIZED not in self.backends:
                raise ValueError("grid.user_sampling chooses the centralized per-user DP algorithm; it needs "
                                 "centralized in grid.backends and user in grid.units (add them, or drop "
                                 "grid.user_sampling)")
        return self

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
    levels: Literal["all", "dp_only"] | list[float] = Field(
        "all", description="privacy levels that get an audit run: all, dp_only, or a list of the "
        "grid's levels, e.g. [inf, 2]")

    @field_validator("backends", mode="before")
    @classmethod
    def _backend_alias(cls, v: Any) -> Any:
        return [backend_name(b) for b in v] if isinstance(v, list) else v  # `parallel`: the old name


class MatchUtilityConfig(_Section):
    """Matched-utility points (`memaudit.sweep.match`): one run of the other backend at the
    noise multiplier interpolated to meet each target run's holdout perplexity."""

    enabled: bool = False
    target_backend: Literal["centralized", "federated"] = Field(
        "federated", description="whose DP runs are the targets; the other backend gets the points")

    @field_validator("target_backend", mode="before")
    @classmethod
    def _backend_alias(cls, v: Any) -> Any:
        return backend_name(v)  # `parallel`: the old name
    levels: list[float] | None = Field(None, description="the target backend's grid epsilons to "
                                       "match; default: every finite grid epsilon (a level the "
                                       "grid lacks, e.g. after --epsilons, is skipped and said)")
    tolerance: float = Field(0.1, gt=0, description="|log perplexity ratio| under which a target "
                             "already has a match (the report's default --utility-tolerance)")
    max_factor: float = Field(4.0, gt=1, description="how far beyond the measured noise "
                              "multipliers an extrapolated one may lie (a factor)")

    @field_validator("levels")
    @classmethod
    def _levels(cls, v: list[float] | None) -> list[float] | None:
        for e in v or []:
            if not (e > 0 and math.isfinite(e)):
                raise ValueError(f"match_utility.levels has {e}; list finite target epsilons > 0, e.g. [32]")
        return v


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


EXECUTORS = ("processes", "slurm", "local", "debug")
# Control characters (newline, carriage return, NUL, ...): refused in the executor's strings,
# which submitit writes into the sbatch script as `#SBATCH --key=value` lines.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class ExecutorConfig(_Section):
    """Where the points run: `processes` (worker processes, `jobs` at once, the default), or one
    scheduler job per point through submitit (`slurm`; `local` runs the same jobs with
    submitit's local executor on this machine and `debug` in this process, for trying a study
    file before a cluster). A parallel point (world size > 1)
    is one multi-task job, one task per rank, over `ceil(world / gpus_per_node)` nodes."""

    kind: Literal["processes", "slurm", "local", "debug"] = Field(
        "processes", description="processes | slurm | local | debug (CLI: --executor)")
    folder: str | None = Field(None, description="submitit's job files and logs; default SWEEP_DIR/jobs")
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    nodes: int | None = Field(None, ge=1, description="nodes per parallel point; default: "
                              "ceil(world size / gpus_per_node)")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node (0: CPU jobs)")
    cpus_per_task: int | None = Field(None, ge=1, description="CPU cores per task (rank)")
    mem_gb: float | None = Field(None, gt=0)
    timeout_min: int = Field(60, ge=1, description="wall-clock limit of one point's job")
    max_parallel: int | None = Field(None, ge=1, description="jobs in flight at once (slurm: the "
                                     "whole grid; local: the sweep's jobs)")
    setup: list[str] = Field(default_factory=list, description="shell lines run before each job "
                             "(e.g. module load, source venv/bin/activate)")
    slurm_additional: dict[str, Any] = Field(default_factory=dict, description="other sbatch "
                                             "options, e.g. {exclusive: true}")

    @field_validator("partition", "account", "qos", "constraint", "folder")
    @classmethod
    def _one_line_value(cls, v: str | None) -> str | None:
        if v is not None and _CONTROL.search(v):
            raise ValueError("holds a control character (a newline would become a line of the "
                             "sbatch script); give it on one line, without control characters")
        return v

    @field_validator("slurm_additional")
    @classmethod
    def _one_line_options(cls, v: dict[str, Any]) -> dict[str, Any]:
        for key, value in v.items():
            if any(_CONTROL.search(t) for t in _strings((key, value))):
                raise ValueError(f"option '{_CONTROL.sub('?', str(key))}' holds a control character "
                                 "(a newline would become a line of the sbatch script); give each "
                                 "option on one line, without control characters")
        return v


def _strings(v: Any) -> list[str]:
    """Every string inside `v` (keys and values of nested mappings and lists)."""
    if isinstance(v, dict):
        return [t for k, x in v.items() for t in (*_strings(k), *_strings(x))]
    if isinstance(v, list | tuple):
        return [t for x in v for t in _strings(x)]
    return [v] if isinstance(v, str) else []


REGIMES = ("multi-epoch", "single-pass")
# What a step trains on: per_model may not change it, so sizes compare at equal tokens seen.
TOKEN_KEYS = ("train.steps", "train.batch_size", "data", "federated.rounds", "federated.cohort",
              "federated.local_steps", "federated.local_batch_size", "federated.sampling")


class SweepConfig(_Section):
    jobs: int = Field(1, ge=1, description="points trained and probed at once, each in its own "
                      "process with cpu_count // jobs threads")
    base: dict[str, Any] = Field(default_factory=dict)
    per_backend: dict[str, dict[str, Any]] = Field(default_factory=dict)
    per_backend_dp: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="dotted overrides per backend for its DP points only "
        "(a finite epsilon or a noise multiplier > 0), after per_backend: DP's own step sizes and "
        "clip norms (a noisy average wants a clip near the updates' norm and a smaller server "
        "step); never what a step trains on, so DP and non-DP points compare at equal tokens")
    per_model: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="dotted overrides per model size (its parallel grid, "
        "micro batch, lr); never what a step trains on")
    per_finetune: dict[Literal["full", "lora"], dict[str, Any]] = Field(
        default_factory=dict, description="dotted overrides per grid.finetune mode (LoRA's larger "
        "learning rates, Yu et al. 2022); never what a step trains on, nor the model")
    grid: GridConfig = GridConfig()
    regime: Literal["multi-epoch", "single-pass"] = Field(
        "multi-epoch", description="single-pass: one epoch over the training documents (steps "
        "derived from the data; federated: every user's data once)")
    audit: AuditConfig = AuditConfig()
    match_utility: MatchUtilityConfig = MatchUtilityConfig()
    probe: SweepProbeConfig = SweepProbeConfig()
    executor: ExecutorConfig = ExecutorConfig()
    select: list[str] | None = Field(
        None, description="this invocation's part of the grid: shell patterns over point names "
        "(CLI --only), applied after grid.only; the grid's first size still trains the tokenizer")
    # ---- public pretraining (memaudit.sweep.pretrain, owned there): absent = from scratch
    pretrain: PretrainConfig | None = Field(
        None, description="train one public base model first; every point fine-tunes it")

    @field_validator("per_backend", mode="before")
    @classmethod
    def _per_backend_alias(cls, v: Any) -> Any:
        return {backend_name(b): o for b, o in v.items()} if isinstance(v, dict) else v  # `parallel`

    @field_validator("per_backend")
    @classmethod
    def _per_backend(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        return _backend_overrides("per_backend", v)

    @model_validator(mode="after")
    def _audit_levels(self) -> SweepConfig:
        levels = self.audit.levels
        if isinstance(levels, list) and self.audit.enabled:
            grid = self.grid.noise_multipliers if self.grid.noise_multipliers is not None else (
                self.grid.epsilons or [math.inf])
            missing = [v for v in levels if float(v) not in [float(g) for g in grid]]
            if missing:
                raise ValueError(f"audit.levels has {missing[0]:g}, which is not a grid level; use "
                                 f"levels from {[float(g) for g in grid]}, all or dp_only")
        return self

    @field_validator("per_backend_dp", mode="before")
    @classmethod
    def _per_backend_dp_alias(cls, v: Any) -> Any:
        return {backend_name(b): o for b, o in v.items()} if isinstance(v, dict) else v

    @field_validator("per_backend_dp")
    @classmethod
    def _per_backend_dp(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        _backend_overrides("per_backend_dp", v)
        _same_tokens("per_backend_dp", v, "a DP point fine-tunes the model its non-DP points do",
                     "DP and non-DP points")
        for b, overrides in v.items():
            for key in overrides:
                if key == "privacy.target_epsilon" or key == "privacy.noise_multiplier":
                    raise ValueError(f"per_backend_dp.{b}.{key}: the grid's levels set it; remove the key")
        return v

    @field_validator("per_model")
    @classmethod
    def _per_model(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        _same_tokens("per_model", v, "the size axis sets the model", "sizes")
        return v

    @field_validator("per_finetune")
    @classmethod
    def _per_finetune(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        _same_tokens("per_finetune", v, "grid.finetune and base.model.lora set the model", "full and LoRA")
        return v

    @model_validator(mode="after")
    def _finetune_axis(self) -> SweepConfig:
        unused = sorted(set(self.per_finetune) - set(self.grid.finetune or []))
        if unused:
            raise ValueError(f"per_finetune.{unused[0]} names a mode that is not in grid.finetune "
                             f"({self.grid.finetune}); add it to grid.finetune or remove it")
        return self


def _backend_overrides(section: str, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Overrides per backend name a backend, and give the federated side no Goldfish loss."""
    for b, overrides in v.items():
        if b not in BACKENDS:
            raise ValueError(f"unknown backend '{b}' in {section}; use centralized or federated")
        if b == "federated":
            for key, val in overrides.items():
                if key.startswith("train.goldfish") and val not in (False, None, {"enabled": False}):
                    raise ValueError(
                        "Goldfish loss is a centralized-only mitigation; remove "
                        f"{section}.federated.{key} (use grid.goldfish for the centralized side)"
                    )
    return v


def _same_tokens(section: str, v: dict[str, dict[str, Any]], model_owner: str, what: str) -> None:
    """Overrides per value of an axis may tune (lr, grid) but not change the model or what a
    step trains on: the axis' values compare at equal tokens seen."""
    for name, overrides in v.items():
        for key in overrides:
            if key == "model" or key.startswith("model."):
                raise ValueError(f"{section}.{name}.{key}: {model_owner}; remove the key")
            if any(key == t or key.startswith(t + ".") for t in TOKEN_KEYS):
                raise ValueError(f"{section}.{name}.{key} changes what a step trains on, so "
                                 f"{what} would not compare at equal tokens seen; set it in base")


def _check_sizes(cfg: SweepConfig) -> None:
    """The size axis: per_model names only listed sizes, the sizes share one tokenizer."""
    models = cfg.grid.models
    unused = [f"per_model.{m}" for m in sorted(set(cfg.per_model) - set(models or []))]
    if cfg.pretrain is not None:
        unused += [f"pretrain.per_model.{m}" for m in sorted(set(cfg.pretrain.per_model) - set(models or []))]
    if unused:
        raise ValueError(f"{unused[0]} names a size that is not in grid.models "
                         f"({models}); add it to grid.models or remove it")
    if models is None:
        return
    base_model = cfg.base.get("model") or {}
    if isinstance(base_model, dict) and base_model.get("name_or_path") is not None:
        raise ValueError("grid.models sets model.preset for each point; remove "
                         "base.model.name_or_path or drop grid.models")

    vocab = {m: get_preset(m).vocab_size for m in models}
    data = cfg.base.get("data") or {}
    shared_tokenizer = isinstance(data, dict) and data.get("tokenizer") is not None
    # with public pretraining the first size's base trains the tokenizer every size reads
    # (memaudit.sweep.pretrain.pretrain_bases): its ids fit a larger vocabulary's embeddings
    first_smallest = cfg.pretrain is not None and vocab[models[0]] == min(vocab.values())
    if len(set(vocab.values())) > 1 and not (shared_tokenizer or first_smallest):
        listed = ", ".join(f"{m}: {n}" for m, n in vocab.items())
        raise ValueError(f"grid.models have different vocabularies ({listed}), so each size "
                         "would train its own tokenizer and their numbers would not compare; "
                         "choose sizes with one vocabulary (e.g. tiny, tiny2x), set "
                         "base.data.tokenizer to one shared tokenizer, or pretrain public bases "
                         "with the smallest vocabulary's size first in grid.models")


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
    model: str | None = None  # the size axis' preset; None: the base config's model
    tokens_seen: int | None = None  # training tokens the schedule feeds (padding included)
    matches: str | None = None  # a matched-utility point: the target run it was placed to meet
    unit: str | None = None  # grid.units' privacy unit of a centralized point (None: the base's)
    finetune: str | None = None  # grid.finetune's full | lora (None: the base config's choice)
    user_sampling: str | None = None  # grid.user_sampling's els | uls (None: the base config's)

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


def _audited(levels: str | list[float], level: float | None, kind: str) -> bool:
    """Whether grid level ``level`` (None: no DP) gets an audit run under ``audit.levels``."""
    if levels == "all":
        return True
    if levels == "dp_only":
        return level is not None
    none = math.inf if kind == "epsilon" else 0.0
    return (none if level is None else level) in [float(v) for v in levels]


def point_name(backend: str, model: str | None, level: float | None, kind: str, seed: int, *,
               goldfish: bool = False, audit: bool = False, unit: str | None = None,
               finetune: str | None = None, user_sampling: str | None = None) -> str:
    """A point's run directory name: centralized-eps8-s0, centralized-eps8-user-s0,
    centralized-eps8-user-els-s0, federated-tiny2x-epsinf-audit-s1, centralized-eps8-lora-s0, ..."""
    size = f"-{model}" if model is not None else ""
    return (f"{backend}{size}-{_level_label(level, kind)}{'-user' if unit == 'user' else ''}"
            f"{'-' + user_sampling if user_sampling else ''}"
            f"{'-lora' if finetune == 'lora' else ''}{'-gf' if goldfish else ''}{'-audit' if audit else ''}"
            f"-s{seed}")


def plan_points(cfg: SweepConfig) -> list[SweepPoint]:
    grid = cfg.grid
    if grid.noise_multipliers is not None:
        kind = "noise_multiplier"
        levels = [None if s == 0 else s for s in grid.noise_multipliers]
    else:
        kind = "epsilon"
        levels = [None if math.isinf(e) else e for e in (grid.epsilons or [math.inf])]
    points = []

    base_lora = (cfg.base.get("model") or {}).get("lora") or {}

    def add(backend: str, model: str | None, level: float | None, seed: int, goldfish: bool,
            audit: bool, unit: str | None = None, finetune: str | None = None,
            user_sampling: str | None = None) -> None:
        name = point_name(backend, model, level, kind, seed, goldfish=goldfish, audit=audit, unit=unit,
                          finetune=finetune, user_sampling=user_sampling)
        ov: dict[str, Any] = {"backend": backend, "train.seed": seed, "train.goldfish.enabled": goldfish}
        if finetune is not None:
            ov["model.lora"] = deep_copy(base_lora) if finetune == "lora" else None
        if unit is not None:
            ov["privacy.unit"] = unit
        if user_sampling is not None:
            ov["privacy.user_sampling"] = user_sampling
        if model is not None:
            ov["model.preset"] = model
        ov["privacy.target_epsilon"] = level if (kind == "epsilon") else None
        ov["privacy.noise_multiplier"] = level if (kind == "noise_multiplier") else None
        if audit:
            ov["data.audit_canaries"] = cfg.audit.audit_canaries
        points.append(SweepPoint(name, backend, level, kind, seed, goldfish, audit, ov, model, unit=unit,
                                 finetune=finetune, user_sampling=user_sampling))

    models: list[str | None] = list(grid.models) if grid.models is not None else [None]
    for backend in grid.backends:
        # federated is always user-level: grid.units sets the centralized points' unit only
        units: list[str | None] = list(grid.units) if grid.units and backend == CENTRALIZED else [None]
        for model in models:
            for level in levels:
                for seed in grid.seed_list:
                    for gf in grid.goldfish if backend == CENTRALIZED else [False]:
                        for unit in units if level is not None else units[:1]:
                            # the per-user algorithms differ only under DP: no sampling axis without it
                            samplings: list[str | None] = (list(grid.user_sampling) if grid.user_sampling
                                                           and unit == "user" and level is not None else [None])
                            for ft in grid.finetune or [None]:
                                for smp in samplings:
                                    add(backend, model, level, seed, gf, False, unit, ft, smp)
    if cfg.audit.enabled:
        for backend in cfg.audit.backends or grid.backends:
            for model in models:
                for level in levels:
                    if not _audited(cfg.audit.levels, level, kind):
                        continue
                    add(backend, model, level, grid.seed_list[0], False, True)
    points = [p for p in points if _selected(grid.only, p.name) and _selected(cfg.select, p.name)]
    return [replace(p, tokens_seen=tokens_seen(point_config(cfg, p))) for p in points]


def _selected(patterns: list[str] | None, name: str) -> bool:
    """Whether point `name` matches one of `patterns` (None: every point does).

    >>> _selected(["*-epsinf-gf-*"], "centralized-125m-epsinf-gf-s0"), _selected(["*-eps8-*"], "federated-epsinf-s0")
    (True, False)
    """
    return patterns is None or any(fnmatch.fnmatchcase(name, p) for p in patterns)


def tokens_seen(run_cfg: Config) -> int:
    """Token positions the schedule feeds (padding included; expected values under Poisson
    sampling): steps x batch x seq_len centralized, rounds x cohort x local steps x local
    batch x seq_len federated."""
    L = run_cfg.data.seq_len
    if run_cfg.backend == "federated":
        f = run_cfg.federated
        return f.rounds * f.cohort * f.local_steps * f.local_batch_size * L
    return run_cfg.train.steps * run_cfg.train.batch_size * L


def point_config(cfg: SweepConfig, point: SweepPoint) -> Config:
    """The full run config of one grid point: base, per-backend (and per_backend_dp for a DP
    point), per-model, per-finetune, then the point."""
    raw = deep_copy(cfg.base)
    for key, value in cfg.per_backend.get(point.backend, {}).items():
        set_leaves(raw, key, value)
    if point.level is not None:  # a DP point (the grid's no-DP level is None)
        for key, value in cfg.per_backend_dp.get(point.backend, {}).items():
            set_leaves(raw, key, value)
    if point.model is not None:
        for key, value in cfg.per_model.get(point.model, {}).items():
            set_leaves(raw, key, value)
    if point.finetune is not None:
        for key, value in cfg.per_finetune.get(point.finetune, {}).items():
            set_leaves(raw, key, value)
    for key, value in point.overrides.items():
        set_dotted(raw, key, value)
    return config_from_dict(raw, source=f"sweep point {point.name}")


def deep_copy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: deep_copy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [deep_copy(v) for v in d]
    return d


def sweep_config_from_dict(raw: dict[str, Any], *, source: str = "sweep config") -> SweepConfig:
    try:
        cfg = SweepConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_error(e, source)) from None
    try:
        _check_sizes(cfg)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
    # Validate the base and every point's config up front: a bad grid fails before any training.
    points = plan_points(cfg)
    if not points:
        if cfg.grid.only is not None or cfg.select is not None:
            raise ConfigError(f"{source}: no point of the grid matches grid.only {cfg.grid.only} and "
                              f"--only {cfg.select}; list the points with --dry-run and match their names")
        raise ConfigError(f"{source}: the sweep grid is empty (no backend x privacy level x seed); "
                          "give grid.backends and grid.epsilons or grid.noise_multipliers")
    if cfg.executor.kind != "processes":
        for p in points:  # the ranks of every point fit its job
            try:
                job_resources(cfg.executor, point_config(cfg, p))
            except ConfigError as e:
                raise ConfigError(f"{source}: point {p.name}: {e}") from None
    return cfg


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`, section by section (a sweep's base.train.steps keeps the rest
    of the base file's train section)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_sweep_config(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> SweepConfig:
    raw = load_raw(path)
    base_file = raw.pop("base_config", None)
    if base_file is not None:
        if not isinstance(base_file, str):
            raise ConfigError(f"{path}: base_config must be the path of one run config (e.g. "
                              f"tiny.yaml), not a {type(base_file).__name__}")
        base_path = os.path.join(os.path.dirname(os.fspath(path)), base_file)
        raw["base"] = _merge(load_raw(base_path), raw.get("base") or {})
    for item in overrides:
        _set_override(raw, *parse_override(item))
    return sweep_config_from_dict(raw, source=str(path))


# The sweep's maps of dotted run-config keys, and how many names (a backend, a size) lead to them
_DOTTED_MAPS = (("per_backend",), 1), (("per_backend_dp",), 1), (("per_model",), 1), (("per_finetune",), 1), \
    (("pretrain", "overrides"), 0), (("pretrain", "per_model"), 1)


def _set_override(raw: dict[str, Any], key: str, value: Any) -> None:
    """One `--set key=value` on the sweep file: inside a map of dotted run-config keys
    (`per_backend.federated.federated.server_optimizer`) it sets that map's key
    (`federated.server_optimizer`), which the point then applies as the file's own keys are;
    elsewhere it sets the sweep file's key."""
    parts = key.split(".")
    for head, names in _DOTTED_MAPS:
        n = len(head) + names
        if tuple(parts[:len(head)]) == head and len(parts) > n:
            node = raw
            for p in parts[:n]:
                if node.get(p) is None:  # absent, or empty in the file
                    node[p] = {}
                if not isinstance(node[p], dict):
                    raise ConfigError(f"override '{key}': '{p}' is not a section")
                node = node[p]
            node[".".join(parts[n:])] = value
            return
    set_dotted(raw, key, value)


# ----------------------------------------------------------------------------- job resources
@dataclass(frozen=True)
class JobResources:
    """What one point's job asks the scheduler for."""

    nodes: int
    tasks_per_node: int
    gpus_per_node: int
    cpus_per_task: int | None

    @property
    def tasks(self) -> int:
        return self.nodes * self.tasks_per_node


def job_resources(ex: ExecutorConfig, run_cfg: Config) -> JobResources:
    """One task per rank: the point's world size (1 for federated and one-process points),
    spread over `ex.nodes` or ceil(world / gpus_per_node) nodes. One-line ConfigError when
    the ranks do not split evenly over the nodes or exceed a node's GPUs."""
    world = run_cfg.parallel.world_size if run_cfg.backend == CENTRALIZED else 1
    if world == 1:
        nodes = 1
    elif ex.nodes is not None:
        nodes = ex.nodes
    else:
        nodes = math.ceil(world / ex.gpus_per_node) if ex.gpus_per_node else 1
    if world % nodes:
        raise ConfigError(f"executor.nodes={nodes} does not divide the {world} ranks of the point's "
                          "parallel grid; choose nodes dividing the grid's world size")
    per_node = world // nodes
    if ex.gpus_per_node and per_node > ex.gpus_per_node:
        raise ConfigError(f"{per_node} ranks per node exceed executor.gpus_per_node="
                          f"{ex.gpus_per_node}; raise executor.nodes to {math.ceil(world / ex.gpus_per_node)}")
    if ex.kind == "local" and nodes > 1:
        raise ConfigError(f"executor.kind=local runs on one node, but the point asks for "
                          f"{nodes}; set executor.nodes=1 or use executor.kind=slurm")
    if ex.kind == "debug" and world > 1:
        raise ConfigError("executor.kind=debug runs one task in this process; use "
                          "local for a parallel point (world size > 1)")
    return JobResources(nodes, per_node, ex.gpus_per_node, ex.cpus_per_task)
