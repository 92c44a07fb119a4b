"""The JAX scoring engine against the torch path (the oracle) on a tiny Llama, on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memaudit.probes.jax_scoring import JaxLM
from memaudit.probes.scoring import decode, token_logprobs
from tests.probes.conftest import tiny_llama

VOCAB = 50


@pytest.fixture(scope="module")
def models():
    model = tiny_llama(VOCAB, seed=3, hidden=32)
    return model, JaxLM.from_torch(model, dtype="float32", max_tokens=64)


def _seqs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n).tolist() for n in lengths]


def test_scores_equal_torch(models):
    model, lm = models
    seqs = _seqs((2, 9, 5, 17, 3, 40, 12, 7, 33))  # three bucket widths, several batches
    want = token_logprobs(model, seqs, batch_size=3, with_stats=True)
    got = token_logprobs(lm, seqs, batch_size=3, with_stats=True)
    for name in ("logp", "mu", "sigma"):
        for a, b in zip(getattr(want, name), getattr(got, name), strict=True):
            assert a.shape == b.shape
            np.testing.assert_allclose(b, a, atol=1e-4, rtol=0)


def test_greedy_equals_torch(models):
    model, lm = models
    prompts = _seqs((1, 6, 3, 11, 4, 20), seed=1)
    want = decode(model, prompts, 9, batch_size=4)
    got = decode(lm, prompts, 9, batch_size=4)
    np.testing.assert_array_equal(got, want)


def test_sampled_tokens_are_top_k(models):
    model, lm = models
    prompts = _seqs((3, 5, 8, 2), seed=2)
    got = decode(lm, prompts, 6, top_k=1, batch_size=4)  # top-1 sampling is greedy
    np.testing.assert_array_equal(got, decode(model, prompts, 6, batch_size=4))
    a = decode(lm, prompts, 6, top_k=5, seed=7)
    np.testing.assert_array_equal(a, decode(lm, prompts, 6, top_k=5, seed=7))  # seeded
    for p, row in zip(prompts, a, strict=True):  # each draw within the top 5 of torch's logits
        ids = list(p)
        for tok in row:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            assert int(tok) in torch.topk(logits, 5).indices.tolist()
            ids.append(int(tok))


def test_shared_prefix_equals_full_scores(models):
    model, lm = models
    rng = np.random.default_rng(4)
    prefix = rng.integers(0, VOCAB, 13).tolist()
    seqs = [prefix + rng.integers(0, VOCAB, int(n)).tolist() for n in rng.integers(1, 6, 21)]
    full = np.array([-x.sum() for x in token_logprobs(model, seqs).logp])
    np.testing.assert_allclose(lm.shared_prefix_nll(seqs, rows=8), full, atol=1e-4, rtol=0)
    # no common prefix (first tokens differ): the plain path, same numbers
    seqs2 = [[i % VOCAB, *s[1:]] for i, s in enumerate(seqs)]
    full2 = np.array([-x.sum() for x in token_logprobs(model, seqs2).logp])
    np.testing.assert_allclose(lm.shared_prefix_nll(seqs2), full2, atol=1e-4, rtol=0)


def test_from_pretrained_reads_the_checkpoint_without_torch(models, tmp_path):
    model, lm = models
    model.save_pretrained(tmp_path)
    loaded = JaxLM.from_pretrained(tmp_path, dtype="float32", max_tokens=64)
    seqs = _seqs((5, 12), seed=5)
    for a, b in zip(lm.token_logprobs(seqs).logp, loaded.token_logprobs(seqs).logp, strict=True):
        np.testing.assert_array_equal(a, b)


def test_shared_prefix_takes_an_array_of_candidates(models):
    _model, lm = models
    rng = np.random.default_rng(6)
    arr = np.concatenate([np.tile(rng.integers(0, VOCAB, 9), (30, 1)),
                          rng.integers(0, VOCAB, (30, 4))], axis=1)
    full = np.array([-x.sum() for x in lm.token_logprobs(arr.tolist()).logp])
    np.testing.assert_allclose(lm.shared_prefix_nll(arr, rows=16), full, atol=1e-4, rtol=0)


def test_sampled_draws_do_not_depend_on_the_batch(models):
    _, lm = models
    prompts = _seqs((3, 5, 8, 2, 7, 4), seed=3)
    a = decode(lm, prompts, 6, top_k=5, seed=7, batch_size=4)
    b = decode(lm, prompts, 6, top_k=5, seed=7, batch_size=1)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, decode(lm, prompts, 6, top_k=5, seed=8, batch_size=4))


def test_an_accelerator_decodes_in_long_batches_with_the_same_tokens(models, monkeypatch):
    from memaudit.probes import jax_scoring

    _, lm = models
    prompts = _seqs(tuple(range(1, 41)), seed=4)
    want = decode(lm, prompts, 5, batch_size=4)
    calls = []
    real = jax_scoring._generate

    def counted(*args, **kw):
        calls.append(args[1].shape[0])
        return real(*args, **kw)

    monkeypatch.setattr(jax_scoring, "_generate", counted)
    monkeypatch.setattr(jax_scoring.jax, "default_backend", lambda: "tpu")
    got = decode(lm, prompts, 5, batch_size=4)
    np.testing.assert_array_equal(got, want)
    assert calls == [64]  # one batch of all 40 prompts, padded to a power of two
    monkeypatch.setattr(jax_scoring, "ACCEL_DECODE_CACHE_BYTES", 1)
    calls.clear()
    decode(lm, prompts, 5, batch_size=4)
    assert calls == [4] * 10  # a cache too big for more keeps the asked batch size
