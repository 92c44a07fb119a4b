"""Documents longer than the model's context: every token scored once, in strided windows.

Oracle: Hugging Face's strided perplexity ("Perplexity of fixed-length models") computed here with
plain transformers, window by window with `labels` set to -100 on the tokens an earlier window
scored; and the plain full-sequence loss when a document fits the context.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memaudit.probes.inputs import Doc
from memaudit.probes.membership import doc_scores
from memaudit.probes.targets import Codec
from tests.probes.conftest import make_tokenizer
from tests.probes.outside_models import strided_nll

CTX = 16
WORDS = [a + b for a in "abcdefgh" for b in "ijklm"]  # one token each


@pytest.fixture(scope="module")
def short_context():
    """A GPT-2 with learned positions for CTX tokens (random weights) and its tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = make_tokenizer(WORDS)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=CTX, n_embd=32, n_layer=2, n_head=4,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval(), tok


def test_long_document_loss_covers_every_token(short_context):
    model, tok = short_context
    codec = Codec(tok, start_id=0)
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, n)) for n in (60, 48, 12)]  # ~3.5x, 3x and within CTX
    docs = [Doc(id=str(i), text=t) for i, t in enumerate(texts)]
    ids = [codec.encode(t) for t in texts]
    assert len(ids[0]) > 3 * CTX and len(ids[2]) <= CTX
    for stride in (None, 5, CTX - 1):
        got = -doc_scores(model, codec, docs, batch_size=4, max_tokens=CTX, stride=stride)["loss"]
        want = [strided_nll(model, x, CTX, stride or CTX // 2) for x in ids]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # a document that fits: the plain full-sequence loss
        full = float(model(input_ids=torch.tensor([ids[2]]), labels=torch.tensor([ids[2]])).loss)
    assert -doc_scores(model, codec, docs[2:], batch_size=4, max_tokens=CTX)["loss"][0] == (
        pytest.approx(full, rel=1e-5))


def test_probes_json_written_before_windows_still_reads():
    from memaudit.commands.probe import summary_rows
    from memaudit.reports.targets import input_text

    old = {"context": 64, "documents_truncated": 2, "documents": 81, "extraction_ks_dropped": []}
    new = {**old, "documents_windowed": 2, "window_stride": 32}
    del new["documents_truncated"]
    _probe, measure, value = summary_rows({"counts": old, "probes": {}})[0]
    assert measure.startswith("documents scored on their first 64 tokens") and value == "2 of 81"
    _probe, measure, value = summary_rows({"counts": new, "probes": {}})[0]
    assert measure.startswith("documents scored in windows of 64 tokens") and value == "2 of 81"
    assert measure.endswith("32 apart")
    assert input_text({"counts": old}) == "2 of 81 documents cut to 64 tokens"
    assert input_text({"counts": new}) == "2 of 81 documents scored in windows of 64 tokens"


def test_a_runs_documents_longer_than_the_window_are_counted_in_probes_json_and_the_report(trained):
    """A memaudit run's documents longer than probe.max_tokens are scored in windows and counted
    (probes.json `counts`, the probe table, the report's probe rows); a run whose documents all fit
    writes no counts."""
    from memaudit.commands.probe import summary_rows
    from memaudit.config import ProbeConfig
    from memaudit.probes.runner import run_probes
    from memaudit.probes.targets import resolve_target
    from memaudit.reports.probes_adapter import summarize_probes

    target = resolve_target(trained.run)
    codec = Codec(trained.tokenizer, start_id=target.eos_id)
    lengths = [len(codec.encode(d.text)) for d in target.members + target.nonmembers + target.heldout_user_docs]
    window = max(lengths) - 1  # the longest documents (here: all of the same length) are windowed
    longer = sum(n > window for n in lengths)
    assert longer > 0
    settings = ProbeConfig(device="cpu", probes=("membership",), n_boot=50, max_tokens=window)
    doc = run_probes(target, settings, model=trained.model, tokenizer=trained.tokenizer).document
    c = doc["counts"]
    assert (c["context"], c["documents"], c["documents_windowed"]) == (window, len(lengths), longer)
    assert c["window_stride"] == window // 2
    rows = [r for r in summarize_probes(doc)["rows"] if r["probe"] == "input"]
    assert len(rows) == 1 and rows[0]["value"] == longer
    assert rows[0]["metric"].startswith(f"documents scored in windows of {window} tokens (probe.max_tokens)")
    assert summary_rows(doc)[0] == ("input", rows[0]["metric"].split(" (of ")[0], f"{longer} of {len(lengths)}")
    fits = run_probes(resolve_target(trained.run), settings.model_copy(update={"max_tokens": max(lengths)}),
                      model=trained.model, tokenizer=trained.tokenizer).document
    assert not fits.get("counts") and not [r for r in summarize_probes(fits)["rows"] if r["probe"] == "input"]


def test_the_reference_scores_kept_for_the_next_point_are_the_reference_scores(short_context, tmp_path):
    """`doc_scores` with a reference cache: the first call scores the reference and keeps its
    per-document means (a 0600 file); a second target against the same reference on the same
    documents reads them, the reference model never called, and gets the scores a call without
    the cache gets; another window, another document list or other weights are other entries."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from memaudit.probes.score_cache import ScoreCache

    model, tok = short_context
    torch.manual_seed(1)
    ref = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=CTX, n_embd=32, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0)).eval()
    codec = Codec(tok, start_id=0)
    rng = np.random.default_rng(1)
    docs = [Doc(id=str(i), text=" ".join(rng.choice(WORDS, n))) for i, n in enumerate((30, 9, 14, 5))]
    cache = ScoreCache(tmp_path / "cache")
    ident = {"weights": "ref-sha", "engine": "torch", "dtype": "float32@cpu"}
    plain = doc_scores(model, codec, docs, batch_size=2, max_tokens=CTX, reference=(ref, codec))
    first = doc_scores(model, codec, docs, batch_size=2, max_tokens=CTX, reference=(ref, codec),
                       reference_cache=cache.model(ident))
    entries = list((tmp_path / "cache").iterdir())
    assert len(entries) == 1 and entries[0].stat().st_mode & 0o777 == 0o600

    class Unused(torch.nn.Module):  # the reference, had it been run again
        def forward(self, *a, **k):
            raise AssertionError("the reference was scored again")

    again = doc_scores(model, codec, docs, batch_size=2, max_tokens=CTX, reference=(Unused(), codec),
                       reference_cache=cache.model(ident))
    for got in (first, again):
        assert got.keys() == plain.keys()
        for name in plain:
            np.testing.assert_array_equal(got[name], plain[name])
    # another window, other documents, other weights: computed (and kept) anew
    doc_scores(model, codec, docs, batch_size=2, max_tokens=CTX // 2, reference=(ref, codec),
               reference_cache=cache.model(ident))
    doc_scores(model, codec, docs[:3], batch_size=2, max_tokens=CTX, reference=(ref, codec),
               reference_cache=cache.model(ident))
    other = doc_scores(model, codec, docs, batch_size=2, max_tokens=CTX, reference=(model, codec),
                       reference_cache=cache.model({**ident, "weights": "other-sha"}))
    assert np.all(other["reference"] == 0.0)  # the target as its own reference
    assert len(list((tmp_path / "cache").iterdir())) == 4
    # the reference's own run (its weights the target, with the stats) keeps what the reference
    # pass computes, bit for bit: a fine-tune against it then reads them
    fresh = ScoreCache(tmp_path / "fresh")
    doc_scores(ref, codec, docs, batch_size=2, max_tokens=CTX, target_cache=fresh.model(ident))
    read = doc_scores(model, codec, docs, batch_size=2, max_tokens=CTX, reference=(Unused(), codec),
                      reference_cache=fresh.model(ident))
    np.testing.assert_array_equal(read["reference"], plain["reference"])


def test_the_shift_check_of_a_split_is_computed_once(tmp_path, monkeypatch):
    """`shift_check` with a cache: a second run on the same split (texts and seed) reads the
    first's result; another split or seed is checked anew."""
    from memaudit.probes import runner

    members = [Doc(id=f"m{i}", text=f"alpha beta {i} gamma") for i in range(30)]
    nonmembers = [Doc(id=f"n{i}", text=f"delta {i} epsilon zeta") for i in range(30)]

    class T:  # the two sides a Target holds
        pass

    t = T()
    t.members, t.nonmembers = members, nonmembers
    first = runner.shift_check(t, 0, tmp_path)
    assert first == runner.shift_check(t, 0, None)  # the same as without a cache
    calls = []
    real = runner.blind_check
    monkeypatch.setattr(runner, "blind_check", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert runner.shift_check(t, 0, tmp_path) == first and calls == []
    runner.shift_check(t, 1, tmp_path)
    t.nonmembers = nonmembers[1:]
    runner.shift_check(t, 0, tmp_path)
    assert calls == [1, 1]
