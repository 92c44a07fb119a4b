"""The backend switch, above the backends: federated (JAX), a multi-process parallel grid, or
one torch process. `check_before_disk` validates what can be validated without the data, so a
bad config is refused before the run lifecycle writes or replaces anything."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memaudit.errors import ConfigError


def check_before_disk(cfg: Any) -> None:
    """One-line errors for a config that cannot train, raised before anything is written.

    Covers the starting checkpoint (`model.init_from`: a Llama model directory with a
    tokenizer that the config does not contradict), the data sources (files that do not exist
    or cannot be read), the parallel grid against the model, and the federated mesh against
    the visible devices.
    """
    from memaudit.data.corpus import check_file, resolve_files
    from memaudit.models.init import check_init_from

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
    if cfg.backend == "federated":
        _check_federated(cfg, shape)
    elif cfg.parallel.world_size > 1:
        from memaudit.models.init import model_shape
        from memaudit.parallel.dims import ParallelDims

        ParallelDims.from_config(cfg.parallel).check_model(shape or model_shape(cfg.model))


def check_data(cfg: Any, prepared: Any, vocab_size: int) -> None:
    """One-line errors for prepared data the configured training cannot use (checked before
    the run directory changes: the data is prepared in a staging folder first)."""
    from memaudit.errors import DataError

    tok_size = int(prepared.meta.get("tokenizer_size", 0))
    if tok_size > vocab_size:
        raise DataError(f"the tokenizer has {tok_size} tokens but the model vocabulary only "
                        f"{vocab_size}; use a smaller tokenizer or a larger model.preset")
    n = len(prepared.train)
    if n == 0:
        raise DataError("no training sequences after the split; add documents or users")
    if cfg.backend == "federated":
        import numpy as np

        from memaudit.federated.trainer import check_population

        check_population(cfg, len(np.unique(np.asarray(prepared.train.user_index))))
    elif cfg.privacy.enabled and cfg.train.batch_size > n:
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} exceeds the {n} training "
                          "sequences; lower train.batch_size for DP-SGD")


def _check_federated(cfg: Any, shape: Any) -> None:
    f = cfg.federated
    if f.algorithm == "fedsgd" and (cfg.privacy.enabled or cfg.privacy.secure_aggregation.enabled):
        raise ConfigError("federated.algorithm=fedsgd has no DP or secure aggregation; use "
                          "federated.algorithm=fedavg (e.g. with local_steps=1)")
    from memaudit.federated.trainer import build_mesh

    # devices, and the model axis dividing the heads of the preset or the checkpoint
    build_mesh(f.mesh_clients, f.mesh_model, shape if shape is not None else cfg.model.preset)


def dispatch(cfg: Any, run: Any, *, resume: bool, progress: Any = None, overwrite: bool = False) -> dict[str, Any]:
    """Train `cfg` into `run` with the backend it names; returns the trainer's result summary."""
    check_before_disk(cfg)
    if cfg.backend == "federated":
        from memaudit.federated.trainer import train_federated as fn
    elif cfg.parallel.world_size > 1:
        # The data x tensor-parallel backend starts its own processes (torch.distributed).
        from memaudit.parallel.launch import launch_training as fn
    else:
        from memaudit.train.trainer import train_centralized as fn
    return fn(cfg, run, resume=resume, progress=progress, overwrite=overwrite)
