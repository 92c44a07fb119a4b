"""The centralized backend's jax engine on one accelerator, side by side in one program; prints JSON.

For each preset: the median step time of the non-private step (`memaudit.train.jax_engine.
plain_step`: token-mean loss, global-norm clipping, AdamW) in the compute dtype (bf16 on an
accelerator, float32 parameters) and its model FLOPs utilisation (MFU: 6 x matmul parameters x
tokens + 12 x layers x hidden x seq x tokens for attention, over the chip's peak); example-level
DP-SGD (`memaudit.train.jax_dp.private_step`: jax-privacy's per-example clipping by vmap,
``--micro`` examples at a time, and its Gaussian noise) and ULS (users of ``--k`` sequences, each
user's summed gradient clipped as one) on the same tokens, and both again with the clipped sum by
book-keeping ghost clipping (`memaudit.train.jax_ghost`: kinds ``dp_ghost``, ``uls_ghost``, the
whole batch in one forward and one backward), as ratios to the non-private step; the kinds are
run interleaved, ``--repeats`` rounds, each kind's median.
Then the largest preset whose DP-SGD full fine-tune (AdamW state, one example per vmap
micro-batch) fits on one device, by XLA's memory analysis of the compiled step (arguments +
outputs + temporaries - donated), checked by running one step of the largest that fits.

Imports neither torch nor transformers (a TPU host has neither): the weights are the Flax
model's own initialisation, the tokens random.

    python benchmarks/centralized_jax.py --presets tiny --batch 8 --seq 64 --repeats 3   # CPU
    python benchmarks/centralized_jax.py --presets 125m 350m --batch 16 --seq 1024         # TPU

Measured figures: docs/results.md ("Centralized training in JAX").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from memaudit.models.flax_llama import FlaxLlama, FlaxLlamaConfig
from memaudit.train import jax_dp
from memaudit.train import jax_engine as eng

# bf16 dense peak per chip (FLOP/s), by `device_kind`
PEAK = {"TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v4": 275e12, "TPU v5p": 459e12, "TPU v6 lite": 918e12}


def step_flops(cfg: FlaxLlamaConfig, tokens: int, seq: int) -> float:
    """Model FLOPs of one training step (forward + backward) on `tokens` tokens of length `seq`."""
    h, f, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * cfg.head_dim
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * f  # q, o, k, v, gate, up, down
    matmul = layers * per_layer + cfg.vocab_size * h  # + the lm head (or the tied embedding)
    return 6.0 * matmul * tokens + 12.0 * layers * h * seq * tokens


def _median_time(run: Any, state: tuple, repeats: int, warm: bool = True) -> tuple[float, tuple]:
    """Median seconds of `run(state) -> state` over `repeats` calls, after one warm-up call
    (compilation) unless `warm` is False."""
    if warm:
        state = run(state)
        jax.block_until_ready(state)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state = run(state)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), state


def _setup(preset: str, dtype: Any, batch: int, seq: int, scan: bool = False, remat: bool = False,
           attention: str = "xla") -> dict[str, Any]:
    cfg = dataclasses.replace(FlaxLlamaConfig.from_preset(preset, dtype=dtype), scan_layers=scan, remat=remat,
                              attention=attention)
    model = FlaxLlama(cfg)
    params = jax.jit(lambda k: model.init(k, jnp.zeros((1, 8), jnp.int32))["params"])(jax.random.key(0))
    tx = eng.adamw((0.9, 0.95), 0.0)
    ids = jax.random.randint(jax.random.key(1), (batch, seq), 0, cfg.vocab_size, jnp.int32)
    am = jnp.ones((batch, seq), jnp.int32)
    lm = am.astype(bool).at[:, 0].set(False)
    return {"cfg": cfg, "model": model, "forward": eng.make_forward(model), "params": params, "opt": tx.init(params),
            "tx": tx, "batch": (ids, am, lm)}


KINDS = ("plain", "dp", "uls", "dp_ghost", "uls_ghost")
DP_KINDS = KINDS[1:]


def _step_runner(kind: str, s: dict[str, Any], *, micro: int, k: int) -> Any:
    """A `state -> state` closure over one jitted step of `kind` (plain, dp, uls, dp_ghost,
    uls_ghost)."""
    ids, am, lm = s["batch"]
    lr, key = jnp.float32(1e-4), jnp.zeros((2,), jnp.uint32)
    donate = () if jax.default_backend() == "cpu" else (0, 1)
    if kind == "plain":
        fn = jax.jit(eng.plain_step(s["forward"], s["tx"], grad_clip=1.0), donate_argnums=donate)
        return lambda st: fn(st[0], st[1], ids, am, lm, lr, None)[:2]
    group, ghost = kind.startswith("uls"), kind.endswith("_ghost")
    step = jax_dp.private_step(s["forward"], s["tx"], clip=1.0, noise_multiplier=1.0, expected=float(ids.shape[0]),
                               group=group, microbatch=None if ghost else max(1, micro // k) if group else micro,
                               clipping="ghost" if ghost else "vmap", model=s["model"])
    fn = jax.jit(step, donate_argnums=donate)
    if group:  # (users, k, L): each user's k sequences one clipped unit
        ids, am, lm = (x.reshape(-1, k, x.shape[-1]) for x in (ids, am, lm))
    return lambda st: fn(st[0], st[1], ids, am, lm, lr, key)[:2]


def bench_preset(preset: str, *, batch: int, seq: int, micro: int, k: int, repeats: int, dtype: Any,
                 scan: bool = False, remat: bool = False, kinds: tuple[str, ...] = KINDS,
                 attention: str = "xla") -> dict:
    """The `kinds` of step of `preset` on the same tokens: each compiled and warmed up once, then
    `repeats` rounds of one step of every kind in turn (interleaved), each kind's median."""
    s = _setup(preset, dtype, batch, seq, scan, remat, attention)
    peak = PEAK.get(jax.devices()[0].device_kind)
    flops = step_flops(s["cfg"], batch * seq, seq)
    out: dict[str, Any] = {"preset": preset, "parameters": int(sum(x.size for x in jax.tree.leaves(s["params"]))),
                           "batch": batch, "seq": seq, "dp_micro_batch": micro, "uls_k": k,
                           "scan_layers": scan, "remat": remat, "attention": attention, "step_tflop": flops / 1e12}
    state = (s["params"], s["opt"])
    runners, first = {}, {}
    for kind in kinds:
        try:
            t0 = time.perf_counter()
            runner = _step_runner(kind, s, micro=micro, k=k)
            state = runner(state)
            jax.block_until_ready(state)
        except Exception as e:  # noqa: BLE001 - an out-of-memory point is a result, not a crash
            out[kind] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            continue
        runners[kind], first[kind] = runner, time.perf_counter() - t0
        print(json.dumps({"preset": preset, kind: {"first_call_s": first[kind]}}), file=sys.stderr, flush=True)
    times: dict[str, list[float]] = {kind: [] for kind in runners}
    for _ in range(repeats):
        for kind, runner in runners.items():
            secs, state = _median_time(runner, state, 1, warm=False)
            times[kind].append(secs)
    for kind, ts in times.items():
        secs = statistics.median(ts)
        out[kind] = {"step_s": secs, "tokens_per_s": batch * seq / secs, "first_call_s": first[kind],
                     "repeats": len(ts), "mfu": flops / secs / peak if peak else None}
    for kind in DP_KINDS:
        if "step_s" in out.get(kind, {}) and "step_s" in out.get("plain", {}):
            out[f"{kind}_over_plain"] = out[kind]["step_s"] / out["plain"]["step_s"]
    for kind in ("dp", "uls"):
        if "step_s" in out.get(kind, {}) and "step_s" in out.get(f"{kind}_ghost", {}):
            out[f"{kind}_ghost_over_vmap"] = out[f"{kind}_ghost"]["step_s"] / out[kind]["step_s"]
    return out


def dp_memory(preset: str, *, seq: int, dtype: Any, scan: bool = False, remat: bool = False,
              clipping: str = "vmap") -> dict[str, Any]:
    """XLA's memory analysis of the compiled DP-SGD step (one example, AdamW, the clipped sum by
    `clipping`) of `preset`, without allocating it: abstract arguments only."""
    cfg = dataclasses.replace(FlaxLlamaConfig.from_preset(preset, dtype=dtype), scan_layers=scan, remat=remat)
    model = FlaxLlama(cfg)
    params = jax.eval_shape(lambda k: model.init(k, jnp.zeros((1, 8), jnp.int32))["params"], jax.random.key(0))
    tx = eng.adamw((0.9, 0.95), 0.0)
    opt = jax.eval_shape(tx.init, params)
    step = jax_dp.private_step(eng.make_forward(model), tx, clip=1.0, noise_multiplier=1.0, expected=1.0,
                               group=False, microbatch=1, clipping=clipping, model=model)
    row = jax.ShapeDtypeStruct((1, seq), jnp.int32)
    mask = jax.ShapeDtypeStruct((1, seq), jnp.bool_)
    lowered = jax.jit(step, donate_argnums=(0, 1)).lower(
        params, opt, row, row, mask, jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.uint32))
    m = lowered.compile().memory_analysis()
    need = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    return {"preset": preset, "clipping": clipping, "need_gib": need / 2**30, "limit_gib": limit / 2**30 if limit else None,
            "fits": bool(limit and need <= limit)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["125m", "350m"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=8, help="DP-SGD: examples per vmap micro-batch")
    ap.add_argument("--k", type=int, default=4, help="ULS: sequences per user")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--fit-presets", nargs="*", default=["350m", "1b"], help="DP full fine-tune memory check")
    ap.add_argument("--fit-seq", type=int, default=1024)
    ap.add_argument("--fit-clipping", choices=["vmap", "ghost"], default="vmap", help="the checked step's clipping")
    ap.add_argument("--scan", action=argparse.BooleanOptionalAction, default=None,
                    help="decoder layers as one scanned layer (default: on an accelerator)")
    ap.add_argument("--remat", action="store_true", help="rematerialise the scanned layers")
    ap.add_argument("--attention", nargs="+", default=["xla"], choices=["xla", "flash"],
                    help="attention kernels, each run beside the others (flash: Pallas, TPU)")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS),
                    help="steps to time: plain, DP-SGD and ULS by vmap (dp, uls) and by ghost clipping")
    args = ap.parse_args(argv)
    dev = jax.devices()[0]
    dtype = eng.compute_dtype("auto", dev.platform)
    scan = dev.platform != "cpu" if args.scan is None else args.scan
    report: dict[str, Any] = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
                              "compute_dtype": jnp.dtype(dtype).name, "peak_flops": PEAK.get(dev.device_kind),
                              "presets": [], "dp_fit": []}
    for preset in args.presets:
        for attention in args.attention:
            report["presets"].append(bench_preset(preset, batch=args.batch, seq=args.seq, micro=args.micro,
                                                  k=args.k, repeats=args.repeats, dtype=dtype, scan=scan,
                                                  remat=args.remat, kinds=tuple(args.kinds), attention=attention))
            print(json.dumps(report["presets"][-1]), file=sys.stderr, flush=True)
    for preset in args.fit_presets:
        try:
            report["dp_fit"].append(dp_memory(preset, seq=args.fit_seq, dtype=dtype, scan=scan, remat=args.remat,
                                                   clipping=args.fit_clipping))
        except Exception as e:  # noqa: BLE001 - a compile that runs out of memory says it does not fit
            report["dp_fit"].append({"preset": preset, "fits": False, "error": str(e).splitlines()[0][:200]})
    fitting = [f["preset"] for f in report["dp_fit"] if f.get("fits")]
    report["largest_dp_full_finetune"] = fitting[-1] if fitting else None
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    raise SystemExit(main())
