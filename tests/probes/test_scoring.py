"""The batched scorer and the KV-cache batched decoder against one-sequence-at-a-time oracles."""

import numpy as np
import pytest
import torch

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


def test_sampling_is_seeded_and_top_k(model):
    a = decode(model, [[3]] * 6, 10, top_k=5, seed=7)
    b = decode(model, [[3]] * 6, 10, top_k=5, seed=7)
    assert (a == b).all() and len({tuple(r) for r in a.tolist()}) > 1
    with torch.no_grad():  # the first sampled token is among the 5 most likely after the prompt
        top5 = set(
            torch.topk(model(input_ids=torch.tensor([[3]])).logits[0, -1], 5).indices.tolist()
        )
    assert set(a[:, 0].tolist()) <= top5
