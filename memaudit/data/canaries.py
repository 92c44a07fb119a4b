"""Secret Sharer canaries and one-run audit canaries.

Inserted canaries: the template with a random digit secret, for every (repetition r,
owner kind) of the schedule `per_setting` of them. Owner "user": r copies in one training
user's data (owners cycle through a seeded permutation of the training users); owner
"spread": one copy in each of r distinct training users. References: never-inserted
canaries from the same secret space (as many as inserted unless `references` is set);
exposure ranks an inserted secret among them. All secrets are distinct.

Audit canaries (`data.audit_canaries = m`): m canaries, each the only document of its own
new user `audit-0000`, ..., included in training with probability 1/2; the inclusion bits
feed the one-run epsilon audit. `audit_kind` "secret": the template with a long random
secret. "document": a short synthetic message (`audit_documents`) in the private users' style,
with a new faker profile's PII and new facts; its whole text is the secret.

Secrets live only in canaries.json and documents.jsonl; refer to a canary by its id.

References:
    Carlini et al., "The Secret Sharer: Evaluating and Testing Unintended Memorization in
    Neural Networks", USENIX Security 2019.
    Steinke, Nasr, Jagielski, "Privacy Auditing with One (1) Training Run", NeurIPS 2023.

>>> from memaudit.config import CanaryConfig
>>> cs = make_canaries(CanaryConfig(repetitions=[1, 2], owners=["user"]), ["a", "b"], 0, seed=0)
>>> [(c.id, c.repetitions, c.users) for c in cs.inserted], len(cs.references)
([('c0', 1, ('b',)), ('c1', 2, ('a', 'a'))], 2)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memaudit.config import CanaryConfig
from memaudit.data.documents import Document
from memaudit.data.synth import synthesize
from memaudit.errors import DataError

ALPHABET = "0123456789"


@dataclass(frozen=True)
class Canary:
    """An inserted canary. `users` lists the owner of each copy (r entries)."""

    id: str
    secret: str = field(repr=False)  # never in a repr, log or message
    text: str = field(repr=False)
    repetitions: int
    owner_kind: str
    users: tuple[str, ...]

    @property
    def prefix(self) -> str:
        """The text before the secret (what an extraction attack prompts with)."""
        return self.text[: self.text.index(self.secret)]


@dataclass(frozen=True)
class ReferenceCanary:
    id: str
    secret: str = field(repr=False)  # never in a repr, log or message
    text: str = field(repr=False)


@dataclass(frozen=True)
class AuditCanary:
    id: str
    secret: str = field(repr=False)  # never in a repr, log or message
    text: str = field(repr=False)
    user: str
    included: bool


@dataclass(frozen=True)
class CanarySet:
    """The content of canaries.json."""

    template: str
    secret_length: int
    alphabet: str = ALPHABET
    inserted: tuple[Canary, ...] = ()
    references: tuple[ReferenceCanary, ...] = ()
    audit: tuple[AuditCanary, ...] = field(default=())
    audit_kind: str = "secret"

    def to_json(self) -> dict[str, Any]:
        return {
            "template": self.template,
            "secret_length": self.secret_length,
            "alphabet": self.alphabet,
            "audit_kind": self.audit_kind,
            "inserted": [
                {"id": c.id, "secret": c.secret, "text": c.text, "repetitions": c.repetitions,
                 "owner_kind": c.owner_kind, "users": list(c.users)}
                for c in self.inserted
            ],
            "references": [{"id": c.id, "secret": c.secret, "text": c.text} for c in self.references],
            "audit": [
                {"id": c.id, "secret": c.secret, "text": c.text, "user": c.user, "included": c.included}
                for c in self.audit
            ],
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> CanarySet:
        return cls(
            template=obj["template"],
            secret_length=int(obj["secret_length"]),
            alphabet=obj.get("alphabet", ALPHABET),
            inserted=tuple(
                Canary(c["id"], c["secret"], c["text"], int(c["repetitions"]), c["owner_kind"],
                       tuple(c["users"]))
                for c in obj["inserted"]
            ),
            references=tuple(ReferenceCanary(c["id"], c["secret"], c["text"]) for c in obj["references"]),
            audit=tuple(
                AuditCanary(c["id"], c["secret"], c["text"], c["user"], bool(c["included"]))
                for c in obj.get("audit", [])
            ),
            audit_kind=obj.get("audit_kind", "secret"),
        )

    def all_secrets(self) -> list[str]:
        return [c.secret for c in (*self.inserted, *self.references, *self.audit)]


def _secrets(rng: np.random.Generator, n: int, length: int, taken: set[str]) -> list[str]:
    space = len(ALPHABET) ** length
    if n + len(taken) > space // 2:
        raise DataError(
            f"{n} canary secrets of {length} digits are too many for the secret space; raise "
            "data.canaries.secret_length"
        )
    out: list[str] = []
    while len(out) < n:
        s = "".join(ALPHABET[i] for i in rng.integers(0, len(ALPHABET), size=length))
        if s not in taken:
            taken.add(s)
            out.append(s)
    return out


def make_canaries(
    cfg: CanaryConfig, train_users: list[str], audit_canaries: int, *, seed: int
) -> CanarySet:
    """Draw the canaries, their owners and (for audit canaries) their inclusion bits."""
    rng = np.random.default_rng([seed, 3])
    settings = [(r, o) for r in cfg.repetitions for o in cfg.owners for _ in range(cfg.per_setting)]
    too_many = [r for r, o in settings if o == "spread" and r > len(train_users)]
    if too_many:
        raise DataError(
            f"a 'spread' canary with {max(too_many)} repetitions needs {max(too_many)} training "
            f"users but there are {len(train_users)}; lower data.canaries.repetitions, drop "
            "'spread' from data.canaries.owners, or add users"
        )
    taken: set[str] = set()
    n_ref = len(settings) if cfg.references is None else cfg.references
    secrets = _secrets(rng, len(settings) + n_ref, cfg.secret_length, taken)
    order = [train_users[i] for i in rng.permutation(len(train_users))]
    inserted, k_user = [], 0
    for i, (r, kind) in enumerate(settings):
        if kind == "user":
            users = (order[k_user % len(order)],) * r
            k_user += 1
        else:
            users = tuple(train_users[j] for j in sorted(rng.choice(len(train_users), r, replace=False)))
        s = secrets[i]
        inserted.append(Canary(f"c{i}", s, cfg.template.format(secret=s), r, kind, users))
    refs = [
        ReferenceCanary(f"r{j}", s, cfg.template.format(secret=s))
        for j, s in enumerate(secrets[len(settings):])
    ]
    if cfg.audit_kind == "document":
        texts = audit_documents(audit_canaries, seed=seed)
        pairs = list(zip(texts, texts, strict=True))  # (secret, text): the whole message is secret
    else:
        pairs = [(s, cfg.template.format(secret=s))
                 for s in _secrets(rng, audit_canaries, cfg.audit_secret_length, taken)]
    bits = rng.random(audit_canaries) < 0.5
    audit = [
        AuditCanary(f"a{j}", secret, text, f"audit-{j:04d}", bool(b))
        for j, ((secret, text), b) in enumerate(zip(pairs, bits, strict=True))
    ]
    return CanarySet(cfg.template, cfg.secret_length, ALPHABET, tuple(inserted), tuple(refs), tuple(audit),
                     audit_kind=cfg.audit_kind)


AUDIT_DOCUMENT_CHARS = 240  # measured: at most 117 tokens of the tiny preset's BPE (digits are one token each)


def audit_documents(m: int, *, seed: int) -> list[str]:
    """m distinct synthetic messages for document audit canaries, one per new user.

    The private corpus's generator (`memaudit.data.synth.synthesize`: one message per user, its
    topic sentence and fact, no signature, no trailing paragraph) on its own seed drawn from
    (seed, 5), so no profile, fact or invented topic word is a training user's: an excluded
    canary's PII and facts are nowhere in the training data. Messages over
    `AUDIT_DOCUMENT_CHARS` characters are passed over, so that a canary is one training sequence
    at the usual lengths (`memaudit.data.prepare` refuses a run where one would span two).
    """
    own_seed = int(np.random.default_rng([seed, 5]).integers(1_000, 2**31 - 1))
    texts: list[str] = []
    pool = 2 * m
    while len(texts) < m:  # the pool grows until m short, distinct messages are in it
        docs = synthesize(users=pool, docs_per_user=1, seed=own_seed, repeat_every=0, paragraph_sentences=0)
        texts = list(dict.fromkeys(d.text for d in docs if len(d.text) <= AUDIT_DOCUMENT_CHARS))[:m]
        pool *= 2
    return texts


def canary_documents(canaries: CanarySet) -> list[Document]:
    """Documents for every inserted copy (role member) and every audit canary.

    Ids: `c3#0`, `c3#1`, ... for the copies of canary c3; `a0` for audit canary a0 (role
    member when included, else audit_out).
    """
    docs = []
    for c in canaries.inserted:
        for k, u in enumerate(c.users):
            docs.append(Document(id=f"{c.id}#{k}", user=u, text=c.text, kind="canary",
                                 canary_id=c.id, repeats=c.repetitions, role="member"))
    for a in canaries.audit:
        docs.append(Document(id=a.id, user=a.user, text=a.text, kind="audit_canary", canary_id=a.id,
                             repeats=1, role="member" if a.included else "audit_out"))
    return docs
