"""Defect 3 on a GPT-2-style byte-level BPE (trained here, no download) and a small GPT-2.

The tokenizer merges the space before a number with its first digit (" 4" is one token), so a
prefix/secret split that counts that token as prefix never scores the first digit, and a
completion prompt that ends in the template's trailing space asks for a bare-space token the
model never saw. As outside tokenizers do, it merges the space with some digits only: no
training number starts with 0, so " 0" stays two tokens (a space of its own, then the digit),
and candidates starting with 0 split where the others merge: exposure must still rank every
candidate on the same quantity (the whole canary's log-perplexity).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memaudit.probes.exposure import enumerate_secrets, exact_exposure, run_exposure
from memaudit.probes.extraction import canary_completion
from memaudit.probes.loaders import Canaries
from memaudit.probes.targets import Codec

SECRET = "482"
TEMPLATE = "my pin is {secret}"


def _tokenizer(texts):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's regex
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")


@pytest.fixture(scope="module")
def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    filler = [f"my pin is {rng.integers(100, 1000)}" for _ in range(300)]  # never a leading 0
    words = [" ".join(rng.choice(["the", "bank", "code", "call", "me", "at"], 6)) for _ in range(200)]
    tok = _tokenizer(filler + words + [TEMPLATE.format(secret=SECRET)] * 20)
    eos = tok.eos_token_id
    assert len(tok.tokenize(" 4")) == 1, "the tokenizer must merge the space with the digit"
    assert len(tok.tokenize(" 0")) == 2, "... and keep it apart from a 0, which no number starts with"
    cfg = GPT2Config(vocab_size=len(tok), n_positions=32, n_embd=64, n_layer=2, n_head=4,
                     bos_token_id=eos, eos_token_id=eos)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    texts = [TEMPLATE.format(secret=SECRET)] * 64 + filler[:64] + words[:64]
    seqs = [[eos] + tok(t)["input_ids"] for t in texts]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _step in range(150):
        idx = rng.choice(len(seqs), 32, replace=False)
        width = max(len(seqs[i]) for i in idx)
        ids = torch.full((32, width), eos)
        labels = torch.full((32, width), -100)
        for r, i in enumerate(idx):
            ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
            labels[r, : len(seqs[i])] = torch.tensor(seqs[i])
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return model, tok


def _canaries(extra_refs: int = 30) -> Canaries:
    rng = np.random.default_rng(1)
    refs = ["047", "005"] + [f"{x:03d}" for x in rng.choice(1000, extra_refs + 1, replace=False)
                             if f"{x:03d}" not in (SECRET, "047", "005")]
    return Canaries.from_json({
        "template": TEMPLATE, "secret_length": 3, "alphabet": "0123456789",
        "inserted": [{"id": "c0", "secret": SECRET, "text": TEMPLATE.format(secret=SECRET),
                      "repetitions": 64, "owner_kind": "user"}],
        "references": [{"id": f"r{i}", "secret": s, "text": TEMPLATE.format(secret=s)}
                       for i, s in enumerate(refs[:extra_refs])],
    })


@torch.inference_mode()
def _whole_string_logppl(model, tok, texts):
    """Plain transformers: minus the summed log-probability of every token after the start."""
    eos = tok.eos_token_id
    out = []
    for t in texts:
        ids = torch.tensor([[eos] + tok(t)["input_ids"]])
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        out.append(-float(logp.gather(-1, ids[0, 1:, None]).sum()))
    return np.array(out)


def test_exposure_equals_whole_string_scoring(gpt2):
    model, tok = gpt2
    codec = Codec(tok, start_id=tok.eos_token_id)
    c = _canaries()
    res = run_exposure(model, codec, c, batch_size=64, enumerate_max=1000, n_boot=50)
    space = enumerate_secrets("0123456789", 3)
    whole = _whole_string_logppl(model, tok, [TEMPLATE.format(secret=s) for s in space])
    by_id = {r["id"]: r["exposure"] for r in res["scores"]}
    secrets = {"c0": SECRET, **{r.id: r.secret for r in c.references}}
    for cid, s in secrets.items():
        oracle = exact_exposure(whole[[space.index(s)]], whole)[0]
        # the same quantity as the whole-string oracle: ranks agree but for near-ties that float
        # rounding of batched (padded) and one-at-a-time forward passes can flip (0.002 bits each)
        assert by_id[cid] == pytest.approx(oracle, abs=0.05), cid
    assert by_id["c0"] > 8  # the memorised canary is near the top of 1000


def test_completion_succeeds_where_p_secret_above_half(gpt2):
    model, tok = gpt2
    codec = Codec(tok, start_id=tok.eos_token_id)
    res, completions = canary_completion(model, codec, _canaries(), batch_size=8, n_boot=50)
    row = res["scores"][0]
    assert row["p_secret"] > 0.5, row["p_secret"]
    assert row["greedy"] and completions["c0"].startswith(SECRET)
    assert res["summary"]["max_rate"] == 1.0
