"""Are members and non-members from one distribution? A blind attack that never sees the model.

Membership inference on a split whose non-members come from another source (later dates, another
generator, other lengths) measures that shift, not memorization: Duan et al. (MIMIR) and Das et
al. found "blind" classifiers on the texts alone beating every published attack on such splits.
Before any attack is reported, a logistic regression on the texts' word n-grams and lengths is
cross-validated on member vs non-member; its AUC far above 0.5 flags the split.

References:
    Duan et al. 2024, "Do Membership Inference Attacks Work on Large Language Models?" (MIMIR).
    Das, Zhang, Tramèr 2024, "Blind Baselines Beat Membership Inference Attacks for Foundation
    Models".

>>> blind_check(["a b"] * 5, ["c d"] * 5)["flagged"]  # n too small to flag anything
False
"""

from __future__ import annotations

import math

import numpy as np
from scipy.sparse import csr_matrix, hstack
from sklearn.base import BaseEstimator, TransformerMixin
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold, cross_val_predict
from sklearn.pipeline import make_pipeline

MIN_PER_SIDE = 20  # fewer documents per side: not checked ("n too small")
Z_FLAG = 4.0  # AUC this many null sds above 0.5 ...
MIN_EXCESS = 0.1  # ... and at least 0.6: a shift large enough to matter
# Documents per side the classifier sees at most (a seeded random subset beyond): from about 270
# a side the flag's bar is MIN_EXCESS, not Z_FLAG null sds, and 2,000 a side estimate the AUC to a
# null sd of 0.009: more documents change the verdict only for an AUC within a few hundredths of
# 0.6, and they cost the fit's time (the TPU study's 11,613 + 11,891 documents: 95.5 s against
# 11.4 s capped, one CPU core, every point).
MAX_PER_SIDE = 2000


class _TextFeatures(TransformerMixin, BaseEstimator):
    """Word 1-2-gram TF-IDF (fitted on the training fold only) and log character/word counts."""

    def fit(self, docs, y=None):
        self.vec_ = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True).fit(docs)
        return self

    def transform(self, docs):
        lens = np.log1p([[len(d), len(d.split())] for d in docs])
        return hstack([self.vec_.transform(docs), csr_matrix(lens)]).tocsr()


def _at_most(docs: list[str], k: int, rng: np.random.Generator) -> list[str]:
    """`docs` itself when it has at most k documents, else k of them drawn without replacement
    (in their original order)."""
    if len(docs) <= k:
        return list(docs)
    return [docs[i] for i in np.sort(rng.choice(len(docs), size=k, replace=False))]


def _null_sd(n1: int, n0: int) -> float:
    """The AUC's standard deviation when the two classes are exchangeable (Mann-Whitney)."""
    return math.sqrt((n1 + n0 + 1) / (12 * n1 * n0))


def blind_check(members: list[str], nonmembers: list[str], *, folds: int = 5, seed: int = 0,
                max_per_side: int = MAX_PER_SIDE) -> dict:
    """Cross-validated AUC of a text-only classifier of member vs non-member.

    Args:
        members, nonmembers: the documents' texts.
        folds: cross-validation folds (stratified, shuffled with `seed`).
        max_per_side: a side with more documents is checked on a random subset of this many
            (drawn with `seed`); its n is the subset's, and its total is kept beside it.

    Returns:
        {"auc", "null_sd", "n_members", "n_nonmembers", "members_total", "nonmembers_total",
        "flagged", "note", "length_ratio"}: `flagged` when the AUC exceeds 0.5 by Z_FLAG null
        sds and MIN_EXCESS; the n are the documents the classifier saw, the totals all of them
        (the length ratio is over all of them).
    """
    lengths = (float(np.median([len(t) for t in members] or [0])),
               float(np.median([len(t) for t in nonmembers] or [0])))
    ratio = lengths[0] / lengths[1] if lengths[1] else None
    totals = {"members_total": len(members), "nonmembers_total": len(nonmembers)}
    rng = np.random.default_rng(seed)
    members, nonmembers = (_at_most(side, max_per_side, rng) for side in (members, nonmembers))
    n1, n0 = len(members), len(nonmembers)
    out = {"n_members": n1, "n_nonmembers": n0, **totals, "auc": None, "null_sd": None,
           "length_ratio": ratio, "flagged": False, "note": None}
    if min(n1, n0) < MIN_PER_SIDE:
        out["note"] = f"n too small (needs >= {MIN_PER_SIDE} documents per side)"
        return out
    texts = list(members) + list(nonmembers)
    y = np.r_[np.ones(n1), np.zeros(n0)]
    pipe = make_pipeline(_TextFeatures(), LogisticRegression(C=1.0, max_iter=1000))
    cv = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
    p = cross_val_predict(pipe, np.array(texts, dtype=object), y, cv=cv, method="predict_proba")[:, 1]
    auc = float(roc_auc_score(y, p))
    sd = _null_sd(n1, n0)
    flagged = auc > 0.5 + max(Z_FLAG * sd, MIN_EXCESS)
    out.update(auc=auc, null_sd=sd, flagged=bool(flagged),
               note=("members and non-members differ in their texts alone: a blind classifier "
                     f"tells them apart with AUC {auc:.2f}; attack AUCs on this split measure "
                     "that shift, not memorization") if flagged else None)
    return out
