"""Cost of secure aggregation per round, next to plain aggregation and a whole FedAvg round.

Measures, for each cohort size n, model size d and neighbour graph (full = SecAgg,
sparse = SecAgg+):

- ``plain_s``: the jitted ``mean_aggregator`` on (n, d) float32 deltas;
- ``secure_s``: ``secure_aggregation(mean_aggregator())``: clip, quantise, the whole
  protocol between n client objects and a server object (X25519, Shamir, AEAD, masks),
  decode (only where n * d <= --max-wrapper-elems; otherwise only the protocol);
- ``protocol_s``: ``run_round`` alone on pre-quantised uint32 inputs;
- the PRG's mask throughput (AES-256-CTR keystream added mod 2^32) as a fraction of the
  machine's raw AES-256-CTR throughput on the same bytes (one call, and in the mask path's
  chunks), for one mask and for several masks added in one pass (see ``prg_throughput``);
- a whole FedAvg round (``memaudit.federated.algorithms.fedavg``) on a 1M-parameter linear
  model with and without secure aggregation, if that module is importable;
- ``modes``: one protocol round in the previous default mode (``honest_but_curious``: no
  signatures, open to survivor-list forking) next to the default (``malicious``: Ed25519 on
  keys, views and the survivor list, and the consistency round), on 8, 32 and 128 clients
  (graph ``auto``: SecAgg+ from 32), a small vector, timed in turn in every repeat (medians).

Prints one JSON object.

    python benchmarks/secagg_overhead.py                 # cohorts 16 64, 1M and 10M params
    python benchmarks/secagg_overhead.py --reduced       # fewer cases, 1 repeat
    python benchmarks/secagg_overhead.py --modes-only    # the two modes side by side only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np
from timing import median_seconds  # benchmarks/timing.py, beside this script


def prg_throughput(d: int, repeats: int, fused: int = 8) -> dict:
    """Mask throughput next to raw AES-256-CTR, measured the same way and interleaved.

    Every case turns 4d bytes of the same zero plaintext into AES-256-CTR keystream with
    ``update_into`` into a preallocated buffer; the ratios are mask throughput / raw throughput
    for the same bytes (= raw time / mask time). Each repeat times, back to back:

    - ``raw_large``: one raw ``update_into`` of all 4d bytes (the cipher's ceiling);
    - ``mask``: one ``add_mask`` (keystream in cache-sized chunks added mod 2^32 into a
      d-word accumulator, which for a large d lives in memory);
    - ``raw_chunked``: raw ``update_into`` in the mask path's own chunks (``prg.CHUNK_WORDS``)
      into one reused buffer, so mask / raw_chunked isolates the cost of the add;
    - ``fused``: ``add_masks`` with ``fused`` seeds of alternating sign (how a client adds its
      self mask and pairwise masks, and the server removes them: one pass over the
      accumulator), reported per mask;
    - ``expand``: the keystream of d words into a preallocated array (no add);
    - ``mask_numpy`` / ``fused_numpy``: ``mask`` and ``fused`` on the numpy path (the fallback
      where the C extension was not built); ``mask`` and ``fused`` take the C path when it was
      built (``native`` in the JSON says which), in one thread like the raw cipher;
    - ``fused_threads``: ``fused`` on the C path split over ``prg.mask_threads()`` threads (the
      default in the protocol); its ratio is to the one-thread raw cipher, which holds the GIL
      and so cannot run on two threads at once from Python.

    Wall-clock time (under ``wall``) and this process's CPU time over all its threads (under
    ``cpu``: robust to other processes taking a core, not to them evicting its caches) are
    both recorded.
    Ratios are the median over repeats of the per-repeat ratio (``paired_median``) and the
    ratio of the best times (``best``).
    """
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    from memaudit.federated.secagg import prg

    acc = np.zeros(d, dtype=np.uint32)
    nbytes = 4 * d
    zeros = prg._zeros(nbytes) if hasattr(prg, "_zeros") else bytes(nbytes)  # the masks' plaintext
    out = np.empty(d + 4, dtype=np.uint32)  # update_into needs 15 bytes of slack
    out_view = memoryview(out).cast("B")
    chunk = 4 * getattr(prg, "CHUNK_WORDS", 1 << 14)  # bytes per update_into in the mask path
    chunk_out = bytearray(chunk + 16)
    pieces = [zeros[:chunk]] * (nbytes // chunk)  # the same views the mask path passes
    if nbytes % chunk:
        pieces.append(zeros[: nbytes % chunk])
    seeds = [(os.urandom(32), 1 if i % 2 else -1) for i in range(fused)]

    native = getattr(prg, "NATIVE", False)

    def fused_add(acc, seeds, **kw):  # older prg modules: one pass per mask
        if hasattr(prg, "add_masks"):
            return prg.add_masks(acc, seeds, **kw)
        for seed, sign in seeds:
            prg.add_mask(acc, seed, sign)

    def raw_large():
        enc = Cipher(algorithms.AES(os.urandom(32)), modes.CTR(bytes(16))).encryptor()
        enc.update_into(zeros, out_view)

    def raw_chunked():
        enc = Cipher(algorithms.AES(os.urandom(32)), modes.CTR(bytes(16))).encryptor()
        update_into = enc.update_into
        for piece in pieces:  # exactly 4d bytes in all
            update_into(piece, chunk_out)

    one = {"threads": 1} if native else {}  # the ratios compare one thread with one thread
    cases = {"raw_large": raw_large, "mask": lambda: prg.add_mask(acc, os.urandom(32), +1, **one),
             "raw_chunked": raw_chunked, "fused": lambda: fused_add(acc, seeds, **one),
             "expand": lambda: prg._keystream_into(os.urandom(32), out, d)}
    if native:
        cases["mask_numpy"] = lambda: prg.add_mask(acc, os.urandom(32), +1, native=False)
        cases["fused_numpy"] = lambda: fused_add(acc, seeds, native=False)
        cases["fused_threads"] = lambda: fused_add(acc, seeds)  # split over prg.mask_threads()
    per_call = {"fused": fused, "fused_numpy": fused, "fused_threads": fused}  # x nbytes per call
    for fn in cases.values():  # warm up: page in buffers
        fn()
    wall: dict[str, list[float]] = {k: [] for k in cases}
    cpu: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(repeats):
        for k, fn in cases.items():
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            t1, c1 = time.perf_counter(), time.process_time()
            wall[k].append((t1 - t0) / per_call.get(k, 1))
            cpu[k].append((c1 - c0) / per_call.get(k, 1))

    out_json: dict = {"words": d, "repeats": repeats, "fused_masks": fused, "chunk_bytes": chunk,
                      "native": native,
                      "mask_threads": prg.mask_threads() if native else 1}
    for clock, times in (("wall", wall), ("cpu", cpu)):
        def paired(num, den, times=times):  # throughput(num) / throughput(den), per repeat
            return statistics.median(td / tn for tn, td in zip(times[num], times[den], strict=True))

        gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
        best = {k: min(v) for k, v in times.items()}
        out_json[clock] = {
            **{f"{k}_GBps_median": v for k, v in gbps.items()},
            "mask_over_raw_large_paired_median": paired("mask", "raw_large"),
            "mask_over_raw_large_best": best["raw_large"] / best["mask"],
            "mask_over_raw_chunked_paired_median": paired("mask", "raw_chunked"),
            "fused_over_raw_large_paired_median": paired("fused", "raw_large"),
            "fused_over_raw_large_best": best["raw_large"] / best["fused"],
            "fused_over_raw_chunked_paired_median": paired("fused", "raw_chunked"),
            "expand_over_raw_large_paired_median": paired("expand", "raw_large"),
        }
        if native:
            out_json[clock].update({
                "mask_numpy_over_raw_large_paired_median": paired("mask_numpy", "raw_large"),
                "fused_numpy_over_raw_large_paired_median": paired("fused_numpy", "raw_large"),
                "fused_threads_over_raw_large_paired_median": paired("fused_threads", "raw_large"),
            })
    return out_json


def encode_throughput(n: int, d: int, repeats: int) -> dict:
    """Host-side cost of the wrapper's clip + stochastic-rounding quantisation of (n, d) floats."""
    from memaudit.federated.secagg.aggregator import encode, quantisation_scale

    rows = np.random.default_rng(0).normal(size=(n, d)).astype(np.float32)
    scale, _ = quantisation_scale(1.0, 20, n)
    rng = np.random.default_rng(1)
    t = median_seconds(lambda: encode(rows, 1.0, scale, rng), repeats)
    return {"cohort": n, "params": d, "encode_s": t, "encode_ns_per_value": t / (n * d) * 1e9}


def aggregation_case(n: int, d: int, graph: str, repeats: int, max_wrapper_elems: int) -> dict:
    """Protocol alone, plain jitted mean and the secure wrapper, timed in turn in every repeat.

    Times are medians over repeats; ``secure_over_plain`` and ``wrapper_host_s`` (flatten,
    encode, decode: secure minus protocol) are medians of the per-repeat values."""
    import jax
    import jax.numpy as jnp

    from memaudit.federated.aggregators import mean_aggregator
    from memaudit.federated.secagg import run_round
    from memaudit.federated.secagg.aggregator import secure_aggregation

    out: dict = {"cohort": n, "params": d, "graph": graph, "repeats": repeats}
    rng = np.random.default_rng(0)
    q = rng.integers(0, 2**20, size=(n, d), dtype=np.uint32)
    cases = {"protocol": lambda: run_round(q, neighbours=graph)}
    if n * d <= max_wrapper_elems:
        deltas = jnp.asarray(rng.normal(size=(n, d)).astype(np.float32) * 1e-3)
        w = jnp.ones(n)
        plain = jax.jit(mean_aggregator().aggregate)
        jax.block_until_ready(plain(deltas, w, None, None).update)  # compile
        agg = secure_aggregation(mean_aggregator(), clip=1.0, neighbours=graph, seed=0)
        st = agg.init(None)
        cases["plain"] = lambda: jax.block_until_ready(plain(deltas, w, None, None).update)
        cases["secure"] = lambda: agg.aggregate(deltas, w, st, jax.random.key(0))
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(repeats):
        for k, fn in cases.items():
            t0 = time.perf_counter()
            res = fn()
            times[k].append(time.perf_counter() - t0)
            if k == "protocol":
                out["degree"] = res.degree
                out["bytes_up_per_client"] = res.bytes_up / n
    for k, v in times.items():
        out[f"{k}_s"] = statistics.median(v)
    if "secure" in times:
        per = list(zip(times["protocol"], times["plain"], times["secure"], strict=True))
        out["secure_over_plain"] = statistics.median(sec / pl for _, pl, sec in per)
        out["secure_over_protocol"] = statistics.median(sec / pr for pr, _, sec in per)
        out["wrapper_host_s"] = statistics.median(sec - pr for pr, _, sec in per)
    return out


def federated_round(n: int, repeats: int) -> dict:
    """One FedAvg round (1M-parameter linear model) with plain, SecAgg and SecAgg+ aggregation,
    the three timed in turn in every repeat (medians)."""
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
    out = {"cohort": n, "params": k * k, "repeats": repeats}
    aggs = {"plain": mean_aggregator(),
            "secure_full": secure_aggregation(mean_aggregator(), clip=10.0, neighbours="full", seed=0),
            "secure_sparse": secure_aggregation(mean_aggregator(), clip=10.0, neighbours="sparse",
                                                seed=0)}
    rounds = {}
    for name, agg in aggs.items():
        alg = fedavg(loss_fn, client_optimizer=optax.sgd(1e-4), server_optimizer=optax.sgd(1.0),
                     local_steps=2, batch_size=4, aggregator=agg, weighting="uniform")
        state = alg.init(params)
        state, _ = alg.round(state, data, jax.random.key(0))  # compile
        jax.block_until_ready(state.params)

        def one(alg=alg, state=state):
            s, _ = alg.round(state, data, jax.random.key(1))
            jax.block_until_ready(s.params)
        rounds[name] = one
    times: dict[str, list[float]] = {name: [] for name in rounds}
    for _ in range(repeats):
        for name, one in rounds.items():
            t0 = time.perf_counter()
            one()
            times[name].append(time.perf_counter() - t0)
    for name, v in times.items():
        out[f"{name}_round_s"] = statistics.median(v)
    for name in ("secure_full", "secure_sparse"):
        out[f"{name}_over_plain"] = statistics.median(
            t / p for t, p in zip(times[name], times["plain"], strict=True))
    return out


def mode_comparison(cohorts: list[int], d: int, repeats: int) -> list[dict]:
    """``run_round`` in the previous default mode and in the default, side by side, per cohort."""
    from memaudit.federated.secagg import run_round
    from memaudit.federated.secagg.aggregator import graph_kind

    out = []
    for n in cohorts:
        q = np.random.default_rng(n).integers(0, 2**20, size=(n, d), dtype=np.uint32)
        graph = graph_kind("auto", n)
        modes = ("honest_but_curious", "malicious")
        times: dict[str, list[float]] = {m: [] for m in modes}
        row: dict = {"cohort": n, "params": d, "graph": graph, "repeats": repeats}
        for _ in range(repeats):
            for m in modes:
                t0 = time.perf_counter()
                res = run_round(q, neighbours=graph, mode=m)
                times[m].append(time.perf_counter() - t0)
                row[f"{m}_bytes_up_per_client"] = res.bytes_up / n
                row[f"{m}_bytes_down_per_client"] = res.bytes_down / n
                row["degree"] = res.degree
        for m in modes:
            row[f"{m}_s"] = statistics.median(times[m])
        row["malicious_over_honest_but_curious"] = statistics.median(
            a / b for a, b in zip(times["malicious"], times["honest_but_curious"], strict=True))
        out.append(row)
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
    ap.add_argument("--mode-cohorts", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--mode-params", type=int, default=1000, help="vector length of the mode comparison")
    ap.add_argument("--modes-only", action="store_true", help="only the two modes side by side")
    args = ap.parse_args()
    repeats = 1 if args.reduced else args.repeats
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "load_avg": os.getloadavg()}
    if args.modes_only:
        modes = mode_comparison(args.mode_cohorts, args.mode_params, repeats)
        print(json.dumps({"machine": {**machine, "load_avg_end": os.getloadavg()}, "modes": modes}, indent=1))
        return
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
    result["modes"] = mode_comparison(args.mode_cohorts, args.mode_params, repeats)
    result["machine"]["load_avg_end"] = os.getloadavg()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
