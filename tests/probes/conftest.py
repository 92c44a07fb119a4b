"""A tiny memorising Llama, its tokenizer and a run directory, shared by the probe tests.

The corpus is random words (so anything the model predicts well it memorised): training users
with their own word subsets, member documents repeated 1, 4 or 16 times, holdout documents of the
same users, held-out users, Secret Sharer canaries "my pin is dddd" repeated 1-32 times (|R| = 10^4,
small enough to enumerate), 100 never-inserted references and 200 audit canaries each included
with probability 1/2.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

SEQ_WORDS = 24
N_WORDS = 200
STEPS = 250
LR = 5e-3


@dataclass
class Fixture:
    run: Path
    init_dir: Path  # HF model dir with the untrained initial weights + tokenizer
    model: object
    init_model: object
    tokenizer: object
    canaries: dict
    docs: list[dict]
    train_seconds: float
    final_loss: float


def make_tokenizer(words: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<pad>": 1, "<unk>": 2, "▁": 3}
    for d in "0123456789":
        vocab[d] = len(vocab)
    for w in ["my", "pin", "is", "audit", "key", *words]:
        vocab["▁" + w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Metaspace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def tiny_llama(vocab_size: int, seed: int = 0, hidden: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=1,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float().eval()


def make_corpus(seed: int = 0):
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words: list[str] = []
    while len(words) < N_WORDS:
        w = "".join(rng.choice(letters, rng.integers(3, 7)))
        if w not in words and w not in ("my", "pin", "is", "audit", "key"):
            words.append(w)
    docs = []

    def doc(user, role, subset, repeats, pii=False):
        ws = list(rng.choice(subset, SEQ_WORDS))
        text = " ".join(ws)
        item = None
        if pii:
            start = len(" ".join(ws[:16])) + 1
            item = [{"type": "word", "value": ws[16], "start": start}]
        docs.append(
            {
                "id": f"d{len(docs)}",
                "user": user,
                "text": text,
                "pii": item or [],
                "kind": "doc",
                "canary_id": None,
                "repeats": repeats,
                "role": role,
            }
        )

    for u in range(20):
        subset = rng.choice(words, 30, replace=False)
        for j in range(3):
            reps = 1 if u < 12 else (4 if u < 16 else 16)
            doc(f"u{u}", "member", subset, reps, pii=reps == 16)
        for j in range(3):
            doc(f"u{u}", "holdout", subset, 0)
    for u in range(10):
        subset = rng.choice(words, 30, replace=False)
        for j in range(4):
            doc(f"h{u}", "heldout_user", subset, 0, pii=j < 2)
    secrets = set()

    def secret():
        while True:
            s = "".join(rng.choice(list("0123456789"), 4))
            if s not in secrets:
                secrets.add(s)
                return s

    inserted, n = [], 0
    for reps in (1, 2, 4, 8, 16, 32):
        for owner in ("user", "spread"):
            s = secret()
            inserted.append(
                {
                    "id": f"c{n}",
                    "secret": s,
                    "text": f"my pin is {s}",
                    "repetitions": reps,
                    "owner_kind": owner,
                    "users": [f"u{n % 20}"],
                }
            )
            n += 1
    refs = []
    for i in range(100):
        s = secret()
        refs.append({"id": f"r{i}", "secret": s, "text": f"my pin is {s}"})
    audit = []
    for i in range(200):
        ws = " ".join(rng.choice(words, 6))
        audit.append(
            {
                "id": f"a{i}",
                "secret": ws,
                "text": f"audit key is {ws}",
                "user": f"a{i}",
                "included": bool(rng.random() < 0.5),
            }
        )
    canaries = {
        "template": "my pin is {secret}",
        "secret_length": 4,
        "alphabet": "0123456789",
        "inserted": inserted,
        "references": refs,
        "audit": audit,
    }
    return words, docs, canaries


def train(
    model, seqs: list[list[int]], *, steps: int, batch: int = 32, lr: float = 3e-3, seed: int = 0
) -> float:
    """Plain AdamW on right-padded batches; returns the last loss."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    order, pos, loss = rng.permutation(len(seqs)), 0, torch.tensor(0.0)
    for _ in range(steps):
        if pos + batch > len(order):
            order, pos = rng.permutation(len(seqs)), 0
        idx = order[pos : pos + batch]
        pos += batch
        width = max(len(seqs[i]) for i in idx)
        ids = torch.full((len(idx), width), 1, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(idx):
            ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
            mask[r, : len(seqs[i])] = 1
        labels = ids.masked_fill(mask == 0, -100)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())


def write_run(run: Path, model, tokenizer, docs, canaries) -> None:
    (run / "data").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"status": "complete", "backend": "parallel"}))
    model.save_pretrained(run / "model")
    tokenizer.save_pretrained(run / "model")
    with open(run / "data" / "documents.jsonl", "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs)
    (run / "canaries.json").write_text(json.dumps(canaries))
    (run / "data" / "meta.json").write_text(json.dumps({"eos_id": 0, "pad_id": 1}))


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> Fixture:
    import time

    torch.set_num_threads(1)  # the test machine is shared; one thread is steadier
    words, docs, canaries = make_corpus(0)
    tok = make_tokenizer(words)
    init = tiny_llama(len(tok), seed=0)
    model = tiny_llama(len(tok), seed=0)

    def enc(text):
        return [0] + tok(text, add_special_tokens=False)["input_ids"]

    seqs = []
    for d in docs:
        if d["role"] == "member":
            seqs += [enc(d["text"])] * d["repeats"]
    for c in canaries["inserted"]:
        seqs += [enc(c["text"])] * c["repetitions"]
    seqs += [enc(a["text"]) for a in canaries["audit"] if a["included"]]
    t0 = time.perf_counter()
    loss = train(model, seqs, steps=STEPS, lr=LR)
    seconds = time.perf_counter() - t0
    base = tmp_path_factory.mktemp("probes")
    write_run(base / "run", model, tok, docs, canaries)
    init.save_pretrained(base / "init")
    tok.save_pretrained(base / "init")
    return Fixture(
        run=base / "run",
        init_dir=base / "init",
        model=model,
        init_model=init,
        tokenizer=tok,
        canaries=canaries,
        docs=docs,
        train_seconds=seconds,
        final_loss=loss,
    )


FAST = {
    "extraction_ks": (8,),
    "extraction_m": 12,
    "goldfish_m": 12,
    "goldfish_min_prompt": 4,
    "nd_samples": 32,
    "nd_length": 24,
    "nd_top_n": 10,
    "nd_ngram": 12,
    "n_boot": 200,
    "batch_size": 256,
    "pii_candidates": 5,
}


@pytest.fixture(scope="session")
def probed(trained):
    """probes.json documents of the trained model and of its untrained initial weights."""
    from memaudit.config import ProbeConfig
    from memaudit.probes.runner import run_probes
    from memaudit.probes.targets import resolve_target

    target = resolve_target(trained.run)
    done = run_probes(
        target, ProbeConfig(device="cpu", **FAST), model=trained.model, tokenizer=trained.tokenizer
    )
    init = run_probes(
        target,
        ProbeConfig(device="cpu", probes=("exposure", "audit"), **FAST),
        model=trained.init_model,
        tokenizer=trained.tokenizer,
    )
    return done.document, init.document


@pytest.fixture(scope="session")
def outside(tmp_path_factory):
    """An outside GPT-2 (byte-level BPE), its LoRA fine-tune and the merged fine-tune, built with
    plain transformers + peft (tests/probes/outside_models.py)."""
    from tests.probes.outside_models import build

    return build(tmp_path_factory.mktemp("outside"))
