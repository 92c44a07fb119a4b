"""The report's typed values: a measured `Cell`, a `Test` between two runs, and one formatter.

Every number the report shows is a `Cell` of `memaudit.probes.stats` (value, interval or the note
saying why there is none, n and what the unit is) or a pool of such cells over seeds; the records
live in `memaudit.probes.records`, with their one JSON pair (`to_json` / `from_json`). Code that
reads a cell object of a file goes through `as_cell`, and every surface (the
terminal, Markdown, HTML, the README blocks, the findings' sentences) writes a cell with the one
function `format_cell`, in the `CellStyle` of that surface. This module is the bottom of
`memaudit.reports`: it imports none of the others.

References:
  Holm. A simple sequentially rejective multiple test procedure. Scand. J. Statist. 1979.

>>> format_cell({"value": 0.51234, "ci_low": 0.5, "ci_high": 0.53, "n": 96, "unit": "documents"}, PAGE)
'0.5123 [0.5, 0.53] (n = 96 documents)'
>>> format_cell({"value": 3.2, "n": 4, "unit": "canaries", "note": "n too small"}, README)
'3.2 (n = 4 canaries, n too small)'
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from memaudit.probes.records import Cell, Test

__all__ = ["Cell", "Test"]  # the typed records, made by memaudit.probes.stats


# ----------------------------------------------------------------------------- numbers
def fmt(v: Any) -> str:
    """A value as the HTML and Markdown pages write it: 4 significant digits, "inf", "n/a" for
    none or NaN; strings and integers as they are."""
    if v is None:
        return "n/a"
    if isinstance(v, str):
        return v
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        if math.isinf(v):
            return "inf"
        return f"{v:.4g}"
    return str(v)


def number(v: Any, digits: int = 3, *, thousands: bool = False) -> str:
    """A number in `digits` significant digits ("n/a" for none or NaN, "inf"); with `thousands`,
    1,000 and above as a whole number with separators (the README's tables, plot ticks)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    if thousands and isinstance(v, int | float) and abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}g}"


def readme_number(v: Any) -> str:
    """The README's numbers: 3 significant digits, thousands as whole numbers."""
    return number(v, 3, thousands=True)


def fixed3(v: Any) -> str:
    """The terminal's numbers: three decimals."""
    return f"{v:.3f}"


# ----------------------------------------------------------------------------- cells
def as_cell(c: Cell | Mapping[str, Any] | None) -> Cell | None:
    """`c` as a `Cell`: a report.json / probes.json cell object read (`Cell.from_json`); None for
    none or an empty object."""
    if c is None or isinstance(c, Cell):
        return c
    return Cell.from_json(c) if c else None


@dataclass(frozen=True, kw_only=True)
class CellStyle:
    """How one surface writes a cell (see `format_cell`)."""

    num: Callable[[Any], str]
    missing: str = "n/a"                     # no cell at all
    valueless: str | None = "n/a"            # a cell without a value; None: its note (or `missing`) and n
    n: Literal["none", "short", "long"] = "long"  # "n=96 documents" / "n = 96 documents"
    note_in_parens: bool = False             # the note beside n in one parenthesis, else after a comma
    no_note: str | None = None               # said after the comma when a cell has no interval and no note


PAGE = CellStyle(num=fmt, valueless=None)
"""report.html and report.md: ``0.5123 [0.5, 0.53] (n = 96 documents)``, ``3.2, n too small (n = 4 canaries)``."""
README = CellStyle(num=readme_number, note_in_parens=True)
"""The README blocks: ``0.512 [0.5, 0.53] (n = 96 documents)``, ``3.2 (n = 4 canaries, n too small)``."""
FINDING = CellStyle(num=number, n="none", note_in_parens=True)
"""A finding's evidence (its test states n): ``0.512 bits [0.5, 0.53]``, ``3.2 bits (n too small)``."""
TERMINAL = CellStyle(num=fixed3, missing="-", valueless=None, n="short", no_note="no interval")
"""`memaudit probe`'s table: ``0.512 [0.500, 0.530] (n=96 documents)``, ``3.200, n too small (n=4 canaries)``."""


def n_text(c: Cell, style: CellStyle = PAGE) -> str:
    """"n = 96 documents", or for an attack's AUC both classes: "n = 323 members + 96 non-members
    documents" (the interval's width is set by the smaller class, the test uses both); "" without n."""
    if c.n is None or style.n == "none":
        return ""
    unit = c.unit or ""
    if style.n == "short":
        return f"n={c.n} {unit}".strip()
    if c.n_pos is not None and c.n_neg is not None:
        return f"n = {c.n_pos} members + {c.n_neg} non-members {unit}".strip()
    return f"n = {c.n} {unit}".strip()


def format_cell(cell: Cell | Mapping[str, Any] | None, style: CellStyle, value_unit: str = "") -> str:
    """A cell as text: value (">= value" for a lower bound, which shows no interval: its upper end
    would be the estimator's ceiling, not the data's), `value_unit` ("bits"), interval or the note
    saying why there is none, and n with its unit, each as `style` writes it."""
    c = as_cell(cell)
    if c is None:
        return style.missing
    n = n_text(c, style)
    if c.value is None:
        if style.valueless is not None:
            return style.valueless
        return f"{c.note or style.missing}" + (f" ({n})" if n else "")
    s = f"{'>= ' if c.lower_bound else ''}{style.num(c.value)}" + (f" {value_unit}" if value_unit else "")
    note = None
    if c.interval is None:
        note = c.note or style.no_note
    elif not c.lower_bound:
        s += f" [{style.num(c.interval[0])}, {style.num(c.interval[1])}]"
    if style.note_in_parens:
        extra = ", ".join(x for x in (n, note) if x)
        return s + (f" ({extra})" if extra else "")
    return s + (f", {note}" if note else "") + (f" ({n})" if n else "")


# ----------------------------------------------------------------------------- tests
NOT_TESTED = "not tested"
NO_DIFFERENCE = "no difference shown"


def verdict(test: Test | None, alpha: float) -> str:
    """What a comparison shows, from its adjusted test alone: "less" or "more" (side a's
    leakage against side b's, the direction of the tested difference), "no difference shown"
    (adjusted p >= alpha), or "not tested" (no test, or not yet adjusted).

    >>> t = Test(name="t", alternative="two-sided", n_a=50, n_b=50, unit="documents",
    ...          p_value=0.001, estimate=-0.2, p_adjusted=0.004)
    >>> verdict(t, 0.05)
    'less'
    """
    if test is None or test.p_adjusted is None:
        return NOT_TESTED
    if test.p_adjusted >= alpha:
        return NO_DIFFERENCE
    if test.alternative == "less":
        return "less"
    return "more" if test.estimate > 0 else "less"


# ----------------------------------------------------------------------------- the leakage metrics
# key -> (label, unit, lower is better); the report's comparisons, findings and frontier name them so
METRICS: dict[str, tuple[str, str, bool]] = {
    "exposure_top": ("excess exposure of the most-repeated canaries over the references", "bits", True),
    "extraction_exact": ("exact extraction rate of member text", "", True),
    "canary_completion": ("canary completion rate", "", True),
    "mia_auc": ("membership-inference AUC (loss attack)", "", True),
    "user_mia_auc": ("user-inference AUC", "", True),
    "pii_extraction": ("PII extraction rate", "", True),
    "audit_epsilon": ("empirical epsilon lower bound", "", True),
    # probed outside models only (memaudit.reports.targets): the attack furthest from chance
    "mia_strongest": ("membership-inference AUC (strongest attack)", "", True),
}
SHORT = {"exposure_top": "exposure (top reps)", "extraction_exact": "exact extraction",
         "canary_completion": "canary completion", "mia_auc": "MIA AUC", "user_mia_auc": "user-inference AUC",
         "pii_extraction": "PII extraction", "audit_epsilon": "audit epsilon",
         "mia_strongest": "MIA AUC (strongest attack)"}
# the audit bound is a one-sided lower bound: never tested as a difference between runs
TESTABLE = {"audit_epsilon": False}
