"""Goldfish loss (Hans et al. 2024): drop about 1/k of the target tokens from the loss.

A target at position t is dropped when a hash of the h token ids before it,
`input_ids[t-h:t]`, is 0 modulo k. The hash depends only on those ids, so a passage that
appears many times (a canary, a duplicated document) is masked the same way every time and
the model never sees the dropped tokens as targets, wherever the passage sits in a sequence.
Positions with fewer than h preceding tokens are kept.

The hash is a polynomial rolling hash modulo the Mersenne prime 2^31 - 1, followed by an
integer mixer, computed with int64 tensor ops (exact, identical on every device; no
overflow: every intermediate stays below 2^63).

References:
  Hans et al., "Be like a Goldfish, Don't Memorize! Mitigating Memorization in Generative
  LLMs", NeurIPS 2024.

>>> import torch
>>> ids = torch.arange(40).view(1, 40)
>>> m = goldfish_mask(ids, k=4, h=3)
>>> m.shape, bool(m[0, :3].all())
(torch.Size([1, 40]), True)
"""

from __future__ import annotations

import torch

_PRIME = 2**31 - 1
_BASE = 1_000_003
_MIX = 0x9E3779B1  # < 2^32, so (x < 2^31) * _MIX < 2^63


def _window_hash(input_ids: torch.Tensor, h: int) -> torch.Tensor:
    """Hash of every window of h consecutive ids: (B, L - h + 1) int64 in [0, 2^32)."""
    ids = input_ids.to(torch.int64) % _PRIME
    powers = [1]
    for _ in range(h - 1):
        powers.append(powers[-1] * _BASE % _PRIME)
    pw = torch.tensor(powers[::-1], dtype=torch.int64, device=ids.device)  # (h,)
    windows = ids.unfold(1, h, 1)  # (B, L-h+1, h)
    # accumulate term by term so each partial sum stays < 2^62
    acc = torch.zeros(windows.shape[:2], dtype=torch.int64, device=ids.device)
    for j in range(h):
        acc = (acc + windows[..., j] * pw[j]) % _PRIME
    x = (acc * _MIX) % (2**32)
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) % (2**32)
    return x ^ (x >> 16)


def goldfish_mask(input_ids: torch.Tensor, *, k: int, h: int) -> torch.Tensor:
    """Bool mask (B, L), True = keep the target at that position.

    Args:
      input_ids: (B, L) integer token ids.
      k: drop one target in k on average; k >= 2.
      h: number of preceding token ids hashed; h >= 1.

    Returns:
      (B, L) bool tensor on the device of `input_ids`.
    """
    if k < 2:
        raise ValueError(f"goldfish k must be >= 2 (k={k} would drop every token); use k=4")
    if h < 1:
        raise ValueError(f"goldfish h must be >= 1, got h={h}; use h=13")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (B, L), got shape {tuple(input_ids.shape)}")
    b, length = input_ids.shape
    keep = torch.ones(b, length, dtype=torch.bool, device=input_ids.device)
    if length <= h:
        return keep
    hv = _window_hash(input_ids[:, :-1], h)  # window starting at s is the context of s + h
    keep[:, h:] = hv % k != 0
    return keep
