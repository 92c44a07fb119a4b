"""Outside models as a user brings them, built here with plain transformers and peft (no download).

A GPT-2 with a byte-level BPE trained by `tokenizers` on public text (the base), then fine-tuned
on member documents twice: a LoRA adapter (peft, saved as an adapter folder naming the base) and
the adapter merged into a full model folder. The text is random words, so whatever the fine-tune
predicts better than the base it memorised. Non-members come from the same generator.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

WORDS = [f"w{i}" for i in range(300)]
CTX = 64


@dataclass
class Outside:
    root: Path
    base_dir: Path
    adapter_dir: Path
    merged_dir: Path
    members: Path  # members.jsonl
    nonmembers: Path  # nonmembers.txt
    member_texts: list[str]
    nonmember_texts: list[str]


def _texts(rng, n: int, words: int = 14) -> list[str]:
    return [" ".join(rng.choice(WORDS, words)) for _ in range(n)]


def bpe_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")


def train_lm(model, tok, texts: list[str], steps: int, lr: float, seed: int) -> None:
    """Plain AdamW on [eos] + text, CTX tokens at most, batches of 32."""
    eos = tok.eos_token_id
    seqs = [[eos, *tok(t)["input_ids"]][:CTX] for t in texts]
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for _ in range(steps):
        idx = rng.choice(len(seqs), min(32, len(seqs)), replace=False)
        width = max(len(seqs[i]) for i in idx)
        ids = torch.full((len(idx), width), eos)
        labels = torch.full((len(idx), width), -100)
        for r, i in enumerate(idx):
            ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
            labels[r, : len(seqs[i])] = torch.tensor(seqs[i])
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def build(root: Path, *, n: int = 40, ft_steps: int = 150, n_public: int = 400,
          n_nonmembers: int | None = None) -> Outside:
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    public, members = _texts(rng, n_public), _texts(rng, n)
    nonmembers = _texts(rng, n if n_nonmembers is None else n_nonmembers)
    tok = bpe_tokenizer(public)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=CTX, n_embd=64, n_layer=2, n_head=4,
                     bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    base = GPT2LMHeadModel(cfg)
    train_lm(base, tok, public, steps=40, lr=3e-3, seed=1)
    base_dir = root / "base"
    base.save_pretrained(base_dir)
    tok.save_pretrained(base_dir)
    # the fine-tune starts from the saved base, so adapter_config.json names its folder
    ft = get_peft_model(GPT2LMHeadModel.from_pretrained(base_dir),
                        LoraConfig(r=32, lora_alpha=64, target_modules=["c_attn", "c_fc", "c_proj"],
                                   fan_in_fan_out=True, task_type="CAUSAL_LM"))
    train_lm(ft, tok, members, steps=ft_steps, lr=5e-3, seed=2)
    adapter_dir = root / "adapter"
    ft.save_pretrained(adapter_dir)
    merged_dir = root / "merged"
    ft.merge_and_unload().save_pretrained(merged_dir)
    tok.save_pretrained(merged_dir)
    mem = root / "members.jsonl"
    mem.write_text("".join(json.dumps({"id": f"m{i}", "text": t}) + "\n"
                           for i, t in enumerate(members)))
    non = root / "nonmembers.txt"
    non.write_text("\n".join(nonmembers) + "\n")
    return Outside(root, base_dir, adapter_dir, merged_dir, mem, non, members, nonmembers)


def hub_cache(root: Path, repo_id: str, model_dir: Path) -> Path:
    """A hub cache (HF_HUB_CACHE layout) holding `model_dir` as `repo_id`'s main snapshot."""
    import shutil

    repo = root / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 39 + "1"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    return root


def mean_logp(model, tok, texts: list[str]) -> np.ndarray:
    """The oracle: mean log p(x_t | x_<t) of [eos] + text under a plain forward pass."""
    out = []
    with torch.no_grad():
        for t in texts:
            ids = torch.tensor([[tok.eos_token_id, *tok(t)["input_ids"]]])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
            out.append(float(logp.gather(-1, ids[0, 1:, None]).mean()))
    return np.array(out)


def strided_nll(model, ids: list[int], window: int, stride: int) -> float:
    """Mean token NLL of `ids` by Hugging Face's sliding-window loop."""
    total, count, prev_end = 0.0, 0, 0
    x = torch.tensor([ids])
    with torch.no_grad():
        for begin in range(0, len(ids), stride):
            end = min(begin + window, len(ids))
            new = end - prev_end  # tokens no earlier window scored
            inp = x[:, begin:end]
            labels = inp.clone()
            labels[:, :-new] = -100
            n = int((labels[:, 1:] != -100).sum())  # the model shifts labels by one
            total += float(model(input_ids=inp, labels=labels).loss) * n
            count += n
            prev_end = end
            if end == len(ids):
                break
    assert count == len(ids) - 1
    return total / count
