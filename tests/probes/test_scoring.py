"""The batched scorer and the KV-cache batched decoder against one-sequence-at-a-time oracles."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from memaudit.probes import scoring
from memaudit.probes.scoring import decode, token_logprobs
from tests.probes.conftest import tiny_llama


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_llama(50, seed=3, hidden=32)


def test_batched_logprobs_equal_unpadded_calls(model):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 50, n).tolist() for n in (2, 9, 5, 17, 3, 12, 7)]
    ts = token_logprobs(model, seqs, batch_size=3, with_stats=True)
    for s, lp, mu, sd in zip(seqs, ts.logp, ts.mu, ts.sigma, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([s])).logits[0, :-1].double()
        ls = torch.log_softmax(logits, -1)
        np.testing.assert_allclose(
            lp, ls[torch.arange(len(s) - 1), torch.tensor(s[1:])].numpy(), atol=1e-4
        )
        p = ls.exp()
        m = (p * ls).sum(-1)
        np.testing.assert_allclose(mu, m.numpy(), atol=1e-4)
        np.testing.assert_allclose(sd, ((p * ls**2).sum(-1) - m**2).sqrt().numpy(), atol=1e-4)
    with pytest.raises(ValueError):
        token_logprobs(model, [[1]])


def test_token_batches_cover_every_index_once_under_the_budget():
    rng = np.random.default_rng(2)
    lengths = rng.integers(2, 40, 200)
    order = np.argsort(-lengths, kind="stable")
    batches = list(scoring._token_batches(order, lengths, 64))
    np.testing.assert_array_equal(np.concatenate(batches), order)
    for b in batches:  # over budget only when one sequence alone is longer than it
        assert len(b) * lengths[b].max() <= 64 or len(b) == 1


def test_bucketed_scores_come_back_in_input_order(model, monkeypatch):
    """Several length buckets, a sequence over the token budget, ragged vocab chunks."""
    monkeypatch.setattr(scoring, "CPU_MAX_BATCH_TOKENS", 24)
    monkeypatch.setattr(scoring, "CPU_CHUNK_LOGITS", 3 * 50)  # 3 rows of the 50-token vocab
    rng = np.random.default_rng(4)
    seqs = [rng.integers(0, 50, n).tolist() for n in (5, 31, 2, 12, 12, 7, 25, 3, 18, 9, 2, 14)]
    seen = []
    ts = token_logprobs(
        model, seqs, batch_size=1, with_stats=True, progress=lambda d, n, _: seen.append(d)
    )
    assert seen[-1] == len(seqs) and len(seen) > 3 and seen == sorted(seen)
    for i, s in enumerate(seqs):
        one = token_logprobs(model, [s], with_stats=True)
        assert len(ts.logp[i]) == len(s) - 1
        for got, ref in zip((ts.logp, ts.mu, ts.sigma), (one.logp, one.mu, one.sigma)):
            assert got[i].dtype == np.float64
            np.testing.assert_allclose(got[i], ref[0], atol=1e-5)


def test_sigma_keeps_precision_on_flat_distributions():
    """mu and sigma against float64 over a 4096-token vocab with near-uniform predictions.

    There mu^2 (~70) dwarfs sigma^2 (~0.01), so fp32 E[l^2] - mu^2 would be off by ~2e-4.
    """

    class Table(torch.nn.Module):  # next-token logits looked up from the current token
        def __init__(self, vocab):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=g) * 0.1)

        def forward(self, input_ids, attention_mask=None, use_cache=False):
            return SimpleNamespace(logits=self.table[input_ids])

    model = Table(4096)
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, 4096, n).tolist() for n in (40, 3, 17)]
    ts = token_logprobs(model, seqs, with_stats=True)
    for s, lp, mu, sd in zip(seqs, ts.logp, ts.mu, ts.sigma, strict=True):
        ls = torch.log_softmax(model.table.detach()[s[:-1]].double(), -1)
        p = ls.exp()
        m = (p * ls).sum(-1)
        np.testing.assert_allclose(lp, ls[torch.arange(len(s) - 1), s[1:]].numpy(), atol=1e-5)
        np.testing.assert_allclose(mu, m.numpy(), atol=1e-4)
        np.testing.assert_allclose(
            sd, (p * (ls - m[:, None]) ** 2).sum(-1).sqrt().numpy(), atol=1e-5
        )


def test_batched_greedy_equals_generate_per_prompt(model):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, 50, n).tolist() for n in (1, 6, 3, 11, 4)]
    got = decode(model, prompts, 8, batch_size=4, pad_id=1)
    for p, g in zip(prompts, got, strict=True):
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=8,
                min_new_tokens=8,
                do_sample=False,
                pad_token_id=1,
            )
        assert g.tolist() == ref[0, len(p) :].tolist()


@pytest.mark.parametrize(("rows", "tokens"), [(1, 1 << 14), (3, 1 << 14), (128, 40), (128, 1 << 14)])
def test_greedy_batches_of_any_size_give_the_same_tokens(model, monkeypatch, rows, tokens):
    """Greedy decoding's CPU floor of rows a batch (capped by the batch's tokens) changes how the
    prompts are batched, not the tokens: each row equals `generate` on its prompt alone; sampled
    decoding keeps `batch_size` rows, so a seed draws the same samples whatever the floor."""
    monkeypatch.setattr(scoring, "CPU_DECODE_ROWS", rows)
    monkeypatch.setattr(scoring, "CPU_DECODE_TOKENS", tokens)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(2, 50, int(n)).tolist() for n in rng.integers(1, 12, 9)]
    got = decode(model, prompts, 6, batch_size=2, pad_id=1)
    for p, g in zip(prompts, got, strict=True):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=1)
        assert g.tolist() == ref[0, len(p) :].tolist()
    sampled = decode(model, prompts, 6, batch_size=2, pad_id=1, top_k=5, seed=3)
    monkeypatch.setattr(scoring, "CPU_DECODE_ROWS", 1)
    assert (decode(model, prompts, 6, batch_size=2, pad_id=1, top_k=5, seed=3) == sampled).all()


def test_sampling_is_seeded_and_top_k(model):
    a = decode(model, [[3]] * 6, 10, top_k=5, seed=7)
    b = decode(model, [[3]] * 6, 10, top_k=5, seed=7)
    assert (a == b).all() and len({tuple(r) for r in a.tolist()}) > 1
    with torch.no_grad():  # the first sampled token is among the 5 most likely after the prompt
        top5 = set(
            torch.topk(model(input_ids=torch.tensor([[3]])).logits[0, -1], 5).indices.tolist()
        )
    assert set(a[:, 0].tolist()) <= top5
