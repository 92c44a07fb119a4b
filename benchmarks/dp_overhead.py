"""DP-SGD step cost against the non-private step, side by side, on the same LlamaForCausalLM.

Variants (one optimizer step each: forward, backward, optimizer):
  nonprivate   plain token-mean loss, loss.backward(), SGD step
  dp_ghost     memaudit DPSGD, ghost norms + book-keeping (one backward pass)
  dp_vmap      memaudit DPSGD, torch.func vmap(grad) reference
  dp_ghost_user4  memaudit DPSGD, per-user clipping (user-level ULS): 4 sequences a user,
               clipped as one unit through the ghost-norm path
  dp_vmap_user4   the same per-user clipping on the vmap reference path
  opacus_hooks Opacus 1.6 make_private(grad_sample_mode="hooks")      (if opacus is installed)
  opacus_ghost Opacus 1.6 make_private(grad_sample_mode="ghost")      (if opacus is installed)

Opacus is a benchmark extra (`pip install opacus==1.6.0`), never a runtime dependency.
Prints one JSON object: per preset, the median seconds per step over --repeats and the
ratio to the non-private step.

    python benchmarks/dp_overhead.py --presets tiny small --repeats 5

Measured 2026-12-05, ``--presets small --variants nonprivate dp_ghost opacus_ghost opacus_hooks``
(batch 16, sequences of 128, 2 CPU cores, torch 2.13.0): with the output layer's per-example
gradients formed (the ghost clipper's budget at 2**26) dp_ghost 1.527x the non-private step
(5 repeats), Opacus ghost 2.07x, hooks 1.95x; with that layer in its Gram form (budget 2**25,
`memaudit.train.ghost.MATERIALIZE_BUDGET`) 1.376x (7 repeats), Opacus ghost 2.11x, hooks
1.95x. Side by side in one process (11 interleaved steps, no Opacus): 1.336x against 1.296x.

Later the same day every variant runs with glibc keeping the memory a step frees, as a training
run does (`memaudit.train.host_memory`; ``--glibc-default`` leaves glibc as it is), and the
noise is drawn on torch's threads (`memaudit.train.noise.for_each_draw`). The same command
with ``--repeats 11 --warmup 2``: dp_ghost 1.286x the non-private step (1.075 s against
0.836 s), Opacus ghost 2.24x, hooks 1.98x. Interleaved processes, 7 repeats, kept against
``--glibc-default``: dp_ghost 1.283x and 1.357x against 1.55x and 1.92x; the non-private step
0.848 s and 0.894 s against 1.128 s and 0.985 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time
import traceback
import warnings

import torch

from memaudit.models.presets import build_model
from memaudit.privacy.randomness import DPRandomness
from memaudit.train.dpsgd import DPSGD
from memaudit.train.host_memory import kept_freed_memory
from memaudit.train.losses import causal_lm_loss


def _batch(vocab: int, batch: int, seq: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    attn = torch.ones_like(ids)
    return ids, attn, attn.bool()


def _nonprivate(model, ids, attn, lmask):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
        causal_lm_loss(logits, ids, lmask).backward()
        opt.step()
    return step


def _memaudit(mode, group_size: int = 1):
    """memaudit's DPSGD; `group_size` > 1: per-user clipping (ULS), each run of `group_size`
    rows one user's sequences clipped as one unit, the batch holding batch / group_size users."""
    def make(model, ids, attn, lmask):
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        dp = DPSGD(model, clip=1.0, noise_multiplier=1.0, expected_batch_size=ids.shape[0] // group_size,
                   randomness=DPRandomness.from_seed(0), mode=mode)

        def step():
            opt.zero_grad(set_to_none=True)
            dp.step_gradients(ids, attn, lmask, group_size=group_size)
            opt.step()
        return step
    return make


def _opacus(grad_sample_mode):
    def make(model, ids, attn, lmask):
        from opacus import PrivacyEngine
        from torch.utils.data import DataLoader, TensorDataset

        loader = DataLoader(TensorDataset(ids), batch_size=ids.shape[0])
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        crit = torch.nn.CrossEntropyLoss()
        engine = PrivacyEngine()
        kw = {"criterion": crit} if grad_sample_mode == "ghost" else {}
        out = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                  noise_multiplier=1.0, max_grad_norm=1.0,
                                  grad_sample_mode=grad_sample_mode, poisson_sampling=False, **kw)
        pmodel, popt = out[0], out[1]
        pcrit = out[2] if grad_sample_mode == "ghost" else crit
        b, length = ids.shape

        def step():
            popt.zero_grad(set_to_none=True)
            logits = pmodel(input_ids=ids, attention_mask=attn, use_cache=False).logits
            pred = logits[:, :-1].reshape(-1, logits.shape[-1])
            tgt = ids[:, 1:].reshape(-1)
            if grad_sample_mode == "ghost":
                loss = pcrit(pred, tgt, shape=(b, length - 1))
            else:
                loss = crit(pred, tgt)
            loss.backward()
            popt.step()
        return step
    return make


VARIANTS = {
    "nonprivate": _nonprivate,
    "dp_ghost": _memaudit("ghost"),
    "dp_vmap": _memaudit("vmap"),
    "dp_ghost_user4": _memaudit("ghost", group_size=4),
    "dp_vmap_user4": _memaudit("vmap", group_size=4),
    "opacus_hooks": _opacus("hooks"),
    "opacus_ghost": _opacus("ghost"),
}


def run(presets, variants, *, batch: int, seq: int, repeats: int, warmup: int) -> dict:
    """Median seconds per step; variants are interleaved round-robin so that load from other
    processes on a shared machine falls on all of them alike."""
    try:
        import opacus
        opacus_version = opacus.__version__
    except ImportError:
        opacus_version = None
    result = {"batch": batch, "seq_len": seq, "repeats": repeats, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "machine": platform.machine(),
              "opacus": opacus_version, "presets": {}}
    for preset in presets:
        rows, steps = {}, {}
        for name in variants:
            if name.startswith("opacus") and opacus_version is None:
                rows[name] = {"skipped": "opacus not installed (pip install opacus==1.6.0)"}
                continue
            model = build_model(preset, seed=0)
            ids, attn, lmask = _batch(model.config.vocab_size, batch, seq)
            try:
                steps[name] = VARIANTS[name](model, ids, attn, lmask)
                for _ in range(warmup):
                    steps[name]()
                rows[name] = {"times_s": []}
            except Exception as e:  # noqa: BLE001 - a variant that cannot run is reported, not fatal
                steps.pop(name, None)
                rows[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                              "where": traceback.format_exc().splitlines()[-3][:200]}
        for _ in range(repeats):
            for name, step in steps.items():
                t0 = time.perf_counter()
                step()
                rows[name]["times_s"].append(round(time.perf_counter() - t0, 4))
        for name in steps:
            rows[name]["median_s"] = statistics.median(rows[name]["times_s"])
        base = rows.get("nonprivate", {}).get("median_s")
        for r in rows.values():
            if base and "median_s" in r:
                r["x_nonprivate"] = round(r["median_s"] / base, 3)
        result["presets"][preset] = rows
    return result


def main() -> None:
    warnings.filterwarnings("ignore", module="opacus")
    warnings.filterwarnings("ignore", message=".*(backward hook|Secure RNG|performance drop).*")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--glibc-default", action="store_true",
                    help="leave glibc's allocator as it is (training keeps freed memory: "
                         "memaudit.train.host_memory)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    policy = contextlib.nullcontext(False) if args.glibc_default else kept_freed_memory("cpu")
    with policy as kept:
        result = run(args.presets, args.variants, batch=args.batch, seq=args.seq, repeats=args.repeats,
                     warmup=args.warmup)
    print(json.dumps({**result, "kept_freed_memory": kept}, indent=2))


if __name__ == "__main__":
    main()
