"""The abort bit of secure aggregation on SecAgg+'s graph with dropouts (issue 29): the rule the
ledger's bound assumes is the server's, and the bound is above the exact ε (counted over every
drop set) where the complete graph's rule, which the ledger used before, was below it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from memaudit.federated.secagg.aggregator import holders
from memaudit.federated.secagg.graph import sparse_degree
from memaudit.privacy.aborts import abort_epsilon


def _windows_ok(dropped_positions, n, h, z):
    """Every window of h consecutive positions of the cycle holds at most z dropped clients."""
    dead = np.zeros(n, int)
    dead[list(dropped_positions)] = 1
    return all(dead[[(s + j) % n for j in range(h)]].sum() <= z for s in range(n))


def test_a_secagg_plus_round_completes_iff_every_window_keeps_t_live_holders():
    """The real protocol (malicious-server mode) on SecAgg+'s graph of 16 clients (degree 12:
    13 holders, t = 8, so a window may hold z = 5 dropped clients): six clients dropped next to
    each other on the graph's cycle abort the round, six spread out do not, and random drop
    sets abort exactly when a window holds more than z."""
    from memaudit.federated.secagg.messages import SecAggAbort
    from memaudit.federated.secagg.protocol import Dropouts, run_round

    n, seed = 16, 5
    h = sparse_degree(n) + 1
    z = h - math.ceil(0.6 * h)
    assert (h, z) == (13, 5)
    perm = np.random.default_rng(seed).permutation(n)  # position p of the cycle holds client perm[p]
    x = np.arange(n * 3, dtype=np.uint32).reshape(n, 3)
    rng = np.random.default_rng(0)
    cases = [{0, 1, 2, 3, 4, 5}, {0, 3, 6, 9, 12, 14}]
    cases += [set(rng.choice(n, size=int(rng.integers(5, 8)), replace=False).tolist()) for _ in range(10)]
    outcomes = []
    for positions in cases:
        dropped = {int(perm[p]) for p in positions}
        want = _windows_ok(positions, n, h, z)
        try:
            res = run_round(x, neighbours="sparse", graph_seed=seed, dropouts=Dropouts(before_masked=dropped))
            done = True
            alive = sorted(set(range(n)) - dropped)
            assert np.array_equal(res.total, x[alive].sum(0, dtype=np.uint32))
        except SecAggAbort:
            done = False
        assert done is want, sorted(positions)
        outcomes.append(done)
    assert outcomes[:2] == [False, True] and True in outcomes[2:] and False in outcomes[2:]


def _exact_completion(n, h, z):
    """P(every window holds <= z dropped | D dropped, uniformly at random), D = 0..n, counted
    over all 2^n drop sets."""
    masks = np.arange(1 << n, dtype=np.int64)
    bits = ((masks[:, None] >> np.arange(n)) & 1).astype(np.int8)
    ok = np.ones(len(masks), bool)
    for s in range(n):
        ok &= bits[:, [(s + j) % n for j in range(h)]].sum(1) <= z
    dropped = bits.sum(1)
    return np.array([ok[dropped == d].mean() for d in range(n + 1)])


def _exact_epsilon(population, cohort, dropout, threshold, min_survivors):
    """The abort bit's pure ε under add/remove adjacency with Poisson sampling, each completion
    probability counted exactly (the malicious-server mode's quorum with no colluders)."""
    q = cohort / population
    counted = {}

    def complete(n, s):
        if n < 1 or s < max(min_survivors, n // 2 + 1):
            return 0.0
        h = holders("sparse", n)
        z = h - max(1, math.ceil(threshold * h - 1e-9))
        if h == n:
            return float(n - s <= z)
        if n not in counted:
            counted[n] = _exact_completion(n, h, z)
        return float(counted[n][n - s])

    without = {"complete": 0.0, "abort": 0.0}
    target = {"complete": 0.0, "abort": 0.0}
    for n in range(population):
        for s in range(n + 1):
            w = stats.binom.pmf(n, population - 1, q) * stats.binom.pmf(s, n, 1 - dropout)
            c = complete(n, s)
            without["complete"] += w * c
            without["abort"] += w * (1 - c)
            for n2, s2, p in ((n + 1, s + 1, 1 - dropout), (n + 1, s, dropout)):
                c2 = complete(n2, s2)
                target["complete"] += w * p * c2
                target["abort"] += w * p * (1 - c2)
    return max(abs(math.log((1 - q) + q * target[o] / without[o])) for o in without)


@pytest.mark.parametrize(("population", "cohort", "dropout"), [(20, 14, 0.3), (18, 12, 0.25)])
def test_the_ledgers_abort_bit_on_secagg_plus_is_at_least_the_exact_one(population, cohort, dropout):
    """The ledger's ε for the abort bit (`memaudit.federated.secagg.aggregator.abort_bit_epsilon`)
    against the exact one, counted over every drop set on the graph each cohort size runs on.
    At population 20, cohort 14, dropout 0.3 the complete graph's rule gave 0.0292 against an
    exact 0.0390 (before: the ledger understated the bit); the bound gives 0.0468."""
    from memaudit.config import load_config
    from memaudit.federated.secagg.aggregator import abort_bit_epsilon

    cfg = load_config(None, ["backend=federated", f"federated.cohort={cohort}", "privacy.noise_multiplier=1.0",
                             "privacy.secure_aggregation.enabled=true", "privacy.secure_aggregation.neighbours=sparse",
                             f"privacy.secure_aggregation.dropout={dropout}", "privacy.secure_aggregation.min_survivors=3"])
    exact = _exact_epsilon(population, cohort, dropout, 0.6, 3)
    ledger = abort_bit_epsilon(cfg, population)
    assert exact - 1e-9 <= ledger <= exact + 0.06, (exact, ledger)
    complete_graph = abort_epsilon(population=population, cohort=cohort, min_survivors=3, dropout=dropout,
                                   threshold=0.6)
    if population == 20:
        assert complete_graph < exact  # the rule the ledger used before
