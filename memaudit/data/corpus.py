"""Load a corpus through `datasets`: JSONL, CSV, Parquet, plain text, a directory or a name.

`data.path` names a file (by its extension: .jsonl/.json, .csv, .parquet, .txt), a
directory (every such file in it, sorted by name), or, when nothing of that name exists
on disk and it has no file extension, a dataset for `datasets.load_dataset(name,
split=data.split_name)` (`name:subset` picks a configuration, e.g.
`wikitext:wikitext-2-raw-v1`). Plain text gives one document per line or, with
`data.text_unit=file`, one per file.

Users: the `data.user_field` column when present. A corpus without it gets pseudo-users
assigned deterministically: document i goes to user `pseudo-%03d` % (sha256(str(i)) mod K)
with K = `data.pseudo_users` or max(2, ceil(N / 8)). An `id` column is kept when present
(else ids are `d000000`, ...), and a `pii` column of [{type, value, start}] spans (the form
`memaudit data synth` writes) is kept as well. Empty or missing texts are skipped.

Errors are one-line `DataError`s naming the file and the fix, never any document text.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from memaudit.data.documents import Document, Pii, count_repeats
from memaudit.errors import DataError

FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def check_file(path: Path, *, allow_empty: bool = False) -> bool:
    """A text-format corpus file must be UTF-8; False when it holds only whitespace."""
    if FORMATS[path.suffix.lower()] == "parquet":
        if path.stat().st_size == 0 and not allow_empty:
            raise DataError(f"corpus file '{path}' is empty; give it at least a few documents")
        return path.stat().st_size > 0
    blank = True
    try:
        with open(path, encoding="utf-8") as f:
            while chunk := f.read(1 << 20):
                blank = blank and not chunk.strip()
    except UnicodeDecodeError as e:
        raise DataError(
            f"corpus file '{path}' is not UTF-8 text (bad byte at offset {e.start}); "
            "re-encode it as UTF-8"
        ) from None
    if blank and not allow_empty:
        raise DataError(f"corpus file '{path}' is empty; give it at least a few documents")
    return not blank


def resolve_files(path: str) -> list[Path] | None:
    """The files `path` names, or None when it is a dataset name. Raises DataError."""
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in FORMATS)
        if not files:
            raise DataError(
                f"corpus directory '{p}' holds no .jsonl/.json/.csv/.parquet/.txt files; "
                "point data.path at a directory of corpus files"
            )
        return files
    if p.is_file():
        if p.suffix.lower() not in FORMATS:
            raise DataError(
                f"corpus file '{p}' has an unknown extension '{p.suffix}'; use .jsonl, .json, "
                ".csv, .parquet or .txt"
            )
        return [p]
    if p.suffix or "/" in path or path.startswith("."):
        raise DataError(f"corpus file '{p}' not found; check data.path")
    return None


@contextlib.contextmanager
def _quiet(datasets) -> Iterator[None]:
    """No progress bars or log lines from `datasets` or `huggingface_hub` (whose retries
    print a warning per attempt): only the CLI prints."""
    was = datasets.is_progress_bar_enabled()
    level = datasets.logging.get_verbosity()
    hub = logging.getLogger("huggingface_hub")
    hub_level = hub.level
    datasets.disable_progress_bars()
    # above CRITICAL: its error lines quote the failing row (a corpus value) before memaudit's line
    datasets.logging.set_verbosity(logging.CRITICAL + 1)
    hub.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hub.setLevel(hub_level)
        datasets.logging.set_verbosity(level)
        if was:
            datasets.enable_progress_bars()


def _records_from_file(f: Path, text_unit: str, *, in_dir: bool) -> list[dict[str, Any]]:
    """Rows of one file. In a directory an empty file is skipped; alone it is an error."""
    # lazy: datasets (~1.4 s) only when called; this module imports without it
    import datasets

    fmt = FORMATS[f.suffix.lower()]
    if not check_file(f, allow_empty=in_dir):
        return []
    if fmt == "text" and text_unit == "file":
        return [{"text": f.read_text(encoding="utf-8"), "id": f.stem}]
    try:
        with _quiet(datasets):
            ds = datasets.load_dataset(fmt, data_files=str(f), split="train")
    except Exception as e:  # noqa: BLE001 (datasets raises many unrelated types)
        raise DataError(
            f"corpus file '{f}' could not be read as {fmt} ({type(e).__name__}); fix the file "
            "or its extension"
        ) from None
    return list(ds)


def _records_from_name(name: str, split: str) -> list[dict[str, Any]]:
    # lazy: datasets (~1.4 s) only when called; this module imports without it
    import datasets

    repo, _, subset = name.partition(":")
    try:
        with _quiet(datasets):
            ds = datasets.load_dataset(repo, subset or None, split=split)
    except Exception as e:  # noqa: BLE001 (any load failure is a user-input error)
        raise DataError(
            f"dataset '{name}' (split '{split}') could not be loaded ({type(e).__name__}); check "
            "data.path and data.split_name, or pass a local file"
        ) from None
    return list(ds)


def _pseudo_user(i: int, k: int) -> str:
    h = int.from_bytes(hashlib.sha256(str(i).encode()).digest()[:8], "big")
    return f"pseudo-{h % k:03d}"


def _pii(raw: Any, text: str) -> tuple[Pii, ...]:
    if not isinstance(raw, list):
        return ()
    spans = []
    for p in raw:
        if isinstance(p, dict) and {"type", "value", "start"} <= p.keys():
            span = Pii(str(p["type"]), str(p["value"]), int(p["start"]))
            if span.check(text):
                spans.append(span)
    return tuple(spans)


def records_to_documents(
    records: list[dict[str, Any]],
    *,
    source: str,
    text_field: str,
    user_field: str,
    pseudo_users: int | None = None,
) -> list[Document]:
    """Turn loaded rows into Documents (see the module docstring for the rules)."""
    if not records:
        raise DataError(f"corpus '{source}' is empty; give it at least a few documents")
    fields = list(records[0].keys())
    if text_field not in fields:
        shown = ", ".join(fields[:12]) or "none"
        raise DataError(
            f"corpus '{source}' has no text field '{text_field}' (fields: {shown}); set "
            "data.text_field to one of them"
        )
    has_user = user_field in fields
    k = pseudo_users or max(2, math.ceil(len(records) / 8))
    docs, seen = [], set()
    for i, r in enumerate(records):
        text = r.get(text_field)
        if not isinstance(text, str) or not text.strip():
            continue
        user = r.get(user_field) if has_user else None
        user = str(user) if user is not None and str(user) != "" else _pseudo_user(i, k)
        doc_id = str(r["id"]) if r.get("id") is not None else f"d{i:06d}"
        if doc_id in seen:
            doc_id = f"{doc_id}#{i}"
        seen.add(doc_id)
        try:
            pii = _pii(r.get("pii"), text)
        except (TypeError, ValueError):  # the value itself is never shown: it may be private
            raise DataError(f"corpus '{source}' row {i + 1}, field 'pii': a span's 'start' is not an "
                            "integer (its value is not shown); fix that row") from None
        docs.append(Document(id=doc_id, user=user, text=text, pii=pii))
    if not docs:
        raise DataError(f"corpus '{source}' has no non-empty '{text_field}' values; fill them in")
    return count_repeats(docs)


def load_corpus(
    path: str,
    *,
    text_field: str = "text",
    user_field: str = "user",
    text_unit: str = "line",
    split_name: str = "train",
    pseudo_users: int | None = None,
) -> list[Document]:
    """Load `path` (file, directory or dataset name) into Documents.

    >>> import tempfile, json, os
    >>> d = tempfile.mkdtemp(); f = os.path.join(d, "c.jsonl")
    >>> _ = open(f, "w").write(json.dumps({"text": "hello", "user": "a"}) + "\\n")
    >>> [(x.id, x.user, x.text) for x in load_corpus(f)]
    [('d000000', 'a', 'hello')]
    """
    files = resolve_files(path)
    if files is None:
        records = _records_from_name(path, split_name)
    else:
        records = []
        for f in files:
            rows = _records_from_file(f, text_unit, in_dir=len(files) > 1 or Path(path).is_dir())
            if records and rows and set(rows[0]) != set(records[0]) and text_field in rows[0]:
                rows = [{**{k: None for k in records[0]}, **row} for row in rows]
            records.extend(rows)
    return records_to_documents(
        records, source=path, text_field=text_field, user_field=user_field, pseudo_users=pseudo_users
    )
