"""Training throughput and model FLOPs utilisation (MFU) of the centralized trainer, as JSON.

For each preset (tiny, small) at batch 16, sequence 128, side by side in one run:

- plain: a bare `transformers` step — forward with labels, backward, AdamW step;
- memaudit: `CentralizedTrainer.train_step` on the same model (batch selection, masked loss,
  global-norm clipping, schedule, AdamW, metrics record).

Timed steps alternate between the two variants, so drift on a shared CPU hits both alike;
figures are medians over `--repeats` steps after `--warmup` untimed ones. MFU counts
6 * N * tokens FLOPs (Kaplan et al. 2020; attention FLOPs not counted) with N = every
parameter except the input embedding table (the LM head counts), against the machine's
measured fp32 matmul peak (the median rate of a large `torch.mm`). Optionally times
`configs/tiny.yaml` end to end (`--config-run`).

    python benchmarks/train_throughput.py [--presets tiny small] [--repeats 7] [--config-run]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from memaudit.config import load_config
from memaudit.data.packing import PackedSequences
from memaudit.models.presets import build_model
from memaudit.rundir import RunDir
from memaudit.train.batches import EpochBatches
from memaudit.train.trainer import CentralizedTrainer, deterministic


def matmul_peak(n: int = 2048, repeats: int = 7) -> float:
    """Median fp32 GFLOP/s of an n x n x n torch.mm."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        rates.append(2 * n**3 / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def non_embedding_params(model: torch.nn.Module) -> int:
    emb = model.get_input_embeddings().weight
    return sum(p.numel() for p in model.parameters() if p is not emb)


def _packed(n: int, seq: int, vocab: int) -> PackedSequences:
    ids = np.random.default_rng(0).integers(0, vocab, size=(n, seq)).astype(np.int32)
    return PackedSequences(ids, np.ones_like(ids, dtype=np.int8), np.zeros(n, np.int32), ("u",))


def bench_preset(preset: str, *, batch: int, seq: int, warmup: int, repeats: int, peak: float) -> dict:
    cfg = load_config(None, [f"model.preset={preset}", f"train.batch_size={batch}", "train.device=cpu",
                             f"train.steps={warmup + repeats + 1}", "train.warmup_steps=1"])
    # memaudit: the trainer's own step on its own model and optimizer
    tr = CentralizedTrainer(cfg, RunDir(tempfile.gettempdir()))
    tr.model = tr.build_model(tr.model_vocab_size())
    tr.optimizer = tr.build_optimizer()
    vocab = tr.model.config.vocab_size
    tr.train_set = tr.holdout_set = _packed(batch * 8, seq, vocab)
    tr.sampler = EpochBatches(len(tr.train_set), batch, 0)
    # plain: the same model, a bare transformers step
    plain = build_model(preset, seed=0).train()
    plain.config.use_cache = False
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)
    ids = torch.as_tensor(tr.train_set.input_ids[:batch], dtype=torch.long)

    def plain_step() -> None:
        loss = plain(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {"plain": [], "memaudit": []}
    with deterministic(torch.device("cpu")):
        for i in range(warmup + repeats):
            for name in ("plain", "memaudit") if i % 2 == 0 else ("memaudit", "plain"):
                t0 = time.perf_counter()
                plain_step() if name == "plain" else tr.train_step(i)
                if i >= warmup:
                    times[name].append(time.perf_counter() - t0)
    n = non_embedding_params(plain)
    tokens = batch * seq
    out = {"preset": preset, "batch": batch, "seq_len": seq, "params_total": sum(p.numel() for p in plain.parameters()),
           "params_non_embedding": n}
    for name, ts in times.items():
        med = statistics.median(ts)
        out[name] = {"step_s_median": med, "step_s_all": ts, "tokens_per_s": tokens / med,
                     "model_gflops_per_s": 6 * n * tokens / med / 1e9,
                     "mfu": 6 * n * tokens / med / 1e9 / peak}
    out["memaudit_over_plain"] = out["memaudit"]["step_s_median"] / out["plain"]["step_s_median"]
    return out


def config_run(path: Path) -> dict:
    from memaudit.run.centralized import train_centralized

    cfg = load_config(path)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        res = train_centralized(cfg, RunDir(Path(d) / "run"))
        wall = time.perf_counter() - t0
    return {"config": str(path.relative_to(REPO)), "wall_s": wall, "steps": res["steps"],
            "initial_holdout_loss": res["initial_holdout_loss"], "final_holdout_loss": res["final_holdout_loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--config-run", action="store_true", help="also time configs/tiny.yaml end to end")
    args = ap.parse_args()
    torch.manual_seed(0)
    peak = matmul_peak()
    report = {"machine": {"threads": torch.get_num_threads(), "fp32_matmul_peak_gflops": peak,
                          "torch": torch.__version__},
              "presets": []}
    for p in args.presets:
        report["presets"].append(bench_preset(p, batch=args.batch, seq=args.seq, warmup=args.warmup,
                                              repeats=args.repeats, peak=peak))
        print(json.dumps(report["presets"][-1]), file=sys.stderr, flush=True)  # partial results
    report["fp32_matmul_peak_gflops_after"] = matmul_peak()  # drift check on a shared machine
    if args.config_run:
        report["config_run"] = config_run(REPO / "configs" / "tiny.yaml")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
