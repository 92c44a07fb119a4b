"""The one `Trainer` with `TensorParallelLayout` on 2-process grids (run inside the world-2 gloo group) against
`train_centralized` on the same config: DP-SGD with sigma=0 under x=2 tensor parallelism
(micro-batched), gradient accumulation (`train.micro_batch_size`) and per-user clipping (ULS) on a data=2 grid."""

from __future__ import annotations

import json

import pytest

from memaudit.config import load_config
from memaudit.run.centralized import train_centralized
from memaudit.rundir import RunDir
from tests.conftest import REPO_ROOT
from tests.parallel import _workers


def _metrics(path) -> list[dict]:
    from tests._metrics import merged_metrics

    return merged_metrics(path)


def _single(job: str, tiny_corpus, tmp_path, **extra: str):
    over = _workers.train_overrides(job, str(tiny_corpus), parallel=False)
    over += [f"{k}={v}" for k, v in extra.items()]
    run = RunDir(tmp_path / f"{job}-single")
    train_centralized(load_config(REPO_ROOT / "configs" / "tiny.yaml", over), run)
    return run.path


def _check_same_run(par, ser, *, keys: tuple[str, ...], **close: float) -> None:
    a, b = _metrics(par), _metrics(ser)
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3, 4]
    for x, y in zip(a, b, strict=True):
        assert abs(x["loss"] - y["loss"]) < 1e-4, (x["step"], x["loss"], y["loss"])
        assert abs(x["grad_norm"] - y["grad_norm"]) < 1e-4 * max(1.0, y["grad_norm"])
        for k in keys:
            assert x[k] == pytest.approx(y[k], rel=1e-9, abs=1e-12), (k, x[k], y[k])
        if "holdout_loss" in y:
            assert abs(x["holdout_loss"] - y["holdout_loss"]) < 1e-4
    _workers.assert_weights_close(par, ser, **close)


def test_dp_sigma0_under_tensor_parallelism_equals_single_process(results, train_runs, tiny_corpus,
                                                                  tmp_path) -> None:
    err = results(2)["train-dp0-x2"]
    assert err is None, err
    par = train_runs[1] / "dp0-x2"
    ser = _single("dp0-x2", tiny_corpus, tmp_path)
    # Poisson batch sizes, the fraction of clipped examples and the noise std are the same step by step
    # Per-example clipping divides by norms whose fp32 summation order differs between the grid
    # and one process; over AdamW's normalisation of tiny gradients (rows of tokens these four
    # Poisson batches barely touch) that reaches ~lr on a few embedding elements and 1e-5..1e-4
    # on ~0.1% of lm_head, while every step's loss, grad norm, batch and clip count agree above.
    _check_same_run(par, ser, keys=("batch_size", "clip_fraction", "noise_std"), max_abs=6e-3,
                    far_fraction=3e-3)
    assert 0 < sum(m["clip_fraction"] for m in _metrics(par)) < 4  # some, not all, clipped
    assert len(list(par.glob("privacy*.json"))) == 1  # one ledger for the run, written by rank 0
    assert json.loads((par / "privacy.json").read_text())["steps"] == 4
    assert json.loads((par / "run.json").read_text())["status"] == "complete"


def test_gradient_accumulation_on_a_data_grid_equals_single_process(results, train_runs, tiny_corpus,
                                                                   tmp_path) -> None:
    err = results(2)["train-accum-d2"]
    assert err is None, err
    par = train_runs[1] / "accum-d2"
    ser = _single("accum-d2", tiny_corpus, tmp_path)  # the same chunks of 3, 3, 2 rows
    _check_same_run(par, ser, keys=("batch_size",))
    assert json.loads((par / "run.json").read_text())["config"]["train"]["micro_batch_size"] == 3
    # and accumulating is not a different algorithm: one full batch per step gives the same losses
    full = _metrics(_single("accum-d2", tiny_corpus, tmp_path / "full", **{"train.micro_batch_size": "null"}))
    for x, y in zip(_metrics(par), full, strict=True):
        assert abs(x["loss"] - y["loss"]) < 1e-4


def test_per_user_clipping_on_a_data_grid_equals_single_process(results, train_runs, tiny_corpus,
                                                                tmp_path) -> None:
    """ULS (user-level DP-SGD, privacy.user_sampling=uls) on a data=2 grid: each rank clips whole
    users (a user's capped sequences never straddle two ranks), the users sampled, clipped and
    counted each step, the noise and the weights are one process's."""
    err = results(2)["train-uls0-d2"]
    assert err is None, err
    par = train_runs[1] / "uls0-d2"
    ser = _single("uls0-d2", tiny_corpus, tmp_path)
    _check_same_run(par, ser, keys=("batch_size", "sequences", "clip_fraction", "noise_std"))
    fractions = [m["clip_fraction"] for m in _metrics(par)]
    assert 0 < min(fractions) and max(fractions) < 1  # some users clipped every step, never all
    assert all(m["sequences"] > m["batch_size"] for m in _metrics(par))  # users of several sequences
    ledger = json.loads((par / "privacy.json").read_text())
    assert ledger["unit"] == "user" and ledger["steps"] == 4
    assert ledger["mechanisms"][0]["max_examples_per_user"] == 2
