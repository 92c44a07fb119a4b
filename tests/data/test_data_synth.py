"""Synthetic corpus: determinism, PII offsets, stable profiles, repeats, and `memaudit data synth`."""

from __future__ import annotations

import json
from collections import Counter

from memaudit.cli import main
from memaudit.data.synth import synthesize


def test_same_seed_same_corpus_other_seed_differs():
    a = synthesize(6, 4, seed=3)
    assert a == synthesize(6, 4, seed=3)
    b = synthesize(6, 4, seed=4)
    assert [d.text for d in a] != [d.text for d in b]


def test_the_corpus_does_not_depend_on_the_day_it_is_written(monkeypatch):
    """The same seed writes the same corpus on any day: a date of birth drawn relative to the
    machine's clock moved every result (and the golden report) at midnight."""
    import datetime as dt

    import faker.providers.date_time as faker_dates

    today = synthesize(6, 4, seed=3)

    class Later(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return dt.datetime(2031, 7, 15, 12, 0, tzinfo=tz)

    monkeypatch.setattr(faker_dates, "datetime", Later)
    assert synthesize(6, 4, seed=3) == today


def test_user_profile_independent_of_corpus_size():
    small = [d for d in synthesize(3, 4, seed=1) if d.user == "u0001"]
    large = [d for d in synthesize(9, 4, seed=1) if d.user == "u0001"]
    assert small == large


def test_pii_offsets_and_stable_profiles():
    docs = synthesize(16, 8, seed=0)
    assert len({d.id for d in docs}) == len(docs)
    n_spans = 0
    values: dict[tuple[str, str], set[str]] = {}
    for d in docs:
        for p in d.pii:
            assert d.text[p.start : p.start + len(p.value)] == p.value
            n_spans += 1
            if p.type != "name":  # "name" covers both full and first name
                values.setdefault((d.user, p.type), set()).add(p.value)
    assert n_spans > len(docs)
    assert all(len(v) == 1 for v in values.values()), "a user's email/phone/card/... must be stable"
    types = {p.type for d in docs for p in d.pii}
    assert {"name", "email", "phone", "address", "credit_card", "dob", "ssn"} <= types
    # different users have different emails
    emails = {next(iter(v)) for (u, t), v in values.items() if t == "email"}
    assert len(emails) == len({u for (u, t) in values if t == "email"})


def test_docs_per_user_and_repeats_match_a_counter():
    docs = synthesize(8, 5, seed=2, repeat_every=4, repeat_counts=[3, 5])
    per_user = Counter(d.user for d in docs if "-d" in d.id)
    assert set(per_user.values()) == {5} and len(per_user) == 8
    counts = Counter(d.text for d in docs)
    assert all(d.repeats == counts[d.text] for d in docs)
    sigs = Counter(d.user for d in docs if "-s" in d.id)
    assert sigs == {"u0003": 3, "u0007": 5}
    assert max(d.repeats for d in docs) == 5


def test_cli_synth_writes_the_corpus(tmp_path, capsys):
    out = tmp_path / "corpus.jsonl"
    rc = main(["data", "synth", "--users", "5", "--docs-per-user", "3", "--seed", "7", "--out", str(out)])
    assert rc == 0
    lines = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    expect = synthesize(5, 3, seed=7)
    assert [x["text"] for x in lines] == [d.text for d in expect]
    assert set(lines[0]) == {"id", "user", "text", "pii"}
    captured = capsys.readouterr()
    printed = captured.out + captured.err
    assert "15" in printed or str(len(expect)) in printed
    for d in expect:  # no document text or PII value is printed
        assert d.text not in printed
        assert all(p.value not in printed for p in d.pii)


def _one_line_error(capsys, argv):
    rc = main(argv)
    cap = capsys.readouterr()
    assert rc == 2
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memaudit: error: "), cap.err
    assert "Traceback" not in cap.err
    return lines[0]


def test_cli_synth_bad_input(tmp_path, capsys):
    out = tmp_path / "c.jsonl"
    assert "--users 1" in _one_line_error(capsys, ["data", "synth", "--users", "1", "--out", str(out)])
    assert "--docs-per-user 0" in _one_line_error(
        capsys, ["data", "synth", "--docs-per-user", "0", "--out", str(out)])
    assert not out.exists()
    assert "directory" in _one_line_error(capsys, ["data", "synth", "--out", str(tmp_path)])
    out.write_text("keep me\n")
    assert "--overwrite" in _one_line_error(capsys, ["data", "synth", "--users", "2", "--out", str(out)])
    assert out.read_text() == "keep me\n"
    assert main(["data", "synth", "--users", "2", "--docs-per-user", "1", "--out", str(out),
                 "--overwrite"]) == 0
    assert len(out.read_text().splitlines()) == 2


def test_default_documents_are_long_enough_for_extraction(tmp_path):
    """Defect 6: at k in {32, 50} with a 50-token suffix, >= 90% of member documents are scored
    (not skipped as too short) on the default synthetic corpus and its default tokenizer."""
    from memaudit.config import load_config
    from memaudit.data.prepare import prepare_data
    from memaudit.models.presets import PRESETS
    from memaudit.probes.extraction import extraction_prompts
    from memaudit.probes.targets import Codec, _run_docs, load_tokenizer
    from memaudit.rundir import RunDir

    cfg = load_config(None)
    rd = RunDir(tmp_path / "run")
    (tmp_path / "run").mkdir()
    prepare_data(cfg.data, rd, vocab_size=PRESETS[cfg.model.preset].vocab_size)
    members, _, _ = _run_docs(rd)
    meta = json.loads((rd.data_dir / "meta.json").read_text())
    codec = Codec(load_tokenizer(rd.data_dir / "tokenizer"), start_id=meta["eos_id"])
    encoded = [codec.encode(d.text) for d in members]
    for k in (32, 50):
        keep, _, _ = extraction_prompts(codec, encoded, k, 50)
        assert len(keep) >= 0.9 * len(members), (k, len(keep), len(members))
    # repeated documents (the signatures) are long enough too
    rep = [i for i, d in enumerate(members) if d.repeats > 1]
    keep, _, _ = extraction_prompts(codec, encoded, 50, 50)
    assert rep and set(rep) <= set(keep)
