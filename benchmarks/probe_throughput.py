"""Probe throughput: the batched scorer and the batched KV-cache greedy decoder against plain loops.

Same model, same data, side by side:
  scoring  - memaudit.probes.scoring.token_logprobs (length-sorted, padded batches) vs one
             model(...) call per sequence; tokens scored per second.
  greedy   - memaudit.probes.scoring.decode (left-padded batches, KV cache) vs one
             model.generate(...) per prompt; new tokens per second.
Prints one JSON object with the medians of --repeats runs and the speed-ups.

    python benchmarks/probe_throughput.py --preset tiny --reduced
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.no_grad()
def loop_score(model, seqs, device) -> None:
    for s in seqs:
        ids = torch.tensor([s], device=device)
        lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        lp.gather(-1, ids[0, 1:, None]).cpu()


@torch.no_grad()
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--vocab-size", type=int, default=None)
    ap.add_argument("--seqs", type=int, default=512)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--short-seqs", type=int, default=2048, help="canary-length sequences")
    ap.add_argument("--short-len", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--reduced", action="store_true", help="small sizes for a quick check on a shared CPU"
    )
    args = ap.parse_args()
    if args.reduced:
        args.seqs, args.max_len, args.prompts, args.new_tokens, args.repeats = 128, 128, 16, 32, 3
        args.short_seqs = 512
    if args.threads:
        torch.set_num_threads(args.threads)

    from memaudit.models.presets import build_model
    from memaudit.probes.scoring import decode, token_logprobs

    model = build_model(args.preset, vocab_size=args.vocab_size, seed=0).to(args.device).eval()
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    seqs = [
        rng.integers(1, vocab, int(n)).tolist()
        for n in rng.integers(args.min_len, args.max_len + 1, args.seqs)
    ]
    prompts = [rng.integers(1, vocab, args.prompt_len).tolist() for _ in range(args.prompts)]
    n_tokens = sum(len(s) - 1 for s in seqs)

    token_logprobs(model, seqs[:4], batch_size=4)  # warm-up
    t_batched = _median_time(
        lambda: token_logprobs(model, seqs, batch_size=args.batch_size), args.repeats
    )
    t_loop = _median_time(lambda: loop_score(model, seqs, args.device), args.repeats)
    short = [rng.integers(1, vocab, args.short_len).tolist() for _ in range(args.short_seqs)]
    n_short = args.short_seqs * (args.short_len - 1)
    s_batched = _median_time(
        lambda: token_logprobs(model, short, batch_size=4 * args.batch_size), args.repeats
    )
    s_loop = _median_time(lambda: loop_score(model, short, args.device), args.repeats)
    decode(model, prompts[:2], 2)
    g_batched = _median_time(
        lambda: decode(model, prompts, args.new_tokens, batch_size=args.batch_size), args.repeats
    )
    g_loop = _median_time(
        lambda: loop_generate(model, prompts, args.new_tokens, args.device), args.repeats
    )
    new = args.prompts * args.new_tokens
    out = {
        "benchmark": "probe_throughput",
        "device": args.device,
        "threads": torch.get_num_threads(),
        "preset": args.preset,
        "params": sum(p.numel() for p in model.parameters()),
        "repeats": args.repeats,
        "scoring": {
            "sequences": args.seqs,
            "tokens": n_tokens,
            "batch_size": args.batch_size,
            "batched_tokens_per_s": n_tokens / t_batched,
            "loop_tokens_per_s": n_tokens / t_loop,
            "speedup": t_loop / t_batched,
        },
        "scoring_canary_length": {
            "sequences": args.short_seqs,
            "tokens": n_short,
            "batch_size": 4 * args.batch_size,
            "batched_tokens_per_s": n_short / s_batched,
            "loop_tokens_per_s": n_short / s_loop,
            "speedup": s_loop / s_batched,
        },
        "greedy": {
            "prompts": args.prompts,
            "new_tokens": args.new_tokens,
            "batch_size": args.batch_size,
            "batched_tokens_per_s": new / g_batched,
            "generate_loop_tokens_per_s": new / g_loop,
            "speedup": g_loop / g_batched,
        },
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
