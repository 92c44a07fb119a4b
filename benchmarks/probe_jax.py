"""The probes' JAX engine (memaudit.probes.jax_scoring) on whatever JAX runs on: scoring rate
against the chip's bf16 peak, exposure's candidate scoring, greedy decoding. Prints JSON.

Random weights of a preset's shape (throughput does not depend on the values); imports neither
torch nor transformers, so it runs on a TPU host with only memaudit's JAX dependencies.

- scoring: --docs documents of --seq-len tokens through `JaxLM.token_logprobs` (the path
  membership's scores take), tokens/s and MFU = 2 x params x tokens/s / --peak-tflops, where
  params counts every weight a token multiplies (the input embedding, a lookup, is left out;
  `params_all` states the total).
- exposure: --canaries canaries, each with --candidates candidates of --prefix-tokens shared
  tokens and --secret-tokens differing ones, through `JaxLM.shared_prefix_nll`. When
  --measure-canaries is smaller than --canaries, that many are timed and the total extrapolated
  (per-canary time x canaries), said so in the output.
- decode: greedy continuations of --decode-new tokens for --decode-prompts prompts.

    python benchmarks/probe_jax.py --preset tiny --docs 16 --seq-len 64 --candidates 2000 \\
        --canaries 2 --decode-prompts 8                                       # CPU check
    python benchmarks/probe_jax.py --preset 125m                              # TPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time

import numpy as np
from timing import median_seconds  # benchmarks/, beside this script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="125m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=None, help="padded tokens per batch")
    ap.add_argument("--docs", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--other-max-tokens", default="", help="comma-separated batch budgets to "
                    "time scoring under as well")
    ap.add_argument("--stats", action="store_true", help="also time scoring with mu and sigma")
    ap.add_argument("--canaries", type=int, default=100)
    ap.add_argument("--measure-canaries", type=int, default=None)
    ap.add_argument("--candidates", type=int, default=100_000)
    ap.add_argument("--exposure-max-tokens", default="", help="comma-separated batch budgets "
                    "to time exposure under as well (--measure-canaries canaries each)")
    ap.add_argument("--prefix-tokens", type=int, default=12)
    ap.add_argument("--secret-tokens", type=int, default=8)
    ap.add_argument("--decode-prompts", type=int, default=64)
    ap.add_argument("--decode-prompt-len", type=int, default=32)
    ap.add_argument("--decode-new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=197.0, help="TPU v5e bf16 peak")
    args = ap.parse_args()

    import jax

    from memaudit.models.presets import get_preset
    from memaudit.probes.jax_scoring import JaxLM, random_llama

    p = get_preset(args.preset)
    t0 = time.perf_counter()
    sd, cfg = random_llama(vocab_size=p.vocab_size, hidden=p.hidden_size,
                           layers=p.num_hidden_layers, heads=p.num_attention_heads,
                           kv_heads=p.num_key_value_heads, intermediate=p.intermediate_size)
    lm = JaxLM.from_state_dict(sd, cfg, dtype=args.dtype, max_tokens=args.max_tokens)
    params_all = sum(v.size for v in sd.values())
    params = params_all - sd["model.embed_tokens.weight"].size
    del sd
    out = {"benchmark": "probe_jax", "device": str(jax.devices()[0].device_kind),
           "backend": jax.default_backend(), "jax": jax.__version__, "host": platform.node(),
           "preset": args.preset, "dtype": str(lm.params["embed"].dtype),
           "max_tokens": lm.max_tokens, "params": int(params), "params_all": int(params_all),
           "peak_tflops": args.peak_tflops, "setup_s": round(time.perf_counter() - t0, 2),
           "load_avg": os.getloadavg()[0], "repeats": args.repeats}
    rng = np.random.default_rng(0)
    peak = args.peak_tflops * 1e12

    # scoring
    docs = rng.integers(0, p.vocab_size, (args.docs, args.seq_len)).tolist()
    tokens = args.docs * args.seq_len
    t_c0 = time.perf_counter()
    sec = median_seconds(lambda: lm.token_logprobs(docs), args.repeats, warmup=1)
    rate = tokens / sec
    out["scoring"] = {"docs": args.docs, "seq_len": args.seq_len, "tokens": tokens,
                      "seconds": round(sec, 4), "tokens_per_s": round(rate),
                      "mfu": round(2 * params * rate / peak, 4)}
    if args.stats:
        sec = median_seconds(lambda: lm.token_logprobs(docs, with_stats=True), args.repeats, warmup=1)
        out["scoring"]["with_stats"] = {"seconds": round(sec, 4),
                                        "tokens_per_s": round(tokens / sec),
                                        "mfu": round(2 * params * tokens / sec / peak, 4)}
    out["scoring"]["incl_compile_s"] = round(time.perf_counter() - t_c0, 2)
    for budget in [int(b) for b in args.other_max_tokens.split(",") if b]:
        other = dataclasses.replace(lm, max_tokens=budget)
        sec = median_seconds(lambda other=other: other.token_logprobs(docs), args.repeats, warmup=1)
        out["scoring"][f"max_tokens_{budget}"] = {"tokens_per_s": round(tokens / sec),
                                                  "mfu": round(2 * params * tokens / sec / peak, 4)}
    print(json.dumps(out), flush=True)

    # exposure: candidates share the canary's prefix
    measured = min(args.measure_canaries or args.canaries, args.canaries)
    times = []
    first = None
    for c in range(measured + 1):  # canary 0 compiles; it is not counted
        prefix = rng.integers(0, p.vocab_size, args.prefix_tokens)
        cands = np.empty((args.candidates, args.prefix_tokens + args.secret_tokens), np.int32)
        cands[:, : args.prefix_tokens] = prefix
        cands[:, args.prefix_tokens :] = rng.integers(0, p.vocab_size,
                                                      (args.candidates, args.secret_tokens))
        t0 = time.perf_counter()
        nll = lm.shared_prefix_nll(cands)
        dt = time.perf_counter() - t0
        if c == 0:
            first = dt
        else:
            times.append(dt)
        assert np.isfinite(nll).all()
    per = statistics.median(times)
    fwd_tokens = args.candidates * (args.secret_tokens - 1)  # the last token is only a target
    out["exposure"] = {
        "canaries": args.canaries, "candidates_per_canary": args.candidates,
        "prefix_tokens": args.prefix_tokens, "secret_tokens": args.secret_tokens,
        "measured_canaries": measured, "first_canary_s_incl_compile": round(first, 2),
        "seconds_per_canary": round(per, 3),
        "candidates_per_s": round(args.candidates / per),
        "total_s": round(per * args.canaries + (first - per), 1),
        "extrapolated": measured < args.canaries,
        "mfu_forward_tokens": round(2 * params * fwd_tokens / per / peak, 4),
    }
    for budget in [int(b) for b in args.exposure_max_tokens.split(",") if b]:
        other = dataclasses.replace(lm, max_tokens=budget)
        other.shared_prefix_nll(cands)  # compiles this budget's batch shape
        t0 = time.perf_counter()
        for _ in range(measured):
            other.shared_prefix_nll(cands)
        per_b = (time.perf_counter() - t0) / measured
        out["exposure"][f"max_tokens_{budget}"] = {
            "seconds_per_canary": round(per_b, 3), "total_s": round(per_b * args.canaries, 1),
            "mfu_forward_tokens": round(2 * params * fwd_tokens / per_b / peak, 4)}
    print(json.dumps(out), flush=True)

    # greedy decoding
    prompts = rng.integers(0, p.vocab_size, (args.decode_prompts, args.decode_prompt_len)).tolist()
    sec = median_seconds(lambda: lm.decode(prompts, args.decode_new,
                                        batch_size=args.decode_prompts), args.repeats, warmup=1)
    out["decode"] = {"prompts": args.decode_prompts, "prompt_len": args.decode_prompt_len,
                     "new_tokens": args.decode_new, "seconds": round(sec, 4),
                     "new_tokens_per_s": round(args.decode_prompts * args.decode_new / sec)}
    out["shape"] = dataclasses.asdict(lm.shape)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
