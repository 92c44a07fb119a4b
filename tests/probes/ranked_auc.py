"""The paired and unpaired AUC permutation tests by ranking every permuted row: the oracle of
`memaudit.probes.stats.auc_difference_test` (tests/probes/test_stats.py) and the variant it is
timed against (benchmarks/auc_permutation.py)."""

import numpy as np
from scipy.stats import rankdata

from memaudit.probes.stats import _p_from_null, chance_advantage


def ranked_auc_difference_test(a, b, *, paired, alternative, n_perm, seed, advantage):
    """`memaudit.probes.stats.auc_difference_test` as first written: each permuted row ranked
    with rankdata, O(N log N) a row. The same random draws, so the same p-value exactly."""

    def auc_rows(pos, neg):
        n1, n0 = pos.shape[1], neg.shape[1]
        ranks = rankdata(np.concatenate([pos, neg], axis=1), axis=1)
        return (ranks[:, :n1].sum(axis=1) - n1 * (n1 + 1) / 2) / (n1 * n0)

    def pct(pos, neg):
        r = rankdata(np.r_[pos, neg]) / (len(pos) + len(neg))
        return r[: len(pos)], r[len(pos):]

    (ap, an), (bp, bn) = pct(*a), pct(*b)
    f = chance_advantage if advantage else (lambda x: x)
    obs = float(f(auc_rows(ap[None], an[None])[0]) - f(auc_rows(bp[None], bn[None])[0]))
    rng = np.random.default_rng(seed)
    if paired:
        sp, sn = rng.random((n_perm, len(ap))) < 0.5, rng.random((n_perm, len(an))) < 0.5
        xp, yp = np.where(sp, bp, ap), np.where(sp, ap, bp)
        xn, yn = np.where(sn, bn, an), np.where(sn, an, bn)
    else:
        pp = rng.permuted(np.broadcast_to(np.r_[ap, bp], (n_perm, len(ap) + len(bp))), axis=1)
        pn = rng.permuted(np.broadcast_to(np.r_[an, bn], (n_perm, len(an) + len(bn))), axis=1)
        xp, yp, xn, yn = pp[:, : len(ap)], pp[:, len(ap):], pn[:, : len(an)], pn[:, len(an):]
    return _p_from_null(obs, f(auc_rows(xp, xn)) - f(auc_rows(yp, yn)), alternative)
