"""Exposure's candidates in heads and chunks (memaudit.probes.jax_groups) against the plain
shared-prefix path (`JaxLM.shared_prefix_nll`, the oracle), on the CPU in f32."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from memaudit.probes.exposure import jax_exposure_path
from memaudit.probes.jax_groups import grouped_nll, plan_groups
from memaudit.probes.jax_scoring import JaxLM, random_llama

VOCAB = 32
DIGITS = np.arange(20, 30)  # a 10-token alphabet, as digits are under memaudit's tokenizer
PREFIX = 5


@pytest.fixture(scope="module")
def lm():
    sd, cfg = random_llama(vocab_size=VOCAB, hidden=16, layers=2, heads=4, kv_heads=2, seed=1)
    # weights x15: log-probabilities that vary by nats, so a wrong key or position shows
    sd = {k: v * (15.0 if v.ndim == 2 else 1.0) for k, v in sd.items()}
    return JaxLM.from_state_dict(sd, cfg, dtype="float32", max_tokens=512)


def _digits(n: int, length: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    pre = np.tile(rng.integers(0, VOCAB, PREFIX), (n, 1))
    return np.concatenate([pre, rng.choice(DIGITS, (n, length))], axis=1).astype(np.int32)


def _own(seqs):
    lengths = np.array([len(s) for s in seqs])
    arr = np.zeros((len(seqs), lengths.max()), np.int64)
    for r, s in enumerate(seqs):
        arr[r, : len(s)] = s
    return arr[:, PREFIX:], lengths - PREFIX


def _check(lm, seqs, **kw):
    seen = []
    got = grouped_nll(lm, seqs, progress=lambda done, total, _: seen.append((done, total)), **kw)
    n = len(seqs)
    assert seen[-1] == (n, n) and seen == sorted(seen)  # reaches n, never back
    np.testing.assert_allclose(got, lm.shared_prefix_nll(seqs), atol=1e-4, rtol=0)


def test_digit_secrets_share_heads(lm):
    seqs = _digits(2000, 8, seed=0)
    plan = plan_groups(*_own(seqs))
    assert plan.m >= 2 and plan.forward_tokens < 0.8 * plan.flat_forward_tokens
    assert plan.heads.shape == (10**plan.m, plan.m)
    _check(lm, seqs)


def test_heads_that_score_the_last_token(lm):
    seqs = _digits(1000, 3, seed=6)  # 3 own tokens: heads of 2 score the third, no chunks
    plan = plan_groups(*_own(seqs))
    assert plan.m == 2 and not len(plan.chunk_head)
    _check(lm, seqs)


def test_plan_counts():
    seqs = _digits(2000, 8, seed=0)
    own, n_tok = _own(seqs)
    plan = plan_groups(own, n_tok, depths=[2], chunks=(8,))
    heads = {tuple(r[:2]) for r in own}
    assert plan.m == 2 and len(plan.heads) == len(heads)
    per = [sum(tuple(r[:2]) == h for r in own) for h in sorted(heads)]
    slots = 8 * sum(-(-k // 8) for k in per)
    assert plan.forward_tokens == 2 * len(heads) + slots * 5  # 8 own tokens: 7 inputs, 2 in the head
    assert plan.flat_forward_tokens == 2000 * 8  # 7 inputs, bucket width 8
    assert np.array_equal(np.sort(plan.row_of[plan.row_of >= 0]), np.flatnonzero(plan.row_n))


def test_variable_length_and_short_candidates(lm):
    rng = np.random.default_rng(1)
    base = _digits(1500, 7, seed=1)
    seqs = [list(s[: PREFIX + int(k)]) + ([7] if rng.random() < 0.3 else [])
            for s, k in zip(base, rng.integers(1, 8, len(base)), strict=True)]
    own, n_tok = _own(seqs)
    plan = plan_groups(own, n_tok, depths=[3], min_saving=-1.0)  # m = 3 even if it costs more
    assert plan.m == 3 and (n_tok <= 3).any() and (plan.row_n > 0).any()
    _check(lm, seqs, plan=plan)  # the short ones through the plain path
    _check(lm, seqs)


def test_duplicates(lm):
    seqs = _digits(1200, 6, seed=2)
    seqs = np.concatenate([seqs, seqs[:300], seqs[:40]])[np.random.default_rng(2).permutation(1540)]
    plan = plan_groups(*_own(seqs))
    assert plan.m >= 1 and len(plan.inv) == 1540 and plan.inv.max() < 1200
    _check(lm, seqs)


def test_no_sharing_falls_back_to_the_plain_path(lm):
    rng = np.random.default_rng(3)
    # 100 candidates of 9 own tokens from the whole vocabulary: about 3 a head of one token, so
    # chunks of 8 rows would run more tokens than the plain path's 8 inputs a row
    seqs = np.concatenate([np.tile(rng.integers(0, VOCAB, PREFIX), (100, 1)),
                           rng.integers(0, VOCAB, (100, 9))], axis=1)
    assert plan_groups(*_own(seqs)).m == 0
    _check(lm, seqs)
    no_prefix = seqs.copy()
    no_prefix[:, 0] = np.arange(100) % VOCAB
    _check(lm, no_prefix)


def test_a_head_spans_batches(lm):
    seqs = _digits(1000, 7, seed=4)
    own, n_tok = _own(seqs)
    plan = plan_groups(own, n_tok, depths=[1], chunks=(8,), min_saving=-1.0)
    small = dataclasses.replace(lm, max_tokens=64)  # 8 rows x 5 inputs: one chunk a batch
    assert np.bincount(plan.chunk_head).min() > 64 // (8 * 5)
    _check(small, seqs, plan=plan)


def test_too_short_is_refused(lm):
    with pytest.raises(ValueError, match="at least 2 tokens"):
        grouped_nll(lm, [[1, 2, 3], [4]])


def test_exposure_paths_by_name(lm):
    seqs = _digits(300, 6, seed=5)
    want = lm.shared_prefix_nll(seqs)
    for name in ("flat", "trie", "grouped"):
        np.testing.assert_allclose(jax_exposure_path(name)(lm, seqs), want, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="unknown JAX exposure path 'tree'"):
        jax_exposure_path("tree")


class _DigitCodec:
    """Letters and digits to this module's tokens: digit d -> DIGITS[d], another character -> 1..19."""

    def batch(self, texts):
        return [[int(DIGITS[int(c)]) if c.isdigit() else 1 + ord(c) % 19 for c in t] for t in texts]


def test_an_accelerator_scores_exposure_on_the_grouped_path(lm, monkeypatch):
    """`score_secrets` on a non-CPU backend takes JAX_ACCEL_PATH (grouped, the faster on the
    chip) and gives the flat path's sums; the CPU keeps the trie."""
    import jax

    from memaudit.probes import exposure, jax_groups, jax_trie

    calls = []
    for mod, name in ((jax_groups, "grouped_nll"), (jax_trie, "trie_nll")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    secrets = exposure.sample_secrets("0123456789", 6, 400, seed=3)
    template = "my pin is {secret}."
    want = lm.shared_prefix_nll(_DigitCodec().batch([template.replace("{secret}", s) for s in secrets]))
    got = exposure.score_secrets(lm, _DigitCodec(), template, secrets, batch_size=8)
    assert calls == ["trie_nll"]
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    got_tpu = exposure.score_secrets(lm, _DigitCodec(), template, secrets, batch_size=8)
    assert calls == ["trie_nll", "grouped_nll"] and exposure.JAX_ACCEL_PATH == "grouped"
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    np.testing.assert_allclose(got_tpu, want, atol=1e-4, rtol=0)
