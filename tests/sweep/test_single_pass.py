"""The single-pass regime: one epoch over the prepared training data, counted independently."""

from __future__ import annotations

import math

import numpy as np
import pytest

from memaudit.sweep.config import plan_points, point_config, sweep_config_from_dict
from memaudit.sweep.regime import resolve_regime

BASE = {"data": {"synth": {"users": 16, "docs_per_user": 4, "paragraph_sentences": 2},
                 "canaries": {"repetitions": [1, 4]}, "seq_len": 64},
        "train": {"batch_size": 8, "steps": 1000},
        "federated": {"cohort": 3, "rounds": 1000, "local_steps": 4, "local_batch_size": 2}}


@pytest.fixture(scope="module")
def resolved(tmp_path_factory):
    cfg = sweep_config_from_dict({"base": BASE, "regime": "single-pass",
                                  "grid": {"backends": ["centralized", "federated"], "models": ["tiny", "tiny2x"]}})
    out = tmp_path_factory.mktemp("sp")
    return cfg, resolve_regime(cfg, plan_points(cfg), out)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """The same data prepared on its own, as a point's run would prepare it."""
    from memaudit.config import config_from_dict
    from memaudit.data import prepare_data
    from memaudit.rundir import RunDir

    cfg = config_from_dict(BASE)
    return prepare_data(cfg.data, RunDir(tmp_path_factory.mktemp("oracle")), vocab_size=4096)


def test_centralized_points_see_every_sequence_once(resolved, oracle):
    from memaudit.train.batches import EpochBatches

    cfg, points = resolved
    n = len(oracle.train)
    for p in (p for p in points if p.backend == "centralized"):
        c = point_config(cfg, p)
        assert c.train.steps == math.ceil(n / 8) and c.train.steps < 1000
        seen = np.concatenate([EpochBatches(n, 8, c.train.seed).indices(t) for t in range(c.train.steps)])
        assert sorted(seen[:n].tolist()) == list(range(n))  # each sequence once ...
        assert len(seen) - n < 8  # ... and less than one batch of the next epoch
        assert p.tokens_seen == c.train.steps * 8 * 64


def test_federated_points_see_every_users_data_once(resolved, oracle):
    cfg, points = resolved
    counts: dict[int, int] = {}
    for u in oracle.train.user_index.tolist():  # per-user sequences, by a plain loop
        counts[u] = counts.get(u, 0) + 1
    for p in (p for p in points if p.backend == "federated"):
        f = point_config(cfg, p).federated
        assert f.rounds == math.ceil(len(counts) / 3)  # each user in one cohort in expectation
        assert f.local_steps == 1 and f.local_batch_size == max(counts.values())  # all of a client's data


def test_sizes_get_the_same_schedule_and_the_data_repeats(resolved, oracle):
    _, points = resolved
    by_backend = {}
    for p in points:
        by_backend.setdefault(p.backend, set()).add((p.tokens_seen, tuple(sorted(
            (k, v) for k, v in p.overrides.items() if k.startswith(("train.steps", "federated."))))))
    assert all(len(v) == 1 for v in by_backend.values())
    member_repeats = {d.repeats for d in oracle.documents if d.role == "member"}
    assert {1, 4} <= member_repeats and len(member_repeats) > 2  # canaries and repeated documents


def test_multi_epoch_keeps_the_configured_steps(tmp_path):
    cfg = sweep_config_from_dict({"base": BASE, "grid": {"backends": ["centralized"]}})
    pts = resolve_regime(cfg, plan_points(cfg), tmp_path)
    assert point_config(cfg, pts[0]).train.steps == 1000 and not (tmp_path / "regime").exists()
