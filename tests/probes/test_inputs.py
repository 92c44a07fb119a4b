"""Members and non-members in every format a user has, canaries files, flags and their refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from memaudit.cli import main
from memaudit.probes.inputs import Columns, read_documents
from memaudit.probes.loaders import Canaries
from tests.probes.outside_models import strided_nll

DOCS = Path(__file__).parents[2] / "docs"
FAST = ["--device", "cpu", "--bootstrap", "50"]


def _err_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memaudit: error: "), err
    return err[0]


def _rows(n=5):
    return [{"body": f"text number {i}", "author": f"u{i % 2}",
             "spans": [{"type": "name", "value": f"n{i}", "start": 0}]} for i in range(n)]


def _write_all(tmp_path: Path, rows) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset, DatasetDict

    out = {"jsonl": tmp_path / "d.jsonl", "parquet": tmp_path / "d.parquet",
           "csv": tmp_path / "d.csv", "dataset": tmp_path / "ds", "dict": tmp_path / "dd"}
    out["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), out["parquet"])
    import csv

    with out["csv"].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["body", "author", "spans"])
        w.writeheader()
        for r in rows:
            w.writerow({**r, "spans": json.dumps(r["spans"])})
    Dataset.from_list(rows).save_to_disk(str(out["dataset"]))
    DatasetDict({"members": Dataset.from_list(rows)}).save_to_disk(str(out["dict"]))
    return out


def test_every_format_gives_the_same_documents(tmp_path):
    rows = _rows()
    paths = _write_all(tmp_path, rows)
    cols = Columns(text="body", user="author", pii="spans", split="members")
    for fmt, p in paths.items():
        docs = read_documents(p, "member", cols)
        assert [d.text for d in docs] == [r["body"] for r in rows], fmt
        assert [d.user for d in docs] == [r["author"] for r in rows], fmt
        assert [d.pii for d in docs] == [r["spans"] for r in rows], fmt


def test_missing_column_and_split_are_named(tmp_path):
    from memaudit.errors import DataError

    paths = _write_all(tmp_path, _rows())
    for p in paths.values():
        with pytest.raises(DataError, match="no column 'text'.*--text-column"):
            read_documents(p, "member", Columns(split="members"))
    with pytest.raises(DataError, match="no split 'train'.*members"):
        read_documents(paths["dict"], "member", Columns(text="body"))


def _probe(tmp_path, outside, *extra):
    return main(["probe", str(outside.merged_dir), "--out", str(tmp_path / "p.json"),
                 "--members", str(outside.members), "--nonmembers", str(outside.nonmembers),
                 *FAST, *extra])


def test_parquet_and_dataset_members_score_as_jsonl(tmp_path, outside):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    pq.write_table(pa.Table.from_pylist([{"body": t} for t in outside.member_texts]),
                   tmp_path / "m.parquet")
    Dataset.from_list([{"body": t, "author": "x"} for t in outside.nonmember_texts]).save_to_disk(
        str(tmp_path / "n"))
    assert main(["probe", str(outside.merged_dir), "--out", str(tmp_path / "a.json"),
                 "--members", str(tmp_path / "m.parquet"), "--nonmembers", str(tmp_path / "n"),
                 "--text-column", "body", "--probes", "membership", *FAST]) == 0
    assert _probe(tmp_path, outside, "--probes", "membership") == 0
    a = json.loads((tmp_path / "a.json").read_text())["probes"]["membership"]["summary"]
    b = json.loads((tmp_path / "p.json").read_text())["probes"]["membership"]["summary"]
    assert a["loss"]["auc"]["value"] == b["loss"]["auc"]["value"]


def test_dataset_without_the_named_column_is_one_line(tmp_path, outside, capsys):
    assert _probe(tmp_path, outside, "--text-column", "body") == 2
    assert "no column 'body'" in _err_line(capsys)


def test_overlap_says_how_many(tmp_path, outside, capsys):
    non = tmp_path / "non.txt"
    non.write_text("\n".join(outside.member_texts[:3] + outside.nonmember_texts) + "\n")
    rc = main(["probe", str(outside.merged_dir), "--out", str(tmp_path / "p.json"),
               "--members", str(outside.members), "--nonmembers", str(non), *FAST])
    assert rc == 2 and "share 3 document(s)" in _err_line(capsys)


def test_fpr_needs_enough_nonmembers(tmp_path, outside, capsys):
    assert _probe(tmp_path, outside, "--probes", "membership", "--fpr", "0.001") == 2
    line = _err_line(capsys)
    assert "needs at least 10000 non-member documents" in line and "got 40" in line
    assert _probe(tmp_path, outside, "--probes", "membership", "--fpr", "0.25") == 0
    s = json.loads((tmp_path / "p.json").read_text())["probes"]["membership"]["summary"]
    assert list(s["loss"]["tpr_at_fpr"]) == ["0.25"]


def test_canary_example_validates_and_is_probed(tmp_path, outside):
    import jsonschema

    schema = json.loads((DOCS / "canaries.schema.json").read_text())
    example = json.loads((DOCS / "canaries.example.json").read_text())
    jsonschema.validate(example, schema)
    c = Canaries.from_json(example)
    assert c.secret_length == 4 and c.inserted[0].text == "my account number is 4829"
    assert _probe(tmp_path, outside, "--probes", "exposure", "--canaries",
                  str(DOCS / "canaries.example.json"), "--exposure-enumerate-max", "200", "--exposure-candidates", "200") == 0
    doc = json.loads((tmp_path / "p.json").read_text())
    assert "skipped" not in doc["probes"]["exposure"]["summary"]
    assert doc["settings"]["exposure_samples"] == 200


def test_canary_file_without_canaries_is_never_ignored(tmp_path, outside, capsys):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"template": "my pin is {secret}", "alphabet": "0123456789",
                             "secret_length": 4}))
    assert _probe(tmp_path, outside, "--canaries", str(f)) == 2
    assert "lists no canaries" in _err_line(capsys)
    with pytest.raises(Exception, match="lengths"):
        Canaries.from_json({"template": "{secret}", "inserted": [
            {"id": "a", "secret": "12"}, {"id": "b", "secret": "123"}]})


def test_long_documents_fit_the_context_and_are_counted(tmp_path, outside):
    mem = tmp_path / "m.jsonl"
    long = " ".join(outside.member_texts[:8])  # 3-4 times the 64-token context
    mem.write_text("".join(json.dumps({"text": t}) + "\n" for t in [long, *outside.member_texts]))
    rc = main(["probe", str(outside.merged_dir), "--out", str(tmp_path / "p.json"),
               "--members", str(mem), "--nonmembers", str(outside.nonmembers), "--probes",
               "membership,extraction", "--prefix-lengths", "8,20", *FAST])
    assert rc == 0
    doc = json.loads((tmp_path / "p.json").read_text())
    c = doc["counts"]
    assert c["context"] == 64 and c["documents_windowed"] == 1 and c["documents"] == 81
    assert c["window_stride"] == 32 and doc["settings"]["max_tokens"] == 64
    assert c["extraction_ks_dropped"] == [20]  # 1 + 20 + 50 > 64
    rows = doc["probes"]["membership"]["scores"]
    assert np.isfinite([r["loss"] for r in rows]).all()
    # every token of the long document scored, as Hugging Face's strided perplexity scores it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(outside.merged_dir)
    ids = [tok.eos_token_id, *tok(long)["input_ids"]]
    assert len(ids) > 3 * 64
    want = strided_nll(AutoModelForCausalLM.from_pretrained(outside.merged_dir), ids, 64, 32)
    assert -rows[0]["loss"] == pytest.approx(want, rel=1e-5)


def test_a_reference_with_a_shorter_context_sets_the_windows_of_both(tmp_path, outside):
    """--reference with a context of 32 tokens beside a target of 64: both models score every
    document in the reference's windows (the ratio attack compares their losses), counted on the
    first screen; it used to run the reference past its learned positions."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(outside.merged_dir)
    torch.manual_seed(1)
    ref = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=32, n_embd=32, n_layer=1, n_head=2,
                                     bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)).eval()
    ref.save_pretrained(tmp_path / "ref")
    tok.save_pretrained(tmp_path / "ref")
    mem = tmp_path / "m.jsonl"
    texts = [" ".join(outside.member_texts[:3]), *outside.member_texts[3:20]]
    mem.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    rc = main(["probe", str(outside.merged_dir), "--out", str(tmp_path / "p.json"), "--members", str(mem),
               "--nonmembers", str(outside.nonmembers), "--probes", "membership",
               "--reference", str(tmp_path / "ref"), *FAST])
    assert rc == 0
    doc = json.loads((tmp_path / "p.json").read_text())
    c = doc["counts"]
    assert c["context"] == 32 and c["reference_context"] == {str(tmp_path / "ref"): 32}
    assert c["window_stride"] == 16 and doc["settings"]["max_tokens"] == 32
    target = AutoModelForCausalLM.from_pretrained(outside.merged_dir).eval()
    lengths = [len(tok(t)["input_ids"]) + 1 for t in texts]
    assert c["documents_windowed"] >= sum(n > 32 for n in lengths) >= 1
    row = doc["probes"]["membership"]["scores"][0]
    ids = [tok.eos_token_id, *tok(texts[0])["input_ids"]]
    want = strided_nll(ref, ids, 32, 16) - strided_nll(target, ids, 32, 16)
    assert row["reference"] == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert -row["loss"] == pytest.approx(strided_nll(target, ids, 32, 16), rel=1e-5)
    from memaudit.reports.targets import input_text

    assert "windows of 32 tokens, the reference's context" in input_text({"counts": c})
    assert c["target_context"] == 64 and c["extraction_ks_dropped"] == [32, 50]  # 1 + k + 50 > 64


def test_window_stride_of_a_whole_context_is_one_line(tmp_path, outside, capsys):
    assert _probe(tmp_path, outside, "--probes", "membership", "--window-stride", "64") == 2
    assert "--window-stride 64 must be smaller than the window of 64 tokens" in _err_line(capsys)
    assert not (tmp_path / "p.json").exists()


def test_columns_file_names_the_columns_and_a_flag_wins(tmp_path, outside):
    from datasets import Dataset, DatasetDict

    rows = [{"body": t, "author": f"u{i % 4}"} for i, t in enumerate(outside.member_texts)]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    DatasetDict({"held": Dataset.from_list([{"body": t, "author": "x"} for t in outside.nonmember_texts])}
                ).save_to_disk(str(tmp_path / "n"))
    (tmp_path / "cols.yaml").write_text("text: nope\nuser: author\nsplit: held\n")
    common = ["probe", str(outside.merged_dir), "--members", str(tmp_path / "m.jsonl"),
              "--nonmembers", str(tmp_path / "n"), "--probes", "membership", *FAST]
    assert main([*common, "--out", str(tmp_path / "a.json"), "--columns",
                 str(tmp_path / "cols.yaml"), "--text-column", "body"]) == 0  # the flag wins
    assert main([*common, "--out", str(tmp_path / "b.json"), "--text-column", "body",
                 "--user-column", "author", "--split", "held"]) == 0
    a, b = (json.loads((tmp_path / f).read_text())["probes"]["membership"]
            for f in ("a.json", "b.json"))
    assert len(a["scores"]) == 80 and a["summary"] == b["summary"]
    # the file alone: its text column is read (and here absent, so named in the refusal)
    from memaudit.probes.inputs import resolve_columns

    assert resolve_columns(tmp_path / "cols.yaml") == Columns(text="nope", user="author",
                                                               split="held")


@pytest.mark.parametrize("content, says", [
    (None, "not found"),
    ("- text\n- body\n", "not a mapping"),
    ("", "not a mapping"),
    ("text: body\ncolumn: x\n", "unknown key 'column'"),
    ("text: [a, b]\n", "'text' must name a column"),
    ("text: {unclosed\n", "is not YAML"),
])
def test_bad_columns_file_is_one_line(tmp_path, outside, capsys, content, says):
    spec = tmp_path / "cols.yaml"
    if content is not None:
        spec.write_text(content)
    assert _probe(tmp_path, outside, "--columns", str(spec)) == 2
    assert says in _err_line(capsys) and not (tmp_path / "p.json").exists()
