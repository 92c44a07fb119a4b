"""Cost of secure aggregation per round, next to plain aggregation and a whole FedAvg round.

Measures, for each cohort size n, model size d and neighbour graph (full = SecAgg,
sparse = SecAgg+):

- ``plain_s``: the jitted ``mean_aggregator`` on (n, d) float32 deltas;
- ``secure_s``: ``secure_aggregation(mean_aggregator())``: clip, quantise, the whole
  protocol between n client objects and a server object (X25519, Shamir, AEAD, masks),
  decode (only where n * d <= --max-wrapper-elems; otherwise only the protocol);
- ``protocol_s``: ``run_round`` alone on pre-quantised uint32 inputs;
- the PRG's mask throughput (AES-256-CTR keystream added mod 2^32) as a fraction of the
  machine's raw AES-256-CTR throughput, both for a large buffer (memory-bound) and a
  cache-sized buffer (AES compute bound);
- a whole FedAvg round (``memaudit.federated.algorithms.fedavg``) on a 1M-parameter linear
  model with and without secure aggregation, if that module is importable.

Prints one JSON object.

    python benchmarks/secagg_overhead.py                 # cohorts 16 64, 1M and 10M params
    python benchmarks/secagg_overhead.py --reduced       # fewer cases, 1 repeat
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np


def _time(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def prg_throughput(d: int, repeats: int, fused: int = 8) -> dict:
    """Mask throughput next to raw AES-256-CTR, measured the same way and interleaved.

    Each repeat times, back to back: one raw AES-256-CTR ``update_into`` of 4d zero bytes into
    a preallocated buffer (the limit, memory-bound for a large d), one ``add_mask`` (keystream
    in cache-sized chunks added mod 2^32 into a d-word accumulator), one raw pass over a
    cache-sized buffer (AES compute bound) and ``add_masks`` with ``fused`` seeds (how a client
    adds its self mask and pairwise masks: one pass over the accumulator). Ratios are of the
    best times (least disturbed by a shared machine) and the median of per-repeat ratios.
    """
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    from memaudit.federated.secagg import prg

    acc = np.zeros(d, dtype=np.uint32)
    zeros = bytes(4 * d)
    out = np.empty(d + 4, dtype=np.uint32)  # update_into needs 15 bytes of slack
    out_view = memoryview(out).cast("B")
    small = 1 << 14  # words: a cache-sized raw pass, repeated to cover 4d bytes
    small_zeros, small_out = bytes(4 * small), bytearray(4 * small + 16)
    seeds = [(os.urandom(32), 1 if i % 2 else -1) for i in range(fused)]

    def fused_add(acc, seeds):  # older prg modules: one pass per mask
        if hasattr(prg, "add_masks"):
            return prg.add_masks(acc, seeds)
        for seed, sign in seeds:
            prg.add_mask(acc, seed, sign)

    def raw_large():
        enc = Cipher(algorithms.AES(os.urandom(32)), modes.CTR(bytes(16))).encryptor()
        enc.update_into(zeros, out_view)

    def raw_cache():
        update_into = Cipher(algorithms.AES(os.urandom(32)), modes.CTR(bytes(16))).encryptor().update_into
        for _ in range(0, d, small):
            update_into(small_zeros, small_out)

    cases = {"raw_large": raw_large, "mask": lambda: prg.add_mask(acc, os.urandom(32), +1),
             "raw_cache": raw_cache, "fused": lambda: fused_add(acc, seeds),
             "expand": lambda: prg._keystream_into(os.urandom(32), out, d)}
    for fn in cases.values():  # warm up: page in buffers
        fn()
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(repeats):
        for k, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    best = {k: min(v) for k, v in times.items()}
    times["fused"] = [t / fused for t in times["fused"]]
    best["fused"] /= fused
    gbps = {k: 4 * d / v / 1e9 for k, v in best.items()}

    def paired(a, b):
        return statistics.median(rb / ra for ra, rb in zip(times[a], times[b], strict=True))

    return {"words": d, "repeats": repeats, "fused_masks": fused,
            "raw_aes_ctr_large_GBps": gbps["raw_large"], "raw_aes_ctr_cache_GBps": gbps["raw_cache"],
            "mask_add_GBps": gbps["mask"], "fused_mask_add_GBps_per_mask": gbps["fused"],
            "expand_GBps": gbps["expand"],
            "fraction_of_raw_large": gbps["mask"] / gbps["raw_large"],
            "fraction_of_raw_large_paired_median": paired("mask", "raw_large"),
            "fraction_of_raw_cache": gbps["mask"] / gbps["raw_cache"],
            "fused_fraction_of_raw_large": gbps["fused"] / gbps["raw_large"],
            "fused_fraction_of_raw_large_paired_median": paired("fused", "raw_large"),
            "expand_fraction_of_raw_large": gbps["expand"] / gbps["raw_large"]}


def encode_throughput(n: int, d: int, repeats: int) -> dict:
    """Host-side cost of the wrapper's clip + stochastic-rounding quantisation of (n, d) floats."""
    from memaudit.federated.secagg.aggregator import encode, quantisation_scale

    rows = np.random.default_rng(0).normal(size=(n, d)).astype(np.float32)
    scale, _ = quantisation_scale(1.0, 20, n)
    rng = np.random.default_rng(1)
    t = _time(lambda: encode(rows, 1.0, scale, rng), repeats)
    return {"cohort": n, "params": d, "encode_s": t, "encode_ns_per_value": t / (n * d) * 1e9}


def aggregation_case(n: int, d: int, graph: str, repeats: int, max_wrapper_elems: int) -> dict:
    import jax
    import jax.numpy as jnp

    from memaudit.federated.aggregators import mean_aggregator
    from memaudit.federated.secagg import run_round
    from memaudit.federated.secagg.aggregator import secure_aggregation

    out: dict = {"cohort": n, "params": d, "graph": graph}
    rng = np.random.default_rng(0)
    q = rng.integers(0, 2**20, size=(n, d), dtype=np.uint32)
    t0 = time.perf_counter()
    res = run_round(q, neighbours=graph)
    out["protocol_s"] = time.perf_counter() - t0
    out["degree"] = res.degree
    out["bytes_up_per_client"] = res.bytes_up / n
    if repeats > 1:
        out["protocol_s"] = min(out["protocol_s"], _time(lambda q=q: run_round(q, neighbours=graph), repeats - 1))
    q = None  # free the inputs before the wrapper's own copies
    if n * d <= max_wrapper_elems:
        deltas = jnp.asarray(rng.normal(size=(n, d)).astype(np.float32) * 1e-3)
        w = jnp.ones(n)
        plain = jax.jit(mean_aggregator().aggregate)
        jax.block_until_ready(plain(deltas, w, None, None).update)
        out["plain_s"] = _time(lambda: jax.block_until_ready(plain(deltas, w, None, None).update), max(repeats, 3))
        agg = secure_aggregation(mean_aggregator(), clip=1.0, neighbours=graph, seed=0)
        st = agg.init(None)
        out["secure_s"] = _time(lambda: agg.aggregate(deltas, w, st, jax.random.key(0)), repeats)
        out["secure_over_plain"] = out["secure_s"] / out["plain_s"]
        out["wrapper_host_s"] = out["secure_s"] - out["protocol_s"]  # flatten, encode, decode
        out["secure_over_protocol"] = out["secure_s"] / out["protocol_s"]
    return out


def federated_round(n: int, repeats: int) -> dict:
    try:
        import jax
        import jax.numpy as jnp
        import optax

        from memaudit.federated.aggregators import mean_aggregator
        from memaudit.federated.algorithms import fedavg
        from memaudit.federated.cohorts import ClientData
        from memaudit.federated.secagg.aggregator import secure_aggregation
    except ImportError as e:
        return {"skipped": f"federated algorithms module not importable: {e}"}

    k = 1000  # params: a (1000, 1000) linear map = 1M
    def loss_fn(params, batch):
        pred = batch["x"] @ params["w"]
        return jnp.sum((pred - batch["y"]) ** 2, axis=-1), {}

    rng = np.random.default_rng(0)
    data = ClientData({"x": jnp.asarray(rng.normal(size=(n, 8, k)), jnp.float32),
                       "y": jnp.asarray(rng.normal(size=(n, 8, k)), jnp.float32)}, jnp.ones((n, 8)))
    params = {"w": jnp.zeros((k, k), jnp.float32)}
    out = {"cohort": n, "params": k * k}
    for name, agg in (("plain", mean_aggregator()),
                      ("secure_full", secure_aggregation(mean_aggregator(), clip=10.0, neighbours="full", seed=0)),
                      ("secure_sparse", secure_aggregation(mean_aggregator(), clip=10.0, neighbours="sparse", seed=0))):
        alg = fedavg(loss_fn, client_optimizer=optax.sgd(1e-4), server_optimizer=optax.sgd(1.0),
                     local_steps=2, batch_size=4, aggregator=agg, weighting="uniform")
        state = alg.init(params)
        state, _ = alg.round(state, data, jax.random.key(0))  # compile
        jax.block_until_ready(state.params)

        def one(alg=alg, state=state):
            s, _ = alg.round(state, data, jax.random.key(1))
            jax.block_until_ready(s.params)
        out[f"{name}_round_s"] = _time(one, repeats)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cohorts", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--params", type=float, nargs="+", default=[1e6, 1e7])
    ap.add_argument("--graphs", nargs="+", default=["full", "sparse"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-wrapper-elems", type=float, default=2**28,
                    help="run the full wrapper (with float deltas) only up to n*d elements")
    ap.add_argument("--reduced", action="store_true", help="1 repeat; the 64 x 10M full graph only as protocol")
    ap.add_argument("--skip", nargs="*", default=[], help="cases to skip as n:d:graph, e.g. 64:10000000:full")
    args = ap.parse_args()
    repeats = 1 if args.reduced else args.repeats
    result = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "load_avg": os.getloadavg()},
              "prg": prg_throughput(int(max(args.params)), max(repeats, 5) * 3),
              "encode": encode_throughput(min(args.cohorts), int(min(args.params)), max(repeats, 3)),
              "aggregation": [],
              "skipped": []}
    for n in args.cohorts:
        for d in (int(p) for p in args.params):
            for g in args.graphs:
                tag = f"{n}:{d}:{g}"
                if tag in args.skip:
                    result["skipped"].append(tag)
                    continue
                result["aggregation"].append(aggregation_case(n, d, g, repeats, int(args.max_wrapper_elems)))
                print(json.dumps(result["aggregation"][-1]), flush=True, file=__import__("sys").stderr)
    result["federated_round"] = federated_round(min(args.cohorts), repeats)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
