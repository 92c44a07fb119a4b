"""User inference (Kandpal et al. 2023): was any of this user's data used in training?

A user's statistic is the mean of their documents' scores: the log-likelihood ratio between the
target and a reference model when one is given (the paper's test statistic), else the mean
log-likelihood (minus the mean loss). Training users are scored on their held-out documents —
documents the model never saw — and compared with users held out entirely, so the attack
measures leakage about the *user*, which user-level DP is meant to bound.

References:
  Kandpal, Pillutla, Oprea, Kairouz, Choquette-Choo, Xu. User Inference Attacks on Large
  Language Models. 2023.

>>> import numpy as np
>>> user_scores(["a", "b", "a"], np.array([1.0, 5.0, 3.0]))
{'a': 2.0, 'b': 5.0}
"""

from __future__ import annotations

import numpy as np

from memaudit.probes.stats import attack_summary


def user_scores(users, doc_scores: np.ndarray) -> dict[str, float]:
    """Mean document score per user, users in first-seen order."""
    acc: dict[str, list[float]] = {}
    for u, s in zip(users, doc_scores, strict=True):
        acc.setdefault(str(u), []).append(float(s))
    return {u: float(np.mean(v)) for u, v in acc.items()}


def run_user_inference(
    train_docs,
    heldout_docs,
    train_scores: np.ndarray,
    heldout_scores: np.ndarray,
    *,
    statistic: str,
    n_boot: int,
    seed: int,
    fprs=(0.01, 0.001),
) -> dict:
    """Training users (their documents `train_docs`) vs held-out users' documents."""
    if any(d.user is None for d in list(train_docs) + list(heldout_docs)):
        raise ValueError(
            "user inference needs a 'user' on every document; add user ids or drop "
            "user_inference from --probes"
        )
    pos = user_scores([d.user for d in train_docs], train_scores)
    neg = user_scores([d.user for d in heldout_docs], heldout_scores)
    summary = attack_summary(
        np.array(list(pos.values())),
        np.array(list(neg.values())),
        fprs=fprs,
        n_boot=n_boot,
        seed=seed,
    )
    summary["statistic"] = statistic
    rows = [{"user": u, "training_user": True, "score": s} for u, s in pos.items()]
    rows += [{"user": u, "training_user": False, "score": s} for u, s in neg.items()]
    return {"summary": summary, "scores": rows}
