"""Holdout loss and perplexity of a causal LM on packed sequences.

The loss is the mean next-token cross-entropy over every real target token (a token
whose attention mask is 1, excluding position 0 of each sequence), so padding never
counts and the perplexity is exp(mean loss), as in Jelinek et al. (1977).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch


def target_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) bool: real tokens that are prediction targets (position 0 never is)."""
    mask = attention_mask.bool().clone()
    mask[:, 0] = False
    return mask


def is_right_padded(attention_mask: np.ndarray) -> bool:
    """True when every row is 1...1 0...0: then causal attention never sees padding.

    Real tokens only attend to earlier positions, so with right padding the model can be
    called without an attention mask (faster SDPA path) and gives the same logits on them.
    """
    m = np.asarray(attention_mask).astype(bool)
    return bool((m[:, 1:] <= m[:, :-1]).all())


def token_loss_sum(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies over `loss_mask` targets (fp32 scalar)."""
    # lazy: torch (~2 s) only when called; this module imports without it
    import torch.nn.functional as F

    # logits[:, i] predicts input_ids[:, i + 1]
    pred = logits[:, :-1].float()  # (B, L-1, V)
    tgt = input_ids[:, 1:]
    per_tok = F.cross_entropy(pred.reshape(-1, pred.shape[-1]), tgt.reshape(-1), reduction="none")
    return (per_tok * loss_mask[:, 1:].reshape(-1).to(per_tok.dtype)).sum()


@contextlib.contextmanager
def eval_mode(model: Any) -> Iterator[None]:
    """Within: `model` in eval mode (no dropout); its training flag as it was after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def holdout_loss(
    model: torch.nn.Module,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    *,
    batch_size: int,
    max_batches: int | None,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[float, float]:
    """(mean token loss, perplexity) over the first `max_batches` batches of the set.

    The same fixed leading subset is used at every evaluation, so values are comparable
    across steps. Returns (nan, nan) for an empty set.
    """
    # lazy: torch (~2 s) only when called; this module imports without it
    import torch

    n = len(input_ids) if max_batches is None else min(len(input_ids), batch_size * max_batches)
    if n == 0:
        return float("nan"), float("nan")
    right_padded = is_right_padded(attention_mask[:n])
    total, count = 0.0, 0
    amp = (
        torch.autocast(device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    with eval_mode(model), torch.no_grad(), amp:
        for start in range(0, n, batch_size):
            ids = torch.as_tensor(input_ids[start : start + batch_size], dtype=torch.long, device=device)
            am = torch.as_tensor(attention_mask[start : start + batch_size], device=device)
            logits = model(input_ids=ids, attention_mask=None if right_padded else am).logits
            mask = target_mask(am)
            total += float(token_loss_sum(logits, ids, mask))
            count += int(mask[:, 1:].sum())
    if count == 0:
        return float("nan"), float("nan")
    loss = total / count
    return loss, math.exp(min(loss, 700.0))
