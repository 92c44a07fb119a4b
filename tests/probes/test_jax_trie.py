"""Exposure's candidates over the trie of their tokens (memaudit.probes.jax_trie) against the
full-candidate scoring (every whole sequence through the model, the oracle), on the CPU in f32."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from memaudit.probes.exposure import exact_exposure, sample_secrets, score_secrets
from memaudit.probes.jax_scoring import JaxLM
from memaudit.probes.jax_trie import plan_trie, trie_nll
from memaudit.probes.scoring import token_logprobs
from memaudit.probes.targets import Codec
from tests.probes.conftest import make_corpus, make_tokenizer, tiny_llama

VOCAB = 50
DIGITS = np.arange(10, 14)  # a 4-token alphabet: a few hundred candidates share their first ones


@pytest.fixture(scope="module")
def models():
    model = tiny_llama(VOCAB, seed=3, hidden=32)
    return model, JaxLM.from_torch(model, dtype="float32", max_tokens=64)


def _full_nll(model, seqs) -> np.ndarray:
    return np.array([-x.sum() for x in token_logprobs(model, [list(s) for s in seqs]).logp])


def _candidates(seed: int, n: int = 300) -> list[list[int]]:
    """A shared prefix, 1-6 secret tokens from DIGITS, sometimes a closing token, some repeats."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, VOCAB, 9).tolist()
    cands = [prefix + rng.choice(DIGITS, int(k)).tolist() + ([7] if rng.random() < 0.3 else [])
             for k in rng.integers(1, 7, n)]
    return cands + cands[:7]


def _suffix(seqs, lcp):
    lengths = np.array([len(s) for s in seqs])
    arr = np.zeros((len(seqs), lengths.max()), np.int64)
    for r, s in enumerate(seqs):
        arr[r, : len(s)] = s
    return arr[:, lcp:], lengths - lcp


def test_plan_counts_equal_a_set_of_prefixes():
    seqs = _candidates(0)
    suffix, n_tok = _suffix(seqs, 9)
    plan = plan_trie(suffix, n_tok, share=1.0)
    inputs = {tuple(s[9 : len(s) - 1]) for s in seqs}  # each candidate's own input tokens
    for d, lv in enumerate(plan.levels, start=1):
        assert len(lv.tokens) == len({p[:d] for p in inputs if len(p) >= d})
    assert plan.plain_forward_tokens == sum(len(s) - 10 for s in seqs)
    assert plan.forward_tokens == len({p[:d] for p in inputs for d in range(1, len(p) + 1)})
    assert plan.forward_tokens < plan.plain_forward_tokens / 2


@pytest.mark.parametrize("share,cache,runs", [
    (0.9, None, "levels+rows"), (0.0, None, "rows"), (1.0, 6, "levels+rows")])  # cache: at most 6 nodes' keys and values (level 1's 4)
def test_trie_equals_full_candidates(models, share, cache, runs):
    model, lm = models
    seqs = _candidates(1)
    suffix, n_tok = _suffix(seqs, 9)
    node_bytes = 2 * 2 * 2 * 8 * 4  # K and V x layers x kv heads x head dim x f32
    plan = plan_trie(suffix, n_tok, share=share,
                     max_nodes=None if cache is None else cache)
    assert ("+".join(["levels"] * bool(plan.levels) + ["rows"] * bool(len(plan.row_ids)))
            == runs)
    seen = []
    got = trie_nll(lm, seqs, share=share,
                   max_cache_bytes=1 << 40 if cache is None else cache * node_bytes,
                   progress=lambda done, total, _: seen.append((done, total)))
    assert seen[-1] == (len(seqs), len(seqs)) and seen == sorted(seen)  # reaches n, never back
    np.testing.assert_allclose(got, _full_nll(model, seqs), atol=1e-4, rtol=0)
    np.testing.assert_allclose(got, lm.shared_prefix_nll(seqs), atol=1e-4, rtol=0)


def test_only_levels_and_no_common_prefix(models):
    model, lm = models
    # every candidate 3 own tokens over 2 values: all 8, so the levels cover every input token
    seqs = [[5, 6, *c] for c in itertools.product((10, 11), repeat=3)]
    plan = plan_trie(*_suffix(seqs, 2), share=1.0)
    assert len(plan.levels) == 2 and not len(plan.row_ids)
    np.testing.assert_allclose(trie_nll(lm, seqs, share=1.0), _full_nll(model, seqs), atol=1e-4,
                               rtol=0)
    no_prefix = [[i % VOCAB, *s[1:]] for i, s in enumerate(seqs)]
    np.testing.assert_allclose(trie_nll(lm, no_prefix), _full_nll(model, no_prefix), atol=1e-4,
                               rtol=0)


def test_too_short_is_refused(models):
    _, lm = models
    with pytest.raises(ValueError, match="at least 2 tokens"):
        trie_nll(lm, [[1, 2, 3], [4]])


def test_exposure_ranks_and_likelihoods_equal_the_full_scoring():
    words, _, _ = make_corpus(0)
    tok = make_tokenizer(words)
    model = tiny_llama(len(tok), seed=2)
    lm = JaxLM.from_torch(model, dtype="float32", max_tokens=128)
    codec = Codec(tok)
    template = "my pin is {secret} key"
    canaries = sample_secrets("0123456789", 5, 12, 3)
    cands = sample_secrets("0123456789", 5, 400, 4)
    got_c = score_secrets(lm, codec, template, canaries, batch_size=64)
    got = score_secrets(lm, codec, template, cands, batch_size=64)
    texts = [template.replace("{secret}", s) for s in canaries + cands]
    want = _full_nll(model, codec.batch(texts))
    np.testing.assert_allclose(np.concatenate([got_c, got]), want, atol=1e-4, rtol=0)
    np.testing.assert_array_equal(exact_exposure(got_c, got),
                                  exact_exposure(want[:12], want[12:]))


def test_flax_llama_weights(models):
    """memaudit's own Flax Llama (its init, converted to the HF names): its forward is the oracle."""
    import jax

    from memaudit.models.convert import flax_to_hf
    from memaudit.models.flax_llama import FlaxLlama, FlaxLlamaConfig, init_params

    cfg = FlaxLlamaConfig.from_preset("tiny", vocab_size=VOCAB)
    params = init_params(cfg, preset="tiny", seed=4)
    hf_cfg = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": cfg.hidden_size,
              "intermediate_size": cfg.intermediate_size,
              "num_hidden_layers": cfg.num_hidden_layers,
              "num_attention_heads": cfg.num_attention_heads,
              "num_key_value_heads": cfg.num_key_value_heads, "rms_norm_eps": cfg.rms_norm_eps,
              "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_word_embeddings}
    lm = JaxLM.from_state_dict(flax_to_hf(params), hf_cfg, dtype="float32", max_tokens=64)
    seqs = _candidates(5, 120)
    got = trie_nll(lm, seqs)
    suffix, n_tok = _suffix(seqs, 0)  # right-padded: causal, so no real token reads a pad
    logits = FlaxLlama(cfg).apply({"params": params}, suffix.astype(np.int32))
    lsm = np.asarray(jax.nn.log_softmax(logits, axis=-1), np.float64)
    want = [-lsm[r, np.arange(n - 1), suffix[r, 1:n]].sum() for r, n in enumerate(n_tok)]
    np.testing.assert_allclose(got, np.array(want), atol=1e-4, rtol=0)
