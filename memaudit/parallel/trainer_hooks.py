"""`ParallelTrainer`: the centralized trainer's seams filled in for the 4D grid.

One instance per rank. The process groups are built before anything else (so that no
collective is interleaved with the writer's data preparation); rank 0 is the writer. Each
step's global batch is padded with masked rows to a multiple of data*z and sliced; the
loss/gradients, clipping, DP-SGD, evaluation and checkpoints go through
`memaudit.parallel`. Checkpoints are gathered: `state/` holds one full (single-process)
checkpoint, including merged AdamW moments, so any grid (or one process) resumes from it
exactly; `model/` is the merged Hugging Face export.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from memaudit.parallel import clip as pclip
from memaudit.parallel.dims import ParallelDims, build_groups
from memaudit.parallel.dp import dp_sgd_backward
from memaudit.parallel.parallelize import ParallelLlama, merge_tensor, parallelize_llama
from memaudit.train.trainer import Batch, CentralizedTrainer


def pad_rows(batch: Batch, multiple: int) -> Batch:
    """Append masked rows (no targets, full attention) so the batch divides by `multiple`."""
    b = batch.input_ids.shape[0]
    extra = (-b) % multiple if b else multiple
    if extra == 0:
        return batch
    ids = torch.cat([batch.input_ids, batch.input_ids.new_zeros(extra, batch.input_ids.shape[1])])
    am = torch.cat([batch.attention_mask, batch.attention_mask.new_ones(extra, batch.attention_mask.shape[1])])
    lm = torch.cat([batch.loss_mask, batch.loss_mask.new_zeros(extra, batch.loss_mask.shape[1])])
    return Batch(ids, am, lm, batch.right_padded)


class _ParallelDP:
    """The DP-SGD component of the parallel trainer; its noise is a function of (seed, step)."""

    def __init__(self, model: ParallelLlama, *, clip: float, noise_multiplier: float,
                 expected_batch_size: float, seed: int | None) -> None:
        self.model, self.clip, self.sigma = model, clip, noise_multiplier
        self.expected = expected_batch_size
        if seed is None:  # a fresh secret seed, the same on every rank, kept in checkpoints
            import secrets

            t = torch.tensor([secrets.randbits(62)], dtype=torch.int64)
            if dist.is_initialized():
                dist.broadcast(t, src=0)
            seed = int(t.item())
        self.seed = int(seed)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": torch.tensor([self.seed], dtype=torch.int64)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if "seed" in sd:
            self.seed = int(sd["seed"][0])


class ParallelTrainer(CentralizedTrainer):
    """`CentralizedTrainer` on a data x (x, y, z) grid; rank 0 writes the run directory."""

    def __init__(self, cfg: Any, run: Any, *, progress: Any = None) -> None:
        self.dims = ParallelDims.from_config(cfg.parallel)
        self.pg = build_groups(self.dims)
        self.is_writer = self.pg.rank == 0
        self._step = 0
        super().__init__(cfg, run, progress=progress if self.pg.rank == 0 else None)

    # ------------------------------------------------------------------ seams
    def select_device(self) -> torch.device:
        if dist.is_initialized() and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return super().select_device() if not dist.is_initialized() else torch.device("cpu")

    def prepare(self, resume: bool) -> None:
        # the writer prepares (and writes) the data; the others load it afterwards
        if dist.is_initialized() and not self.is_writer:
            dist.barrier()
        super().prepare(resume)
        if dist.is_initialized() and self.is_writer:
            dist.barrier()

    def build_model(self, vocab_size: int) -> torch.nn.Module:
        base = super().build_model(vocab_size)
        return parallelize_llama(base, dims=self.dims, pg=self.pg, overlap=self.cfg.parallel.overlap)

    def _local(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        b = pad_rows(batch, self.pg.batch_shards)
        am = None if b.right_padded else self.pg.batch_shard(b.attention_mask)
        return self.pg.batch_shard(b.input_ids), self.pg.batch_shard(b.loss_mask), am

    def compute_gradients(self, batch: Batch) -> dict[str, float]:
        ids, lm, am = self._local(batch)
        with self._autocast():
            loss, logged = self.model(ids, lm, am)
        loss.backward()
        self.model.finish_grad_sync()
        return {"loss": float(logged)}

    def clip_gradients(self) -> float:
        c = self.tcfg.grad_clip if self.tcfg.grad_clip is not None else math.inf
        return pclip.clip_grad_norm_(self.model, c)

    def grad_norm(self) -> float:
        return pclip.grad_norm(self.model)

    def train_step(self, step: int) -> dict[str, Any]:
        self._step = step
        return super().train_step(step)

    # ------------------------------------------------------------------ privacy
    def setup_privacy(self) -> None:
        # The base class calibrates sigma, builds the Poisson sampler and the ledger, and
        # constructs `memaudit.train.dpsgd.DPSGD(model, ...)`; the single-process DP-SGD
        # cannot wrap the parallel model, so that one constructor is swapped for ours.
        # (A `make_dp` seam in CentralizedTrainer would make this patch unnecessary.)
        from unittest import mock

        from memaudit.train import dpsgd

        def make(model: Any, *, clip: float, noise_multiplier: float, expected_batch_size: float, seed: int,
                 **_: Any) -> _ParallelDP:
            return _ParallelDP(model, clip=clip, noise_multiplier=noise_multiplier,
                               expected_batch_size=expected_batch_size, seed=seed)

        with mock.patch.object(dpsgd, "DPSGD", make):
            super().setup_privacy()

    def private_gradients(self, rows: np.ndarray) -> dict[str, float]:
        ids, lm, am = self._local(self.make_batch(rows))
        with self._autocast():
            st = dp_sgd_backward(self.model, ids, lm, clip=self.dp.clip, noise_multiplier=self.dp.sigma,
                                 expected_batch=self.dp.expected, seed=self.dp.seed, step=self._step,
                                 attention_mask=am)
        # noise_std as in the single-process DP-SGD: of the averaged gradient, sigma C / E|S|
        return {"loss": st.loss, "clip_fraction": st.clip_fraction, "noise_std": st.noise_std / self.dp.expected}

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> tuple[float, float]:
        h = self.holdout_set
        bs = self.tcfg.micro_batch_size or self.tcfg.batch_size
        n = min(len(h.input_ids), bs * self.tcfg.eval_batches)
        if n == 0:
            return math.nan, math.nan
        from memaudit.train.evaluate import is_right_padded, target_mask

        right = is_right_padded(h.attention_mask[:n])
        total = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad(), self._autocast():
            for s in range(0, n, bs):
                am = torch.as_tensor(h.attention_mask[s:s + bs], dtype=torch.long, device=self.device)
                ids = torch.as_tensor(h.input_ids[s:s + bs], dtype=torch.long, device=self.device)
                b = Batch(ids, am, target_mask(am), right)
                lids, llm, lam = self._local(b)
                total += self.model.loss_sums(lids, llm, lam)
        if total[1] == 0:
            return math.nan, math.nan
        loss = float(total[0] / total[1])
        return loss, math.exp(min(loss, 700.0))

    # ------------------------------------------------------------------ checkpoints
    def _plain(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """A single-process model and AdamW holding the merged state (every rank builds one)."""
        from memaudit.models.presets import build_model

        vocab = self.model.hf.config.vocab_size
        plain = build_model(self.cfg.model.preset, vocab_size=vocab, seed=self.cfg.model.init_seed)
        t = self.tcfg
        opt = torch.optim.AdamW(plain.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
        return plain, opt

    def _merged_optimizer_state(self) -> dict[str, Any]:
        sd = self.optimizer.state_dict()
        params = list(self.model.hf.parameters())
        state = {}
        for i, p in enumerate(params):
            st = sd["state"].get(i)
            if st is None:
                continue
            state[i] = {k: (merge_tensor(self.model, p, v) if torch.is_tensor(v) and v.shape == p.shape else v)
                        for k, v in st.items()}
        return {"state": state, "param_groups": sd["param_groups"]}

    def save_checkpoint(self, step: int) -> None:
        from memaudit.train import checkpoint as ckpt

        full = self.model.full_state_dict()  # collectives: every rank takes part
        optsd = self._merged_optimizer_state()
        if not self.is_writer:
            return
        plain, opt = self._plain()
        plain.load_state_dict(full, strict=False)
        opt.load_state_dict(optsd)
        extra = {"dp": self.dp.state_dict()} if self.dp is not None else {}
        files = {"privacy.json": self.ledger_json()} if self.ledger is not None else None
        scalars = {"step": step, "metrics_count": step, "initial_holdout_loss": self.initial_holdout[0],
                   "initial_holdout_perplexity": self.initial_holdout[1],
                   "noise_multiplier": self.noise_multiplier,
                   "grid": [self.dims.data, self.dims.x, self.dims.y, self.dims.z]}
        ckpt.save_state(self.run, model=plain, optimizer=opt, scalars=scalars, extra=extra, files=files)
        self.write_ledger()

    def restore_checkpoint(self) -> int:
        from memaudit.train import checkpoint as ckpt

        plain, opt = self._plain()
        ckpt.load_state(self.run, model=plain, optimizer=opt, device=torch.device("cpu"))
        real_model, real_opt = self.model, self.optimizer
        self.model.load_full_state_dict(plain.state_dict())
        full = opt.state_dict()
        local = {}
        for i, p in enumerate(real_model.hf.parameters()):
            st = full["state"].get(i)
            if st is not None:
                local[i] = {k: (p.shard_spec.local(v, real_model.comm).to(p.device)
                                if torch.is_tensor(v) and tuple(v.shape) == p.shard_spec.full_shape else v)
                            for k, v in st.items()}
        real_opt.load_state_dict({"state": local, "param_groups": full["param_groups"]})
        # the base class restores scalars, DP state and the ledger; give it throwaway targets
        self.model, self.optimizer = plain, opt
        try:
            step = super().restore_checkpoint()
        finally:
            self.model, self.optimizer = real_model, real_opt
        return step

    def export_model(self) -> None:
        full = self.model.full_state_dict()
        if not self.is_writer:
            return
        plain, _ = self._plain()
        plain.load_state_dict(full, strict=False)
        real = self.model
        self.model = plain
        try:
            super().export_model()
        finally:
            self.model = real
