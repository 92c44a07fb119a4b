"""The federated backend on one accelerator chip, side by side in one program; prints JSON lines.

One process measures, on the chip it finds (a TPU v5e in `docs/results.md`), with memaudit's
compute policy (`memaudit.models.precision`: bf16 compute, f32 weights and sums, scanned decoder
layers) and random tokens (sequence 512, 2 local steps of 2 sequences per client, clients one
after the other inside the round, the server state donated):

- ``round``: a FedAvg round per (preset, cohort): compile seconds, XLA's memory of the compiled
  round, the median of warm rounds, per-client seconds and the model FLOPs utilisation (MFU:
  6 N + 12 L h s FLOPs a token, PaLM appendix B, over the chip's bf16 peak);
  ``--client-steps both`` runs each round with a client's local steps peeled (the first and last
  outside the steps' loop, `fedavg`'s default) and in one scan, in turns, with their ratio;
- ``centralized``: SGD on the same tokens (``local_steps`` steps of the cohort's sequences as one
  batch) with the same model and policy; ``vs_centralized`` = round / centralized seconds;
- ``dp``: DP-FedAvg (clip and sum fused in the clients' loop) beside FedAvg on the same cohort;
- ``steps``: FedAvg and DP-FedAvg with k clients a step of the clients' loop
  (``federated.clients_per_step``, vmapped within the step) for each k of ``--steps-k``, beside
  k = 1 on the same cohort: round seconds, memory, MFU and the ratio to k = 1;
- ``fax``: FAX's shapes for real (350m x 2,048 and 1b x 512 clients), one timed round each;
- ``checks``: `accelerator_check`'s checks (a client stage's gradient against the CPU's at
  highest precision, a bf16 matmul rate), first.

Every item is guarded: one that fails (out of memory) prints its error and the rest go on. Each
line is printed as soon as it is measured (``--out FILE`` appends them there too).

    python benchmarks/federated_chip.py --reduced        # CPU rehearsal (tiny preset, seconds)
    python benchmarks/federated_chip.py                  # on the chip (about 5 minutes on a v5e)
    python benchmarks/federated_chip.py --only round dp  # a subset
    python benchmarks/federated_chip.py --only round --rounds 125m:32 --unrolled --client-steps both
    python benchmarks/federated_chip.py --only steps --steps 125m:32 --steps-k 1 2 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from federated_scale import flops_per_token  # benchmarks/, beside this script
from timing import median_seconds

from memaudit.federated.aggregators import mean_aggregator
from memaudit.federated.algorithms import fedavg
from memaudit.federated.cohorts import ClientData
from memaudit.federated.dp import dp_fedavg
from memaudit.federated.trainer import make_loss_fn
from memaudit.models.flax_llama import FlaxLlama, FlaxLlamaConfig, init_params
from memaudit.models.precision import ComputePolicy, resolve_policy

PEAK_TFLOPS = {"tpu v5 lite": 197.0, "tpu v5e": 197.0, "tpu v4": 275.0, "tpu v5p": 459.0,
               "tpu v6 lite": 918.0, "h100": 989.0, "h200": 989.0, "a100": 312.0}


def peak_tflops() -> float | None:
    """The chip's dense bf16 peak (None: not a chip this table knows, e.g. the CPU)."""
    kind = jax.devices()[0].device_kind.lower()
    return next((v for k, v in PEAK_TFLOPS.items() if k in kind), None)


def memory_stats() -> dict:
    """The device's allocator figures (bytes in use, peak), in GiB; {} where JAX has none (CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return {k + "_gib": round(v / 2**30, 3) for k, v in stats.items()
            if k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")}


def compiled_gib(compiled) -> float:
    mem = compiled.memory_analysis()
    return round((mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                  - mem.alias_size_in_bytes) / 2**30, 3)


class Bench:
    """The shared settings and the emitter of result lines."""

    def __init__(self, args):
        self.args, self.peak = args, peak_tflops()
        self.out = Path(args.out) if args.out else None

    def emit(self, row: dict) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        if self.out is not None:
            with self.out.open("a") as f:
                f.write(line + "\n")

    def mfu(self, flops: float, seconds: float) -> float | None:
        return None if self.peak is None else round(flops / seconds / (self.peak * 1e12), 4)

    def model(self, preset: str, policy: ComputePolicy):
        cfg = dataclasses.replace(FlaxLlamaConfig.from_preset(preset, policy=policy), attention=self.args.attention)
        params = jax.jit(lambda: init_params(cfg, seed=0))()
        n = int(sum(x.size for x in jax.tree.leaves(params)))
        return cfg, FlaxLlama(cfg), params, n

    def tokens(self, cfg, cohort: int) -> np.ndarray:
        a = self.args
        return np.random.default_rng(cohort).integers(0, cfg.vocab_size, (cohort, a.local_steps * a.batch, a.seq),
                                                      dtype=np.int32)

    def round_flops(self, cfg, n_params: int, cohort: int) -> float:
        a = self.args
        return flops_per_token(cfg, n_params, a.seq) * cohort * a.local_steps * a.batch * a.seq

    def prepare_round(self, model, params, ids, *, dp: bool = False, clients_per_step: int = 1,
                      peel: bool = True) -> tuple:
        """FedAvg (or DP-FedAvg) on ``ids`` compiled: ``(one, facts)``, ``one()`` running a round
        (its metrics) and ``facts`` the compile seconds and XLA's memory. ``peel``: a client's first
        and last local steps outside its steps' loop (`fedavg`'s ``peel_local_steps``)."""
        a = self.args
        agg = None
        if dp:  # user-level: uniform weights, a clip most deltas reach, noise z = 1
            agg = dp_fedavg(mean_aggregator(), clip=0.1, noise_multiplier=1.0, expected_cohort=float(ids.shape[0]))
        algo = fedavg(make_loss_fn(model), client_optimizer=optax.sgd(0.1), server_optimizer=optax.sgd(1.0),
                      local_steps=a.local_steps, batch_size=a.batch, aggregator=agg,
                      weighting="uniform" if dp else "examples", donate=True,
                      clients_per_step=clients_per_step, peel_local_steps=peel)
        data = ClientData({"input_ids": jnp.asarray(ids), "attention_mask": jnp.ones(ids.shape, jnp.int32)},
                          jnp.ones(ids.shape[:2], jnp.float32))
        state = algo.init(jax.tree.map(jnp.array, params))  # a copy: the round donates its state
        key = jax.random.key(0)
        t0 = time.perf_counter()
        compiled = algo.jitted.lower(state, data, key).compile()
        compile_s = time.perf_counter() - t0
        box = [state]

        def one():
            box[0], m = compiled(box[0], data, key)
            jax.block_until_ready(box[0].params)
            return m

        return one, {"compile_s": round(compile_s, 2), "compiled_gib": compiled_gib(compiled)}

    def fed_round(self, model, params, ids, *, dp: bool = False, repeats: int | None = None,
                  clients_per_step: int = 1, peel: bool = True) -> dict:
        """Compile, memory and the median of warm rounds of FedAvg (or DP-FedAvg) on ``ids``,
        ``clients_per_step`` clients a step of the clients' loop."""
        repeats = self.args.repeats if repeats is None else repeats
        one, facts = self.prepare_round(model, params, ids, dp=dp, clients_per_step=clients_per_step, peel=peel)
        t1 = time.perf_counter()
        m = one()  # the first run, timed on its own (the only one for FAX's shapes)
        first_s = time.perf_counter() - t1
        round_s = median_seconds(one, repeats) if repeats > 0 else first_s
        loss = float(jax.device_get(m[0]["loss"]))
        return {**facts, "first_round_s": round(first_s, 4), "round_s": round(round_s, 4), "loss": round(loss, 4),
                **memory_stats()}

    def rounds_side_by_side(self, model, params, ids, variants: dict[str, dict]) -> dict[str, dict]:
        """Each variant (``prepare_round`` options) compiled, run once, then timed in turns (one
        round of each per repeat, so that a drift of the machine falls on all alike): per variant
        its compile facts, first round and median round."""
        runs = {name: self.prepare_round(model, params, ids, **opts) for name, opts in variants.items()}
        rows, times = {}, {name: [] for name in runs}
        for name, (one, facts) in runs.items():
            t0 = time.perf_counter()
            m = one()
            rows[name] = {**facts, "first_round_s": round(time.perf_counter() - t0, 4),
                          "loss": round(float(jax.device_get(m[0]["loss"])), 4)}
        for _ in range(self.args.repeats):
            for name, (one, _) in runs.items():
                t0 = time.perf_counter()
                one()
                times[name].append(time.perf_counter() - t0)
        for name in runs:
            rows[name]["round_s"] = round(statistics.median(times[name]), 4)
        return rows

    def centralized(self, model, params, ids) -> dict:
        """SGD on the round's tokens in the same shapes: ``cohort x local_steps`` steps of ``batch``
        sequences each (every client's local batches one after the other), the same model and policy
        (one batch of the whole cohort holds every client's activations at once: 32 GiB at 125m x 32)."""
        a = self.args
        loss_fn, opt = make_loss_fn(model), optax.sgd(0.1)
        batches = ids.reshape(-1, a.batch, ids.shape[-1])[: ids.shape[0] * a.local_steps]

        def train(p, batches):
            def step(p, t):
                g = jax.grad(lambda p: loss_fn(p, {"input_ids": t, "attention_mask": jnp.ones_like(t)})[0].mean())(p)
                u, _ = opt.update(g, opt.init(p), p)
                return optax.apply_updates(p, u), None

            return jax.lax.scan(step, p, batches)[0]

        p = jax.tree.map(jnp.array, params)
        batches = jnp.asarray(batches)
        fn = jax.jit(train, donate_argnums=0)
        t0 = time.perf_counter()
        compiled = fn.lower(p, batches).compile()
        compile_s = time.perf_counter() - t0
        box = [p]

        def one():
            box[0] = compiled(box[0], batches)
            jax.block_until_ready(box[0])

        s = median_seconds(one, a.repeats, warmup=1)
        return {"centralized_s": round(s, 4), "centralized_compile_s": round(compile_s, 2),
                "centralized_gib": compiled_gib(compiled)}

    def compile_only(self, model, params, ids) -> dict:
        """The round compiled, not run: its compile seconds and XLA's memory."""
        a = self.args
        algo = fedavg(make_loss_fn(model), client_optimizer=optax.sgd(0.1), server_optimizer=optax.sgd(1.0),
                      local_steps=a.local_steps, batch_size=a.batch, donate=True)
        data = ClientData({"input_ids": jax.ShapeDtypeStruct(ids.shape, jnp.int32),
                           "attention_mask": jax.ShapeDtypeStruct(ids.shape, jnp.int32)},
                          jax.ShapeDtypeStruct(ids.shape[:2], jnp.float32))
        state = jax.eval_shape(algo.init, params)
        t0 = time.perf_counter()
        compiled = algo.jitted.lower(state, data, jax.eval_shape(lambda: jax.random.key(0))).compile()
        return {"compile_s": round(time.perf_counter() - t0, 2), "compiled_gib": compiled_gib(compiled)}


def guarded(bench: Bench, what: dict, fn) -> dict | None:
    try:
        row = {**what, **fn()}
    except Exception as e:  # noqa: BLE001 - one item's failure (out of memory) must not stop the rest
        row = {**what, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
        traceback.print_exc(file=sys.stderr)
    bench.emit(row)
    return row


def run_rounds(bench: Bench, policy: ComputePolicy) -> None:
    """FedAvg rounds per preset and cohort, beside the centralized step on the same tokens. With
    ``--client-steps both`` each round runs a client's local steps peeled (the first and last
    outside the steps' loop, the default) and in one scan, in turns, on the same tokens."""
    a = bench.args
    variants = {"peeled": {"peel": True}, "scanned": {"peel": False}}
    if a.client_steps != "both":
        variants = {a.client_steps: variants[a.client_steps]}
    for preset, cohorts in a.rounds:
        cfg, model, params, n = bench.model(preset, policy)
        for i, cohort in enumerate(cohorts):
            ids = bench.tokens(cfg, cohort)
            flops = bench.round_flops(cfg, n, cohort)
            what = {"item": "round", "preset": preset, "params": n, "cohort": cohort,
                    "dtype": policy.compute_dtype, "scan_layers": policy.scan_layers, "round_tflop": round(flops / 1e12, 3)}
            rows = {}
            for name, r in _round_rows(bench, model, params, ids, variants).items():
                if "round_s" in r:
                    r = {**r, "round_s_per_client": round(r["round_s"] / cohort, 5), "mfu": bench.mfu(flops, r["round_s"])}
                rows[name] = {**what, "client_steps": name, **r}
                bench.emit(rows[name])
            if len(rows) == 2 and all("round_s" in r for r in rows.values()):
                bench.emit({**what, "item": "client_steps", "peeled_s": rows["peeled"]["round_s"],
                            "scanned_s": rows["scanned"]["round_s"],
                            "peeled_vs_scanned": round(rows["peeled"]["round_s"] / rows["scanned"]["round_s"], 4)})
            done = {name: r["round_s"] for name, r in rows.items() if "round_s" in r}
            if i == len(cohorts) - 1 and done:  # the centralized step beside the largest cohort

                def central(ids=ids, flops=flops, done=done, model=model, params=params):
                    c = bench.centralized(model, params, ids)
                    ratios = {f"vs_centralized_{name}": round(s / c["centralized_s"], 3) for name, s in done.items()}
                    first = next(iter(done))
                    return {**c, "round_s": done[first], "vs_centralized": ratios[f"vs_centralized_{first}"],
                            **(ratios if len(done) > 1 else {}), "centralized_mfu": bench.mfu(flops, c["centralized_s"])}

                guarded(bench, {**what, "item": "centralized", "client_steps": next(iter(done))}, central)
        del params


def _round_rows(bench: Bench, model, params, ids, variants: dict[str, dict]) -> dict[str, dict]:
    """The variants' rows (`Bench.rounds_side_by_side`; one variant: `Bench.fed_round`), or each an
    error row when they failed (out of memory)."""
    try:
        if len(variants) == 1:
            (name, opts), = variants.items()
            return {name: bench.fed_round(model, params, ids, **opts)}
        rows = bench.rounds_side_by_side(model, params, ids, variants)
        return {name: {**row, **memory_stats()} for name, row in rows.items()}
    except Exception as e:  # noqa: BLE001 - one item's failure (out of memory) must not stop the rest
        traceback.print_exc(file=sys.stderr)
        return {name: {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
                for name in variants}


def run_dp(bench: Bench, policy: ComputePolicy) -> None:
    """DP-FedAvg beside FedAvg on one cohort: time and memory."""
    preset, cohort = bench.args.dp
    cfg, model, params, _ = bench.model(preset, policy)
    ids = bench.tokens(cfg, cohort)

    def measure():
        plain = bench.fed_round(model, params, ids)
        private = bench.fed_round(model, params, ids, dp=True)
        return {"fedavg": plain, "dp_fedavg": private,
                "time_ratio": round(private["round_s"] / plain["round_s"], 4),
                "memory_ratio": round(private["compiled_gib"] / plain["compiled_gib"], 4)}

    guarded(bench, {"item": "dp", "preset": preset, "cohort": cohort, "dtype": policy.compute_dtype}, measure)


def run_steps(bench: Bench, policy: ComputePolicy) -> None:
    """k clients a step of the clients' loop beside one, FedAvg and DP-FedAvg on one cohort; the
    variants alternate (k = 1, 2, ... for FedAvg, then for DP-FedAvg), each its median of warm rounds."""
    preset, cohort = bench.args.steps
    cfg, model, params, n = bench.model(preset, policy)
    ids = bench.tokens(cfg, cohort)
    flops = bench.round_flops(cfg, n, cohort)
    for dp in (False, True):
        base = None
        for k in bench.args.steps_k:
            def measure(k=k, dp=dp, base=base):
                r = bench.fed_round(model, params, ids, dp=dp, clients_per_step=k)
                vs = None if base is None else round(r["round_s"] / base, 4)
                return {**r, "mfu": bench.mfu(flops, r["round_s"]), "vs_k1": vs}

            row = guarded(bench, {"item": "steps", "preset": preset, "cohort": cohort, "dp": dp,
                                  "clients_per_step": k, "dtype": policy.compute_dtype}, measure)
            if k == 1 and "round_s" in row:
                base = row["round_s"]


def run_fax(bench: Bench, policy: ComputePolicy) -> None:
    """FAX's shapes: one compiled, one timed round each (clients in sequence); ``--fax-compile``
    shapes are compiled only (memory, compile seconds). ``--fax-remat``: rematerialised layers."""
    a = bench.args
    if a.fax_remat:
        policy = dataclasses.replace(policy, scan_layers=True, remat=True)
    for (preset, cohort), run in [*((x, True) for x in a.fax), *((x, False) for x in a.fax_compile)]:
        cfg, model, params, n = bench.model(preset, policy)
        ids = bench.tokens(cfg, cohort)
        flops = bench.round_flops(cfg, n, cohort)

        def measure(ids=ids, flops=flops, cohort=cohort, run=run, model=model, params=params):
            if not run:
                return bench.compile_only(model, params, ids)
            r = bench.fed_round(model, params, ids, repeats=0)
            return {**r, "round_s_per_client": round(r["round_s"] / cohort, 5), "mfu": bench.mfu(flops, r["round_s"])}

        guarded(bench, {"item": "fax" if run else "fax_compile", "preset": preset, "params": n, "cohort": cohort,
                        "dtype": policy.compute_dtype, "remat": policy.remat, "round_tflop": round(flops / 1e12, 2)},
                measure)
        del params


def _pairs(items: list[str]) -> list[tuple[str, int]]:
    return [(p, int(c)) for p, c in (s.split(":") for s in items)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", default=["checks", "round", "dp", "steps", "fax"],
                    choices=["checks", "round", "dp", "steps", "fax"])
    ap.add_argument("--rounds", nargs="+", default=["125m:8,32", "350m:8,32"], metavar="PRESET:C1,C2",
                    help="FedAvg rounds (the last cohort of each also runs the centralized step)")
    ap.add_argument("--dp", default="125m:16", metavar="PRESET:COHORT")
    ap.add_argument("--steps", default="125m:32", metavar="PRESET:COHORT",
                    help="clients per step of the loop: k of --steps-k beside 1")
    ap.add_argument("--steps-k", nargs="+", type=int, default=[1, 2, 4], metavar="K")
    ap.add_argument("--fax", nargs="*", default=["350m:2048", "1b:512"], metavar="PRESET:COHORT")
    ap.add_argument("--fax-compile", nargs="*", default=[], metavar="PRESET:COHORT",
                    help="FAX shapes compiled only (memory, compile seconds)")
    ap.add_argument("--fax-remat", action="store_true", help="FAX shapes with rematerialised layers")
    ap.add_argument("--attention", choices=["xla", "flash"], default="xla",
                    help="attention kernel: einsums (xla) or the Pallas TPU flash kernel")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--unrolled", action="store_true", help="decoder layers unrolled (not scanned)")
    ap.add_argument("--client-steps", choices=["peeled", "scanned", "both"], default="peeled",
                    help="a client's local steps in rounds: first and last outside the steps' loop (peeled), "
                         "all in one scan (scanned), or both side by side")
    ap.add_argument("--remat", action="store_true", help="rematerialise the scanned layers")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--local-steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="append the JSON lines to this file as well")
    ap.add_argument("--reduced", action="store_true", help="the CPU rehearsal: tiny presets, short sequences")
    args = ap.parse_args(argv)
    if args.reduced:
        args.rounds, args.dp, args.fax = ["tiny:2,4", "tiny2x:4"], "tiny:4", ["tiny:16"]
        args.steps = "tiny:8"
        args.fax_compile = ["tiny2x:8"]
        args.seq, args.repeats = 32, 2
    args.rounds = [(p, [int(c) for c in cs.split(",")]) for p, cs in (s.split(":") for s in args.rounds)]
    args.dp, args.steps = _pairs([args.dp])[0], _pairs([args.steps])[0]
    if 1 not in args.steps_k:
        args.steps_k = [1, *args.steps_k]  # the baseline every ratio is to
    args.steps_k = sorted(set(args.steps_k))
    args.fax, args.fax_compile = _pairs(args.fax), _pairs(args.fax_compile)
    scan = False if args.unrolled else (True if args.remat else None)
    policy = resolve_policy(args.dtype, scan_layers=True if scan is None and jax.default_backend() != "cpu" else scan,
                            remat=args.remat)
    bench = Bench(args)
    dev = jax.devices()[0]
    bench.emit({"item": "device", "backend": jax.default_backend(), "kind": dev.device_kind, "jax": jax.__version__,
                "peak_bf16_tflops": bench.peak, "policy": vars(policy), "seq": args.seq,
                "local_steps": args.local_steps, "batch": args.batch, "repeats": args.repeats,
                "date": time.strftime("%Y-%m-%d"), **memory_stats()})
    if "checks" in args.only:
        import accelerator_check  # lazy: benchmarks/, beside this script; only with the checks

        guarded(bench, {"item": "checks"}, lambda: accelerator_check.checks(quick=args.reduced))
    if "round" in args.only:
        run_rounds(bench, policy)
    if "dp" in args.only:
        run_dp(bench, policy)
    if "steps" in args.only:
        run_steps(bench, policy)
    if "fax" in args.only:
        run_fax(bench, policy)


if __name__ == "__main__":
    main()
