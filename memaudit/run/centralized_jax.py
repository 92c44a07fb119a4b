"""The centralized backend's JAX engine (`train.engine: jax`): `train_centralized_jax(cfg, run)`.

Sets up the `JaxTrainer` (`memaudit.train.jax_trainer`: the Flax Llama on a (data, model) mesh,
DP-SGD by jax-privacy) and trains it through the one driver (`memaudit.run.driver`) inside the
run lifecycle. Imports jax, flax and jax-privacy.
"""

from __future__ import annotations

from typing import Any

from memaudit.config import Config
from memaudit.run.driver import ProgressFn, run_trainer
from memaudit.rundir import RunDir
from memaudit.train.jax_trainer import JaxTrainer


def train_centralized_jax(cfg: Config, run: RunDir, *, resume: bool = False, progress: ProgressFn | None = None,
                          **session_kw: Any) -> dict[str, Any]:
    """Train `cfg` into `run` with the jax engine; returns run.json's result (as
    `memaudit.run.centralized.train_centralized`)."""
    return run_trainer(JaxTrainer(cfg, run, progress=progress), resume=resume, **session_kw)
