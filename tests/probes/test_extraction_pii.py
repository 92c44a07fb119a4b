"""Match metrics, the n-gram index and the PII detectors against direct computations."""

import numpy as np
import pytest

from memaudit.probes.extraction import NgramIndex, bleu4, levenshtein_similarity, repeat_bucket
from memaudit.probes.pii import candidates, detect_pii, luhn_ok


def test_levenshtein_and_bleu_by_hand():
    assert levenshtein_similarity([1, 2, 3], [1, 2, 3]) == 1.0
    assert levenshtein_similarity([1, 2, 3, 4, 5], [2, 3, 4, 5, 6]) == pytest.approx(
        1 - 2 / 5
    )  # drop + add
    assert levenshtein_similarity([], [1, 2]) == 0.0
    # candidate 1..8 vs reference 1..9: p_n = (8-n+1)/(8-n+1) = 1, brevity penalty exp(1 - 9/8)
    assert bleu4(list(range(1, 9)), list(range(1, 10))) == pytest.approx(np.exp(1 - 9 / 8))
    # one substitution in the middle of 10 tokens: p1=9/10, p2=7/9, p3=5/8, p4=3/7
    cand = [1, 2, 3, 4, 5, 0, 7, 8, 9, 10]
    expect = (9 / 10 * 7 / 9 * 5 / 8 * 3 / 7) ** 0.25
    assert bleu4(cand, list(range(1, 11))) == pytest.approx(expect)
    assert bleu4([1, 2, 3], [4, 5, 6]) == 0.0
    assert [repeat_bucket(r) for r in (1, 2, 3, 4, 16, 31, 32)] == [
        "1",
        "2-3",
        "2-3",
        "4-7",
        "16-31",
        "16-31",
        "32-63",
    ]


def test_ngram_index_equals_python_set():
    rng = np.random.default_rng(0)
    train = [rng.integers(0, 20, 60).tolist() for _ in range(5)]
    n = 6
    grams = {tuple(s[i : i + n]) for s in train for i in range(len(s) - n + 1)}
    idx = NgramIndex(train, n)
    queries, wants = [], []
    for _ in range(200):
        if rng.random() < 0.5:  # a window copied from training, inside random context
            s = train[rng.integers(5)]
            j = rng.integers(0, len(s) - n)
            q = rng.integers(0, 20, 4).tolist() + s[j : j + n] + rng.integers(0, 20, 3).tolist()
        else:
            q = rng.integers(0, 20, 12).tolist()
        want = any(tuple(q[i : i + n]) in grams for i in range(len(q) - n + 1))
        assert idx.contains_any(q) == want
        queries.append(q)
        wants.append(want)
    assert idx.contains(queries).tolist() == wants  # the batched form, in order
    assert not idx.contains_any([1, 2])
    assert idx.contains([[1, 2], [], train[0][:n]]).tolist() == [False, False, True]
    assert not NgramIndex([[1, 2]], n).contains([train[0]]).any()  # an empty index


def test_pii_detectors():
    text = (
        "write to jane.doe@example.com, card 4111 1111 1111 1111, "
        "not 4111 1111 1111 1112; call 555-010-1234"
    )
    found = detect_pii(text)
    assert [(f["type"], f["value"]) for f in found] == [
        ("email", "jane.doe@example.com"),
        ("card", "4111 1111 1111 1111"),
        ("phone", "555-010-1234"),
    ]
    for f in found:
        assert text[f["start"] : f["start"] + len(f["value"])] == f["value"]
    assert luhn_ok("79927398713") is False  # too short for a card
    assert luhn_ok("4111111111111111") and not luhn_ok("4111111111111112")


def test_candidates_same_type_and_distinct():
    from faker import Faker

    fake = Faker()
    fake.seed_instance(0)
    c = candidates("email", "a@b.org", [], 5, np.random.default_rng(0), fake)
    assert len(c) == 5 and len(set(c)) == 5 and "a@b.org" not in c and all("@" in x for x in c)
    c = candidates("word", "cat", ["cat", "dog", "cow"], 5, np.random.default_rng(0), fake)
    assert sorted(c[:2]) == ["cow", "dog"]  # corpus values first, then the pattern re-drawn
    assert len(set(c)) == 5 and all(len(x) == 3 and x.isalpha() and x.islower() for x in c)


def _shape(v: str) -> str:
    import re

    return re.sub(r"[a-z]+", "a", re.sub(r"[A-Z]", "A", re.sub(r"\d", "9", v)))


def test_decoys_have_the_synthetic_corpus_format():
    """Defect 4: faker's own email/phone formats told decoys apart from the corpus's values."""
    from faker import Faker

    from memaudit.data.synth import synthesize

    docs = synthesize(users=6, docs_per_user=3, seed=0, paragraph_sentences=0)
    spans = [(p.type, p.value) for d in docs for p in d.pii]
    fake = Faker("en_US")
    fake.seed_instance(0)
    for kind in ("phone", "email", "ssn", "dob", "credit_card"):
        vals = [v for k, v in spans if k == kind]
        if not vals:
            continue
        true = vals[0]
        # no other corpus values: every decoy comes from a generator
        for c in candidates(kind, true, [true], 12, np.random.default_rng(0), fake):
            if kind == "email":
                assert _shape(c) == "a.a@a.a", c
            elif kind != "credit_card":
                assert _shape(c) == _shape(true), (kind, c, true)
