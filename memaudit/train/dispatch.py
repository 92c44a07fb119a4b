"""Pick the trainer for a config: federated (JAX), a multi-process parallel grid, or one process."""

from __future__ import annotations

import importlib
from typing import Any

from memaudit.errors import MemauditError


def _lazy(module: str, name: str, what: str):
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as e:
        if e.name is not None and not module.startswith(e.name) and e.name != module:
            raise
        raise MemauditError(f"{what} is not available in this installation ({module}.{name} is "
                            "missing); use backend=parallel with a 1x1x1x1 grid") from None
    except AttributeError:
        raise MemauditError(f"{what} is not available in this installation ({module}.{name} is "
                            "missing); use backend=parallel with a 1x1x1x1 grid") from None


def dispatch(cfg, run, *, resume: bool, progress=None) -> dict[str, Any]:
    """Train `cfg` into `run` with the backend it names; returns the trainer's result summary."""
    if cfg.backend == "federated":
        fn = _lazy("memaudit.federated.trainer", "train_federated", "the federated backend")
    elif cfg.parallel.world_size > 1:
        # The data x tensor-parallel backend starts its own processes (torch.distributed).
        fn = _lazy("memaudit.parallel.launch", "launch_training", "the multi-process parallel backend")
    else:
        from memaudit.train.trainer import train_centralized as fn
    return fn(cfg, run, resume=resume, progress=progress)
