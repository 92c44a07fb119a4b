"""User inference (Kandpal et al. 2023): was any of this user's data used in training?

A user's statistic is the mean of k of their documents' scores: the log-likelihood ratio between
the target and a reference model when one is given (the paper's test statistic), else the mean
log-likelihood (minus the mean loss). Training users are scored on their held-out documents
(documents the model never saw) and compared with users held out entirely, so the attack
measures leakage about the *user*, which user-level DP is meant to bound.

Both sides use the same number k of documents per user. A mean over 8 documents is less spread
than a mean over 2, so unequal counts alone separate the two sides at low FPR even where the
model knows nothing; users with fewer than k documents are left out (and counted).

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


def group_by_user(users, doc_scores: np.ndarray) -> dict[str, np.ndarray]:
    """Each user's document scores, users in first-seen order."""
    acc: dict[str, list[float]] = {}
    for u, s in zip(users, doc_scores, strict=True):
        if u is None:
            raise ValueError(
                "user inference needs a 'user' on every document; add user ids or drop "
                "user_inference from --probes"
            )
        acc.setdefault(str(u), []).append(float(s))
    return {u: np.array(v) for u, v in acc.items()}


def equal_k_means(
    per_user: dict[str, np.ndarray], k: int, rng: np.random.Generator
) -> dict[str, float]:
    """Mean of k documents drawn without replacement per user; users with fewer are dropped."""
    return {u: float(rng.choice(s, k, replace=False).mean()) for u, s in per_user.items()
            if len(s) >= k}


def user_inference_result(
    train_users: dict[str, np.ndarray],
    heldout_users: dict[str, np.ndarray],
    *,
    statistic: str,
    k: int | None = None,
    n_boot: int = 1000,
    seed: int = 0,
    fprs=(0.01, 0.001),
) -> dict:
    """Pure statistics: per-user document scores of training vs held-out users -> the attack.

    k: documents per user on both sides; default the largest k that every user of the smaller
    side reaches (the median count otherwise would drop half the users).
    """
    if not train_users or not heldout_users:
        raise ValueError(
            f"user inference needs training and held-out users, got {len(train_users)} and "
            f"{len(heldout_users)}"
        )
    if k is None:
        k = int(min(min(len(v) for v in train_users.values()),
                    min(len(v) for v in heldout_users.values())))
    rng = np.random.default_rng(seed)
    pos, neg = equal_k_means(train_users, k, rng), equal_k_means(heldout_users, k, rng)
    if not pos or not neg:
        raise ValueError(
            f"no user has {k} documents on one side of user inference; lower --user-docs"
        )
    summary = attack_summary(np.array(list(pos.values())), np.array(list(neg.values())),
                             unit="users", fprs=fprs, n_boot=n_boot, seed=seed)
    summary.update({
        "statistic": statistic,
        "docs_per_user": k,
        "dropped_users": {"training": len(train_users) - len(pos),
                          "heldout": len(heldout_users) - len(neg)},
    })
    rows = [{"user": u, "training_user": True, "score": s} for u, s in pos.items()]
    rows += [{"user": u, "training_user": False, "score": s} for u, s in neg.items()]
    return {"summary": summary, "scores": rows}


def run_user_inference(
    train_docs,
    heldout_docs,
    train_scores: np.ndarray,
    heldout_scores: np.ndarray,
    *,
    statistic: str,
    k: int | None = None,
    n_boot: int = 1000,
    seed: int = 0,
    fprs=(0.01, 0.001),
) -> dict:
    """Training users (their unseen documents `train_docs`) vs held-out users' documents."""
    return user_inference_result(
        group_by_user([d.user for d in train_docs], train_scores),
        group_by_user([d.user for d in heldout_docs], heldout_scores),
        statistic=statistic, k=k, n_boot=n_boot, seed=seed, fprs=fprs,
    )
