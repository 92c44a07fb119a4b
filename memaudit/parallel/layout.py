"""`TensorParallelLayout`: the centralized trainer's `Layout` on the data x (x, y, z) grid.

One instance per rank. The process groups are built when the layout is made, before
anything else (so that no collective is interleaved with the writer's data preparation);
rank 0 is the writer. Each chunk of a step's global batch is padded with masked rows to a
multiple of data*z and sliced; the loss/gradients, clipping, DP-SGD
(`memaudit.parallel.dp.TensorParallelClipping`), evaluation and checkpoints go through
`memaudit.parallel`. Checkpoints are sharded (`memaudit.parallel.checkpoint`): each rank
writes its own shards and AdamW moments, the same x*y*z grid resumes exactly, and any other
grid (or one process) resumes from the assembled tensors; `model/` is the merged Hugging
Face export, gathered on rank 0.

References: Singh et al., "A 4D Hybrid Algorithm to Scale Parallel Training to Thousands of
GPUs", SC'24 (AxoNN).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from memaudit.models.init import initial_model
from memaudit.models.lora import apply_lora
from memaudit.parallel import checkpoint as pckpt
from memaudit.parallel import clip as pclip
from memaudit.parallel.dims import ParallelDims, build_groups
from memaudit.parallel.dp import TensorParallelClipping, pad_rows
from memaudit.parallel.lora import gather_peft
from memaudit.parallel.parallelize import ParallelLlama, overlap_options, parallelize_llama
from memaudit.train import checkpoint as ckpt
from memaudit.train.evaluate import eval_mode, is_right_padded, target_mask
from memaudit.train.layout import Batch, autocast, make_optimizer, select_device


class TensorParallelLayout:
    """`Layout` of a `ParallelLlama` on `cfg.parallel`'s grid (a collective to build)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.dims = ParallelDims.from_config(cfg.parallel)
        self.pg = build_groups(self.dims)
        self.is_writer = self.pg.rank == 0
        if dist.is_initialized() and dist.get_backend() == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        elif dist.is_initialized():
            self.device = torch.device("cpu")
        else:
            self.device = select_device(cfg.train.device)

    @contextlib.contextmanager
    def writer_first(self) -> Iterator[None]:
        """The writer prepares (and writes) the data and the DP secret; the others load them after."""
        many = dist.is_initialized()
        if many and not self.is_writer:
            dist.barrier()
        yield
        if many and self.is_writer:
            dist.barrier()

    def parallelize(self, model: torch.nn.Module) -> ParallelLlama:
        return parallelize_llama(model, dims=self.dims, pg=self.pg, **overlap_options(self.cfg.parallel))

    def local(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This rank's (input_ids, loss_mask, attention_mask or None) of a global chunk."""

        ids, am, lm = pad_rows(batch.input_ids, batch.attention_mask, batch.loss_mask, self.pg.batch_shards)
        lam = None if batch.right_padded else self.pg.batch_shard(am)
        return self.pg.batch_shard(ids), self.pg.batch_shard(lm), lam

    def chunk_loss(self, model: ParallelLlama, batch: Batch, autocast_dtype: torch.dtype | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        ids, lm, am = self.local(batch)
        with autocast(self.device, autocast_dtype):
            return model(ids, lm, am)  # this chunk's token mean (local share, global log)

    def first_local_row(self, rows: int, first_row: int) -> int:
        """Rows padded to a multiple of data*z, then this rank's share (`local`)."""
        return first_row + self.pg.batch_index * (-(-rows // self.pg.batch_shards))

    def finish_gradients(self, model: ParallelLlama) -> None:
        model.finish_grad_sync()

    def grad_norm(self, model: ParallelLlama) -> float:
        return pclip.grad_norm(model)

    def clip_grad_norm_(self, model: ParallelLlama, max_norm: float) -> float:
        return pclip.clip_grad_norm_(model, max_norm)

    def dp_clipping(self, model: ParallelLlama, mode: str) -> Any:
        if mode != "ghost":
            raise ValueError(f"DP-SGD mode '{mode}' has no tensor-parallel form; use 'ghost' on a grid")
        return TensorParallelClipping(model)

    def evaluate(self, model: ParallelLlama, holdout: Any, *, batch_size: int, max_batches: int | None,
                 autocast_dtype: torch.dtype | None) -> tuple[float, float]:
        """The vocabulary-parallel token-mean loss, as `memaudit.train.evaluate.holdout_loss`."""

        n = len(holdout.input_ids) if max_batches is None else min(len(holdout.input_ids), batch_size * max_batches)
        if n == 0:
            return math.nan, math.nan
        right = is_right_padded(holdout.attention_mask[:n])
        total = torch.zeros(2, dtype=torch.float64)
        with eval_mode(model), torch.no_grad(), autocast(self.device, autocast_dtype):  # no adapter dropout
            for s in range(0, n, batch_size):
                am = torch.as_tensor(holdout.attention_mask[s:s + batch_size], dtype=torch.long, device=self.device)
                ids = torch.as_tensor(holdout.input_ids[s:s + batch_size], dtype=torch.long, device=self.device)
                lids, llm, lam = self.local(Batch(ids, am, target_mask(am), right))
                total += model.loss_sums(lids, llm, lam).cpu()
        if total[1] == 0:
            return math.nan, math.nan
        loss = float(total[0] / total[1])
        return loss, math.exp(min(loss, 700.0))

    # ------------------------------------------------------------------ checkpoints
    def write_state(self, session: Any, step: int, model: ParallelLlama, optimizer: Any, *,
                    scalars: dict[str, Any], extra: dict[str, Any], files: dict[str, Any] | None) -> None:
        tmp = session.begin_checkpoint(step)  # the writer makes it; the same path on every rank
        pckpt.save_sharded(tmp, model, optimizer, scalars=scalars, extra=extra, files=files,
                     commit=lambda: session.commit_checkpoint(step))

    def read_state(self, run: Any, model: ParallelLlama, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """A sharded checkpoint (any grid; exact on the same x*y*z), or a full single-process one
        sliced for this grid."""

        scalars = ckpt.read_scalars(run)
        if scalars.get("format") != pckpt.FORMAT:
            return self._read_full_state(run, model, optimizer)
        d, saved = self.dims, scalars.get("grid", [])
        same_tp = list(saved[1:]) == [d.x, d.y, d.z]
        pckpt.load_sharded(run, params=dict(model.hf.named_parameters()), optimizer=optimizer,
                           local=lambda n, full: model.hf.get_parameter(n).shard_spec.local(full, model.comm),
                           own_rank=self.pg.rank % d.tp_size if same_tp else None)
        if list(saved) == list(d.grid()):
            pckpt.restore_rng(run, self.pg.rank)
        return scalars, ckpt.read_extra(run)

    def _read_full_state(self, run: Any, model: ParallelLlama, optimizer: Any
                         ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Every rank loads the full checkpoint into a plain model and AdamW and keeps its slices."""

        plain = initial_model(self.cfg.model, model.hf.config.vocab_size)
        lora = self.cfg.model.lora
        if lora is not None:  # the one-process run's peft model (the optimizer holds its adapters only)
            plain = apply_lora(plain, lora, seed=self.cfg.model.init_seed)
        opt = make_optimizer([p for p in plain.parameters() if p.requires_grad], self.cfg.train)
        scalars, extra = pckpt.load_any(run, model=plain, optimizer=opt, device=torch.device("cpu"))
        model.load_full_state_dict((plain.get_base_model() if lora is not None else plain).state_dict())
        full = opt.state_dict()
        local = {}
        for i, p in enumerate(p for p in model.hf.parameters() if p.requires_grad):
            st = full["state"].get(i)
            if st is not None:
                local[i] = {k: (p.shard_spec.local(v, model.comm).to(p.device)
                                if torch.is_tensor(v) and tuple(v.shape) == p.shard_spec.full_shape else v)
                            for k, v in st.items()}
        optimizer.load_state_dict({"state": local, "param_groups": full["param_groups"]})
        return scalars, extra

    def export_model(self, session: Any, model: ParallelLlama, prepared: Any) -> None:
        full = model.full_state_dict(dst=0)  # a collective; only the writer gets the tensors
        if not self.is_writer:
            return

        plain = initial_model(self.cfg.model, model.hf.config.vocab_size)
        plain.load_state_dict(full, strict=False)
        session.export_hf(plain, tokenizer=prepared.tokenizer(), tokenizer_dir=prepared.tokenizer_dir)

    def lora_model(self, model: ParallelLlama) -> Any:
        """The writer's one-process peft model (the run's seeded `apply_lora` of a fresh model)
        holding the assembled base and adapters, so both LoRA exports are what one process
        writes; None on the other ranks. A collective."""
        fresh = None
        if self.is_writer:
            plain = initial_model(self.cfg.model, model.hf.config.vocab_size)
            fresh = apply_lora(plain, self.cfg.model.lora, seed=self.cfg.model.init_seed)
        return gather_peft(model, fresh)

    def num_parameters(self, model: ParallelLlama) -> int:
        return sum(math.prod(p.shard_spec.full_shape) for p in model.hf.parameters())
