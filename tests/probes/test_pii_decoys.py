"""PII inference ranks the true value among decoys that no training user holds (issue 32, item 2).

Decoys drawn from other training users' values were values the model had learned too: a model
that memorised every training user ranked a training user's value below another's, and the
training users' top-1 rate fell (0.19 against 0.475 with such decoys, measured on a memaudit run)
exactly when the model memorises.
"""

from __future__ import annotations

import numpy as np

from memaudit.probes import pii
from memaudit.probes.stats import clopper_pearson
from memaudit.probes.targets import Codec, resolve_target


def _run(trained, model, monkeypatch, seen=None, k=5):
    if seen is not None:
        real = pii.candidates

        def spy(kind, true, pool, n, rng, fake=None, exclude=frozenset()):
            out = real(kind, true, pool, n, rng, fake, exclude)
            seen.extend(out)
            return out

        monkeypatch.setattr(pii, "candidates", spy)
    t = resolve_target(trained.run)
    trained_users = {d.user for d in t.members}
    held = t.heldout_user_docs or [d for d in t.nonmembers if d.user not in trained_users]
    return pii.run_pii(model, Codec(trained.tokenizer, start_id=0), t.members, held,
                       n_candidates=k, n_boot=50, batch_size=256)["summary"]


def test_no_decoy_is_a_training_users_value(trained, monkeypatch):
    seen: list[str] = []
    _run(trained, trained.model, monkeypatch, seen)
    training_values = {p["value"] for d in trained.docs if d["role"] == "member" for p in d["pii"]}
    assert seen and not set(seen) & training_values


def test_candidates_skip_excluded_values():
    rng = np.random.default_rng(0)
    c = pii.candidates("word", "cat", ["cat", "dog", "cow", "pig"], 5, rng, None,
                       exclude={"dog", "pig"})
    assert "dog" not in c and "pig" not in c and c[0] == "cow" and len(set(c)) == 5


def test_untrained_model_ranks_at_chance(trained, monkeypatch):
    """A model that learned nothing: top-1 over both groups is consistent with 1 / (k + 1)."""
    s = _run(trained, trained.init_model, monkeypatch, k=5)
    hits = sum(round(g["inference_top1"]["value"] * g["items"]) for g in s.values())
    n = sum(g["items"] for g in s.values())
    lo, hi = clopper_pearson(hits, n)
    assert all(abs(g["chance_top1"] - 1 / 6) < 1e-12 for g in s.values())
    assert lo <= 1 / 6 <= hi, (hits, n)
    assert all(g["decoys"] == pii.DECOYS for g in s.values())


def test_memorising_model_ranks_training_values_first(trained, monkeypatch):
    """The fixture's model saw each PII-bearing training document 16 times."""
    s = _run(trained, trained.model, monkeypatch, k=5)
    tr = s["training_users"]
    lo, _ = clopper_pearson(round(tr["inference_top1"]["value"] * tr["items"]), tr["items"])
    assert lo > tr["chance_top1"]
