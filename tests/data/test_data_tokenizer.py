"""Tokenizer: public-text only, digits one token each, no secret in the vocabulary, round trip."""

from __future__ import annotations

import re

import pytest

from memaudit.errors import DataError
from memaudit.models.tokenizer import EOS, load_tokenizer, train_tokenizer

TEXTS = [
    "Hi, this is Dana Smith. You can reach me at (555) 010-2030 or dana@example.com.",
    "Please ship the order to 12 Main St, Springfield, IL 62704. Thanks, Dana",
    "  leading spaces, tabs\tand\nnewlines; ünïcödé, emoji 🙂, CJK 中文 and 1234567890.",
    "my account pin is 000123",
    "",
]


def _vocab_strings(tok):
    return [tok.convert_tokens_to_string([t]) for t in tok.get_vocab()]


def test_no_secret_and_no_multi_digit_token_in_vocab(prepared):
    tok = prepared.tokenizer()
    strings = _vocab_strings(tok)
    assert not [s for s in strings if re.search(r"\d\d", s)]
    for secret in prepared.canaries.all_secrets():
        assert not any(secret in s for s in strings)
    assert len(tok) <= prepared.vocab_size
    assert tok.eos_token == EOS and tok.eos_token_id == prepared.eos_id == prepared.pad_id


def test_digits_one_token_each_and_round_trip(prepared):
    tok = prepared.tokenizer()
    for digits in ("0", "42", "8675309", "".join(str(i % 10) for i in range(40))):
        ids = tok.encode(digits, add_special_tokens=False)
        assert len(ids) == len(digits)
        assert [tok.decode([i]) for i in ids] == list(digits)
    for c in prepared.canaries.inserted:  # the secret is the last len(secret) tokens
        ids = tok.encode(c.text, add_special_tokens=False)
        assert tok.decode(ids[-len(c.secret):]) == c.secret
        assert ids[: -len(c.secret)] == tok.encode(c.prefix, add_special_tokens=False)
    for text in [*TEXTS, *(d.text for d in prepared.documents[:200])]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.encode("hello", add_special_tokens=True) == tok.encode("hello", add_special_tokens=False)


def test_trained_only_on_public_text(prepared):
    """The synthetic default's tokenizer is an independent retrain on the public synthetic corpus
    (different people, same generator): no training or held-out user's text is in it."""
    from memaudit.data.prepare import PUBLIC_SEED_OFFSET
    from memaudit.data.synth import synthesize
    from tests.data.conftest import DEFAULT_CFG

    s = DEFAULT_CFG.synth
    public = synthesize(max(32, s.users), s.docs_per_user, s.seed + PUBLIC_SEED_OFFSET, repeat_every=0,
                        paragraph_sentences=s.paragraph_sentences)
    private = {d.text for d in prepared.documents}
    assert not private & {d.text for d in public}
    again = train_tokenizer([d.text for d in public], vocab_size=prepared.vocab_size)
    assert again.get_vocab() == prepared.tokenizer().get_vocab()


def test_real_corpus_tokenizer_uses_heldout_users_text(tmp_path):
    """With a corpus file and no tokenizer corpus, the held-out users' documents train it."""
    import json

    from memaudit.config import DataConfig
    from memaudit.data import prepare_data
    from memaudit.rundir import RunDir

    rows = [{"user": f"p{i % 10}", "text": f"note {i} from person {i % 10} about topic {i * 7 % 13}"} for i in range(80)]
    f = tmp_path / "c.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    cfg = DataConfig(path=str(f), canaries={"repetitions": [1, 2], "per_setting": 1}, seq_len=32)
    prep = prepare_data(cfg, RunDir(tmp_path / "run"), vocab_size=300)
    heldout = set(prep.split.heldout_users)
    texts = [d.text for d in prep.documents if d.user in heldout]
    assert all(d.kind == "doc" for d in prep.documents if d.user in heldout)
    assert train_tokenizer(texts, vocab_size=300).get_vocab() == prep.tokenizer().get_vocab()


def test_auto_tokenizer_loads_and_user_tokenizer_dir(prepared, tmp_path):
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(prepared.tokenizer_dir))
    assert auto.get_vocab() == prepared.tokenizer().get_vocab()
    assert auto.encode(TEXTS[0]) == prepared.tokenizer().encode(TEXTS[0])
    tok = load_tokenizer(prepared.tokenizer_dir, vocab_size=prepared.vocab_size)
    assert tok.get_vocab() == auto.get_vocab()
    with pytest.raises(DataError, match="model's vocabulary is 300"):
        load_tokenizer(prepared.tokenizer_dir, vocab_size=300)
    with pytest.raises(DataError, match="not found"):
        load_tokenizer(tmp_path / "nope")


def test_small_vocab_is_respected():
    tok = train_tokenizer(TEXTS * 5, vocab_size=270)
    assert len(tok) <= 270
    assert tok.decode(tok.encode(TEXTS[2], add_special_tokens=False)) == TEXTS[2]
    with pytest.raises(DataError, match="vocab size 100"):
        train_tokenizer(TEXTS, vocab_size=100)
