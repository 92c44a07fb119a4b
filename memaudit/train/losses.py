"""Causal language-model loss, per example and batch-averaged.

Targets are shifted by one: the logits at position t predict `input_ids[:, t + 1]`.
`loss_mask` (B, L) is aligned with `input_ids` and says which *targets* count, so
`loss_mask[:, 0]` is ignored (position 0 is never a target). Combine the attention mask and,
when used, the Goldfish mask into it before calling.

>>> import torch
>>> logits = torch.zeros(2, 4, 5)                 # uniform over 5 tokens
>>> ids = torch.zeros(2, 4, dtype=torch.long)
>>> mask = torch.ones(2, 4, dtype=torch.bool)
>>> round(float(causal_lm_loss(logits, ids, mask)), 4)  # ln 5
1.6094
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _token_losses(
    logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked token losses (B, L-1) in fp32 and the float mask (B, L-1)."""
    if logits.shape[:2] != input_ids.shape or loss_mask.shape != input_ids.shape:
        raise ValueError(
            f"shape mismatch: logits {tuple(logits.shape)}, input_ids {tuple(input_ids.shape)}, "
            f"loss_mask {tuple(loss_mask.shape)}; expected (B, L, V), (B, L), (B, L)"
        )
    b, length, vocab = logits.shape
    pred = logits[:, :-1].reshape(-1, vocab).float()  # (B*(L-1), V)
    target = input_ids[:, 1:].reshape(-1)
    mask = loss_mask[:, 1:].to(torch.float32)  # (B, L-1)
    tok = F.cross_entropy(pred, target, reduction="none").view(b, length - 1)
    return tok * mask, mask


def causal_lm_loss_per_example(
    logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """Mean token loss of each example, shape (B,). An example with no target has loss 0.

    Args:
      logits: (B, L, V) next-token logits.
      input_ids: (B, L) token ids.
      loss_mask: (B, L) bool, True where the token at that position is a target that counts.
    """
    tok, mask = _token_losses(logits, input_ids, loss_mask)
    return tok.sum(1) / mask.sum(1).clamp(min=1.0)


def causal_lm_loss(
    logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """Token-mean loss over every counted target in the batch (a scalar)."""
    tok, mask = _token_losses(logits, input_ids, loss_mask)
    return tok.sum() / mask.sum().clamp(min=1.0)
