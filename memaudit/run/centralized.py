"""The centralized backend in one torch process: `train_centralized(cfg, run)`.

Sets up the torch `Trainer` (`memaudit.train.trainer`) over the `SerialLayout` and trains it
through the one driver (`memaudit.run.driver`) inside the run lifecycle. Imports torch.
"""

from __future__ import annotations

from typing import Any

from memaudit.config import Config
from memaudit.run.driver import ProgressFn, run_trainer
from memaudit.rundir import RunDir
from memaudit.train.layout import SerialLayout
from memaudit.train.trainer import Trainer


def train_centralized(
    cfg: Config, run: RunDir, *, resume: bool = False, progress: ProgressFn | None = None,
    **session_kw: Any,
) -> dict[str, Any]:
    """Train `cfg` into `run` (single process) and return the result summary.

    Args:
        cfg: the resolved config.
        run: the run directory; the caller has checked it with `prepare_new_run` or
            `open_for_resume`. A fresh run removes memaudit's artifacts of a previous run.
        resume: continue from `run`'s last checkpoint (or from the start if it has none).
        progress: called as progress(done_steps, total_steps, info) after every step.
        session_kw: passed to the run lifecycle (`overwrite`, `lock_held`).

    Returns:
        {"steps", "final_holdout_loss", "final_holdout_perplexity", "initial_holdout_loss",
         "final_train_loss", "train_seconds", "parameters", "epsilon" (DP only), ...}
    """
    return run_trainer(Trainer(cfg, run, SerialLayout(cfg), progress=progress), resume=resume, **session_kw)
