"""Splits: disjoint, complete, seeded, IID among training users."""

from __future__ import annotations

import math

import numpy as np

from memaudit.data.splits import assign_roles, make_split
from memaudit.data.synth import synthesize


def _split(seed=0, users=64, docs=8):
    corpus = synthesize(users, docs, seed=0)
    return corpus, make_split(corpus, heldout_users=0.2, holdout_fraction=0.2, seed=seed)


def test_split_is_disjoint_complete_and_keeps_members():
    corpus, s = _split()
    assert len(s.heldout_users) == round(0.2 * 64)
    assert set(s.heldout_users).isdisjoint(s.train_users)
    assert sorted([*s.heldout_users, *s.train_users]) == sorted({d.user for d in corpus})
    member, holdout, out = set(s.member_docs), set(s.holdout_docs), set(s.heldout_user_docs)
    assert member.isdisjoint(holdout) and member.isdisjoint(out) and holdout.isdisjoint(out)
    assert member | holdout | out == {d.id for d in corpus}
    user_of = {d.id: d.user for d in corpus}
    assert {user_of[i] for i in out} == set(s.heldout_users)
    assert {user_of[i] for i in member} == set(s.train_users)  # every training user keeps a member
    # identical texts of a user fall on the same side (no copy of a holdout text is trained)
    text_of = {d.id: d.text for d in corpus}
    assert not {(user_of[i], text_of[i]) for i in member} & {(user_of[i], text_of[i]) for i in holdout}
    roles = {d.id: d.role for d in assign_roles(corpus, s)}
    assert {roles[i] for i in member} == {"member"} and {roles[i] for i in holdout} == {"holdout"}
    assert {roles[i] for i in out} == {"heldout_user"}


def test_split_is_seeded():
    _, a = _split(seed=1)
    _, b = _split(seed=1)
    _, c = _split(seed=2)
    assert a == b
    assert a.heldout_users != c.heldout_users or a.holdout_docs != c.holdout_docs


def test_member_holdout_split_looks_iid():
    corpus, s = _split(users=200, docs=8)
    train_docs = [d for d in corpus if d.user in set(s.train_users) and "-d" in d.id]
    held = np.array([d.id in set(s.holdout_docs) for d in train_docs])
    n = len(held)
    # binomial: the holdout rate is 0.2 within 5 standard deviations
    assert abs(held.mean() - 0.2) < 5 * math.sqrt(0.2 * 0.8 / n)
    # same distribution: text lengths and message kinds of member and holdout docs match
    lengths = np.array([len(d.text) for d in train_docs])
    sd = lengths.std()
    assert abs(lengths[held].mean() - lengths[~held].mean()) < 5 * sd * math.sqrt(1 / held.sum() + 1 / (~held).sum())
    has_card = np.array([any(p.type == "credit_card" for p in d.pii) for d in train_docs])
    p = has_card.mean()
    assert abs(has_card[held].mean() - has_card[~held].mean()) < 5 * math.sqrt(p * (1 - p) * (1 / held.sum() + 1 / (~held).sum()))
    # not position-dependent: early and late documents are held out at similar rates
    pos = np.array([int(d.id.split("-d")[1]) for d in train_docs])
    assert abs(held[pos < 4].mean() - held[pos >= 4].mean()) < 5 * math.sqrt(0.16 * 4 / n)
