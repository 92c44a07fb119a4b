"""Corpus loading through `datasets`, pseudo-users, and one-line errors through the CLI."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from memaudit.cli import main
from memaudit.data.corpus import load_corpus
from memaudit.data.synth import synthesize
from memaudit.errors import DataError

ROWS = [
    {"body": "first message, 12 apples", "author": "ann"},
    {"body": "second one", "author": "bob"},
    {"body": "third, with ünïcode", "author": "ann"},
]

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")


def _pseudo(i: int, k: int) -> str:  # independent restatement of the documented rule
    return f"pseudo-{int(hashlib.sha256(str(i).encode()).hexdigest()[:16], 16) % k:03d}"


def _check(docs, texts, users):
    assert [d.text for d in docs] == texts
    assert [d.user for d in docs] == users
    assert len({d.id for d in docs}) == len(docs)


def test_jsonl_with_fields_and_pii_roundtrip(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    docs = load_corpus(str(f), text_field="body", user_field="author")
    _check(docs, [r["body"] for r in ROWS], ["ann", "bob", "ann"])
    # the synth corpus written as JSONL loads back with its ids and PII spans
    synth = synthesize(3, 2, seed=0)
    g = tmp_path / "synth.jsonl"
    g.write_text("".join(json.dumps(d.to_corpus_json()) + "\n" for d in synth), encoding="utf-8")
    assert load_corpus(str(g)) == synth


def test_csv_and_parquet(tmp_path):
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame(ROWS)
    frame.to_csv(tmp_path / "c.csv", index=False)
    frame.to_parquet(tmp_path / "c.parquet")
    for name in ("c.csv", "c.parquet"):
        docs = load_corpus(str(tmp_path / name), text_field="body", user_field="author")
        _check(docs, [r["body"] for r in ROWS], ["ann", "bob", "ann"])


def test_text_lines_files_directory_and_pseudo_users(tmp_path):
    lines = [f"line number {i}" for i in range(20)]
    f = tmp_path / "a.txt"
    f.write_text("\n".join(lines) + "\n\n", encoding="utf-8")  # the blank line is skipped
    docs = load_corpus(str(f))
    _check(docs, lines, [_pseudo(i, 3) for i in range(20)])  # K = ceil(20 / 8) = 3
    docs = load_corpus(str(f), pseudo_users=5)
    assert [d.user for d in docs] == [_pseudo(i, 5) for i in range(20)]
    assert len({d.user for d in docs}) > 1
    d = tmp_path / "dir"
    d.mkdir()
    (d / "x.txt").write_text("doc x\nsecond line of x", encoding="utf-8")
    (d / "y.txt").write_text("doc y", encoding="utf-8")
    (d / "z.txt").write_text("", encoding="utf-8")  # an empty document, skipped
    (d / "notes.md").write_text("ignored", encoding="utf-8")
    per_file = load_corpus(str(d), text_unit="file")
    assert [x.text for x in per_file] == ["doc x\nsecond line of x", "doc y"]
    per_line = load_corpus(str(d))
    assert [x.text for x in per_line] == ["doc x", "second line of x", "doc y"]


@pytest.mark.parametrize(
    ("make", "expect"),
    [
        (lambda p: None, "not found"),
        (lambda p: p.write_text("", encoding="utf-8"), "empty"),
        (lambda p: p.write_text('{"body": "x"}\n', encoding="utf-8"), "no text field 'text' (fields: body)"),
        (lambda p: p.write_bytes(b'{"text": "caf\xe9 secret words"}\n'), "not UTF-8"),
        (lambda p: p.write_text('{"text": ""}\n', encoding="utf-8"), "no non-empty"),
    ],
)
def test_bad_corpus_is_one_line_error_through_the_cli(tmp_path, capsys, make, expect):
    corpus = tmp_path / "corpus.jsonl"
    make(corpus)
    out = tmp_path / "out"
    rc = main(["data", "prepare", TINY, "--out", str(out), "--set", f"data.path={corpus}"])
    cap = capsys.readouterr()
    assert rc == 2
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memaudit: error: "), cap.err
    assert expect in lines[0] and str(corpus) in lines[0]
    assert "secret words" not in cap.err + cap.out
    assert not (out / "data").exists()


def test_library_errors_are_data_errors(tmp_path):
    with pytest.raises(DataError, match="unknown extension"):
        (tmp_path / "c.xml").write_text("<x/>")
        load_corpus(str(tmp_path / "c.xml"))
    with pytest.raises(DataError, match="holds no"):
        (tmp_path / "empty_dir").mkdir()
        load_corpus(str(tmp_path / "empty_dir"))
    (tmp_path / "blank_dir").mkdir()
    (tmp_path / "blank_dir" / "a.txt").write_text("\n\n", encoding="utf-8")
    with pytest.raises(DataError, match="is empty"):
        load_corpus(str(tmp_path / "blank_dir"))
    f = tmp_path / "one_user.jsonl"
    f.write_text('{"text": "a", "user": "x"}\n{"text": "b", "user": "x"}\n', encoding="utf-8")
    from memaudit.data.splits import make_split

    with pytest.raises(DataError, match="at least 2"):
        make_split(load_corpus(str(f)), heldout_users=0.2, holdout_fraction=0.2, seed=0)
