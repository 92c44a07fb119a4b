"""The probes' JAX engine (memaudit.probes.jax_scoring) on whatever JAX runs on: scoring rate
against the chip's bf16 peak, exposure's candidate scoring, greedy decoding. Prints JSON.

Random weights of a preset's shape (throughput does not depend on the values); imports neither
torch nor transformers, so it runs on a TPU host with only memaudit's JAX dependencies.

- scoring: --docs documents of --seq-len tokens through `JaxLM.token_logprobs` (the path
  membership's scores take), tokens/s and MFU = 2 x params x tokens/s / --peak-tflops, where
  params counts every weight a token multiplies (the input embedding, a lookup, is left out;
  `params_all` states the total).
- exposure: --canaries canaries, each with --candidates candidates of --prefix-tokens shared
  tokens and --secret-tokens own ones drawn from --secret-alphabet token ids (10: digit secrets,
  one token a digit as memaudit's tokenizer splits them), side by side: the plain path
  (`JaxLM.shared_prefix_nll`: every candidate's every token), the trie
  (`memaudit.probes.jax_trie.trie_nll`: each distinct token prefix once) and the grouped path
  (`memaudit.probes.jax_groups.grouped_nll`: heads of the first m own tokens once, the rest in
  chunks of one head), interleaved on the same candidates, the plain one on every
  --plain-every-th canary; medians, each one's ratio against plain, the input tokens each runs
  and the largest difference of each one's sums from plain's. When --measure-canaries is smaller than --canaries,
  that many are timed and the total extrapolated (per-canary time x canaries), said so.
- decode: greedy continuations of --decode-new tokens for --decode-prompts prompts.

    python benchmarks/probe_jax.py --reduced                                  # CPU check
    python benchmarks/probe_jax.py --preset 125m                              # TPU
    python benchmarks/probe_jax.py --preset 125m --parts exposure --plain-every 10  # issue 65
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time
from functools import partial

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
    ap.add_argument("--secret-alphabet", type=int, default=10, help="token ids a secret token is "
                    "drawn from (10: digits, one token each); 0: the whole vocabulary")
    ap.add_argument("--plain-every", type=int, default=1, help="time the plain exposure path on "
                    "every k-th canary beside the others (which run on every one)")
    ap.add_argument("--exposure-paths", default="plain,trie,grouped", help="comma-separated "
                    "exposure paths to time, any of: plain (the reference of the ratios and differences), "
                    "trie, grouped")
    ap.add_argument("--parts", default="scoring,exposure,decode")
    ap.add_argument("--reduced", action="store_true", help="a CPU check in under a minute: the "
                    "tiny preset, 16 x 64 scoring, 4 canaries x 2,000 candidates, 8 prompts")
    args = ap.parse_args()
    if args.reduced:
        args.preset, args.docs, args.seq_len, args.canaries = "tiny", 16, 64, 4
        args.candidates, args.decode_prompts, args.repeats = 2000, 8, 2
    parts = set(args.parts.split(","))

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

    if "scoring" in parts:
        out["scoring"] = scoring(lm, args, rng, params, peak)
        print(json.dumps(out), flush=True)

    if "exposure" in parts:
        out["exposure"] = exposure(lm, args, rng, params, peak)
        print(json.dumps(out), flush=True)

    if "decode" in parts:
        out["decode"] = decode(lm, args, rng)
    out["shape"] = dataclasses.asdict(lm.shape)
    print(json.dumps(out), flush=True)


def scoring(lm, args, rng, params: int, peak: float) -> dict:
    """--docs documents of --seq-len tokens through `JaxLM.token_logprobs`: tokens/s and MFU."""
    docs = rng.integers(0, lm.shape.vocab, (args.docs, args.seq_len)).tolist()
    tokens = args.docs * args.seq_len
    t_c0 = time.perf_counter()
    sec = median_seconds(lambda: lm.token_logprobs(docs), args.repeats, warmup=1)
    rate = tokens / sec
    res = {"docs": args.docs, "seq_len": args.seq_len, "tokens": tokens,
           "seconds": round(sec, 4), "tokens_per_s": round(rate),
           "mfu": round(2 * params * rate / peak, 4)}
    if args.stats:
        sec = median_seconds(lambda: lm.token_logprobs(docs, with_stats=True), args.repeats, warmup=1)
        res["with_stats"] = {"seconds": round(sec, 4), "tokens_per_s": round(tokens / sec),
                             "mfu": round(2 * params * tokens / sec / peak, 4)}
    res["incl_compile_s"] = round(time.perf_counter() - t_c0, 2)
    for budget in [int(b) for b in args.other_max_tokens.split(",") if b]:
        other = dataclasses.replace(lm, max_tokens=budget)
        sec = median_seconds(lambda other=other: other.token_logprobs(docs), args.repeats, warmup=1)
        res[f"max_tokens_{budget}"] = {"tokens_per_s": round(tokens / sec),
                                       "mfu": round(2 * params * tokens / sec / peak, 4)}
    return res


def decode(lm, args, rng) -> dict:
    """Greedy continuations: new tokens/s."""
    prompts = rng.integers(0, lm.shape.vocab, (args.decode_prompts, args.decode_prompt_len)).tolist()
    sec = median_seconds(lambda: lm.decode(prompts, args.decode_new,
                                        batch_size=args.decode_prompts), args.repeats, warmup=1)
    return {"prompts": args.decode_prompts, "prompt_len": args.decode_prompt_len,
            "new_tokens": args.decode_new, "seconds": round(sec, 4),
            "new_tokens_per_s": round(args.decode_prompts * args.decode_new / sec)}


def _candidates(rng, args, vocab: int) -> np.ndarray:
    """One canary's candidates: a shared prefix, then --secret-tokens tokens each, drawn from
    --secret-alphabet token ids (digits: one token each under memaudit's tokenizer) or, with 0,
    from the whole vocabulary."""
    prefix = rng.integers(0, vocab, args.prefix_tokens)
    alphabet = (rng.choice(vocab, args.secret_alphabet, replace=False) if args.secret_alphabet
                else np.arange(vocab))
    cands = np.empty((args.candidates, args.prefix_tokens + args.secret_tokens), np.int32)
    cands[:, : args.prefix_tokens] = prefix
    cands[:, args.prefix_tokens :] = alphabet[rng.integers(0, len(alphabet),
                                                           (args.candidates, args.secret_tokens))]
    return cands


def _exposure_paths(lm, names: list[str]) -> dict:
    from memaudit.probes.jax_groups import grouped_nll
    from memaudit.probes.jax_trie import trie_nll

    table = {"plain": lm.shared_prefix_nll, "trie": partial(trie_nll, lm),
             "grouped": partial(grouped_nll, lm)}
    unknown = set(names) - set(table)
    if unknown or not names:
        raise SystemExit(f"--exposure-paths: {sorted(unknown) or names} (choose from "
                         "plain,trie,grouped; ratios and differences need plain among them)")
    return {name: table[name] for name in names}


def exposure(lm, args, rng, params: int, peak: float) -> dict:
    """The exposure paths (--exposure-paths: plain `JaxLM.shared_prefix_nll`, trie
    `jax_trie.trie_nll`, grouped `jax_groups.grouped_nll`) on the same candidates, interleaved:
    plain on every --plain-every-th canary, the others on every one, the order rotating from
    canary to canary. Canary 0 compiles every path and is not counted. Each path's ratio is
    plain's seconds over its own on the canaries both ran (median of the per-canary ratios)."""
    from memaudit.probes.jax_groups import plan_groups
    from memaudit.probes.jax_trie import plan_trie, trie_nll

    paths = _exposure_paths(lm, args.exposure_paths.split(","))
    measured = min(args.measure_canaries or args.canaries, args.canaries)
    times: dict[str, list[float]] = {name: [] for name in paths}
    paired: dict[str, list[tuple[float, float]]] = {name: [] for name in paths if name != "plain"}
    first: dict[str, float] = {}
    diff = dict.fromkeys(paired, 0.0) if "plain" in paths else {}
    for c in range(measured + 1):
        cands = _candidates(rng, args, lm.shape.vocab)
        names = [nm for nm in paths if nm != "plain" or c % args.plain_every == 0]
        names = names[c % len(names):] + names[: c % len(names)]  # rotate who runs first
        got, took = {}, {}
        for name in names:
            t0 = time.perf_counter()
            got[name] = paths[name](cands)
            took[name] = time.perf_counter() - t0
            if c == 0:
                first[name] = took[name]
            else:
                times[name].append(took[name])
            assert np.isfinite(got[name]).all()
        if "plain" in got:
            for name, pairs in paired.items():  # every path but plain
                diff[name] = max(diff[name], float(np.abs(got[name] - got["plain"]).max()))
                if c:
                    pairs.append((took["plain"], took[name]))
    own = cands[:, args.prefix_tokens:]
    n_own = np.full(len(cands), args.secret_tokens)
    trie, grouped = plan_trie(own, n_own), plan_groups(own, n_own)
    fwd = {"plain": trie.plain_forward_tokens, "trie": trie.forward_tokens,
           "grouped": grouped.forward_tokens}
    out = {"canaries": args.canaries, "candidates_per_canary": args.candidates,
           "prefix_tokens": args.prefix_tokens, "secret_tokens": args.secret_tokens,
           "secret_alphabet": args.secret_alphabet or "vocabulary",
           "input_tokens_per_canary": {name: fwd[name] for name in paths},
           "plain_padded_tokens_per_canary": grouped.flat_forward_tokens,
           "trie_levels": [len(lv.tokens) for lv in trie.levels],
           "grouped_plan": {"m": grouped.m, "c": grouped.c, "heads": len(grouped.heads),
                            "chunks": len(grouped.chunk_head)},
           "max_abs_diff_nats_vs_plain": diff}
    for name, ts in times.items():
        if not ts:
            continue
        per = statistics.median(ts)
        out[name] = {"measured_canaries": len(ts), "first_canary_s_incl_compile": round(first[name], 2),
                     "seconds_per_canary": round(per, 3),
                     "candidates_per_s": round(args.candidates / per),
                     "total_s": round(per * args.canaries + (first[name] - per), 1),
                     "extrapolated": len(ts) < args.canaries,
                     "mfu_forward_tokens": round(2 * params * fwd[name] / per / peak, 4)}
        if paired.get(name):
            pairs = paired[name]
            out[name]["ratio_plain_over_this"] = {
                "paired_canaries": len(pairs),
                "median_of_ratios": round(statistics.median(p / q for p, q in pairs), 3),
                "ratio_of_medians": round(statistics.median(p for p, _ in pairs)
                                          / statistics.median(q for _, q in pairs), 3)}
    for budget in [int(b) for b in args.exposure_max_tokens.split(",") if b]:
        other = dataclasses.replace(lm, max_tokens=budget)
        trie_nll(other, cands)  # compiles this budget's batch shapes
        per_b = median_seconds(lambda other=other: trie_nll(other, cands), max(1, args.repeats))
        out[f"trie_max_tokens_{budget}"] = {"seconds_per_canary": round(per_b, 3),
                                            "total_s": round(per_b * args.canaries, 1)}
    return out


if __name__ == "__main__":
    main()
