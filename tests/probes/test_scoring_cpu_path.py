"""The CPU scoring path's shortcuts against plain forward passes: the shared prefix run once for
exposure's and PII's candidates, each document tokenized once, and the thread count taken from
the machine."""

import numpy as np
import pytest
import torch

from memaudit.probes import scoring
from memaudit.probes.scoring import grouped_prefix_nll, shared_prefix_nll, token_logprobs
from memaudit.probes.targets import Codec
from tests.probes.conftest import make_tokenizer, tiny_llama


def tiny_gpt2(vocab: int, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model(request):
    torch.manual_seed(0)
    return tiny_llama(60, seed=5, hidden=32) if request.param == "llama" else tiny_gpt2(60, seed=5)


def oracle_logp(model, s: list[int]) -> np.ndarray:
    """log p(x_t | x_<t) of one unpadded sequence, float64 log-softmax of the model's logits."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([s])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1)[torch.arange(len(s) - 1), torch.tensor(s[1:])].numpy()


@pytest.mark.parametrize("start", [1, 4, 8, 10])
def test_shared_prefix_nll_equals_whole_sequences(model, monkeypatch, start):
    """Sums from `start` (within the 8-token shared prefix, or past it) over candidates whose
    suffixes have 1-9 tokens (a 1-token suffix never enters the forward pass), several batches:
    equal to the whole sequences' scores and the oracle's, in input order."""
    monkeypatch.setattr(scoring, "CPU_MAX_BATCH_TOKENS", 30)
    rng = np.random.default_rng(start)
    pre = rng.integers(0, 60, 8).tolist()
    shortest = 1 if start <= 8 else 3
    seqs = [pre + rng.integers(0, 60, int(k)).tolist() for k in rng.integers(shortest, 10, 23)]
    if start <= 8:
        seqs[3] = pre + [int(seqs[4][8])]  # two candidates of one token
    seen = []
    got = shared_prefix_nll(model, seqs, start=start, batch_size=1,
                            progress=lambda d, n, _: seen.append((d, n)))
    assert seen[-1] == (len(seqs), len(seqs)) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    whole = token_logprobs(model, seqs).logp
    want = np.array([-x[start - 1 :].sum() for x in whole])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    oracle = np.array([-oracle_logp(model, s)[start - 1 :].sum() for s in seqs])
    np.testing.assert_allclose(got, oracle, atol=1e-4)


@pytest.mark.parametrize("budget", [30, 1024])
def test_grouped_prefix_nll_equals_each_group_alone(model, monkeypatch, budget):
    """PII's items batched together: groups with prefixes of 2-11 tokens (padded beside longer
    ones), starts inside and past the prefix, suffixes of 1-6 tokens, a group without a shared
    prefix and an empty group; under a 30-token budget (many batches) and the CPU's 1,024 (one):
    each group's sums equal `token_logprobs` of its sequences (1e-6 relative) and the float64
    oracle's, in input order."""
    monkeypatch.setattr(scoring, "CPU_MAX_BATCH_TOKENS", budget)
    rng = np.random.default_rng(budget)
    groups, starts = [], []
    for _ in range(9):
        pre = rng.integers(0, 60, int(rng.integers(2, 12))).tolist()
        groups.append([pre + rng.integers(0, 60, int(k)).tolist() for k in rng.integers(1, 7, 6)])
        groups[-1][1] = pre + [int(groups[-1][2][len(pre)])]  # a one-token suffix beside another
        starts.append(int(rng.integers(1, len(pre) + 1)))
    groups.append([[1, 2, 3, 4], [5, 6, 7]])  # no shared prefix: scored whole
    starts.append(2)
    groups.append([])
    starts.append(1)
    seen = []
    got = grouped_prefix_nll(model, groups, starts, batch_size=1,
                             progress=lambda d, n, _: seen.append((d, n)))
    n = sum(len(g) for g in groups)
    assert seen[-1] == (n, n) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert [len(x) for x in got] == [len(g) for g in groups]
    for g, st, x in zip(groups[:-1], starts, got, strict=False):
        whole = token_logprobs(model, g).logp
        np.testing.assert_allclose(x, [-lp[st - 1 :].sum() for lp in whole], rtol=1e-6)
        np.testing.assert_allclose(x, [-oracle_logp(model, s)[st - 1 :].sum() for s in g],
                                   atol=1e-4)
    with pytest.raises(ValueError, match="start must lie"):
        grouped_prefix_nll(model, [[[1, 2, 3], [1, 2, 4]], [[1, 2]]], [1, 2])


def test_shared_prefix_nll_without_a_shared_prefix(model):
    rng = np.random.default_rng(7)
    seqs = [rng.integers(0, 60, n).tolist() for n in (5, 9, 3)]
    seqs[1][0] = (seqs[0][0] + 1) % 60
    got = shared_prefix_nll(model, seqs, start=2)
    np.testing.assert_allclose(got, [-oracle_logp(model, s)[1:].sum() for s in seqs], atol=1e-4)
    with pytest.raises(ValueError, match="start must lie"):
        shared_prefix_nll(model, seqs, start=3)


def test_each_text_is_tokenized_once():
    tok = make_tokenizer(["alpha", "beta", "gamma"])
    calls = []
    real = tok.__call__

    class Counting:
        def __getattr__(self, name):
            return getattr(tok, name)

        def __call__(self, text, **kw):
            calls.append(text)
            return real(text, **kw)

    codec = Codec(Counting(), start_id=0)
    texts = ["alpha beta", "gamma", "alpha beta", "beta beta gamma"]
    batch = codec.encode_all(texts)
    assert len(calls) == 1 and calls[0] == ["alpha beta", "gamma", "beta beta gamma"]
    assert batch == [[0, *real(t, add_special_tokens=False)["input_ids"]] for t in texts]
    again = [codec.encode(t) for t in texts]
    assert again == batch and len(calls) == 1
    again[0].append(99)  # a caller's list is its own
    assert codec.encode(texts[0]) == batch[0]


def test_probe_threads_from_the_machine_unless_set(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(scoring, "machine_threads", lambda: 1 if before != 1 else 2)
    with scoring.probe_threads():
        assert torch.get_num_threads() == (1 if before != 1 else 2)
    assert torch.get_num_threads() == before
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    with scoring.probe_threads():
        assert torch.get_num_threads() == before
    assert 1 <= scoring.machine_threads() <= (__import__("os").cpu_count() or 1)
