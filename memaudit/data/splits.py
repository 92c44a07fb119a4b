"""Seeded user and document splits.

1. Held-out users: round(heldout_users * U) users (at least one, leaving at least one
   training user), chosen uniformly at random. None of their documents is trained on.
2. Among the training users, an IID member/holdout split of documents: each group of
   identical texts of one user (a repeated signature is one group, so no copy of a holdout
   text is ever trained) is held out independently with probability `holdout_fraction`.
   A user left with no member group gets one random group back, so every training user
   keeps at least one member document.

Membership inference needs random splits of the same distribution, not shifted ones
(Carlini et al., "Membership Inference Attacks From First Principles", S&P 2022).

>>> from memaudit.data.documents import Document
>>> docs = [Document(id=f"{u}{i}", user=u, text=f"{u} {i}") for u in "abcde" for i in range(4)]
>>> s = make_split(docs, heldout_users=0.2, holdout_fraction=0.25, seed=0)
>>> len(s.heldout_users), len(s.train_users), set(s.member_docs).isdisjoint(s.holdout_docs)
(1, 4, True)
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from memaudit.data.documents import Document
from memaudit.errors import DataError


@dataclass(frozen=True)
class Split:
    """The content of split.json. Ids are sorted; member_docs include inserted canaries."""

    seed: int
    heldout_users: tuple[str, ...]
    train_users: tuple[str, ...]
    member_docs: tuple[str, ...]
    holdout_docs: tuple[str, ...]
    heldout_user_docs: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Split:
        return cls(
            seed=int(obj["seed"]),
            **{k: tuple(obj[k]) for k in (
                "heldout_users", "train_users", "member_docs", "holdout_docs", "heldout_user_docs"
            )},
        )


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream])


def make_split(
    docs: list[Document], *, heldout_users: float, holdout_fraction: float, seed: int
) -> Split:
    users = sorted({d.user for d in docs})
    if len(users) < 2:
        raise DataError(
            f"the corpus has {len(users)} user(s); memaudit needs at least 2 (training and "
            "held-out); add users or set data.user_field"
        )
    n_out = min(len(users) - 1, max(1, round(heldout_users * len(users))))
    rng = _rng(seed, 1)
    out = sorted(users[i] for i in rng.choice(len(users), size=n_out, replace=False))
    out_set = set(out)
    train = [u for u in users if u not in out_set]

    groups: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for d in docs:
        if d.user not in out_set:
            groups[d.user][d.text].append(d.id)
    rng = _rng(seed, 2)
    member, holdout = [], []
    for u in train:
        gs = list(groups[u].values())  # insertion order = corpus order: deterministic
        held = rng.random(len(gs)) < holdout_fraction
        if held.all():
            held[rng.integers(len(gs))] = False
        for g, h in zip(gs, held, strict=True):
            (holdout if h else member).extend(g)
    return Split(
        seed=seed,
        heldout_users=tuple(out),
        train_users=tuple(train),
        member_docs=tuple(sorted(member)),
        holdout_docs=tuple(sorted(holdout)),
        heldout_user_docs=tuple(sorted(d.id for d in docs if d.user in out_set)),
    )


def assign_roles(docs: list[Document], split: Split) -> list[Document]:
    """Set each corpus document's role from the split."""
    holdout, out = set(split.holdout_docs), set(split.heldout_users)
    return [
        d.with_(role="heldout_user" if d.user in out else "holdout" if d.id in holdout else "member")
        for d in docs
    ]
