"""Canaries: schedule, owners, references, audit inclusion bits, and where secrets go."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from memaudit.cli import main
from memaudit.config import CanaryConfig, DataConfig
from memaudit.data import prepare_data
from memaudit.data.canaries import make_canaries
from memaudit.errors import DataError
from memaudit.rundir import RunDir

VOCAB = 4096
TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")


def _train_texts(prepared):
    tok = prepared.tokenizer()
    t = prepared.train
    return [tok.decode(row[m == 1]) for row, m in zip(t.input_ids, t.attention_mask, strict=True)]


def test_schedule_counts_per_owner_kind(prepared):
    cfg = CanaryConfig()
    c = prepared.canaries
    assert len(c.inserted) == len(cfg.repetitions) * len(cfg.owners) * cfg.per_setting
    assert Counter((x.repetitions, x.owner_kind) for x in c.inserted) == {
        (r, o): 1 for r in cfg.repetitions for o in cfg.owners}
    copies = Counter(d.canary_id for d in prepared.documents if d.kind == "canary")
    train_users = set(prepared.split.train_users)
    member = set(prepared.split.member_docs)
    for x in c.inserted:
        docs = [d for d in prepared.documents if d.canary_id == x.id]
        assert copies[x.id] == x.repetitions == len(x.users)
        assert [d.user for d in docs] == list(x.users)
        assert all(d.role == "member" and d.text == x.text and d.repeats == x.repetitions for d in docs)
        assert all(d.id in member for d in docs)
        assert set(x.users) <= train_users
        if x.owner_kind == "user":
            assert len(set(x.users)) == 1
        else:
            assert len(set(x.users)) == x.repetitions
        assert x.text == c.template.format(secret=x.secret) and x.prefix + x.secret in x.text
    owners = [x.users[0] for x in c.inserted if x.owner_kind == "user"]
    assert len(set(owners)) == len(owners)  # user-owned canaries go to different users


def test_secrets_distinct_digits_and_references(prepared):
    c = prepared.canaries
    assert len(c.references) == len(c.inserted)
    secrets = c.all_secrets()
    assert len(set(secrets)) == len(secrets)
    for x in (*c.inserted, *c.references):
        assert len(x.secret) == c.secret_length and x.secret.isdigit()
    assert all(len(a.secret) == 12 and a.secret.isdigit() for a in c.audit)


def test_references_never_trained_and_inserted_are(prepared):
    texts = "\n".join(_train_texts(prepared))
    corpus_text = "\n".join(d.text for d in prepared.documents)
    for r in prepared.canaries.references:
        assert r.secret not in corpus_text and r.secret not in texts
    for x in prepared.canaries.inserted:
        assert texts.count(x.text) == x.repetitions


def test_audit_inclusion_bits_match_training(prepared):
    audit = prepared.canaries.audit
    assert len(audit) == 40 and 8 <= sum(a.included for a in audit) <= 32
    texts = "\n".join(_train_texts(prepared))
    docs = {d.id: d for d in prepared.documents}
    for j, a in enumerate(audit):
        assert a.user == f"audit-{j:04d}"
        assert (a.user in prepared.train.users) == a.included
        assert (a.secret in texts) == a.included
        assert docs[a.id].role == ("member" if a.included else "audit_out")
        assert docs[a.id].kind == "audit_canary" and docs[a.id].user == a.user
        assert (a.id in prepared.split.member_docs) == a.included
        for packed in (prepared.holdout, prepared.heldout):
            assert a.user not in packed.users


def test_references_count_and_per_setting():
    cfg = CanaryConfig(repetitions=[1, 3], owners=["spread"], per_setting=2, references=7)
    c = make_canaries(cfg, [f"u{i}" for i in range(5)], 3, seed=1)
    assert [x.repetitions for x in c.inserted] == [1, 1, 3, 3]
    assert len(c.references) == 7 and len(c.audit) == 3
    assert c == make_canaries(cfg, [f"u{i}" for i in range(5)], 3, seed=1)


def test_spread_needs_enough_users(tmp_path, capsys):
    with pytest.raises(DataError, match="needs 32 training users but there are 4"):
        make_canaries(CanaryConfig(repetitions=[32], owners=["spread"]), list("abcd"), 0, seed=0)
    make_canaries(CanaryConfig(repetitions=[32], owners=["user"]), list("abcd"), 0, seed=0)
    rc = main(["data", "prepare", TINY, "--out", str(tmp_path / "o"),
               "--set", "data.synth.users=10"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "spread" in err[0] and "training users" in err[0]


def test_secrets_only_in_canaries_json_and_documents(prepared_run):
    run, prepared, _ = prepared_run
    secrets = prepared.canaries.all_secrets()
    allowed = {run.canaries_path, run.data_dir / "documents.jsonl"}
    checked = 0
    for f in run.path.rglob("*"):
        if f.is_file() and f not in allowed:
            data = f.read_bytes()
            checked += 1
            assert not any(s.encode() in data for s in secrets), f.name
    assert checked >= 6
    for name in allowed:
        assert prepared.canaries.inserted[0].secret.encode() in name.read_bytes()


def test_document_audit_canaries_are_new_users_messages_one_sequence_each(tmp_path):
    from memaudit.data.canaries import AUDIT_DOCUMENT_CHARS, CanarySet
    from memaudit.probes.loaders import Canaries

    cfg = DataConfig(audit_canaries=40, canaries=CanaryConfig(audit_kind="document"))
    run = RunDir(tmp_path / "run")
    prepared = prepare_data(cfg, run, vocab_size=VOCAB)
    audit = prepared.canaries.audit
    assert prepared.canaries.audit_kind == "document" and len(audit) == 40
    assert 8 <= sum(a.included for a in audit) <= 32
    assert len({a.text for a in audit}) == 40
    assert all(a.secret == a.text and len(a.text) <= AUDIT_DOCUMENT_CHARS for a in audit)
    # new users' messages: no training user's document holds one, and each included canary is
    # exactly one whole training sequence (its user's only one)
    corpus = "\n".join(d.text for d in prepared.documents if d.kind == "doc")
    assert not any(a.text in corpus for a in audit)
    rows = Counter(_train_texts(prepared))
    tok = prepared.tokenizer()
    for a in audit:
        n_rows = sum(n for row, n in rows.items() if a.text in row)
        assert n_rows == (1 if a.included else 0)
        assert len(tok(a.text)["input_ids"]) + 1 <= cfg.seq_len
    # the kind survives canaries.json for the probes, and the same seed draws the same canaries
    assert Canaries.from_json(prepared.canaries.to_json()).audit_kind == "document"
    assert CanarySet.from_json(prepared.canaries.to_json()) == prepared.canaries
    again = make_canaries(cfg.canaries, list(prepared.split.train_users), 40, seed=cfg.seed)
    assert again == prepared.canaries
    other = make_canaries(cfg.canaries, list(prepared.split.train_users), 40, seed=cfg.seed + 1)
    assert not {a.text for a in other.audit} & {a.text for a in audit}


def test_an_unknown_audit_kind_in_canaries_json_is_one_line():
    from memaudit.probes.loaders import Canaries

    obj = make_canaries(CanaryConfig(repetitions=[1], owners=["user"]), ["a", "b"], 2, seed=0).to_json()
    assert Canaries.from_json(obj).audit_kind == "secret"
    del obj["audit_kind"]  # a canaries.json from before the kinds: secrets
    assert Canaries.from_json(obj).audit_kind == "secret"
    with pytest.raises(DataError, match="'audit_kind' is 'image'; use one of secret, document"):
        Canaries.from_json({**obj, "audit_kind": "image"})
