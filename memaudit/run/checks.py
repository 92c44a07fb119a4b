"""The checks made before anything is written: a config that cannot train, and prepared data
the configured training cannot use, are refused with one line before the run lifecycle
(`memaudit.run.lifecycle`) writes or replaces anything.

This module sits below the lifecycle and imports no trainer: the lifecycle runs `check_data`
on the data it stages, the backend switch (`memaudit.run.dispatch`) runs `check_before_disk`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

from memaudit.data.corpus import check_file, resolve_files
from memaudit.errors import ConfigError, DataError, MemauditError
from memaudit.models.init import check_init_from, model_shape
from memaudit.models.lora import check_lora, check_lora_grid
from memaudit.models.presets import shape_param_count
from memaudit.parallel.dims import ParallelDims


def check_before_disk(cfg: Any) -> None:
    """One-line errors for a config that cannot train, raised before anything is written.

    Covers the starting checkpoint (`model.init_from`: a Llama model directory with a
    tokenizer that the config does not contradict), the data sources (files that do not exist
    or cannot be read), the parallel grid against the model, and the federated mesh against
    the visible devices.
    """
    shape = check_init_from(cfg)  # None without model.init_from
    d = cfg.data
    if d.path is not None:
        files = resolve_files(d.path) or []
        if files and not any(check_file(f, allow_empty=True) for f in files):
            check_file(files[0])  # all empty: the one-line "is empty" error
    for key in ("tokenizer", "tokenizer_corpus"):
        value = getattr(d, key)
        if value is not None and not Path(value).expanduser().exists():
            raise ConfigError(f"data.{key}='{value}' does not exist; give an existing path or drop it")
    check_lora(cfg.model.lora, shape or model_shape(cfg.model))
    lora = cfg.model.lora
    if cfg.backend != "federated" and cfg.parallel.world_size > 1:
        check_lora_grid(lora, shape or model_shape(cfg.model), x=cfg.parallel.x, y=cfg.parallel.y)
    if lora is not None and cfg.backend == "federated" and cfg.federated.runtime == "flower":
        check_flower_lora(shape or model_shape(cfg.model))
    if cfg.backend == "federated":
        _check_federated(cfg, shape)
    elif centralized_engine(cfg) == "jax":
        check_jax_engine(cfg, shape or model_shape(cfg.model))
    elif cfg.train.clipping != "auto":
        raise ConfigError(f"train.clipping={cfg.train.clipping} chooses the jax engine's DP-SGD clipping; set "
                          "train.engine=jax or drop train.clipping")
    elif cfg.train.mesh_model != 1:
        raise ConfigError(f"train.mesh_model={cfg.train.mesh_model} is the jax engine's model axis; set "
                          "train.engine=jax, or use parallel.x/y/z for the torch grid")
    elif cfg.parallel.world_size > 1:
        ParallelDims.from_config(cfg.parallel).check_model(shape or model_shape(cfg.model))


def centralized_engine(cfg: Any) -> str:
    """`train.engine` resolved: torch or jax; auto is jax where a TPU runtime (libtpu) is
    installed and the config asks for no torch grid, else torch (found without importing jax)."""
    engine = cfg.train.engine
    if engine != "auto":
        return engine
    tpu = importlib.util.find_spec("libtpu") is not None
    return "jax" if tpu and cfg.parallel.world_size == 1 else "torch"


# the torch grid's settings, which the jax engine refuses when a config sets them
_GRID_ONLY = ("dist_backend", "overlap", "overlap_reduce_scatter", "overlap_all_gather",
              "bucket_data_sync", "bucket_mb")


def check_jax_engine(cfg: Any, shape: Any) -> None:
    """One line for an option the jax engine does not support (the torch grid's degrees and
    overlap flags, a torch device, activation checkpointing, ghost clipping with LoRA's dropout), and for
    a model axis that does not divide the model's heads."""
    par, t = cfg.parallel, cfg.train
    if t.clipping == "ghost" and cfg.model.lora is not None and cfg.model.lora.dropout > 0:
        raise ConfigError("train.clipping=ghost does not cover LoRA's adapter dropout (model.lora.dropout="
                          f"{cfg.model.lora.dropout}); set train.clipping=vmap or auto, or model.lora.dropout=0")
    for axis in ("data", "x", "y", "z"):
        if getattr(par, axis) > 1:
            raise ConfigError(f"parallel.{axis}={getattr(par, axis)} is the torch grid's; the jax engine shards "
                              "over its own mesh (train.mesh_model; the data axis is the other devices): "
                              f"set parallel.{axis}=1 or train.engine=torch")
    for name in _GRID_ONLY:
        if name in par.model_fields_set:
            raise ConfigError(f"parallel.{name} is an option of the torch grid, not of the jax engine; drop "
                              "it or set train.engine=torch")
    if t.device != "auto":
        raise ConfigError(f"train.device={t.device} picks a torch device; the jax engine runs on JAX's "
                          "default backend: drop train.device or set train.engine=torch")
    if t.activation_checkpointing:
        raise ConfigError("train.activation_checkpointing is not supported by the jax engine; drop it or "
                          "set train.engine=torch")
    if t.mesh_model > 1:
        # lazy: jax and flax (~2.5 s), only for a jax-engine config with a model axis
        from memaudit.models.flax_llama import check_model_axis

        try:
            check_model_axis(shape, t.mesh_model)
        except ValueError as e:
            raise ConfigError(str(e).replace("federated.mesh_model", "train.mesh_model")) from None


def check_data(cfg: Any, prepared: Any, vocab_size: int) -> None:
    """One-line errors for prepared data the configured training cannot use (checked before
    the run directory changes: the data is prepared in a staging folder first)."""
    tok_size = int(prepared.meta.get("tokenizer_size", 0))
    if tok_size > vocab_size:
        raise DataError(f"the tokenizer has {tok_size} tokens but the model vocabulary only "
                        f"{vocab_size}; use a smaller tokenizer or a larger model.preset")
    n = len(prepared.train)
    if n == 0:
        raise DataError("no training sequences after the split; add documents or users")
    if cfg.backend != "federated" and cfg.privacy.enabled and cfg.privacy.unit == "user" and all(
            str(u).startswith("pseudo-") for u in prepared.train.users):
        raise DataError(f"privacy.unit=user but the data has no user id (no '{cfg.data.user_field}' field: "
                        "every document got a pseudo-user); set data.user_field or use privacy.unit=example")
    if cfg.backend == "federated":
        check_population(cfg, len(np.unique(np.asarray(prepared.train.user_index))))
    elif cfg.privacy.enabled and cfg.train.batch_size > n:
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} exceeds the {n} training "
                          "sequences; lower train.batch_size for DP-SGD")


def check_population(cfg: Any, population: int) -> None:
    """One-line errors for a cohort the data cannot supply."""
    f = cfg.federated
    if population < 2:
        raise MemauditError(
            f"the training data has {population} user(s) with sequences; federated training needs at "
            "least 2 clients: add users (data.synth.users) or lower data.heldout_users")
    if f.cohort > population:
        raise MemauditError(
            f"federated.cohort={f.cohort} is larger than the population of {population} training "
            f"users; set federated.cohort <= {population} or add users")
    if f.local_steps < 1:
        raise MemauditError(f"federated.local_steps={f.local_steps} must be >= 1")



def check_expected_survivors(cfg: Any) -> None:
    """One-line error for secure aggregation whose expected survivors per round, federated.cohort
    x (1 - privacy.secure_aggregation.dropout), are fewer than its min_survivors: most rounds
    would abort and release nothing."""
    p, sa, f = cfg.privacy, cfg.privacy.secure_aggregation, cfg.federated
    if not (sa.enabled or (p.enabled and p.mechanism == "distributed")):
        return
    expected = f.cohort * (1.0 - sa.dropout)
    if expected < sa.min_survivors:
        raise ConfigError(
            f"secure aggregation expects {expected:g} survivors per round (federated.cohort={f.cohort} x "
            f"(1 - privacy.secure_aggregation.dropout={sa.dropout:g})), fewer than min_survivors="
            f"{sa.min_survivors}: rounds would abort; lower the dropout or raise federated.cohort")


def _check_federated(cfg: Any, shape: Any) -> None:
    f = cfg.federated
    if f.algorithm == "fedsgd" and (cfg.privacy.enabled or cfg.privacy.secure_aggregation.enabled):
        raise ConfigError("federated.algorithm=fedsgd has no DP or secure aggregation; use "
                          "federated.algorithm=fedavg (e.g. with local_steps=1)")
    check_expected_survivors(cfg)
    # devices, and the model axis dividing the heads of the preset or the checkpoint. The
    # lazy: the memaudit.federated package imports jax (~2 s): only a federated config pays it
    from memaudit.federated.mesh import build_mesh

    build_mesh(f.mesh_clients, f.mesh_model, shape if shape is not None else cfg.model.preset)


FLOWER_MESSAGE_BYTES = 2**31 - 1  # a Flower message (gRPC) and a serialised jax.export module


def check_flower_lora(shape: Any) -> None:
    """LoRA on Flower sends the frozen base inside each client stage's exported module (so the
    node's manifest pins the base the server trains on); refused where that base cannot fit in one
    Flower message."""
    base = 4 * shape_param_count(shape)  # float32
    if base >= FLOWER_MESSAGE_BYTES:
        raise ConfigError(f"model.lora on federated.runtime=flower sends the frozen base inside each client "
                          f"stage ({base / 2**30:.1f} GiB in float32), over the 2 GiB one Flower message "
                          "holds; use federated.runtime=jax or a smaller model")
