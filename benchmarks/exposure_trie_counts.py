"""How much of exposure's forward pass the trie of candidates saves, on real candidate sets.

Tokenizes the canary template with --candidates sampled secrets (as `memaudit probe` draws them:
uniform digits, `memaudit.probes.exposure.sample_secrets`) under each tokenizer and counts, after
the candidates' common token prefix, the distinct token prefixes at each depth (the trie's
levels), the input tokens of the plain path (every candidate, every token but its last) and of
the trie plan (`memaudit.probes.jax_trie.plan_trie`). No model: counts only. Prints JSON.

Tokenizers: memaudit's (every digit its own token) and a byte-level BPE without the digit split
(GPT-2's kind: merges join digits into tokens of 1-3 digits, unevenly), both trained here on the
same synthetic corpus (`memaudit.data.synth`), or any saved ones with --tokenizer DIR.

    python benchmarks/exposure_trie_counts.py --secret-lengths 6,8,9 --candidates 100000
"""

from __future__ import annotations

import argparse
import json


def plain_bpe(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def counts(tok, template: str, length: int, n: int, seed: int) -> dict:
    from memaudit.probes.exposure import sample_secrets
    from memaudit.probes.jax_scoring import as_padded, common_prefix_len
    from memaudit.probes.jax_trie import plan_trie

    prefix, suffix = template.split("{secret}")
    texts = [prefix + s + suffix for s in sample_secrets("0123456789", length, n, seed)]
    arr, lengths = as_padded(tok(texts)["input_ids"])
    lcp = common_prefix_len(arr, lengths)
    plan = plan_trie(arr[:, lcp:], lengths - lcp, share=1.0)
    auto = plan_trie(arr[:, lcp:], lengths - lcp)
    own = lengths - lcp
    return {"secret_digits": length, "candidates": n, "common_prefix_tokens": lcp,
            "own_tokens": {"min": int(own.min()), "max": int(own.max()),
                           "mean": round(float(own.mean()), 2)},
            "distinct_prefixes_per_depth": [len(lv.tokens) for lv in plan.levels],
            "plain_input_tokens": plan.plain_forward_tokens,
            "full_trie_input_tokens": plan.forward_tokens,
            "full_trie_saving": round(plan.plain_forward_tokens / max(1, plan.forward_tokens), 3),
            "plan_levels": len(auto.levels), "plan_input_tokens": auto.forward_tokens,
            "plan_saving": round(auto.plain_forward_tokens / max(1, auto.forward_tokens), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", action="append", default=[], help="a saved HF tokenizer "
                    "directory (repeatable); default: the two trained here")
    ap.add_argument("--template", default="my account pin is {secret}")
    ap.add_argument("--secret-lengths", default="6,8,9")
    ap.add_argument("--candidates", type=int, default=100_000)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    toks = {}
    if args.tokenizer:
        from transformers import AutoTokenizer

        toks = {d: AutoTokenizer.from_pretrained(d) for d in args.tokenizer}
    else:
        from memaudit.data.synth import synthesize
        from memaudit.models.tokenizer import train_tokenizer

        texts = [d.text for d in synthesize(users=300, docs_per_user=6, seed=1)]
        toks = {"memaudit (digits split)": train_tokenizer(texts, vocab_size=args.vocab),
                "byte-level BPE (digits merged)": plain_bpe(texts, args.vocab)}
    out = {"benchmark": "exposure_trie_counts", "template_tokens_shared": True,
           "candidates": args.candidates, "results": []}
    for name, tok in toks.items():
        for length in (int(x) for x in args.secret_lengths.split(",")):
            out["results"].append({"tokenizer": name,
                                   **counts(tok, args.template, length, args.candidates,
                                            args.seed)})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
