"""Probe throughput: memaudit's scoring path against a plain forward pass, and its batched scorer
and KV-cache decoder against plain loops.

Default (--mode forward): tokens scored per second by the path `memaudit probe` scores documents
with (memaudit.probes.scoring.windowed_logprobs: length-sorted batches under a token budget,
chunked log-softmax, strided windows for documents longer than the context; with the Min-K%++
statistics as membership's doc_scores asks for them, and without as the reference models' path)
next to plain transformers on the same tokens: the forward pass alone (logits, in batches of
--batch-size sequences in input order, right-padded) and the same forward pass plus the
per-token log-probabilities a plain script computes. Ratios are memaudit's tokens/s over the
plain ones. Models: the `tiny` and `small` configs (configs/tiny.yaml, configs/small.yaml; the
model built from the config's preset and seed, random weights) and a GPT-2-sized outside model
(transformers' GPT2Config defaults: 124M parameters, 1024 positions), each with documents of
--min-len..--max-len tokens and --long-docs documents of 4x the model's context (memaudit:
strided windows, every token once with stride context/2; plain: non-overlapping chunks of the
context, which score each token once with less left context). Medians of --repeats alternating
turns; the load average before and after is printed, since a shared machine slows every
variant alike but not evenly.

    python benchmarks/probe_throughput.py                       # tiny, small, gpt2
    python benchmarks/probe_throughput.py --models configs/tiny.yaml gpt2-reduced

--mode loop (the scorer's own history): memaudit.probes.scoring.token_logprobs vs one
model(...) call per sequence (documents, canary-length sequences and the quickstart probe's
mix), and memaudit.probes.scoring.decode vs one model.generate(...) per prompt:

    python benchmarks/probe_throughput.py --mode loop --preset tiny --reduced --threads 1 2
"""

from __future__ import annotations

import argparse
import json
import os
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


# ----------------------------------------------------------------------------- --mode forward
GPT2_REDUCED = {"n_layer": 4}  # --models gpt2-reduced: GPT-2's width and vocabulary, 4 layers


def model_from(spec: str, device: str):
    """(model, description) for a config file (its preset and seed) or gpt2 / gpt2-reduced."""
    if spec.endswith((".yaml", ".yml")):
        from memaudit.config import load_config
        from memaudit.models.presets import build_model

        cfg = load_config(spec)
        model = build_model(cfg.model.preset, seed=cfg.model.init_seed)
        desc = {"config": spec, "preset": cfg.model.preset}
    elif spec in ("gpt2", "gpt2-reduced"):
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(**(GPT2_REDUCED if spec == "gpt2-reduced" else {})))
        desc = {"config": f"transformers GPT2Config{'(n_layer=4)' if spec != 'gpt2' else '()'}",
                "preset": spec}
    else:
        raise SystemExit(f"--models: '{spec}' is neither a config file nor gpt2 / gpt2-reduced")
    model = model.float().to(device).eval()
    ctx = getattr(model.config, "n_positions", None) or model.config.max_position_embeddings
    return model, {**desc, "params": sum(p.numel() for p in model.parameters()),
                   "context": ctx, "vocab": model.config.vocab_size}


@torch.inference_mode()
def plain_forward(model, seqs, batch_size: int, device, logprobs: bool) -> None:
    """Plain transformers: batches of `batch_size` sequences in input order, right-padded; the
    logits alone, or with each token's log-probability as a plain script computes it."""
    for i in range(0, len(seqs), batch_size):
        batch = seqs[i : i + batch_size]
        width = max(len(s) for s in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, s in enumerate(batch):
            ids[r, : len(s)] = torch.as_tensor(s)
            mask[r, : len(s)] = 1
        ids, mask = ids.to(device), mask.to(device)
        logits = model(input_ids=ids, attention_mask=mask).logits  # (batch, width, vocab)
        if logprobs:
            lp = torch.log_softmax(logits[:, :-1].float(), -1)
            lp.gather(-1, ids[:, 1:, None]).squeeze(-1)[mask[:, 1:].bool()].cpu()
        else:
            logits[:, -1, 0].cpu()  # wait for the device


def compare_forward(model, seqs, *, window: int, chunks: list, args) -> dict:
    """Medians of memaudit's scoring path and the plain forward passes on `seqs`, tokens/s.

    `chunks`: what the plain passes run (the sequences themselves, or a long document's
    non-overlapping chunks of the context); tokens counted are the scored ones, len - 1 each.
    """
    from memaudit.probes.scoring import windowed_logprobs

    bs, dev = args.batch_size, args.device
    t = _alternating_medians({
        "memaudit_with_stats": lambda: windowed_logprobs(model, seqs, window=window,
                                                         batch_size=bs, with_stats=True),
        "memaudit": lambda: windowed_logprobs(model, seqs, window=window, batch_size=bs),
        "plain_forward": lambda: plain_forward(model, chunks, bs, dev, logprobs=False),
        "plain_forward_logprobs": lambda: plain_forward(model, chunks, bs, dev, logprobs=True),
    }, args.repeats)
    n = sum(len(s) - 1 for s in seqs)
    rate = {k: n / v for k, v in t.items()}
    return {
        "documents": len(seqs), "tokens_scored": n,
        "tokens_per_s": rate, "median_s": t,
        "ratio_to_plain_forward": {k: rate[k] / rate["plain_forward"]
                                   for k in ("memaudit_with_stats", "memaudit")},
        "ratio_to_plain_forward_logprobs": {k: rate[k] / rate["plain_forward_logprobs"]
                                            for k in ("memaudit_with_stats", "memaudit")},
    }


def run_forward(args) -> dict:
    rng = np.random.default_rng(0)
    out = []
    for spec in args.models:
        model, desc = model_from(spec, args.device)
        ctx, vocab = desc["context"], desc["vocab"]
        n_docs = args.docs if desc["params"] < 50e6 else args.docs_large
        seqs = [rng.integers(1, vocab, int(n)).tolist()
                for n in rng.integers(args.min_len, args.max_len + 1, n_docs)]
        entry = {**desc, "documents": compare_forward(model, seqs, window=ctx, chunks=seqs,
                                                      args=args)}
        if args.long_docs:
            long = [rng.integers(1, vocab, 4 * ctx).tolist() for _ in range(args.long_docs)]
            chunks = [s[i : i + ctx] for s in long for i in range(0, len(s), ctx)]
            entry["long_documents"] = {"length": 4 * ctx, "stride": ctx // 2,
                                       **compare_forward(model, long, window=ctx, chunks=chunks,
                                                         args=args)}
        out.append(entry)
        del model
    return {"models": out}


def forward_main(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads[0])
    load = os.getloadavg()
    t0 = time.perf_counter()
    res = run_forward(args)
    print(json.dumps({
        "benchmark": "probe_throughput", "mode": "forward", "device": args.device,
        "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
        "repeats": args.repeats, "batch_size": args.batch_size,
        "lengths": [args.min_len, args.max_len],
        "load_average_1m": {"before": load[0], "after": os.getloadavg()[0]},
        "seconds": time.perf_counter() - t0, **res}, indent=2))


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
    ap.add_argument("--batch-size", type=int, default=None,
                    help="sequences per batch (default: 32 in --mode forward, the probe's "
                    "default; 64 in --mode loop)")
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
    ap.add_argument("--mode", choices=("forward", "loop"), default="forward")
    ap.add_argument("--models", nargs="+",
                    default=["configs/tiny.yaml", "configs/small.yaml", "gpt2"],
                    help="--mode forward: config files and/or gpt2, gpt2-reduced")
    ap.add_argument("--docs", type=int, default=128, help="--mode forward: documents per model")
    ap.add_argument("--docs-large", type=int, default=32,
                    help="--mode forward: documents for models of 50M parameters or more")
    ap.add_argument("--long-docs", type=int, default=2,
                    help="--mode forward: documents of 4x the context (0: none)")
    args = ap.parse_args()
    if args.mode == "forward":
        args.batch_size = args.batch_size or 32
        forward_main(args)
        return
    args.batch_size = args.batch_size or 64
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
