"""The report's one multiple-comparison correction, over typed tests.

Every test the report states (the comparisons' `Test`s between runs, the scale section's, the
literature section's `SectionTest`s) is one entry of one family. `correct` takes the family's
tests in a fixed order and returns new records: each with its adjusted p-value, the correction's
name, the family's size and alpha. What a test then shows (its verdict, a sentence) is for the
part of the report that states it to say, from the adjusted record (`memaudit.reports.cells.verdict`,
`memaudit.reports.scale.settle`, `memaudit.reports.literature.settle`).

References:
  Holm. A simple sequentially rejective multiple test procedure. Scand. J. Statist. 1979.
  Benjamini, Hochberg. Controlling the false discovery rate. J. R. Statist. Soc. B 1995.

>>> from memaudit.reports.blocks import SectionTest
>>> ts = [SectionTest(test="t", p_value=p) for p in (0.01, 0.04, 0.03)]
>>> [(t.p_adjusted, t.family) for t in correct(ts)]
[(0.03, 3), (0.06, 3), (0.06, 3)]
>>> ts[0].p_adjusted is None  # the records given are left as they were
True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

ALPHA = 0.05
CORRECTION = "holm"


class Adjustable(Protocol):
    """A test record the correction can adjust: its p-value, and a copy with fields changed."""

    @property
    def p_value(self) -> float | None: ...

    def replace(self, **changes: Any) -> Any: ...


T = TypeVar("T", bound=Adjustable)


def correct(tests: Sequence[T], correction: str = CORRECTION, alpha: float = ALPHA) -> list[T]:
    """The family `tests` corrected by `correction` ("holm" or "benjamini-hochberg", as
    `memaudit.probes.stats.CORRECTIONS` names them): new records, in the order given, each with
    `p_adjusted`, `correction`, `family` (the number of tests) and `alpha`."""
    # lazy: probes.stats costs ~0.5 s of import (numpy, scipy); this module imports without it
    from memaudit.probes.stats import CORRECTIONS

    if correction not in CORRECTIONS:
        raise ValueError(f"unknown correction '{correction}'; use one of {', '.join(sorted(CORRECTIONS))}")
    adjusted = CORRECTIONS[correction]([t.p_value for t in tests]) if tests else []
    return [t.replace(p_adjusted=pa, correction=correction, family=len(tests), alpha=alpha)
            for t, pa in zip(tests, adjusted, strict=True)]
