"""Packing: sequences never mix users, nothing is lost, copies of a canary are spread out."""

from __future__ import annotations

from collections import Counter

import numpy as np

from memaudit.data.packing import pack


def _docs_of_rows(packed, eos_id):
    """Per user, the multiset of documents (token tuples) read back from its rows."""
    out: dict[str, Counter] = {}
    for row, mask, ui in zip(packed.input_ids, packed.attention_mask, packed.user_index, strict=True):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()  # real tokens are a prefix
        assert out.setdefault(packed.users[ui], Counter()) is not None
        out[packed.users[ui]].update([tuple(row[:n].tolist())])
    return out


def test_pack_oracle_small():
    rng = np.random.default_rng(0)
    by_user = {u: [rng.integers(1, 50, size=rng.integers(1, 12)).tolist() for _ in range(rng.integers(1, 6))]
               for u in ("x", "y", "z")}
    p = pack(by_user, seq_len=8, eos_id=0, pad_id=99, seed=0)
    assert p.input_ids.dtype == np.int32 and p.attention_mask.dtype == np.int8
    assert p.user_index.dtype == np.int32 and p.users == ("x", "y", "z")
    assert (p.input_ids[p.attention_mask == 0] == 99).all()
    for ui, u in enumerate(p.users):
        stream = np.concatenate([r[m == 1] for r, m, i in zip(p.input_ids, p.attention_mask, p.user_index,
                                                               strict=True) if i == ui]).tolist()
        docs, cur = [], []
        for t in stream:  # split the user's stream on EOS
            if t == 0:
                docs.append(tuple(cur))
                cur = []
            else:
                cur.append(t)
        assert not cur
        assert Counter(docs) == Counter(tuple(d) for d in by_user[u])
    # a document that fits a row is never split across rows
    for r, m in zip(p.input_ids, p.attention_mask, strict=True):
        assert r[m == 1][-1] == 0 or m.all()
    assert pack(by_user, seq_len=8, eos_id=0, pad_id=99, seed=0).input_ids.tolist() == p.input_ids.tolist()


def test_prepared_sets_never_mix_users(prepared):
    tok = prepared.tokenizer()
    eos = prepared.eos_id
    for name, role in (("train", "member"), ("holdout", "holdout"), ("heldout", "heldout_user")):
        packed = getattr(prepared, name)
        assert packed.input_ids.shape == packed.attention_mask.shape
        assert packed.input_ids.shape[1] == prepared.seq_len == 128
        assert len(packed.user_index) == len(packed)
        expect: dict[str, Counter] = {}
        docs = [d for d in prepared.documents if d.role == role]
        for d, ids in zip(docs, tok([d.text for d in docs], add_special_tokens=False)["input_ids"], strict=True):
            expect.setdefault(d.user, Counter()).update([(*ids, eos)])
        # a user's rows are consecutive; joined in order and split after each EOS they give
        # back that user's documents (one longer than a row continues in the next row)
        streams: dict[str, list[int]] = {}
        for row, mask, ui in zip(packed.input_ids, packed.attention_mask, packed.user_index, strict=True):
            streams.setdefault(packed.users[ui], []).extend(row[mask == 1].tolist())
        got: dict[str, Counter] = {}
        for user, stream in streams.items():
            pieces, cur = [], []
            for t in stream:
                cur.append(t)
                if t == eos:
                    pieces.append(tuple(cur))
                    cur = []
            assert not cur
            got[user] = Counter(pieces)
        assert got == expect, name
        assert sorted(packed.users) == sorted(expect) == list(packed.users)
    assert set(prepared.heldout.users) == set(prepared.split.heldout_users)
    assert set(prepared.train.users) & set(prepared.heldout.users) == set()


def test_canary_copies_spread_over_sequences(prepared):
    tok = prepared.tokenizer()
    for c in prepared.canaries.inserted:
        if c.owner_kind != "user" or c.repetitions < 8:
            continue
        rows = prepared.train.rows_of(c.users[0])
        hits = [i for i in rows if tok.decode(prepared.train.input_ids[i]).count(c.text) > 0]
        assert len(hits) >= 2
        total = sum(tok.decode(prepared.train.input_ids[i]).count(c.text) for i in rows)
        assert total == c.repetitions


def test_doc_spans_match_a_brute_force_count_over_the_rows():
    """Each document's tokens are its own (ids no other document uses): the rows holding any of
    them, or the EOS right after its last token, are the sequences it spans, counted from the
    packed arrays alone."""
    rng = np.random.default_rng(3)
    next_id, by_user, owner = 1, {}, {}
    for u in ("a", "b", "c", "d"):
        docs = []
        for i in range(int(rng.integers(2, 7))):
            n = 16 if i == 0 else int(rng.integers(1, 30))  # up to ~4 rows of 8; 16: EOS spills over
            docs.append(list(range(next_id, next_id + n)))
            next_id += n
        by_user[u] = docs
    for u, docs in by_user.items():
        for j, d in enumerate(docs):
            owner.update({t: (u, j) for t in d})
    p = pack(by_user, seq_len=8, eos_id=0, pad_id=0, seed=5)
    touched: dict[tuple[str, int], set[int]] = {}
    last = {u: {d[-1]: (u, j) for j, d in enumerate(docs)} for u, docs in by_user.items()}
    for r, (row, mask) in enumerate(zip(p.input_ids, p.attention_mask, strict=True)):
        for c, t in enumerate(row[mask == 1].tolist()):
            if t in owner:
                touched.setdefault(owner[t], set()).add(r)
            if t in last[p.user_of(r)]:  # its EOS: next position, or the next row's first
                touched[owner[t]].add(r if c + 1 < p.seq_len else r + 1)
    brute = [len(touched[(u, j)]) for u in p.users for j in range(len(by_user[u]))]
    assert p.doc_spans.tolist() == brute
    assert max(brute) >= 3 and min(brute) == 1  # the case is not trivial
    from memaudit.data.packing import span_summary

    s = span_summary(p.doc_spans)
    assert s["max_sequences_per_document"] == max(brute) and s["documents"] == len(brute)
    assert s["spanning"] == {"1": brute.count(1), "2": brute.count(2), "3+": sum(b >= 3 for b in brute)}
