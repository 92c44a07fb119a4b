"""The federated backend in JAX, in this process (or one JAX process of several): `train_federated`.

Sets up the `FederatedTrainer` (`memaudit.federated.trainer`) with its in-process runtime and
trains it through the one driver (`memaudit.run.driver`) inside the run lifecycle. A run on
Flower is submitted by `memaudit.run.flower` instead. Imports jax and flax.
"""

from __future__ import annotations

from typing import Any

from memaudit.config import Config
from memaudit.errors import ConfigError
from memaudit.federated.distributed import maybe_initialize
from memaudit.federated.trainer import FederatedTrainer
from memaudit.run.driver import ProgressFn, run_trainer
from memaudit.rundir import RunDir


def train_federated(cfg: Config, run: RunDir, *, resume: bool = False,
                    progress: ProgressFn | None = None, **session_kw: Any) -> dict[str, Any]:
    """Train `cfg` federated into `run`; returns the result summary written to run.json.

    Args:
        cfg: the resolved config (`cfg.federated` holds rounds, cohort, sampling, local steps,
            client/server optimizers, mesh_clients).
        run: the run directory, already checked by `prepare_new_run` / `open_for_resume`.
        resume: continue from the last checkpoint in state/.
        progress: called as progress(done_rounds, total_rounds, info) after every round.
        session_kw: passed to the run lifecycle (`overwrite`, `lock_held`).

    Returns:
        {"steps" (= rounds), "rounds", "final_holdout_loss", "final_holdout_perplexity",
         "initial_holdout_loss", "initial_holdout_perplexity", "final_train_loss", ...}
    """
    if cfg.federated.runtime == "flower":
        raise ConfigError("federated.runtime=flower submits the run to a Flower federation: train it with "
                          "`memaudit train` (memaudit.run.dispatch.dispatch), not train_federated")
    maybe_initialize()
    return run_trainer(FederatedTrainer(cfg, run, progress=progress), resume=resume, **session_kw)
