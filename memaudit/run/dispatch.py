"""The backend switch, above the backends: federated (JAX in this process, or submitted to a
Flower federation), the centralized backend's JAX engine (`train.engine`), a multi-process
centralized grid, or one torch process. `memaudit.run.checks.check_before_disk` validates what can be validated
without the data first, so a bad config is refused before the run lifecycle writes or replaces
anything. Each backend trains through the one driver, `memaudit.run.driver.fit`.

The trainers are imported when chosen: each pulls in its framework (torch, or jax and flax),
seconds of import that the other backend's runs and `memaudit --help` must not pay.
"""

from __future__ import annotations

from typing import Any

from memaudit.run.checks import centralized_engine, check_before_disk


def dispatch(cfg: Any, run: Any, *, resume: bool, progress: Any = None, overwrite: bool = False) -> dict[str, Any]:
    """Train `cfg` into `run` with the backend it names; returns the run's result (run.json's)."""
    check_before_disk(cfg)
    if cfg.backend == "federated" and cfg.federated.runtime == "flower":
        # lazy: jax and flax (~2.5 s); submitted to a Flower federation (optional dependency: flwr)
        from memaudit.run.flower import train_on_flower as fn
    elif cfg.backend == "federated":
        from memaudit.run.federated import train_federated as fn  # lazy: jax and flax (~2.5 s)
    elif centralized_engine(cfg) == "jax":
        # lazy: jax, flax and jax-privacy (~3 s): the centralized backend's JAX engine
        from memaudit.run.centralized_jax import train_centralized_jax as fn
    elif cfg.parallel.world_size > 1:
        # The data x tensor-parallel grid starts its own processes (torch.distributed). lazy: as
        # the other backends, it loads only when a run picks it (a missing one fails in one line)
        from memaudit.run.launch import launch_training as fn
    else:
        from memaudit.run.centralized import train_centralized as fn  # lazy: torch (~2 s)
    return fn(cfg, run, resume=resume, progress=progress, overwrite=overwrite)
