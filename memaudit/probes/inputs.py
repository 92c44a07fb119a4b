"""Members and non-members as a user has them: JSONL, plain text, Parquet, CSV, or a Hugging Face
dataset saved to disk (`Dataset.save_to_disk`), with the text, user-id and PII-span columns named.

Every format becomes the same list of `Doc`; bad input (a missing file or column, a dataset
dictionary without the split named) is refused in one line naming the columns there are. The
columns come from flags or a small YAML file (`read_column_spec`); a flag wins over the file.
Documentation of the formats: docs/inputs.md.

>>> Columns().text
'text'
"""

from __future__ import annotations

import csv
import json
import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from memaudit.errors import DataError


@dataclass(frozen=True)
class Doc:
    """One document as probed. `role`: member | holdout | heldout_user | nonmember."""

    id: str
    text: str
    user: str | None = None
    repeats: int = 1
    pii: list[dict] | None = None
    role: str = "member"


# A document's copies in the training data. More than a million copies of one text is no
# training set memaudit can probe (and groups by repeats would hold one document): a count past
# it is a wrong column or a typo, refused rather than carried into every per-repeats summary.
MAX_REPEATS = 1_000_000


def parse_repeats(value: Any, where: str) -> int:
    """The `repeats` of one row: absent or empty is 1; a whole number from 1 to MAX_REPEATS, else
    refused in one line naming the row (a number is shown; any other value is not, it may be text).

    >>> parse_repeats("3", "row 1"), parse_repeats(None, "row 2"), parse_repeats(2.0, "row 3")
    (3, 1, 2)
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return 1
    n: float | None = None
    shown = ""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        n, shown = float(value), f" {value}"
    elif isinstance(value, str):
        try:
            n, shown = float(value.strip()), f" {value.strip()}"
        except ValueError:
            n = None
    if n is None or not math.isfinite(n) or n != int(n) or not 1 <= n <= MAX_REPEATS:
        raise DataError(f"{where}: repeats{shown} is not a whole number from 1 to {MAX_REPEATS:,} (the "
                        "document's copies in the training data); fix the column or drop it (1 copy)")
    return int(n)


def read_docs(path: str | Path, role: str) -> list[Doc]:
    """A .jsonl file ({"text", optional "id", "user", "repeats", "pii"} per line) or plain text
    (one document per non-empty line)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"documents file '{p}' not found; pass a .jsonl or .txt file")
    docs = []
    lines = p.read_text(encoding="utf-8").splitlines()
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        if p.suffix == ".jsonl":
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                raise DataError(
                    f"'{p}' line {n + 1} is not JSON; write one object per line"
                ) from None
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                raise DataError(f"'{p}' line {n + 1} has no string 'text' field")
            docs.append(
                Doc(
                    id=str(rec.get("id", f"{p.stem}:{n}")),
                    text=rec["text"],
                    user=None if rec.get("user") is None else str(rec["user"]),
                    repeats=parse_repeats(rec.get("repeats"), f"'{p}' line {n + 1}"),
                    pii=rec.get("pii"),
                    role=role,
                )
            )
        else:
            docs.append(Doc(id=f"{p.stem}:{n}", text=line, role=role))
    if not docs:
        raise DataError(f"documents file '{p}' is empty; it needs at least one document")
    return docs


FORMATS = ".jsonl, .txt, .parquet, .csv or a dataset folder (datasets' save_to_disk)"


@dataclass(frozen=True, kw_only=True)
class Columns:
    """The column names to read; user and pii are optional (absent columns give None)."""

    text: str = "text"
    user: str = "user"
    pii: str = "pii"
    id: str = "id"
    split: str = "train"  # a DatasetDict's split


DEFAULT_COLUMNS = Columns()
# keys of a --columns file, each the flag it stands for
COLUMN_KEYS = {"text": "--text-column", "user": "--user-column", "pii": "--pii-column",
               "split": "--split"}


def read_column_spec(path: str | Path) -> dict[str, str]:
    """The column names a small YAML file gives (`--columns`): a mapping with any of the keys
    text, user, pii and split, each a non-empty string (e.g. "text: body" and "user: author"
    on two lines); bad input (a missing file, not YAML, not a mapping, an unknown key, a value
    that is not a column name) is refused in one line.
    """
    p = Path(path)
    if not p.is_file():
        raise DataError(f"--columns file '{p}' not found; pass a YAML file such as "
                        "'text: body' (keys: text, user, pii, split)")
    try:
        spec = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError):
        raise DataError(f"--columns file '{p}' is not YAML; write one 'key: column' per line "
                        "(keys: text, user, pii, split)") from None
    if not isinstance(spec, dict) or not spec:
        raise DataError(f"--columns file '{p}' is not a mapping of column names; write e.g. "
                        "'text: body' (keys: text, user, pii, split)")
    for key, value in spec.items():
        if key not in COLUMN_KEYS:
            raise DataError(f"--columns file '{p}': unknown key '{key}'; use text, user, pii "
                            "or split")
        if not isinstance(value, str) or not value.strip():
            raise DataError(f"--columns file '{p}': '{key}' must name a column (a non-empty "
                            f"string); write e.g. '{key}: {getattr(DEFAULT_COLUMNS, key)}'")
    return dict(spec)


def resolve_columns(spec: str | Path | None, **flags: str | None) -> Columns:
    """The columns to read: the flags given (not None) win over a --columns file's keys, which
    win over the defaults.

    Args:
        spec: the --columns YAML file, or None.
        flags: text, user, pii, split as passed on the command line (None: not passed).

    >>> resolve_columns(None, text="body", user=None).text
    'body'
    """
    named = read_column_spec(spec) if spec is not None else {}
    named.update({k: v for k, v in flags.items() if v is not None})
    return Columns(**named)


def _is_dataset_dir(p: Path) -> bool:
    return p.is_dir() and any((p / f).is_file() for f in
                              ("dataset_info.json", "state.json", "dataset_dict.json"))


def _records(p: Path, cols: Columns) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows as dicts and the column names the source has."""
    if _is_dataset_dir(p):
        # lazy: datasets (~1.4 s) for this format only
        from datasets import DatasetDict, load_from_disk

        ds = load_from_disk(str(p))
        if isinstance(ds, DatasetDict):
            if cols.split not in ds:
                raise DataError(f"dataset '{p}' has no split '{cols.split}' (splits: "
                                f"{', '.join(ds)}); pass --split NAME or 'split:' in --columns")
            ds = ds[cols.split]
        return ds.to_list(), list(ds.column_names)
    if p.suffix == ".parquet":
        # lazy: pyarrow (~0.2 s) only when called; this module imports without it
        import pyarrow.parquet as pq

        table = pq.read_table(p)
        return table.to_pylist(), list(table.column_names)
    if p.suffix == ".csv":
        with p.open(encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            return rows, list(reader.fieldnames or [])
    if p.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines()):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    raise DataError(f"'{p}' line {n + 1} is not JSON; write one object per line"
                                    ) from None
        names = sorted({k for r in rows if isinstance(r, dict) for k in r})
        return rows, names
    raise DataError(f"documents '{p}' are not in a format memaudit reads; pass {FORMATS}")


def _pii(v: Any, p: Path, i: int) -> list[dict] | None:
    if v is None or v == "":
        return None
    if isinstance(v, str):  # CSV cells hold the spans as JSON
        try:
            v = json.loads(v)
        except json.JSONDecodeError:
            raise DataError(f"'{p}' row {i + 1}: the PII column is not a JSON list of "
                            "{type, value, start}; fix the cell") from None
    if not isinstance(v, list) or not all(isinstance(x, dict) and "value" in x for x in v):
        raise DataError(f"'{p}' row {i + 1}: the PII column must be a list of "
                        "{type, value, start} objects")
    return v


def read_documents(path: str | Path, role: str, cols: Columns = DEFAULT_COLUMNS) -> list[Doc]:
    """The documents of `path` in any of FORMATS, as `Doc`s with `role`.

    Args:
        path: the file or dataset folder.
        role: "member", "holdout" or "heldout_user".
        cols: which columns hold the text, user id, PII spans and id.

    Returns:
        One `Doc` per row with a non-empty text; refuses a missing column in one line.
    """
    p = Path(path)
    if not p.exists():
        raise DataError(f"documents file '{p}' not found; pass {FORMATS}")
    if p.suffix == ".txt" and p.is_file():
        return read_docs(p, role)
    rows, names = _records(p, cols)
    if cols.text not in names:
        raise DataError(f"documents '{p}' have no column '{cols.text}' (columns: "
                        f"{', '.join(names) or 'none'}); pass --text-column NAME or 'text:' in "
                        "--columns")
    if cols.user != "user" and cols.user not in names:
        raise DataError(f"documents '{p}' have no user column '{cols.user}' (columns: "
                        f"{', '.join(names)}); pass --user-column NAME or 'user:' in --columns")
    if cols.pii != "pii" and cols.pii not in names:
        raise DataError(f"documents '{p}' have no PII column '{cols.pii}' (columns: "
                        f"{', '.join(names)}); pass --pii-column NAME or 'pii:' in --columns")
    docs = []
    for i, r in enumerate(rows):
        text = r.get(cols.text) if isinstance(r, dict) else None
        if not isinstance(text, str):
            raise DataError(f"'{p}' row {i + 1} has no string '{cols.text}'; fix the row")
        if not text.strip():
            continue
        user = r.get(cols.user)
        docs.append(Doc(id=str(r.get(cols.id) if r.get(cols.id) is not None else f"{p.stem}:{i}"),
                        text=text, user=None if user in (None, "") else str(user),
                        repeats=parse_repeats(r.get("repeats"), f"'{p}' row {i + 1}"),
                        pii=_pii(r.get(cols.pii), p, i),
                        role=role))
    if not docs:
        raise DataError(f"documents '{p}' hold no text; it needs at least one document")
    return docs


def min_negatives(fprs: tuple[float, ...]) -> int:
    """The non-members a TPR at the lowest FPR needs: ~10 / FPR (STYLE rule 11).

    >>> min_negatives((0.01, 0.001))
    10000
    """
    return round(10 / min(fprs)) if fprs else 0


def check_fpr_negatives(n_nonmembers: int, fprs: tuple[float, ...]) -> None:
    """Refuse FPRs asked for explicitly that the non-members cannot support."""
    need = min_negatives(fprs)
    if n_nonmembers < need:
        raise DataError(f"--fpr {min(fprs):g} needs at least {need} non-member documents "
                        f"(10 / FPR), got {n_nonmembers}; pass more non-members or a larger --fpr")
