"""How many model-sized bytes a compiled FedAvg round moves, a client's local steps peeled or
scanned, side by side; prints JSON lines.

Compiles (does not run) the round of `benchmarks/federated_chip.py` at a preset's real shapes on
whatever backend JAX finds, and reads XLA's optimized module: every top-level instruction of a
non-fused computation that writes or reads an array of at least 2^18 elements counts its bytes,
times the trip counts of the loops around it (XLA's ``known_trip_count``; a conditional's branch
counts as taken). The sum, in units of one float32 copy of the params (P), is the round's memory
traffic in model-sized arrays; its difference between the variants over the cohort is what a
client saves. With it: XLA's memory analysis (temporaries) and the compile seconds. An
instruction counts its whole operands, so a layer's slice of the stacked weights of scanned
layers (a dynamic slice, in-place updates) counts the whole stack: with scanned layers the totals
overstate, alike in both variants, and only their difference is the traffic.

    python benchmarks/federated_round_bytes.py --preset 125m --cohort 4 --unrolled   # CPU, ~3 min
    python benchmarks/federated_round_bytes.py --preset 125m --cohort 4 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time

import jax
import jax.numpy as jnp
import optax

from memaudit.federated.algorithms import fedavg
from memaudit.federated.cohorts import ClientData
from memaudit.federated.dp import dp_fedavg
from memaudit.federated.trainer import make_loss_fn
from memaudit.models.flax_llama import FlaxLlama, FlaxLlamaConfig, init_params
from memaudit.models.precision import resolve_policy

MIN_ELEMENTS = 1 << 18
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1}
_SKIP = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional", "call"}
_HEAD = re.compile(r"^(?:ENTRY )?%(\S+) \((.*)\) -> .*\{$")
_INSTR = re.compile(r"^\s+(?:ROOT )?%(\S+) = (\(.*?\)|\S+?\[[\d,]*\](?:\{[^}]*\})?) (\S+?)\((.*?)\)")


def _big_bytes(shape: str) -> int:
    total = 0
    for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape):
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        if dt in _BYTES and n >= MIN_ELEMENTS:
            total += n * _BYTES[dt]
    return total


def model_sized_traffic(hlo: str) -> tuple[int, int]:
    """(bytes written, bytes read) of model-sized arrays by one run of the module ``hlo``."""
    own: dict[str, list[int]] = {}
    calls: dict[str, list[tuple[str, int]]] = {}  # computation -> (callee, times per call)
    comp, shapes, entry = None, {}, None
    for line in hlo.splitlines():
        head = _HEAD.match(line)
        if head:
            comp, shapes = head.group(1), dict(re.findall(r"(\S+?): (\([^)]*\)|\S+?\[[\d,]*\])", head.group(2)))
            own[comp], calls[comp] = [0, 0], []
            entry = comp if line.startswith("ENTRY") else entry
            continue
        m = _INSTR.match(line)
        if not m or comp is None:
            continue
        name, shape, op, args = m.groups()
        shapes[name] = shape
        if op == "while":
            trips = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
            body = re.search(r"body=%([^,\s]+)", line).group(1)
            calls[comp].append((body, int(trips.group(1)) if trips else 1))
        elif op == "conditional":
            branches = re.search(r"branch_computations=\{([^}]*)\}", line)
            names = branches.group(1) if branches else ",".join(re.findall(r"(?:true|false)_computation=%([^,\s]+)", line))
            calls[comp] += [(b.strip().lstrip("%"), 1) for b in names.split(",")]
        if op in _SKIP:
            continue
        own[comp][0] += _big_bytes(shape)
        own[comp][1] += sum(_big_bytes(shapes.get(a.strip().lstrip("%"), "")) for a in args.split(","))

    def total(c: str) -> tuple[int, int]:
        w, r = own.get(c, [0, 0])
        for callee, times in calls.get(c, []):
            cw, cr = total(callee)
            w, r = w + times * cw, r + times * cr
        return w, r

    return total(entry)


def compile_round(args, peel: bool) -> dict:
    policy = resolve_policy(args.dtype, scan_layers=not args.unrolled)
    cfg = FlaxLlamaConfig.from_preset(args.preset, policy=policy)
    params = jax.eval_shape(lambda: init_params(cfg, seed=0))
    p_bytes = 4 * sum(x.size for x in jax.tree.leaves(params))
    algo = fedavg(make_loss_fn(FlaxLlama(cfg)), client_optimizer=optax.sgd(0.1), server_optimizer=optax.sgd(1.0),
                  local_steps=args.local_steps, batch_size=args.batch, donate=True, peel_local_steps=peel,
                  aggregator=(dp_fedavg(clip=1.0, noise_multiplier=1.0, expected_cohort=args.cohort)
                              if args.dp else None))
    shape = (args.cohort, args.local_steps * args.batch, args.seq)
    data = ClientData({"input_ids": jax.ShapeDtypeStruct(shape, jnp.int32),
                       "attention_mask": jax.ShapeDtypeStruct(shape, jnp.int32)},
                      jax.ShapeDtypeStruct(shape[:2], jnp.float32))
    t0 = time.perf_counter()
    compiled = algo.jitted.lower(jax.eval_shape(algo.init, params), data,
                                 jax.eval_shape(lambda: jax.random.key(0))).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    w, r = model_sized_traffic(compiled.as_text())
    return {"compile_s": round(compile_s, 1), "temp_gib": round(mem.temp_size_in_bytes / 2**30, 3),
            "temp_in_P": round(mem.temp_size_in_bytes / p_bytes, 2), "written_P": round(w / p_bytes, 2),
            "read_P": round(r / p_bytes, 2), "moved_P_per_client": round((w + r) / p_bytes / args.cohort, 2),
            "P_gib": round(p_bytes / 2**30, 3)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="125m")
    ap.add_argument("--cohort", type=int, default=4)
    ap.add_argument("--seq", type=int, default=16, help="short: the traffic of the weights, not of activations")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--local-steps", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--unrolled", action="store_true", help="decoder layers unrolled (default: scanned)")
    ap.add_argument("--dp", action="store_true", help="DP-FedAvg (clip and noise) rather than FedAvg")
    ap.add_argument("--peeled-only", action="store_true", help="only the default (peeled) client steps")
    args = ap.parse_args(argv)
    what = {"backend": jax.default_backend(), "preset": args.preset, "cohort": args.cohort, "seq": args.seq,
            "batch": args.batch, "local_steps": args.local_steps, "dtype": args.dtype,
            "layers": "unrolled" if args.unrolled else "scanned", "aggregator": "dp-fedavg" if args.dp else "mean"}
    rows = {}
    for name, peel in (("peeled", True), ("scanned", False)):
        rows[name] = compile_round(args, peel)
        print(json.dumps({**what, "client_steps": name, **rows[name]}), flush=True)
        if args.peeled_only:
            return
    saved = (rows["scanned"]["written_P"] + rows["scanned"]["read_P"] - rows["peeled"]["written_P"]
             - rows["peeled"]["read_P"]) / args.cohort
    print(json.dumps({**what, "item": "side_by_side", "saved_P_per_client": round(saved, 2),
                      "peeled_vs_scanned_moved": round(rows["peeled"]["moved_P_per_client"]
                                                       / rows["scanned"]["moved_P_per_client"], 3),
                      "compile_peeled_vs_scanned": round(rows["peeled"]["compile_s"] / rows["scanned"]["compile_s"], 2)}))


if __name__ == "__main__":
    main()
