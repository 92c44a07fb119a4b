"""The centralized trainer's parts against independent oracles, and a DP-SGD training run."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

from memaudit.config import load_config
from memaudit.data.packing import PackedSequences
from memaudit.io import read_json, read_jsonl
from memaudit.rundir import RunDir
from memaudit.train.batches import EpochBatches
from memaudit.train.schedule import lr_at
from tests.conftest import REPO_ROOT, TINY_TRAIN_OVERRIDES


def test_schedule_hand_values():
    kw = {"lr": 2.0, "warmup_steps": 4, "total_steps": 14, "min_lr_ratio": 0.25}
    assert [lr_at(i, **kw) for i in range(4)] == [0.5, 1.0, 1.5, 2.0]
    assert lr_at(4, **kw) == 2.0  # peak right after warm-up
    # half-way through the 9 decay steps: cos(pi/2) = 0 -> min + (peak - min) / 2
    assert lr_at(4 + 4.5, **kw) == pytest.approx(0.5 + 1.5 * 0.5)
    assert lr_at(13, **kw) == pytest.approx(0.5)  # the last update ends at min_lr_ratio * lr
    assert lr_at(0, lr=1.0, warmup_steps=0, total_steps=1, min_lr_ratio=0.0) == 1.0


def test_epoch_batches_cover_each_epoch_once_and_are_reproducible():
    sel = EpochBatches(num_examples=10, batch_size=4, seed=7)
    stream = np.concatenate([sel.indices(t) for t in range(10)])  # 40 = 4 epochs
    for e in range(4):
        assert sorted(stream[10 * e : 10 * (e + 1)].tolist()) == list(range(10))
    again = EpochBatches(10, 4, 7)
    assert all((again.indices(t) == sel.indices(t)).all() for t in (9, 3, 0))
    assert not (EpochBatches(10, 4, 8).indices(0) == sel.indices(0)).all()


def _trainer_on(packed: PackedSequences, *overrides: str):
    from memaudit.models.presets import build_model
    from memaudit.train.trainer import Trainer

    cfg = load_config(None, ["train.device=cpu", *overrides])
    tr = Trainer(cfg, RunDir("/nonexistent"))
    tr.model = build_model("tiny", vocab_size=97, seed=3)
    tr.train_set = tr.holdout_set = packed
    return tr


def _packed(n=6, length=12, vocab=97, seed=0) -> PackedSequences:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(n, length)).astype(np.int32)
    lens = rng.integers(2, length + 1, size=n)
    lens[0] = length
    am = (np.arange(length)[None, :] < lens[:, None]).astype(np.int8)  # right padding
    return PackedSequences(ids, am, np.arange(n, dtype=np.int32) % 2, ("a", "b"))


def _hf_oracle_grads(model, packed: PackedSequences):
    """Gradients of transformers' own labels loss (-100 on padding), with the attention mask."""
    import torch

    ids = torch.as_tensor(packed.input_ids, dtype=torch.long)
    am = torch.as_tensor(packed.attention_mask, dtype=torch.long)
    labels = ids.masked_fill(am == 0, -100)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, attention_mask=am, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


@pytest.mark.parametrize("micro", [None, 4, 1])
def test_accumulated_gradients_equal_the_transformers_loss(micro):
    import torch

    packed = _packed()
    over = [] if micro is None else [f"train.micro_batch_size={micro}"]
    tr = _trainer_on(packed, *over)
    ref_loss, ref = _hf_oracle_grads(tr.model, packed)
    stats = tr.compute_gradients(tr.make_batch(np.arange(len(packed))))
    assert stats["loss"] == pytest.approx(ref_loss, rel=1e-5)
    for n, p in tr.model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-4, atol=1e-6)


def test_global_norm_clipping_against_manual_norm():
    import torch

    tr = _trainer_on(_packed(), "train.grad_clip=0.01")
    tr.compute_gradients(tr.make_batch(np.arange(6)))
    grads = [p.grad.clone() for p in tr.model.parameters()]
    manual = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    norm = tr.clip_gradients()
    assert norm == pytest.approx(manual, rel=1e-5)
    after = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in tr.model.parameters()))
    assert after == pytest.approx(0.01, rel=1e-3)
    for g0, p in zip(grads, tr.model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, g0 * (0.01 / manual), rtol=1e-3, atol=1e-9)


def test_holdout_loss_equals_a_per_sequence_loop():
    import torch

    from memaudit.train.evaluate import holdout_loss

    packed = _packed(n=5, seed=2)
    tr = _trainer_on(packed)
    loss, ppl = holdout_loss(tr.model, packed.input_ids, packed.attention_mask, batch_size=2,
                             max_batches=None, device=torch.device("cpu"))
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(5):  # one unpadded sequence at a time, no mask: an independent path
            n = int(packed.attention_mask[i].sum())
            ids = torch.as_tensor(packed.input_ids[i : i + 1, :n], dtype=torch.long)
            logits = tr.model(input_ids=ids).logits[0].double()
            lp = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])
            total -= float(lp.sum())
            count += n - 1
    assert loss == pytest.approx(total / count, rel=1e-5)
    assert ppl == pytest.approx(math.exp(total / count), rel=1e-5)


def _copy_prepared(src, dst):
    dst.mkdir()
    shutil.copytree(src / "data", dst / "data")
    for f in ("split.json", "canaries.json"):
        shutil.copy2(src / f, dst / f)


def test_dp_sgd_run_records_a_ledger(tiny_run, tmp_path):
    """DP path: Poisson batches, DP-SGD gradients, privacy.json whose epsilon dp_accounting confirms."""
    pytest.importorskip("memaudit.train.dpsgd")  # the DP-SGD module ships with the privacy issue
    import dp_accounting

    from memaudit.run.centralized import train_centralized

    manifest = read_json(tiny_run["path"] / "run.json")
    run = RunDir(tmp_path / "dp")
    _copy_prepared(tiny_run["path"], run.path)  # same data config: prepare_data loads it back
    cfg = load_config(REPO_ROOT / "configs" / "tiny.yaml", [
        *TINY_TRAIN_OVERRIDES, f"data.path={manifest['config']['data']['path']}",
        "train.steps=6", "train.eval_every=3", "train.checkpoint_every=3",
        "privacy.noise_multiplier=1.2", "privacy.clip=1.0", "privacy.reproducible_randomness=true", "privacy.delta=1e-4"])
    res = train_centralized(cfg, run)
    ledger = read_json(run.privacy_path)
    n = res["train_sequences"]
    q = 8 / n
    assert ledger["unit"] == "example" and ledger["steps"] == 6 and ledger["sampling_rate"] == q
    from memaudit.privacy.accounting import RDP_ORDERS

    acc = dp_accounting.rdp.RdpAccountant(list(RDP_ORDERS))  # the ledger's orders, dp_accounting's maths
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.2)), 6))
    assert ledger["epsilon"]["rdp"] == pytest.approx(acc.get_epsilon(1e-4), rel=1e-6)
    # the unit is named: per sequence, and per document composed for the m the data records
    m = read_json(run.data_dir / "meta.json")["sequences_per_document"]["max_sequences_per_document"]
    assert ledger["protects"]["unit"] == "sequence" and ledger["max_sequences_per_document"] == m > 1
    from memaudit.privacy.accounting import MIXTURE_PLD_DISCRETIZATION

    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=MIXTURE_PLD_DISCRETIZATION)
    pld.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.dp_event.MixtureOfGaussiansDpEvent(
        1.2, list(range(m + 1)), [math.comb(m, j) * q ** j * (1 - q) ** (m - j) for j in range(m + 1)]), 6))
    assert ledger["document"]["epsilon"]["pld"] == pytest.approx(pld.get_epsilon(1e-4), rel=1e-9)
    metrics = read_jsonl(run.metrics_path)
    assert len(metrics) == 6 and all("noise_std" in m for m in metrics)
    assert metrics[0]["noise_std"] == pytest.approx(1.2 * 1.0 / (n * q))
    # statistics of the private data that DP does not privatise: only in the sensitive file
    sensitive = read_jsonl(run.path / "sensitive_metrics.jsonl")
    assert [m["step"] for m in sensitive] == list(range(1, 7))
    for key in ("batch_size", "clip_fraction", "loss", "grad_norm", "tokens_per_s"):
        assert all(key in m for m in sensitive) and not any(key in m for m in metrics), key
    # Poisson batch sizes: reproducible_randomness derives the sampler's keys from train.seed
    from memaudit.privacy.randomness import DPRandomness
    from memaudit.train.sampling import PoissonSampler

    sampler = PoissonSampler(n, q, DPRandomness.from_seed(0))
    assert [m["batch_size"] for m in sensitive] == [len(sampler.indices(t)) for t in range(6)]
    from tests.test_lifecycle import scan_public_files

    scan_public_files(run.path)
    assert read_json(run.manifest_path)["result"]["privacy"]["noise_multiplier"] == 1.2
