"""prepare_data / load_prepared: the contract files, fingerprint, reuse, tamper check, index."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from memaudit.cli import main
from memaudit.config import DataConfig
from memaudit.data import document_index, load_prepared, prepare_data, token_ids
from memaudit.errors import DataError
from memaudit.rundir import RunDir

SMALL = DataConfig.model_validate({
    "synth": {"users": 12, "docs_per_user": 3}, "audit_canaries": 4, "seq_len": 32,
    "canaries": {"repetitions": [1, 2], "owners": ["user", "spread"]},
})

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")


def test_contract_files(prepared_run):
    run, prepared, calls = prepared_run
    assert sorted(p.name for p in run.data_dir.iterdir()) == [
        "documents.jsonl", "heldout.safetensors", "holdout.safetensors", "meta.json", "tokenizer",
        "train.safetensors"]
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in (run.data_dir / "tokenizer").iterdir()}
    line = json.loads((run.data_dir / "documents.jsonl").read_text(encoding="utf-8").splitlines()[0])
    assert set(line) == {"id", "user", "text", "pii", "kind", "canary_id", "repeats", "role"}
    split = json.loads(run.split_path.read_text())
    assert set(split) == {"seed", "heldout_users", "train_users", "member_docs", "holdout_docs",
                          "heldout_user_docs"}
    can = json.loads(run.canaries_path.read_text())
    assert set(can) == {"template", "secret_length", "alphabet", "audit_kind", "inserted", "references", "audit"}
    assert set(can["inserted"][0]) == {"id", "secret", "text", "repetitions", "owner_kind", "users"}
    assert set(can["audit"][0]) == {"id", "secret", "text", "user", "included"}
    meta = json.loads((run.data_dir / "meta.json").read_text())
    assert {"seq_len", "vocab_size", "eos_id", "pad_id", "users", "fingerprint"} <= set(meta)
    assert meta["fingerprint"] == prepared.fingerprint and meta["digits_split"] is True
    for name in ("train", "holdout", "heldout"):
        arrays = load_file(str(run.data_dir / f"{name}.safetensors"))
        assert arrays["input_ids"].dtype == np.int32 and arrays["attention_mask"].dtype == np.int8
        assert arrays["user_index"].dtype == np.int32
        assert meta["users"][name] == list(getattr(prepared, name).users)
    assert calls[-1][0] == calls[-1][1] and [c[0] for c in calls] == sorted(c[0] for c in calls)
    # kinds and roles: natural docs, canary copies, audit canaries
    kinds = {(d.kind, d.role) for d in prepared.documents}
    assert kinds == {("doc", "member"), ("doc", "holdout"), ("doc", "heldout_user"),
                     ("canary", "member"), ("audit_canary", "member"), ("audit_canary", "audit_out")}
    assert all(p.check(d.text) for d in prepared.documents for p in d.pii)
    sig = [d for d in prepared.documents if d.repeats > 1 and d.kind == "doc"]
    for d in prepared.documents:  # repeats = copies of the text with the same role (a loop oracle)
        assert d.repeats == sum(x.text == d.text and x.role == d.role for x in prepared.documents)
    assert any(d.role == "member" for d in sig)


def test_load_prepared_roundtrip(prepared, reloaded):
    assert reloaded.fingerprint == prepared.fingerprint
    assert reloaded.documents == prepared.documents
    assert reloaded.split == prepared.split and reloaded.canaries == prepared.canaries
    for name in ("train", "holdout", "heldout"):
        a, b = getattr(prepared, name), getattr(reloaded, name)
        assert a.users == b.users
        for k, v in a.arrays().items():
            assert np.array_equal(v, b.arrays()[k]) and v.dtype == b.arrays()[k].dtype
    assert reloaded.tokenizer().get_vocab() == prepared.tokenizer().get_vocab()


def test_fingerprint_stable_reuse_and_tamper(tmp_path):
    a = prepare_data(SMALL, RunDir(tmp_path / "a"), vocab_size=512)
    b = prepare_data(SMALL, RunDir(tmp_path / "b"), vocab_size=512)
    assert a.fingerprint == b.fingerprint and len(a.fingerprint) == 64
    c = prepare_data(SMALL.model_copy(update={"seed": 1}), RunDir(tmp_path / "c"), vocab_size=512)
    assert c.fingerprint != a.fingerprint
    # same config again: loaded, not rebuilt
    mtime = (tmp_path / "a" / "data" / "train.safetensors").stat().st_mtime_ns
    again = prepare_data(SMALL, RunDir(tmp_path / "a"), vocab_size=512)
    assert again.fingerprint == a.fingerprint
    assert (tmp_path / "a" / "data" / "train.safetensors").stat().st_mtime_ns == mtime
    # a changed file no longer matches the fingerprint
    path = tmp_path / "b" / "canaries.json"
    path.write_text(path.read_text().replace('"included": true', '"included": false', 1))
    with pytest.raises(DataError, match="fingerprint"):
        load_prepared(RunDir(tmp_path / "b"))
    with pytest.raises(DataError, match="no prepared data"):
        load_prepared(RunDir(tmp_path / "nothing"))
    # the tokenizer can be copied next to a saved model
    a.copy_tokenizer(tmp_path / "model")
    assert (tmp_path / "model" / "tokenizer.json").read_bytes() == (a.tokenizer_dir / "tokenizer.json").read_bytes()


def test_document_index(prepared):
    idx = document_index(prepared)
    s = prepared.split
    assert {d.id for d in idx.holdout} == set(s.holdout_docs)
    assert {d.id for d in idx.heldout} == set(s.heldout_user_docs)
    assert {d.id for d in idx.member} | {d.id for d in idx.canary_copies} | {
        d.id for d in idx.audit if d.role == "member"} == set(s.member_docs)
    assert all(d.kind == "doc" for d in (*idx.member, *idx.holdout, *idx.heldout))
    assert len(idx.audit) == len(prepared.canaries.audit)
    tok = prepared.tokenizer()
    ids = idx.token_ids(idx.holdout[:3], eos=True)
    assert ids == [[*tok.encode(d.text, add_special_tokens=False), prepared.eos_id] for d in idx.holdout[:3]]
    assert token_ids(prepared, ["12"]) == [tok.encode("12", add_special_tokens=False)]
    assert set(idx.by_user(idx.member)) == set(s.train_users)


def test_cli_prepare_prints_no_secret(tmp_path, capsys):
    out = tmp_path / "prep"
    rc = main(["data", "prepare", TINY, "--out", str(out), "--set", "data.synth.users=12",
               "--set", "data.canaries.repetitions=[1,2]", "--set", "data.audit_canaries=4",
               "--set", "model.preset=tiny"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    prepared = load_prepared(RunDir(out))
    printed = cap.out + cap.err
    assert prepared.fingerprint[:12] in printed
    n = prepared.meta["sequences_per_document"]
    assert (f"spanning 1/2/3+ sequences: {n['spanning']['1']}/{n['spanning']['2']}/{n['spanning']['3+']}"
            in " ".join(printed.split()))
    assert not any(s in printed for s in prepared.canaries.all_secrets())
    assert not any(d.text in printed for d in prepared.documents)
    assert prepared.vocab_size == 4096


def test_config_fields_reach_the_data(tmp_path):
    from memaudit.config import load_config
    from memaudit.models.tokenizer import train_tokenizer

    public = tmp_path / "public.txt"
    public.write_text("the quick brown fox jumps over the lazy dog\n" * 20 + "pack my box 42\n", encoding="utf-8")
    cfg = load_config(TINY, [
        "data.synth.users=12", "data.synth.docs_per_user=3", "data.synth.repeat_every=0",
        "data.canaries.repetitions=[1,2]", "data.audit_canaries=3", "data.canaries.audit_secret_length=16",
        "data.seq_len=64", f"data.tokenizer_corpus={public}",
    ]).data
    p = prepare_data(cfg, RunDir(tmp_path / "run"), vocab_size=300)
    assert not [d for d in p.documents if d.kind == "doc" and d.repeats > 1]
    assert all(len(a.secret) == 16 for a in p.canaries.audit)
    again = train_tokenizer(public.read_text(encoding="utf-8").splitlines(), vocab_size=300)
    assert p.tokenizer().get_vocab() == again.get_vocab()
    # a user-supplied tokenizer directory is used as is
    q = prepare_data(cfg.model_copy(update={"tokenizer": str(p.tokenizer_dir), "tokenizer_corpus": None}),
                     RunDir(tmp_path / "run2"), vocab_size=300)
    assert q.tokenizer().get_vocab() == again.get_vocab()
    assert np.array_equal(q.train.input_ids, p.train.input_ids)
    with pytest.raises(DataError, match="model's vocabulary is 280"):
        prepare_data(cfg.model_copy(update={"tokenizer": str(p.tokenizer_dir)}),
                     RunDir(tmp_path / "run3"), vocab_size=280)


def test_reprs_hold_no_text_or_secret(prepared):
    shown = repr(prepared) + repr(prepared.canaries) + repr(prepared.documents[:50])
    assert not any(s in shown for s in prepared.canaries.all_secrets())
    assert not any(d.text in shown for d in prepared.documents[:50])
    assert "c0" in repr(prepared.canaries.inserted[0]) and "u0000-d00" in repr(prepared.documents[0])


def test_synth_cli_corpus_as_data_path_gives_the_same_data(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    assert main(["data", "synth", "--users", "12", "--docs-per-user", "3", "--out", str(corpus)]) == 0
    built_in = prepare_data(SMALL, RunDir(tmp_path / "a"), vocab_size=512)
    from_file = prepare_data(SMALL.model_copy(update={"path": str(corpus)}), RunDir(tmp_path / "b"), vocab_size=512)
    assert from_file.documents == built_in.documents
    # the built-in corpus's tokenizer learns from a separate public synthetic corpus
    assert from_file.fingerprint != built_in.fingerprint
    # an edited corpus file is prepared again, not loaded back
    lines = corpus.read_text(encoding="utf-8").splitlines(keepends=True)
    corpus.write_text("".join(lines[:-3]), encoding="utf-8")
    again = prepare_data(SMALL.model_copy(update={"path": str(corpus)}), RunDir(tmp_path / "b"), vocab_size=512)
    assert len(again.documents) == len(from_file.documents) - 3
    assert load_prepared(RunDir(tmp_path / "b")).fingerprint == again.fingerprint != from_file.fingerprint


def test_default_tokenizer_does_not_learn_from_heldout_users(tmp_path):
    """Changing which users are held out leaves the synthetic default's vocabulary unchanged."""
    a = prepare_data(SMALL, RunDir(tmp_path / "a"), vocab_size=512)
    b = prepare_data(SMALL.model_copy(update={"seed": SMALL.seed + 1}), RunDir(tmp_path / "b"), vocab_size=512)
    assert a.split.heldout_users != b.split.heldout_users
    assert a.tokenizer().get_vocab() == b.tokenizer().get_vocab()


def _spans_from_rows(packed, eos_id: int) -> list[int]:
    """Brute force over the packed arrays alone: each user's real tokens in row order, cut after
    every EOS; the rows a piece's positions lie in are the sequences that document spans."""
    spans = []
    for ui in range(len(packed.users)):
        rows = np.flatnonzero(packed.user_index == ui)
        stream = [(int(t), int(r)) for r in rows
                  for t in packed.input_ids[r][packed.attention_mask[r] == 1]]
        touched: set[int] = set()
        for t, r in stream:
            touched.add(r)
            if t == eos_id:
                spans.append(len(touched))
                touched = set()
        assert not touched  # every document ends with its EOS
    return spans


def test_meta_counts_the_sequences_each_trained_document_spans(tmp_path):
    cfg = SMALL.model_copy(update={"seq_len": 24})  # short rows: documents span several
    p = prepare_data(cfg, RunDir(tmp_path / "a"), vocab_size=512)
    brute = _spans_from_rows(p.train, p.eos_id)
    got = p.meta["sequences_per_document"]
    assert got["documents"] == len(brute) == sum(d.role == "member" for d in p.documents)
    assert got["max_sequences_per_document"] == max(brute) == p.max_sequences_per_document
    assert got["spanning"] == {"1": brute.count(1), "2": brute.count(2), "3+": sum(b >= 3 for b in brute)}
    assert got["spanning"]["2"] + got["spanning"]["3+"] > 0
    assert load_prepared(RunDir(tmp_path / "a")).max_sequences_per_document == max(brute)
    # data prepared before the count (no key in meta.json, which the fingerprint does not cover): unknown
    meta = tmp_path / "a" / "data" / "meta.json"
    obj = json.loads(meta.read_text())
    del obj["sequences_per_document"]
    meta.write_text(json.dumps(obj))
    assert load_prepared(RunDir(tmp_path / "a")).max_sequences_per_document is None
