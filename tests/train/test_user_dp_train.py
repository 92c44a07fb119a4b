"""User-level DP training runs (ELS, ULS) on the tiny corpus: the ledger's ε against
dp_accounting, the contribution bound counted on what was trained, and exact resume."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from memaudit.config import load_config
from memaudit.io import read_json
from memaudit.privacy.accounting import MIXTURE_PLD_DISCRETIZATION, RDP_ORDERS
from memaudit.run.driver import run_trainer
from memaudit.rundir import RunDir
from tests.conftest import REPO_ROOT, TINY_TRAIN_OVERRIDES

K = 2


def _cfg(corpus, algorithm: str, *extra: str):
    return load_config(REPO_ROOT / "configs" / "tiny.yaml", [
        *TINY_TRAIN_OVERRIDES, f"data.path={corpus}", "train.steps=4", "train.eval_every=2",
        "train.checkpoint_every=2", "train.eval_batches=1", "privacy.noise_multiplier=1.0", "privacy.clip=1.0",
        "privacy.reproducible_randomness=true", "privacy.delta=1e-4", "privacy.unit=user",
        f"privacy.user_sampling={algorithm}", f"privacy.max_examples_per_user={K}", *extra])


def _train(cfg, run: RunDir, *, resume: bool = False, stop_at: int | None = None):
    """Train through the driver, recording the rows each step trained on."""
    from memaudit.train.trainer import Trainer

    def progress(done, total, info):
        if stop_at is not None and done == stop_at:
            raise KeyboardInterrupt

    tr = Trainer(cfg, run, progress=progress)
    seen: list[np.ndarray] = []
    make = tr.make_batch
    tr.make_batch = lambda rows: (seen.append(np.asarray(rows)), make(rows))[1]
    return tr, run_trainer(tr, resume=resume), seen


def _weights(run: RunDir):
    from safetensors.torch import load_file

    return load_file(str(run.path / "model" / "model.safetensors"))


@pytest.fixture(scope="module", params=["uls", "els"])
def user_run(request, tiny_corpus, tmp_path_factory):
    run = RunDir(tmp_path_factory.mktemp(request.param) / "run")
    tr, res, seen = _train(_cfg(tiny_corpus, request.param), run)
    return {"algorithm": request.param, "run": run, "trainer": tr, "result": res, "seen": seen}


def test_user_level_ledger_matches_dp_accounting(user_run):
    tr, res = user_run["trainer"], user_run["result"]
    ledger = read_json(user_run["run"].privacy_path)
    assert ledger["unit"] == "user" and ledger["steps"] == 4 and res["privacy"]["unit"] == "user"
    decl = ledger["mechanisms"][0]
    assert decl["unit"] == "user" and decl["max_examples_per_user"] == K
    users = int(np.unique(tr.train_set.user_index).size)
    if user_run["algorithm"] == "uls":
        q = (8 / K) / users  # train.batch_size / k users per step in expectation
        acc = RdpAccountant(list(RDP_ORDERS))
        acc.compose(dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(1.0)), 4))
        assert ledger["epsilon"]["rdp"] == pytest.approx(acc.get_epsilon(1e-4), rel=1e-6)
        assert ledger["sampling_rate"] == pytest.approx(q)
    else:
        m = res["contribution_bound"]["sequences_sampled_from"]
        q = 8 / m
        assert K == 2
        probs = [(1 - q) ** 2, 2 * q * (1 - q), q * q]  # Binomial(2, q)
        acc = PLDAccountant(value_discretization_interval=MIXTURE_PLD_DISCRETIZATION)
        acc.compose(dp_event.SelfComposedDpEvent(dp_event.MixtureOfGaussiansDpEvent(1.0, [0, 1, 2], probs), 4))
        assert ledger["epsilon"]["rdp"] is None
        assert ledger["epsilon"]["pld"] == pytest.approx(acc.get_epsilon(1e-4), rel=1e-6)


def test_a_user_contributes_at_most_k_sequences(user_run):
    tr, seen = user_run["trainer"], user_run["seen"]
    counts = np.bincount(tr.train_set.user_index)
    assert counts.max() > K  # the cap binds for some user
    rows = np.concatenate([s[s >= 0] for s in seen])
    assert rows.size > 0
    trained = {}
    for r in np.unique(rows):
        trained.setdefault(int(tr.train_set.user_index[r]), set()).add(int(r))
    assert max(len(v) for v in trained.values()) <= K
    for s in seen:  # within a step too: at most k rows of one user
        real = s[s >= 0]
        assert np.bincount(tr.train_set.user_index[real]).max(initial=0) <= K
    assert user_run["result"]["contribution_bound"]["max_examples_per_user"] == K


def test_resume_is_bit_identical(user_run, tmp_path):
    import torch

    ref = user_run["run"]
    run = RunDir(tmp_path / "resumed")
    run.path.mkdir()
    shutil.copytree(ref.path / "data", run.path / "data")
    for f in ("split.json", "canaries.json"):
        shutil.copy2(ref.path / f, run.path / f)
    cfg = user_run["trainer"].cfg
    with pytest.raises(KeyboardInterrupt):
        _train(cfg, run, stop_at=3)
    assert read_json(run.path / "state" / "trainer.json")["step"] == 2
    _, res, _ = _train(cfg, run, resume=True)
    assert res["resumed_from_step"] == 2
    a, b = _weights(ref), _weights(run)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert read_json(run.privacy_path)["epsilon"] == read_json(ref.privacy_path)["epsilon"]
