"""Secret DP randomness: never from the seed, hidden, resumable; reproducible only on request."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memaudit.config import load_config
from memaudit.data.packing import PackedSequences
from memaudit.privacy.plan import new_ledger
from memaudit.privacy.randomness import SECRET_FILE, DPRandomness
from memaudit.rundir import RunDir


def test_secret_is_256_bits_of_os_entropy_and_hidden():
    a, b = DPRandomness.fresh(), DPRandomness.fresh()
    assert len(a.state_dict()["secret"]) == 64 and a != b  # 32 bytes, hex
    assert a.state_dict()["secret"] not in repr(a) and a.state_dict()["secret"] not in str(a)
    assert DPRandomness.from_seed(0) != DPRandomness.fresh()
    assert DPRandomness.from_seed(0) == DPRandomness.from_seed(0) and DPRandomness.from_seed(0).reproducible
    # keys differ by purpose, step and index
    keys = {a.key(p, s, i) for p in ("poisson", "noise") for s in range(3) for i in range(2)}
    assert len(keys) == 12 and all(len(k) == 16 for k in keys)
    with pytest.raises(ValueError, match="128 bits"):
        DPRandomness(b"short")


def test_prf_is_hkdf_sha256():
    """Oracle: HKDF (RFC 5869) written out with hmac, for info 'poisson/3/0'."""
    import hashlib
    import hmac

    r = DPRandomness.from_seed(5)
    secret = bytes.fromhex(r.state_dict()["secret"])
    prk = hmac.new(b"memaudit dp randomness v1", secret, hashlib.sha256).digest()
    okm = hmac.new(prk, b"poisson/3/0" + b"\x01", hashlib.sha256).digest()[:16]
    assert r.key("poisson", 3) == okm


def test_jax_keys_per_step():
    import jax

    r = DPRandomness.fresh()
    k = r.jax_key("round", 4, impl="rbg")
    assert jax.random.key_data(k).shape == (4,)  # 128-bit key data
    x = jax.random.normal(r.jax_key("round", 4), (3,))
    assert np.array_equal(np.asarray(x), np.asarray(jax.random.normal(r.jax_key("round", 4), (3,))))
    assert not np.array_equal(np.asarray(x), np.asarray(jax.random.normal(r.jax_key("round", 5), (3,))))


def _trainer(tmp_path, name, *overrides):
    from memaudit.models.presets import build_model
    from memaudit.train.trainer import CentralizedTrainer

    cfg = load_config(None, ["train.device=cpu", "train.batch_size=3", "privacy.noise_multiplier=1.0",
                             "privacy.clip=1.0", "privacy.delta=1e-4", *overrides])
    run = RunDir(tmp_path / name)
    run.path.mkdir()
    tr = CentralizedTrainer(cfg, run)
    tr.model = build_model("tiny", vocab_size=97, seed=3)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 97, size=(24, 10)).astype(np.int32)
    tr.train_set = tr.holdout_set = PackedSequences(ids, np.ones_like(ids, np.int8),
                                                    np.arange(24, dtype=np.int32) % 4, ("a", "b", "c", "d"))
    tr.setup_privacy()
    return tr


def _draws(tr, steps=4):
    batches = [tr.sampler.indices(t).tolist() for t in range(steps)]
    ids = torch.zeros(0, 10, dtype=torch.long)
    tr.dp.step_gradients(ids, torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool))
    noise = tr.model.model.embed_tokens.weight.grad.clone()
    tr.model.zero_grad(set_to_none=True)
    return batches, noise


def test_two_runs_same_config_and_seed_draw_different_batches_and_noise(tmp_path):
    a, b = _trainer(tmp_path, "a"), _trainer(tmp_path, "b")
    (ba, na), (bb, nb) = _draws(a), _draws(b)
    assert ba != bb and not torch.equal(na, nb)
    assert new_ledger(a.privacy_plan()).to_json()["reproducible_randomness"] is False
    # the secret is kept in dp_secret.json before any step, and never derived from train.seed
    assert (a.run.path / SECRET_FILE).is_file()
    assert a.randomness != DPRandomness.from_seed(a.cfg.train.seed)


def test_reproducible_mode_draws_the_same_and_is_recorded(tmp_path):
    a = _trainer(tmp_path, "a", "privacy.reproducible_randomness=true")
    b = _trainer(tmp_path, "b", "privacy.reproducible_randomness=true")
    (ba, na), (bb, nb) = _draws(a), _draws(b)
    assert ba == bb and torch.equal(na, nb)
    led = new_ledger(a.privacy_plan()).to_json()
    assert led["reproducible_randomness"] is True
    assert led["guarantees"]["release"]["void_if_seed_known"] is True


def test_state_round_trip_resumes_the_same_stream(tmp_path):
    a = _trainer(tmp_path, "a")
    ids = torch.zeros(0, 10, dtype=torch.long)
    a.dp.step_gradients(ids, torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool))  # step 0
    a.model.zero_grad(set_to_none=True)
    state = a.dp.state_dict()
    want = _draws(a)  # batches 0..3, noise of step 1
    # a different process: a fresh secret, then the checkpoint restores it in place
    (a.run.path / SECRET_FILE).unlink()
    b = _trainer(tmp_path, "b")
    assert b.randomness != a.randomness
    b.dp.load_state_dict(state)
    got = _draws(b)
    assert got[0] == want[0] and torch.equal(got[1], want[1])
    # before its first checkpoint, a run killed and resumed reads the secret kept in dp_secret.json
    c = _trainer(tmp_path, "c")
    assert DPRandomness.for_run(c.run.path, c.cfg.privacy, 0) == c.randomness
    with pytest.raises(ValueError, match="reproducible_randomness"):
        DPRandomness.for_run(c.run.path, c.cfg.privacy.model_copy(update={"reproducible_randomness": True}), 0)


def test_secret_mode_resume_from_a_checkpoint_is_bit_identical(tiny_corpus, tmp_path, capsys):
    """A DP run with secret randomness, resumed from its last checkpoint (a copy marked
    interrupted), ends with the same batches and bit-identical weights: the checkpoint carries
    the secret into the one object the sampler and the noise share."""
    import shutil

    from safetensors.torch import load_file

    from memaudit.cli import main
    from memaudit.io import read_json, read_jsonl
    from tests.conftest import REPO_ROOT, tiny_train_args

    a = tmp_path / "a"
    args = ["train", str(REPO_ROOT / "configs" / "tiny.yaml"), "--out", str(a),
            *tiny_train_args(f"data.path={tiny_corpus}", "train.steps=6", "train.checkpoint_every=2",
                             "train.eval_every=6", "privacy.noise_multiplier=1.0", "privacy.clip=1.0",
                             "privacy.delta=1e-4")]
    assert main(args) == 0
    assert read_json(a / "state" / "trainer.json")["step"] == 4
    b = tmp_path / "b"
    shutil.copytree(a, b)
    RunDir(b).update_manifest(status="interrupted")
    assert main(["train", "--resume", str(b)]) == 0
    capsys.readouterr()
    sizes = [[m["step"], m.get("batch_size")] for m in read_jsonl(a / "sensitive_metrics.jsonl")]
    assert sizes == [[m["step"], m.get("batch_size")] for m in read_jsonl(b / "sensitive_metrics.jsonl")]
    assert all(m["batch_size"] is not None for m in read_jsonl(a / "sensitive_metrics.jsonl"))
    wa, wb = load_file(str(a / "model" / "model.safetensors")), load_file(str(b / "model" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    led = read_json(a / "privacy.json")
    assert led["reproducible_randomness"] is False and led["steps"] == 6
    secret = torch.load(a / "state" / "extra.pt", weights_only=True)["dp"]["secret"]
    assert len(secret) == 64  # kept in state/ and dp_secret.json (both sensitive) only
    assert read_json(a / SECRET_FILE)["secret"] == secret
    for f in a.rglob("*"):
        if (f.is_file() and "state" not in f.relative_to(a).parts and f.name != SECRET_FILE
                and f.suffix in (".json", ".jsonl", ".md")):
            assert secret not in f.read_text(), f
