"""Probe throughput: the batched scorer and the batched KV-cache greedy decoder against plain loops.

Same model, same data, side by side:
  scoring  - memaudit.probes.scoring.token_logprobs (length-sorted, padded batches under a token
             budget) vs one model(...) call per sequence computing the same per-token log-probs
             (and, for scoring_with_stats, the Min-K%++ mean and std); tokens scored per second:
             on documents, on canary-length sequences (exposure's candidates), and on the mix of
             both that one probe run scores (scoring_probe_mix: by default the quickstart
             probe's 419 membership documents per 10,000 exposure candidates).
  greedy   - memaudit.probes.scoring.decode (left-padded batches, KV cache) vs one
             model.generate(...) per prompt; new tokens per second.
Batched and loop run in alternating turns; prints one JSON object with the medians of --repeats
turns and the speed-ups, once per --threads value.

    python benchmarks/probe_throughput.py --preset tiny --reduced --threads 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch


def _alternating_medians(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds per function; each repeat runs every function once, in turn.

    Turns alternate (the order flips every repeat) so that load from other processes on a shared
    machine falls on all variants alike; each function runs once untimed first.
    """
    names = list(fns)
    for name in names:
        fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


@torch.inference_mode()
def loop_score(model, seqs, device, with_stats: bool = False) -> None:
    """The plain baseline: one model(...) call per sequence, the same per-token numbers."""
    for s in seqs:
        ids = torch.tensor([s], device=device)
        lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)  # (n-1, vocab)
        tok = lp.gather(-1, ids[0, 1:, None]).squeeze(-1)
        if with_stats:
            p = lp.exp()
            mu = (p * lp).sum(-1)
            sigma = (p * (lp - mu[:, None]).square()).sum(-1).sqrt()
            torch.stack([tok, mu, sigma]).cpu()
        else:
            tok.cpu()


@torch.inference_mode()
def loop_generate(model, prompts, new_tokens, device) -> None:
    for p in prompts:
        ids = torch.tensor([p], device=device)
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )


def _entry(n_items: int, n_tokens: int, batch_size: int, t: dict, label: str = "loop") -> dict:
    return {
        "sequences": n_items,
        "tokens": n_tokens,
        "batch_size": batch_size,
        "batched_tokens_per_s": n_tokens / t["batched"],
        f"{label}_tokens_per_s": n_tokens / t[label],
        "speedup": t[label] / t["batched"],
    }


def run_at(threads: int, model, data: dict, args) -> dict:
    """Every comparison at one intra-op thread count."""
    from memaudit.probes.scoring import decode, token_logprobs

    torch.set_num_threads(threads)
    seqs, short, prompts = data["seqs"], data["short"], data["prompts"]
    dev, bs = args.device, args.batch_size
    n_tokens = sum(len(s) - 1 for s in seqs)
    n_short = sum(len(s) - 1 for s in short)
    docs = _alternating_medians(
        {
            "batched": lambda: token_logprobs(model, seqs, batch_size=bs),
            "loop": lambda: loop_score(model, seqs, dev),
        },
        args.repeats,
    )
    stats = _alternating_medians(
        {
            "batched": lambda: token_logprobs(model, seqs, batch_size=bs, with_stats=True),
            "loop": lambda: loop_score(model, seqs, dev, with_stats=True),
        },
        args.repeats,
    )
    canary = _alternating_medians(
        {
            "batched": lambda: token_logprobs(model, short, batch_size=4 * bs),
            "loop": lambda: loop_score(model, short, dev),
        },
        args.repeats,
    )
    mix = data["mix"]
    n_mix = sum(len(s) - 1 for s in mix)
    probe_mix = _alternating_medians(
        {
            "batched": lambda: token_logprobs(model, mix, batch_size=32),  # the probe's default
            "loop": lambda: loop_score(model, mix, dev),
        },
        args.repeats,
    )
    greedy = _alternating_medians(
        {
            "batched": lambda: decode(model, prompts, args.new_tokens, batch_size=bs),
            "generate_loop": lambda: loop_generate(model, prompts, args.new_tokens, dev),
        },
        args.repeats,
    )
    return {
        "threads": torch.get_num_threads(),
        "scoring": {
            "lengths": [args.min_len, args.max_len],
            **_entry(len(seqs), n_tokens, bs, docs),
        },
        "scoring_with_stats": {
            "lengths": [args.min_len, args.max_len],
            **_entry(len(seqs), n_tokens, bs, stats),
        },
        "scoring_canary_length": {
            "lengths": [args.short_len, args.short_len],
            **_entry(len(short), n_short, 4 * bs, canary),
        },
        "scoring_probe_mix": {
            "docs_per_candidate": args.mix_docs_per_candidate,
            **_entry(len(mix), n_mix, 32, probe_mix),
        },
        "greedy": {
            "new_tokens": args.new_tokens,
            **_entry(len(prompts), len(prompts) * args.new_tokens, bs, greedy, "generate_loop"),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--vocab-size", type=int, default=None)
    ap.add_argument("--seqs", type=int, default=512)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--short-seqs", type=int, default=2048, help="canary-length sequences")
    ap.add_argument("--short-len", type=int, default=12)
    ap.add_argument(
        "--mix-docs-per-candidate",
        type=float,
        default=419 / 10_000,
        help="scoring_probe_mix: documents per canary-length sequence (default: the quickstart "
        "probe's 419 membership documents per 10,000 exposure candidates)",
    )
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=None,
        help="intra-op thread counts to run at, e.g. 1 2 (default: torch's own, what probe uses)",
    )
    ap.add_argument(
        "--reduced", action="store_true", help="small sizes for a quick check on a shared CPU"
    )
    args = ap.parse_args()
    if args.reduced:
        args.seqs, args.max_len, args.prompts, args.new_tokens = 128, 128, 16, 32
        args.short_seqs = 512

    from memaudit.models.presets import build_model

    default_threads = torch.get_num_threads()
    model = build_model(args.preset, vocab_size=args.vocab_size, seed=0).to(args.device).eval()
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    data = {
        "seqs": [
            rng.integers(1, vocab, int(n)).tolist()
            for n in rng.integers(args.min_len, args.max_len + 1, args.seqs)
        ],
        "prompts": [rng.integers(1, vocab, args.prompt_len).tolist() for _ in range(args.prompts)],
        "short": [rng.integers(1, vocab, args.short_len).tolist() for _ in range(args.short_seqs)],
    }
    n_docs = max(1, round(len(data["short"]) * args.mix_docs_per_candidate))
    data["mix"] = data["short"] + data["seqs"][:n_docs]  # the scoring of one probe run, in small
    runs = [run_at(t, model, data, args) for t in args.threads or [default_threads]]
    out = {
        "benchmark": "probe_throughput",
        "device": args.device,
        "default_threads": default_threads,
        "preset": args.preset,
        "params": sum(p.numel() for p in model.parameters()),
        "repeats": args.repeats,
        "runs": runs,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
