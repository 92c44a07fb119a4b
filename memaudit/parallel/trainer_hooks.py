"""`ParallelTrainer`: the centralized trainer's seams filled in for the 4D grid.

One instance per rank. The process groups are built before anything else (so that no
collective is interleaved with the writer's data preparation); rank 0 is the writer. Each
step's global batch is padded with masked rows to a multiple of data*z and sliced; the
loss/gradients, clipping, DP-SGD, evaluation and checkpoints go through
`memaudit.parallel`. Checkpoints are sharded (`memaudit.parallel.checkpoint`): each rank
writes its own shards and AdamW moments, the same x*y*z grid resumes exactly, and any other
grid (or one process) resumes from the assembled tensors; `model/` is the merged Hugging
Face export, gathered on rank 0.
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
from memaudit.parallel.parallelize import ParallelLlama, parallelize_llama
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


class ParallelDP:
    """DP-SGD of a `ParallelLlama` (what `ParallelTrainer.make_dp` returns).

    The noise of step t is a function of (secret, t, parameter) only, drawn full-size and
    sliced, so it does not depend on the grid; the `DPRandomness` (broadcast from rank 0)
    is the checkpointed state. `micro_batch_size` bounds the global rows per pass.
    """

    def __init__(self, model: ParallelLlama, *, clip: float, noise_multiplier: float,
                 expected_batch_size: float, randomness: Any = None, population: int | None = None,
                 micro_batch_size: int | None = None) -> None:
        from memaudit.train.dpsgd import check_dp_args

        check_dp_args(clip, noise_multiplier, expected_batch_size)
        self.model, self.clip, self.noise_multiplier = model, float(clip), float(noise_multiplier)
        self.expected_batch_size = float(expected_batch_size)
        self.micro_batch_size = micro_batch_size
        self.population = population
        if randomness is None:  # a fresh secret, rank 0's on every rank (a collective)
            from memaudit.privacy.randomness import DPRandomness

            randomness = DPRandomness.fresh().broadcast()
        self.randomness = randomness  # the trainer's: every rank read the writer's secret from state/

    @property
    def mechanism(self) -> Any:
        """What one step adds (the same as single-process DP-SGD's)."""
        from memaudit.train.dpsgd import dpsgd_mechanism

        return dpsgd_mechanism(self)

    def dp_event(self) -> Any:
        """The DpEvent of one step: ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))``."""
        return self.mechanism.dp_event()

    def step_gradients(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                       loss_mask: torch.Tensor, *, step: int, right_padded: bool = False) -> dict[str, Any]:
        """The privatised mean gradient of the global batch (every rank passes all of it) into
        `.grad` of the local shards; returns the same statistics as `DPSGD.step_gradients`."""
        pg = self.model.pg
        am = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        batch = pad_rows(Batch(input_ids, am, loss_mask.bool() & am.bool(), right_padded), pg.batch_shards)
        ids, lm = pg.batch_shard(batch.input_ids), pg.batch_shard(batch.loss_mask)
        lam = None if right_padded else pg.batch_shard(batch.attention_mask)
        micro = None
        if self.micro_batch_size is not None:  # global rows per pass -> local rows per pass
            micro = max(1, math.ceil(self.micro_batch_size / pg.batch_shards))
        st = dp_sgd_backward(self.model, ids, lm, clip=self.clip, noise_multiplier=self.noise_multiplier,
                             expected_batch=self.expected_batch_size, randomness=self.randomness, step=step,
                             attention_mask=lam, micro_batch=micro)
        b = int(input_ids.shape[0])
        return {"loss": st.loss if b else math.nan, "clip_fraction": st.clip_fraction, "batch_size": b,
                "noise_std": self.noise_multiplier * self.clip / self.expected_batch_size}

    def state_dict(self) -> dict[str, Any]:
        r = self.randomness.state_dict()
        return {"secret": r["secret"], "reproducible": r["reproducible"], "clip": self.clip,
                "noise_multiplier": self.noise_multiplier, "expected_batch_size": self.expected_batch_size}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for key in ("clip", "noise_multiplier", "expected_batch_size"):
            if key in sd and float(sd[key]) != getattr(self, key):
                raise ValueError(f"checkpoint has {key}={sd[key]} but this run uses {getattr(self, key)}; "
                                 "resume with the original privacy settings")
        if "secret" in sd:
            self.randomness.load_state_dict(sd)  # in place: the sampler shares this object


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
        from memaudit.parallel.parallelize import overlap_options

        return parallelize_llama(base, dims=self.dims, pg=self.pg, **overlap_options(self.cfg.parallel))

    def _local(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        b = pad_rows(batch, self.pg.batch_shards)
        am = None if b.right_padded else self.pg.batch_shard(b.attention_mask)
        return self.pg.batch_shard(b.input_ids), self.pg.batch_shard(b.loss_mask), am

    def compute_gradients(self, batch: Batch) -> dict[str, float]:
        """The token-mean loss gradient, accumulated over micro-batches of
        `train.micro_batch_size` global rows (each padded to data*z and sharded), as the
        single-process trainer splits its batch; one gradient sync at the end."""
        b = batch.input_ids.shape[0]
        micro = self.tcfg.micro_batch_size or max(b, 1)
        total = int(batch.loss_mask[:, 1:].sum())  # the same on every rank: all hold the global batch
        logged_sum = 0.0
        for s in range(0, b, micro):
            part = Batch(batch.input_ids[s:s + micro], batch.attention_mask[s:s + micro],
                         batch.loss_mask[s:s + micro], batch.right_padded)
            n = int(part.loss_mask[:, 1:].sum())
            if n == 0:
                continue
            ids, lm, am = self._local(part)
            with self._autocast():
                loss, logged = self.model(ids, lm, am)  # this chunk's token mean
            if n != total:
                loss, logged = loss * (n / total), logged * (n / total)
            loss.backward()
            logged_sum += float(logged)
        self.model.finish_grad_sync()
        return {"loss": logged_sum}

    def clip_gradients(self) -> float:
        c = self.tcfg.grad_clip if self.tcfg.grad_clip is not None else math.inf
        return pclip.clip_grad_norm_(self.model, c)

    def grad_norm(self) -> float:
        return pclip.grad_norm(self.model)

    def train_step(self, step: int) -> dict[str, Any]:
        self._step = step
        return super().train_step(step)

    # ------------------------------------------------------------------ privacy
    def make_dp(self, *, clip: float, noise_multiplier: float, expected_batch_size: float,
                randomness: Any, population: int) -> ParallelDP:
        return ParallelDP(self.model, clip=clip, noise_multiplier=noise_multiplier,
                          expected_batch_size=expected_batch_size, randomness=randomness, population=population,
                          micro_batch_size=self.tcfg.micro_batch_size)

    def private_gradients(self, rows: np.ndarray) -> dict[str, float]:
        b = self.make_batch(rows)
        with self._autocast():
            st = self.dp.step_gradients(b.input_ids, b.attention_mask, b.loss_mask, step=self._step,
                                        right_padded=b.right_padded)
        return {k: float(v) for k, v in st.items()}

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
    def write_state(self, step: int, scalars: dict[str, Any], *, extra: dict[str, Any],
                    files: dict[str, Any] | None) -> None:
        from memaudit.parallel.checkpoint import save_sharded

        tmp = self.session.begin_checkpoint(step)  # the writer makes it; the same path on every rank
        save_sharded(tmp, self.model, self.optimizer, scalars=scalars, extra=extra, files=files,
                     commit=lambda: self.session.commit_checkpoint(step))

    def read_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """A sharded checkpoint (any grid; exact on the same x*y*z), or a full single-process one
        sliced for this grid."""
        from memaudit.parallel import checkpoint as pckpt
        from memaudit.train import checkpoint as ckpt

        scalars = ckpt.read_scalars(self.run)
        if scalars.get("format") != pckpt.FORMAT:
            return self._read_full_state()
        d, saved = self.dims, scalars.get("grid", [])
        same_tp = list(saved[1:]) == [d.x, d.y, d.z]
        model = self.model
        pckpt.load_sharded(self.run, params=dict(model.hf.named_parameters()), optimizer=self.optimizer,
                           local=lambda n, full: model.hf.get_parameter(n).shard_spec.local(full, model.comm),
                           own_rank=self.pg.rank % d.tp_size if same_tp else None)
        if list(saved) == list(d.grid()):
            pckpt.restore_rng(self.run, self.pg.rank)
        return scalars, ckpt.read_extra(self.run)

    def _read_full_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Every rank loads the full checkpoint into a plain model and AdamW and keeps its slices."""
        from memaudit.models.init import initial_model
        from memaudit.train import checkpoint as ckpt

        plain = initial_model(self.cfg.model, self.model.hf.config.vocab_size)
        t = self.tcfg
        opt = torch.optim.AdamW(plain.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
        scalars, extra = ckpt.load_state(self.run, model=plain, optimizer=opt, device=torch.device("cpu"))
        self.model.load_full_state_dict(plain.state_dict())
        full = opt.state_dict()
        local = {}
        for i, p in enumerate(self.model.hf.parameters()):
            st = full["state"].get(i)
            if st is not None:
                local[i] = {k: (p.shard_spec.local(v, self.model.comm).to(p.device)
                                if torch.is_tensor(v) and tuple(v.shape) == p.shard_spec.full_shape else v)
                            for k, v in st.items()}
        self.optimizer.load_state_dict({"state": local, "param_groups": full["param_groups"]})
        return scalars, extra

    def export_model(self) -> None:
        full = self.model.full_state_dict(dst=0)  # a collective; only the writer gets the tensors
        if not self.is_writer:
            return
        from memaudit.models.init import initial_model

        plain = initial_model(self.cfg.model, self.model.hf.config.vocab_size)
        plain.load_state_dict(full, strict=False)
        real = self.model
        self.model = plain
        try:
            super().export_model()
        finally:
            self.model = real
