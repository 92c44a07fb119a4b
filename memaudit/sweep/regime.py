"""The single-pass regime: every point trains exactly one epoch over its training documents.

Large models memorize even data seen once ("catastrophic memorization", AxoNN's study);
measuring that needs a schedule that shows each document once, with the repetitions coming
only from the data: canaries at `data.canaries.repetitions` and documents repeated at fixed
counts (the synthetic corpus' `data.synth.repeat_counts`). The step count therefore comes from
the prepared data, which the sweep prepares once per distinct data config (deterministic in
the config, the same data every point then prepares for itself) under SWEEP_DIR/regime/:

- centralized: `train.steps = ceil(N / batch)` for N packed training sequences. Without DP
  the batches are per-epoch permutations (`memaudit.train.batches.EpochBatches`), so these
  steps visit every sequence exactly once (N x seq_len packed positions = the train tokens
  with their row padding); under DP-SGD's Poisson sampling each sequence is sampled once in
  expectation.
- federated: `rounds = ceil(users / cohort)` (each training user in one cohort in
  expectation), `local_steps = 1` and `local_batch_size` = the most sequences a user has, so
  a participating client trains once on all of its data (a client's batch is its distinct
  examples).

References:
  Singh et al., SC 2024 (AxoNN's memorization study); Hans et al., "Be like a Goldfish,
  Don't Memorize!", NeurIPS 2024 (single-pass fine-tuning on repeated documents).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memaudit.errors import DataError
from memaudit.models.init import model_vocab_size
from memaudit.rundir import RunDir
from memaudit.sweep.config import point_config, tokens_seen

if TYPE_CHECKING:
    from memaudit.config import Config
    from memaudit.sweep.config import SweepConfig, SweepPoint


@dataclass(frozen=True)
class DataCounts:
    """What one epoch is: packed training sequences, their tokens, and the users they belong to."""

    sequences: int
    tokens: int
    seq_len: int
    users: int
    max_user_sequences: int


def data_counts(run_cfg: Config, cache: Path) -> DataCounts:
    """Prepare (or reuse) the point's data under `cache` and count one epoch of it."""
    # lazy: numpy (~0.4 s) only when called; this module imports without it
    import numpy as np

    from memaudit.data import prepare_data
    from memaudit.data.prepare import config_hash

    vocab = model_vocab_size(run_cfg.model)
    rd = RunDir(cache / config_hash(run_cfg.data, vocab)[:16])
    prepared = prepare_data(run_cfg.data, rd, vocab_size=vocab)
    per_user = np.bincount(np.asarray(prepared.train.user_index))
    per_user = per_user[per_user > 0]
    return DataCounts(len(prepared.train), prepared.train.n_tokens(), prepared.seq_len,
                      len(per_user), int(per_user.max()) if len(per_user) else 0)


def single_pass_overrides(run_cfg: Config, counts: DataCounts) -> dict[str, Any]:
    """The schedule keys that make `run_cfg` one epoch over `counts` (see the module doc)."""
    if counts.sequences == 0:
        raise DataError("single-pass regime: the data has no training sequences; add documents or users")
    if run_cfg.backend == "federated":
        return {"federated.rounds": math.ceil(counts.users / run_cfg.federated.cohort),
                "federated.local_steps": 1, "federated.local_batch_size": counts.max_user_sequences}
    return {"train.steps": math.ceil(counts.sequences / run_cfg.train.batch_size)}


def resolve_regime(cfg: SweepConfig, points: list[SweepPoint], out: Path) -> list[SweepPoint]:
    """The points with the regime's schedule in their overrides and their tokens_seen."""
    if cfg.regime != "single-pass":
        return points
    cache: dict[str, DataCounts] = {}
    resolved = []
    for p in points:
        run_cfg = point_config(cfg, p)
        key = run_cfg.data.model_dump_json() + run_cfg.model.model_dump_json()
        if key not in cache:
            cache[key] = data_counts(run_cfg, out / "regime")
        q = replace(p, overrides={**p.overrides, **single_pass_overrides(run_cfg, cache[key])})
        resolved.append(replace(q, tokens_seen=tokens_seen(point_config(cfg, q))))
    return resolved
