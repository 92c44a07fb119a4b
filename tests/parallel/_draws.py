"""Counting the Gaussian normals a piece of code draws (torch.randn and torch.normal, from any thread)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def counting_normals() -> Iterator[list[int]]:
    """Inside: every torch.randn / torch.normal call appends how many normals it drew to the list."""
    drawn: list[int] = []
    real = {name: getattr(torch, name) for name in ("randn", "normal")}

    def counting(fn: Any) -> Any:
        def draw(*args: Any, **kwargs: Any) -> torch.Tensor:
            out = fn(*args, **kwargs)
            drawn.append(out.numel())
            return out
        return draw

    for name, fn in real.items():
        setattr(torch, name, counting(fn))
    try:
        yield drawn
    finally:
        for name, fn in real.items():
            setattr(torch, name, fn)
