"""Where the centralized trainer's model lives: one process (`SerialLayout`) or the 4D grid.

`memaudit.train.trainer.Trainer` is the one step / evaluation / checkpoint loop; everything
that depends on how the model is laid out over processes is a `Layout`: the device, the
writer rank and the data barrier, parallelising the seeded model, each chunk's loss on this
process's rows (and the gradient sync after backward), the global gradient norm, DP-SGD's
per-example clipping (`memaudit.train.dpsgd.PerExampleClipping`), evaluation, the checkpoint
format and the merged Hugging Face export. The data x (x, y, z) tensor-parallel layout is
`memaudit.parallel.layout.TensorParallelLayout`.

References: torchtitan (Liang et al., 2024): a plain model, parallelised after the fact by a
`ParallelDims` object, in one trainer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from memaudit.errors import MemauditError
from memaudit.train import checkpoint as ckpt

if TYPE_CHECKING:
    import torch

    from memaudit.backends import Session
    from memaudit.config import Config
    from memaudit.data.packing import PackedSequences
    from memaudit.rundir import RunDir
    from memaudit.train.dpsgd import PerExampleClipping


@dataclass
class Batch:
    """One chunk of a step's (global) batch on the training device."""

    input_ids: torch.Tensor  # (B, L) int64
    attention_mask: torch.Tensor  # (B, L) int64, 1 = real token
    loss_mask: torch.Tensor  # (B, L) bool, True = counted target (never position 0)
    right_padded: bool  # then the model runs without an attention mask

    @property
    def num_positions(self) -> int:
        return int(self.input_ids.numel())

    def rows(self, sl: slice) -> Batch:
        return Batch(self.input_ids[sl], self.attention_mask[sl], self.loss_mask[sl], self.right_padded)


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """torch.autocast on `device` to `dtype`, or nothing when `dtype` is None."""
    # lazy: torch (~2 s) only when called; this module imports without it
    import torch

    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def make_optimizer(params: Any, tcfg: Any) -> torch.optim.Optimizer:
    """The trainer's AdamW from `train.lr`, `train.betas` and `train.weight_decay`."""
    # lazy: torch (~2 s) only when called; this module imports without it
    import torch

    return torch.optim.AdamW(params, lr=tcfg.lr, betas=tuple(tcfg.betas), weight_decay=tcfg.weight_decay)


class Layout(Protocol):
    """What the one `Trainer` asks of a model layout (see the module docstring)."""

    device: torch.device
    is_writer: bool  # writes run.json, run.lock, metrics.jsonl, state/, model/, privacy.json

    def writer_first(self) -> contextlib.AbstractContextManager:
        """The writer runs the block (data staging, model, DP secret) before the other processes."""

    def parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        """The training model from the seeded full model (the same on every process)."""

    def chunk_loss(self, model: Any, batch: Batch, autocast_dtype: torch.dtype | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to backpropagate, detached loss to log): the token mean of `batch`'s global rows."""

    def first_local_row(self, rows: int, first_row: int) -> int:
        """The step-batch index of this process's first row of the chunk of `rows` global rows
        starting at `first_row` (what keyed adapter dropout draws its masks from)."""

    def finish_gradients(self, model: Any) -> None:
        """After the last chunk's backward: gradients final on this process."""

    def grad_norm(self, model: Any) -> float:
        """The L2 norm of the whole (logical) model's gradient."""

    def clip_grad_norm_(self, model: Any, max_norm: float) -> float:
        """Scale gradients to a global norm of at most `max_norm`; returns the norm before."""

    def dp_clipping(self, model: Any, mode: str) -> PerExampleClipping:
        """DP-SGD's per-example norms, clipped sum and noise for this layout."""

    def evaluate(self, model: Any, holdout: PackedSequences, *, batch_size: int, max_batches: int | None,
                 autocast_dtype: torch.dtype | None) -> tuple[float, float]:
        """(token-mean holdout loss, perplexity) of the first `max_batches` batches."""

    def write_state(self, session: Session, step: int, model: Any, optimizer: Any, *,
                    scalars: dict[str, Any], extra: dict[str, Any], files: dict[str, Any] | None) -> None:
        """A checkpoint of step `step` in this layout's format (a collective on a grid)."""

    def read_state(self, run: RunDir, model: Any, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load state/ (any format) into the model, optimizer and RNG; return (scalars, extra)."""

    def export_model(self, session: Session, model: Any, prepared: Any) -> None:
        """The merged Hugging Face model (and tokenizer) into model/, written by the writer."""

    def lora_model(self, model: Any) -> Any:
        """Under `model.lora`: the whole one-process peft model (frozen base and adapters) on the
        writer, None elsewhere (a collective on a grid); the LoRA exports are written from it."""

    def num_parameters(self, model: Any) -> int:
        """Parameters of the whole (logical) model."""


def select_device(want: str) -> torch.device:
    """`train.device` (auto | cpu | cuda) as a torch device; cuda without a GPU is one line."""
    # lazy: torch (~2 s) only when called; this module imports without it
    import torch

    if want == "cuda" and not torch.cuda.is_available():
        raise MemauditError("train.device=cuda but no CUDA device is visible; use train.device=auto")
    return torch.device("cuda" if want != "cpu" and torch.cuda.is_available() else "cpu")


class SerialLayout:
    """The whole model in this process; writes plain checkpoints (`memaudit.train.checkpoint`)."""

    is_writer = True

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.device = select_device(cfg.train.device)

    @contextlib.contextmanager
    def writer_first(self) -> Iterator[None]:
        yield

    def parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def chunk_loss(self, model: Any, batch: Batch, autocast_dtype: torch.dtype | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        # lazy: torch (~2 s) only when called; this module imports without it
        from memaudit.train.losses import causal_lm_loss

        am = None if batch.right_padded else batch.attention_mask
        with autocast(self.device, autocast_dtype):
            logits = model(input_ids=batch.input_ids, attention_mask=am).logits  # (b, L, V)
        loss = causal_lm_loss(logits, batch.input_ids, batch.loss_mask)
        return loss, loss.detach()

    def first_local_row(self, rows: int, first_row: int) -> int:
        return first_row

    def finish_gradients(self, model: Any) -> None:
        return None

    def grad_norm(self, model: Any) -> float:
        # lazy: torch (~2 s) only when called; this module imports without it
        import torch

        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))) if grads else 0.0

    def clip_grad_norm_(self, model: Any, max_norm: float) -> float:
        # lazy: torch (~2 s) only when called; this module imports without it
        import torch

        params = [p for p in model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True))

    def dp_clipping(self, model: Any, mode: str) -> PerExampleClipping:
        # lazy: torch (~2 s) only when called; this module imports without it
        from memaudit.train.dpsgd import SerialClipping

        return SerialClipping(model, mode)  # type: ignore[arg-type]

    def evaluate(self, model: Any, holdout: PackedSequences, *, batch_size: int, max_batches: int | None,
                 autocast_dtype: torch.dtype | None) -> tuple[float, float]:
        # lazy: numpy (~0.4 s) only when called; this module imports without it
        from memaudit.train.evaluate import holdout_loss

        return holdout_loss(model, holdout.input_ids, holdout.attention_mask, batch_size=batch_size,
                            max_batches=max_batches, device=self.device, autocast_dtype=autocast_dtype)

    def write_state(self, session: Session, step: int, model: Any, optimizer: Any, *,
                    scalars: dict[str, Any], extra: dict[str, Any], files: dict[str, Any] | None) -> None:
        with session.checkpoint(step) as d:
            ckpt.write_state(d, model=model, optimizer=optimizer, scalars=scalars, extra=extra, files=files)

    def read_state(self, run: RunDir, model: Any, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """state/ of either layout (a grid's is merged into this one process's model)."""
        # lazy: torch (~2 s) only when called; this module imports without it
        from memaudit.parallel.checkpoint import (
            load_any,  # torch.distributed: only a resume pays it
        )

        return load_any(run, model=model, optimizer=optimizer, device=self.device)

    def export_model(self, session: Session, model: Any, prepared: Any) -> None:
        session.export_hf(model, tokenizer=prepared.tokenizer(), tokenizer_dir=prepared.tokenizer_dir)

    def lora_model(self, model: Any) -> Any:
        return model

    def num_parameters(self, model: Any) -> int:
        return sum(p.numel() for p in model.parameters())
