"""The report's typed values: a measured `Cell`, a `Test` between two runs, and one formatter.

Every number the report shows is a cell of `memaudit.probes.stats` (value, interval or the note
saying why there is none, n and what the unit is) or a pool of such cells over seeds. The
report.json keeps them as dicts (its schema is `memaudit.reports.schema`); code that reads them
goes through `Cell.of` and `Test.of`, and every surface (the terminal, Markdown, HTML, the README
blocks, the findings' sentences) writes a cell with the one function `format_cell`, in the
`CellStyle` of that surface. This module is the bottom of `memaudit.reports`: it imports none of
the others.

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
from dataclasses import dataclass, field
from typing import Any, Literal


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
@dataclass(frozen=True, kw_only=True)
class Cell:
    """One measured number: value, two-sided interval (None when there is none, with `note`
    saying why: "n too small", a lower bound, ...), n and the unit n counts. `lower_bound`: the
    value is a one-sided bound (canaries at the exposure estimator's ceiling, `ceiling_units` of
    them). An attack's AUC also names both classes (`n_pos` members, `n_neg` non-members); a cell
    pooled over seeds says how many (`n_seeds`)."""

    value: float | None
    interval: tuple[float, float] | None = None
    n: int | None = None
    unit: str | None = None
    note: str | None = None
    lower_bound: bool = False
    ceiling_units: int | None = None
    n_pos: int | None = None
    n_neg: int | None = None
    n_seeds: int | None = None

    @classmethod
    def of(cls, d: Mapping[str, Any] | Cell | None) -> Cell | None:
        """The cell of a report.json / probes.json cell dict (None for none or an empty one)."""
        if d is None or isinstance(d, Cell):
            return d
        if not d:
            return None
        lo, hi = d.get("ci_low"), d.get("ci_high")
        return cls(value=d.get("value"), interval=None if lo is None or hi is None else (lo, hi),
                   n=d.get("n"), unit=d.get("unit"), note=d.get("note"),
                   lower_bound=bool(d.get("lower_bound")), ceiling_units=d.get("ceiling_units"),
                   n_pos=d.get("n_pos"), n_neg=d.get("n_neg"), n_seeds=d.get("n_seeds"))

    @property
    def has_value(self) -> bool:
        return self.value is not None

    @property
    def n_too_small(self) -> bool:
        """No interval because too few units stand behind the value (`memaudit.probes.stats.MIN_N`)."""
        return self.interval is None and bool(self.note) and self.note.startswith("n too small")


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
    c = Cell.of(cell)
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
@dataclass(frozen=True, kw_only=True)
class Test:
    """A test between two runs or two groups of seeds (`memaudit.probes.stats.compare_units`,
    `compare_seeds`), with its correction once the report's family is adjusted."""

    __test__ = False  # not a pytest class

    name: str
    alternative: str                # "less" (one-sided), "greater" or "two-sided"
    n_a: int
    n_b: int
    unit: str
    p_value: float
    estimate: float
    scope: str = "runs"             # "runs" (their units) or "configurations" (over seeds)
    statistic: str | None = None
    runs: tuple[str, str] | None = None
    p_floor: float | None = None
    p_adjusted: float | None = None
    correction: str | None = None
    family: int | None = None
    alpha: float | None = None
    mde: Mapping[str, Any] | None = field(default=None, hash=False, compare=False)  # when no difference is shown

    @classmethod
    def of(cls, d: Mapping[str, Any]) -> Test:
        runs = d.get("runs")
        return cls(name=d["test"], alternative=d["alternative"], n_a=d["n_a"], n_b=d["n_b"], unit=d["unit"],
                   p_value=d["p_value"], estimate=d.get("estimate", 0.0), scope=d.get("scope", "runs"),
                   statistic=d.get("statistic"), runs=tuple(runs) if runs else None, p_floor=d.get("p_floor"),
                   p_adjusted=d.get("p_adjusted"), correction=d.get("correction"), family=d.get("family"),
                   alpha=d.get("alpha"), mde=d.get("mde"))

    @property
    def sides(self) -> str:
        return "two-sided" if self.alternative == "two-sided" else "one-sided"


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
