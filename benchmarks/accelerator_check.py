"""memaudit's JAX path on an accelerator (TPU or CUDA): one JSON object on stdout, exit 0 unless a
check fails; on a host without one it says ``no_accelerator`` and exits 0.

Checks, on the first accelerator JAX finds (no torch needed):

- ``client_gradient``: a client's gradient (memaudit's loss on the tiny Flax Llama, exported with
  ``jax.export`` for the accelerator and for the CPU, as a Flower node's client stage is) on the
  accelerator against the CPU, both at ``highest`` matmul precision; fails above 1e-4 of the
  largest gradient entry;
- ``bf16_matmul``: the rate of an 8192 x 8192 bf16 matmul, and its share of the chip's peak;
- ``round``: one FedAvg round (125m, 8 clients, bf16 compute, scanned layers, sequence 512) and
  its model FLOPs utilisation (`federated_chip.py` measures many more).

    python benchmarks/accelerator_check.py           # on the accelerator host
    python benchmarks/accelerator_check.py --quick   # tiny shapes (also a CPU rehearsal with --cpu)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp
import numpy as np

GRAD_TOLERANCE = 1e-4  # of the largest |gradient| entry, at highest precision on both sides


def accelerator(allow_cpu: bool = False):
    """The first non-CPU device (None: there is none); ``allow_cpu``: the CPU itself (a rehearsal)."""
    devices = [d for d in jax.devices() if d.platform != "cpu"]
    if devices:
        return devices[0]
    return jax.devices("cpu")[0] if allow_cpu else None


def client_gradient(device) -> dict:
    """A client's gradient exported for the device's platform and for the CPU, run on each."""
    from jax import export

    from memaudit.federated.trainer import make_loss_fn
    from memaudit.models.flax_llama import FlaxLlama, FlaxLlamaConfig, init_params

    cfg = FlaxLlamaConfig.from_preset("tiny", vocab_size=512)  # float32: the comparison is exact math
    model = FlaxLlama(cfg)
    params = jax.tree.map(np.asarray, init_params(cfg, seed=0))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 64)).astype(np.int32)
    loss_fn = make_loss_fn(model)

    def grad(p, x):
        return jax.grad(lambda p: loss_fn(p, {"input_ids": x, "attention_mask": jnp.ones_like(x)})[0].mean())(p)

    structs = jax.tree.map(lambda v: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype), (params, ids))
    got = {}
    with jax.default_matmul_precision("highest"):
        for dev in (device, jax.devices("cpu")[0]):
            exp = export.deserialize(export.export(jax.jit(grad), platforms=(dev.platform,))(*structs).serialize())
            got[dev.platform] = jax.tree.map(np.asarray, exp.call(*jax.device_put((params, ids), dev)))
    a, b = (jax.tree.leaves(got[k]) for k in (device.platform, "cpu"))
    diff = max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))
    scale = max(float(np.max(np.abs(y))) for y in b)
    ok = diff <= GRAD_TOLERANCE * scale
    return {"status": "ok" if ok else "mismatch", "platforms": [device.platform, "cpu"], "max_abs_diff": diff,
            "max_abs_grad": scale, "tolerance": GRAD_TOLERANCE * scale}


def bf16_matmul(device, n: int = 8192, repeats: int = 10) -> dict:
    from federated_chip import peak_tflops  # lazy: benchmarks/, beside this script

    x = jax.device_put(jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16), device)
    f = jax.jit(lambda a: a @ a)
    jax.block_until_ready(f(x))
    t0 = time.perf_counter()
    for _ in range(repeats):
        y = f(x)
    jax.block_until_ready(y)
    s = (time.perf_counter() - t0) / repeats
    tflops = 2 * n**3 / s / 1e12
    peak = peak_tflops()
    return {"n": n, "seconds": round(s, 5), "tflops": round(tflops, 1),
            "peak_share": None if peak is None else round(tflops / peak, 3)}


def one_round(quick: bool) -> dict:
    import federated_chip  # lazy: benchmarks/, beside this script

    args = argparse.Namespace(seq=64 if quick else 512, local_steps=2, batch=2, repeats=2, out=None)
    bench = federated_chip.Bench(args)
    from memaudit.models.precision import resolve_policy

    cfg, model, params, n = bench.model("tiny" if quick else "125m", resolve_policy("auto", scan_layers=True))
    ids = bench.tokens(cfg, 8)
    r = bench.fed_round(model, params, ids)
    return {"preset": "tiny" if quick else "125m", "cohort": 8, **r,
            "mfu": bench.mfu(bench.round_flops(cfg, n, 8), r["round_s"])}


def checks(quick: bool = False, device=None, with_round: bool = False) -> dict:
    """The checks on ``device`` (default: the accelerator, else the CPU): a dict of results."""
    device = device or accelerator(allow_cpu=True)
    out = {"client_gradient": client_gradient(device),
           "bf16_matmul": bf16_matmul(device, n=1024 if quick else 8192, repeats=3 if quick else 10)}
    if with_round:
        out["round"] = one_round(quick)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes")
    ap.add_argument("--cpu", action="store_true", help="run the checks on the CPU when there is no accelerator")
    args = ap.parse_args(argv)
    dev = accelerator(allow_cpu=args.cpu)
    if dev is None:
        print(json.dumps({"status": "no_accelerator", "backend": jax.default_backend(),
                          "reason": f"JAX {jax.__version__} sees no TPU or GPU (devices: "
                                    f"{[d.platform for d in jax.devices()]}); install jax[tpu] or jax[cuda12]"}))
        return 0
    res = checks(quick=args.quick, device=dev, with_round=True)
    failed = [k for k, v in res.items() if isinstance(v, dict) and v.get("status") not in (None, "ok")]
    print(json.dumps({"status": "failed" if failed else "ok", "failed": failed, "platform": dev.platform,
                      "kind": dev.device_kind, "jax": jax.__version__, **res}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
