"""Public/private disjointness (memaudit.data.overlap) and the private content the public
corpus lacks (memaudit.data.synth). The oracle for the overlap counts is a brute-force loop
over every (public document, value) pair."""

from __future__ import annotations

import hashlib
import re

import pytest

from memaudit.data.documents import Document, Pii
from memaudit.data.overlap import check_disjoint, require_disjoint, text_hash
from memaudit.data.synth import synthesize, synthesize_public, topic_vocabulary
from memaudit.errors import DataError

PRIVATE = synthesize(12, 4, seed=0)
PUBLIC = synthesize_public(12, 4, seed=1)


def _brute(public, private, secrets, min_chars=4):
    import re

    hashes = {hashlib.sha256(" ".join(d.text.split()).encode()).hexdigest() for d in private}
    docs = sum(hashlib.sha256(" ".join(d.text.split()).encode()).hexdigest() in hashes for d in public)
    sec = {s for s in secrets for d in public if s in d.text}
    # a name counts only in full (two or more words): a first name alone is an ordinary word
    values = {p.value for d in private for p in d.pii
              if len(p.value) >= min_chars and not (p.type == "name" and " " not in p.value)}
    pii = {v for v in values for d in public if re.search(rf"(?<!\w){re.escape(v)}(?!\w)", d.text)}
    return docs, len(sec), len(pii)


def test_synthetic_public_corpus_is_disjoint_from_the_private_one():
    o = require_disjoint(PUBLIC, PRIVATE, secrets=["123456", "987654"])
    assert o.ok and (o.documents, o.secrets, o.pii_values) == (0, 0, 0)
    assert o.public_documents == len(PUBLIC) and o.private_documents == len(PRIVATE)


def test_constructed_overlap_is_counted_like_brute_force_and_refused():
    victim = PRIVATE[5]
    name = next(p.value for d in PRIVATE for p in d.pii if p.type == "email")
    leaky = [
        *PUBLIC[:6],
        Document(id="x1", user="p", text="  " + victim.text.replace(" ", "\n", 3) + " "),  # a re-wrapped copy
        Document(id="x2", user="p", text=f"a notice that mentions {name} by mistake"),
        Document(id="x3", user="p", text="order 00123456789 shipped"),  # a secret inside a number
        Document(id="x4", user="p", text=f"{name}x is not the same address"),  # not a whole word
    ]
    secrets = ["123456", "555555"]
    o = check_disjoint(leaky, PRIVATE, secrets=secrets)
    assert (o.documents, o.secrets, o.pii_values) == _brute(leaky, PRIVATE, secrets)
    assert o.documents == 1 and o.secrets == 1 and o.pii_values >= 1 and not o.ok
    with pytest.raises(DataError) as e:
        require_disjoint(leaky, PRIVATE, secrets=secrets)
    msg = str(e.value)
    assert "\n" not in msg and "1 shared document(s)" in msg and "1 canary secret(s)" in msg
    assert name not in msg and "123456" not in msg and victim.text[:20] not in msg


def _doc(i, text, *pii):
    return Document(id=f"d{i}", user=f"u{i}", text=text, pii=tuple(
        Pii(kind, value, max(text.find(value), 0)) for kind, value in pii))


def test_every_occurrence_is_found_nested_overlapping_and_not_starting_with_a_letter():
    """The index finds what a search for each value on its own finds: nested values (a full
    name inside a longer one), values that start with a bracket or a plus, values next to an
    underscore (a word character: not a whole word), accented names, text edges."""
    private = [_doc(0, "x", ("name", "Ann Lee"), ("name", "Ann Lee Smith"), ("phone", "(555) 123-4567"),
                    ("phone", "+1 555 0100"), ("email", "ann.lee@example.com"), ("name", "José Núñez"),
                    ("address", "12 Glen Road"), ("name", "Lee Smith"))]
    texts = ["Ann Lee Smith wrote", "call (555) 123-4567 now", "x(555) 123-4567", "a+1 555 0100",
             "mail ann.lee@example.com.", "_Ann Lee", "Ann Lee_", "señor José Núñez", "12 Glen Road",
             "Ann Lees", "(555) 123-45678", "Ann\nLee", "José Núñezá"]
    for i, t in enumerate(texts):
        public = [_doc(100 + i, t)]
        o = check_disjoint(public, private)
        assert o.pii_values == _brute(public, private, [])[2], t
    # all at once: the nested full names both count
    public = [_doc(200, " ".join(texts))]
    assert check_disjoint(public, private).pii_values == _brute(public, private, [])[2] >= 6


def test_a_first_name_alone_is_not_evidence_a_full_name_is():
    private = [_doc(0, "Bill Carter here, Bill for short", ("name", "Bill Carter"), ("name", "Bill"))]
    assert check_disjoint([_doc(1, "Bill the client for the hours")], private).ok
    o = check_disjoint([_doc(2, "a note from Bill Carter")], private)
    assert o.pii_values == 1 and not o.ok


def test_secrets_count_anywhere_also_overlapping():
    public = [_doc(1, "order 1212123 and 99123456")]
    secrets = ["12121", "21212", "2123", "123456", "777"]
    assert check_disjoint(public, PRIVATE, secrets=secrets).secrets == _brute(public, PRIVATE, secrets)[1] == 4


def test_text_hash_ignores_whitespace_only():
    assert text_hash("a  b\nc ") == text_hash("a b c")
    assert text_hash("a b c") != text_hash("a b d")


def test_private_users_have_topics_and_facts_the_public_corpus_lacks():
    """Each private message carries its topic's invented words and one of its user's facts;
    the public corpus holds no PII and none of those words."""
    vocab = {w for t in range(4) for w in [topic_vocabulary(0, t)[0], *topic_vocabulary(0, t)[1]]}
    public_words = {w.strip(".,") for d in PUBLIC for w in d.text.split()}
    assert not vocab & public_words and all(not d.pii for d in PUBLIC)
    for d in (d for d in PRIVATE if "-d" in d.id):
        u = int(d.user[1:])
        _, words = topic_vocabulary(0, u % 4)
        assert any(w in d.text for w in words)
    # every message states one of its user's facts; facts are the user's own
    from memaudit.data.synth import user_facts

    for d in (d for d in PRIVATE if "-d" in d.id):
        u = int(d.user[1:])
        mine = user_facts(0, u, 4, 3)
        assert sum(f in d.text for f in mine) >= 1
        others = {f for v in range(12) if v != u for f in user_facts(0, v, 4, 3)} - set(mine)
        assert not any(f in d.text for f in others)


def test_topics_zero_is_the_corpus_without_private_content():
    plain = synthesize(3, 2, seed=0, topics=0, facts_per_user=0)
    names = {topic_vocabulary(0, t)[0] for t in range(4)}
    assert not any(n in d.text for d in plain for n in names)


def test_public_kind_prepares_without_pii_and_trains_its_own_tokenizer(tmp_path):
    from memaudit.config import DataConfig
    from memaudit.data import prepare_data
    from memaudit.models.tokenizer import train_tokenizer
    from memaudit.rundir import RunDir

    cfg = DataConfig(synth={"kind": "public", "users": 8, "docs_per_user": 2, "seed": 1,
                            "paragraph_sentences": 2},
                     canaries={"per_setting": 0, "references": 0}, seq_len=32)
    prep = prepare_data(cfg, RunDir(tmp_path / "pub"), vocab_size=512)
    assert not prep.canaries.inserted and all(not d.pii for d in prep.documents)
    texts = [d.text for d in prep.documents]
    assert train_tokenizer(texts, vocab_size=512).get_vocab() == prep.tokenizer().get_vocab()


def test_pii_shorter_than_the_minimum_is_not_evidence():
    priv = [Document(id="a", user="u", text="hi Al", pii=(Pii("name", "Al", 3),))]
    pub = [Document(id="p", user="p", text="Al went home")]
    assert check_disjoint(pub, priv).ok


def test_public_corpus_in_the_users_language_shares_their_topics_not_their_facts_or_pii():
    """With language_seed (what sweep pretraining passes), the public corpus writes the private
    users' topic sentences in their vocabulary, their kinds of message and their contact formats,
    and every kind of contact detail they write, in their formats, but none of their facts, PII
    values or documents: its people, dates of birth, SSNs and phones come from ranges no user's do."""
    from memaudit.data.synth import user_facts

    private = synthesize(64, 8, seed=0)
    public = synthesize_public(64, 8, seed=1, language_seed=0)
    words = {w.strip(".,()|") for d in public for w in d.text.split()}
    for t in range(4):
        topic, vocab = topic_vocabulary(0, t)
        assert topic in words and len(set(vocab) & words) >= len(vocab) - 2
    facts = {f for u in range(64) for f in user_facts(0, u, 4, 3)}
    text = "\n".join(d.text for d in public)
    assert not any(f in text for f in facts)
    assert require_disjoint(public, private, secrets=[]).ok
    assert "Best regards,\n" in text and "555-01" in text and "@" in text
    assert all(not d.pii for d in public)
    # the private messages' own phrasing and every kind of their contact details recur in public
    # form: base and users share a language, down to how a person gives an SSN or a card number
    assert sum("You can reach me at" in d.text for d in public) >= 10
    for phrase in ("My card number is", "SSN 9", ", born 19", "Please ship the order to"):
        assert phrase in text, phrase
    private_dobs = {p.value for d in private for p in d.pii if p.type == "dob"}
    public_dobs = set(re.findall(r"born (\d{4}-\d\d-\d\d)", text))
    assert public_dobs and max(public_dobs) < min(private_dobs)
    assert all(ssn.startswith("9") for ssn in re.findall(r"SSN (\d{3}-\d\d-\d{4})", text))
    assert not any(p.value.startswith("9") for d in private for p in d.pii if p.type == "ssn")
    # no run of digits as long as a canary's secret (6), which the overlap check would refuse
    assert max(len(run) for run in re.findall(r"\d+", text)) < 6


def test_sweep_pretraining_writes_in_the_private_users_language_unless_told_not_to():
    from memaudit.sweep.config import sweep_config_from_dict
    from memaudit.sweep.pretrain import public_base_config

    raw = {"base": {"data": {"synth": {"seed": 3, "topics": 2}}}, "pretrain": {"steps": 1}}
    synth = public_base_config(sweep_config_from_dict(raw)).data.synth
    assert (synth.kind, synth.language_seed, synth.topics, synth.seed) == ("public", 3, 2, 1)
    off = public_base_config(sweep_config_from_dict({**raw, "pretrain": {"steps": 1, "shared_language": False}}))
    assert off.data.synth.language_seed is None
