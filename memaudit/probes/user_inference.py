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

from memaudit.probes.stats import attack_summary, auc_placements


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


DRAWS = 200
"""Draws of k documents per user that the AUC is averaged over."""


def draw_means(
    per_user: dict[str, np.ndarray], k: int, draws: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """Per user with >= k documents: the means of k documents drawn without replacement, `draws`
    times (independent draws; users grouped by document count so each group is one array op)."""
    out: dict[str, np.ndarray] = {}
    by_count: dict[int, list[str]] = {}
    for u, s in per_user.items():
        if len(s) >= k:
            by_count.setdefault(len(s), []).append(u)
    for c, users in by_count.items():
        docs = np.stack([per_user[u] for u in users])  # (users, c)
        pick = np.argsort(rng.random((draws, len(users), c)), axis=2)[:, :, :k]  # (draws, users, k)
        means = np.take_along_axis(docs[None], pick, axis=2).mean(axis=2)  # (draws, users)
        out.update({u: means[:, i] for i, u in enumerate(users)})
    return {u: out[u] for u in per_user if u in out}  # first-seen order


def user_inference_result(
    train_users: dict[str, np.ndarray],
    heldout_users: dict[str, np.ndarray],
    *,
    statistic: str,
    k: int | None = None,
    n_boot: int = 1000,
    seed: int = 0,
    fprs=(0.01, 0.001),
    draws: int = DRAWS,
) -> dict:
    """Pure statistics: per-user document scores of training vs held-out users -> the attack.

    k: documents per user on both sides; default the largest k that every user of the smaller
    side reaches (the median count otherwise would drop half the users). The AUC is averaged
    over `draws` draws of the k documents (one draw alone moves it by the luck of which
    documents were drawn: 0.711 on a run whose mean over 500 draws is 0.593); its interval is
    DeLong's on the draw-averaged placements, users being the units. TPR cells come from the
    first draw (a TPR of averaged scores would compare means of unequal spread again). A row's
    score is the user's mean over draws.
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
    pos, neg = draw_means(train_users, k, draws, rng), draw_means(heldout_users, k, draws, rng)
    if not pos or not neg:
        raise ValueError(
            f"no user has {k} documents on one side of user inference; lower --user-docs"
        )
    p, n = np.stack(list(pos.values()), axis=1), np.stack(list(neg.values()), axis=1)  # (draws, users)
    per_draw = [auc_placements(p[d], n[d]) for d in range(draws)]
    placements = (np.mean([v for v, _ in per_draw], axis=0), np.mean([v for _, v in per_draw], axis=0))
    summary = attack_summary(p[0], n[0], unit="users", fprs=fprs, n_boot=n_boot, seed=seed,
                             placements=placements).to_json()
    summary.update({
        "statistic": statistic,
        "docs_per_user": k,
        "draws": draws,
        "dropped_users": {"training": len(train_users) - len(pos),
                          "heldout": len(heldout_users) - len(neg)},
    })
    rows = [{"user": u, "training_user": True, "score": float(s.mean())} for u, s in pos.items()]
    rows += [{"user": u, "training_user": False, "score": float(s.mean())} for u, s in neg.items()]
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
