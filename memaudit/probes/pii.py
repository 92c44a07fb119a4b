"""PII leakage (Lukas et al. 2023): extraction and inference of personal data.

Extraction: prompt with the text that preceded a PII item and decode greedily; count exact
reproductions. Inference: fill the item's slot with the true value and with decoys of the same type
in the corpus's own format that no training document holds (held-out users' values of that type,
then the synthetic corpus's own generator, then the value's pattern with fresh characters), score
each filled text, and check whether the true value ranks first; chance is 1 / (decoys + 1). Training users' PII (member documents) is compared with
held-out users' PII, which the model never saw. Corpora without PII annotations get spans from
pattern detectors (emails, phone numbers, card numbers that pass the Luhn check).

References:
  Lukas, Salem, Sim, Tople, Wutschitz, Zanella-Béguelin. Analyzing Leakage of Personally
  Identifiable Information in Language Models. IEEE S&P 2023.

>>> luhn_ok("4539 1488 0343 6467"), luhn_ok("4539 1488 0343 6468")
(True, False)
>>> [(p["type"], p["start"]) for p in detect_pii("mail a.b@x.org or call +1 (555) 010-9999")]
[('email', 5), ('phone', 23)]
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from memaudit.data.synth import pii_value
from memaudit.probes.stats import clustered_rate_summary

EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}")
CARD = re.compile(r"\b(?:\d[ -]?){12,18}\d\b")
PHONE = re.compile(r"(?:\+\d{1,3}[ .-]?)?(?:\(\d{2,4}\)|\d{2,4})[ .-]?\d{3}[ .-]?\d{3,4}\b")
def luhn_ok(number: str) -> bool:
    digits = [int(c) for c in number if c.isdigit()]
    if len(digits) < 13:
        return False
    total = 0
    for i, d in enumerate(reversed(digits)):
        if i % 2 == 1:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def detect_pii(text: str) -> list[dict]:
    """Emails, Luhn-valid card numbers and phone numbers, as [{type, value, start}], by position."""
    found, taken = [], []

    def free(a: int, b: int) -> bool:
        return all(b <= x or a >= y for x, y in taken)

    for kind, pattern in (("email", EMAIL), ("card", CARD), ("phone", PHONE)):
        for mt in pattern.finditer(text):
            a, b = mt.span()
            if kind == "card" and not luhn_ok(mt.group()):
                continue
            if free(a, b):
                taken.append((a, b))
                found.append({"type": kind, "value": mt.group(), "start": a})
    return sorted(found, key=lambda p: p["start"])


def pii_items(docs, *, detect_if_missing: bool = True) -> list[tuple[object, dict]]:
    """(doc, item) pairs from annotations, or from the detectors for unannotated documents."""
    out = []
    for d in docs:
        items = d.pii if d.pii is not None else (detect_pii(d.text) if detect_if_missing else [])
        out += [
            (d, it)
            for it in items
            if d.text[it["start"] : it["start"] + len(it["value"])] == it["value"]
        ]
    return out


def mimic(value: str, rng: np.random.Generator) -> str:
    """The same pattern with fresh characters: digit -> digit, letter -> letter of its case."""
    out = []
    for ch in value:
        if ch.isdigit():
            out.append(str(rng.integers(0, 10)))
        elif ch.isascii() and ch.isalpha():
            c = chr(ord("a") + int(rng.integers(0, 26)))
            out.append(c.upper() if ch.isupper() else c)
        else:
            out.append(ch)
    return "".join(out)


def candidates(
    kind: str,
    true: str,
    pool: list[str],
    n: int,
    rng: np.random.Generator,
    fake=None,
    exclude: frozenset[str] | set[str] = frozenset(),
) -> list[str]:
    """n distinct decoys != true and not in `exclude`, in the corpus's own format.

    First values of `pool` (values of the same type in the corpus, so of its format by
    construction), then values from the synthetic corpus's own generator (`synth.pii_value`),
    then the true value's pattern with fresh characters (`mimic`) for types of real corpora.
    The probe passes as `exclude` every PII value of the training documents and as `pool` only
    held-out users' values: a decoy the model memorised from another training user would beat
    the true value and pull the training users' rate down exactly when the model memorises.
    """
    others = [v for v in dict.fromkeys(pool) if v != true and v not in exclude]
    rng.shuffle(others)
    out = others[:n]
    tries = 0
    while len(out) < n and tries < 20 * n:
        tries += 1
        v = pii_value(kind, fake) if fake is not None else None
        v = mimic(true, rng) if v is None else v
        if v != true and v not in out and v not in exclude:
            out.append(v)
    return out


@dataclass(frozen=True)
class PiiScores:
    """What the model said about each item of one group: the pure statistics' input."""

    items: list[tuple[object, dict]]
    extracted: list[bool]
    ranks: list[int]
    n_candidates: list[int]


def score_group(model, codec, items, pools, *, n_candidates, context_tokens, suffix_chars,
                batch_size, rng, fake, exclude=frozenset(), progress=None) -> PiiScores:
    """Model-facing: greedy extraction of each item from its preceding text, and the rank of the
    true value among its decoys by the NLL of the value and the text right after it.

    `progress(done, total, info)` counts the items twice (extracted, then ranked): total
    2 * len(items).
    """
    # lazy: torch (~2 s) only when called; this module imports without it
    from memaudit.probes.scoring import decode, grouped_prefix_nll

    prompts, n_new = [], []
    for d, it in items:
        prompts.append(codec.encode(d.text[: it["start"]].rstrip())[-context_tokens:]
                       or codec.start_or_zero())
        n_new.append(len(codec.plain(" " + it["value"])) + 1)
    n = len(items)

    def extracting(done, _total, info):
        progress(done, 2 * n, info)

    gen = (decode(model, prompts, max(n_new, default=1), batch_size=batch_size,
                  pad_id=codec.pad_id, progress=extracting if progress else None)
           if prompts else [])
    extracted = [codec.decode(g).strip().startswith(it["value"].strip())
                 for g, (_d, it) in zip(gen, items, strict=True)]
    seqs, starts, owner = [], [], []
    for j, (d, it) in enumerate(items):
        end = it["start"] + len(it["value"])
        prefix, suffix = d.text[: it["start"]], d.text[end : end + suffix_chars]
        cands = [it["value"]] + candidates(it["type"], it["value"], pools.get(it["type"], []),
                                           n_candidates, rng, fake, exclude)
        split = [codec.encode_split(prefix, c + suffix) for c in cands]
        enc = [ids for ids, _n in split]
        # score every candidate from the last token boundary they all share before the value (a
        # byte-level BPE may merge the space before one value and not another), over the same
        # context window
        start = max(1, min(shared_prefix_len(enc), *(n for _ids, n in split)))
        cut = max(0, start - context_tokens)
        for ids in enc:
            seqs.append(ids[cut:])
            starts.append(start - cut)
            owner.append(j)

    # each item's candidates share their context: it goes through the model once, beside other
    # items' contexts in one batch
    owner = np.array(owner, dtype=int)
    groups = [np.flatnonzero(owner == j) for j in range(len(items))]

    def ranking(done, total, _info):
        progress(n + (n * done) // max(total, 1), 2 * n, {})

    nll = np.zeros(len(seqs))
    for rows, got in zip(groups, grouped_prefix_nll(
            model, [[seqs[i] for i in rows] for rows in groups],
            [starts[rows[0]] for rows in groups], batch_size=batch_size,
            progress=ranking if progress else None), strict=True):
        nll[rows] = got
    ranks = [int(1 + (nll[owner == j][1:] < nll[owner == j][0]).sum()) for j in range(len(items))]
    counts = [int((owner == j).sum()) for j in range(len(items))]
    return PiiScores(items, extracted, ranks, counts)


def shared_prefix_len(seqs: list[list[int]]) -> int:
    """How many leading token ids every sequence shares.

    >>> shared_prefix_len([[1, 2, 3], [1, 2, 4, 5], [1, 2]])
    2
    """
    n = min(len(s) for s in seqs)
    first = seqs[0]
    for s in seqs[1:]:
        k = 0
        while k < n and s[k] == first[k]:
            k += 1
        n = k
    return n


def pii_result(groups: dict[str, PiiScores], *, n_boot: int = 1000, seed: int = 0) -> dict:
    """Pure statistics: extraction and top-1 inference rates per group, with chance = 1/k. A
    user's items go together (what the model learned of her, it learned of all her details): the
    rates' intervals are clustered by user (`clustered_rate_summary`; a document without a user is
    its own cluster). `n_boot` and `seed` are kept for callers; the interval needs neither."""
    summary, rows = {}, []
    for group, g in groups.items():
        for (d, it), e, r, k in zip(g.items, g.extracted, g.ranks, g.n_candidates, strict=True):
            rows.append({"doc": d.id, "user": d.user, "group": group, "type": it["type"],
                         "extracted": e, "rank": r, "candidates": k})
        types = sorted({it["type"] for _d, it in g.items})
        owner = [f"user:{d.user}" if d.user is not None else f"doc:{d.id}" for d, _it in g.items]

        def rate(x, keep=None, owner=owner):
            sel = [i for i in range(len(owner)) if keep is None or keep[i]]
            return clustered_rate_summary(np.array([x[i] for i in sel], float), [owner[i] for i in sel],
                                          unit="PII items").to_json()

        summary[group] = {
            "items": len(g.items),
            "extraction": rate(g.extracted),
            "inference_top1": rate([r == 1 for r in g.ranks]),
            "chance_top1": float(np.mean([1 / k for k in g.n_candidates])) if g.items else None,
            "by_type": {
                t: {"items": sum(1 for _d, it in g.items if it["type"] == t),
                    "extraction": rate(g.extracted, [it["type"] == t for _d, it in g.items]),
                    "inference_top1": rate([r == 1 for r in g.ranks], [it["type"] == t for _d, it in g.items])}
                for t in types
            },
        }
    return {"summary": summary, "scores": rows}


def run_pii(
    model,
    codec,
    member_docs,
    heldout_docs,
    *,
    n_candidates: int = 9,
    context_tokens: int = 64,
    suffix_chars: int = 32,
    max_items: int = 200,
    batch_size: int = 32,
    seed: int = 0,
    n_boot: int = 1000,
    progress=None,
) -> dict:
    """Extraction and inference rates for training users' vs held-out users' PII.

    `progress(done, total, info)`: each group's items, extracted then ranked, one count.
    """
    # lazy: faker (~0.2 s) only when called; this module imports without it
    from faker import Faker

    fake = Faker("en_US")
    fake.seed_instance(seed)
    rng = np.random.default_rng(seed)
    groups = {"training_users": pii_items(member_docs), "heldout_users": pii_items(heldout_docs)}
    # decoys no training user holds: chance is 1 / (n_candidates + 1) for a model that learned
    # nothing, whatever it memorised of other training users
    held = frozenset(it["value"] for _d, it in groups["training_users"])
    pools: dict[str, list[str]] = {}
    for _d, it in groups["heldout_users"]:
        if it["value"] not in held:
            pools.setdefault(it["type"], []).append(it["value"])
    scored = {}
    total = 2 * sum(min(len(items), max_items) for items in groups.values())
    offset = 0
    for group, items in groups.items():
        if len(items) > max_items:
            items = [items[i] for i in np.sort(rng.choice(len(items), max_items, replace=False))]

        def step(done, _total, info, offset=offset):
            progress(offset + done, total, info)

        scored[group] = score_group(model, codec, items, pools, n_candidates=n_candidates,
                                    context_tokens=context_tokens, suffix_chars=suffix_chars,
                                    batch_size=batch_size, rng=rng, fake=fake, exclude=held,
                                    progress=step if progress else None)
        offset += 2 * len(items)
    out = pii_result(scored, n_boot=n_boot, seed=seed)
    for g in out["summary"].values():
        g["decoys"] = DECOYS
    return out


DECOYS = ("values no training document holds: held-out users' values of the type, then the "
          "corpus generator, then the value's pattern with fresh characters")
