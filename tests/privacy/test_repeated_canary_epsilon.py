"""The ε that covers a canary repeated r times under example-level DP (issue 61, item 3).

The report printed r x epsilon for r copies, the group-privacy lemma's figure, which holds only at
delta' = r e^((r-1) epsilon) delta (vacuous from r = 8 at the quickstart's epsilon) and is below the
truth at the run's delta. Each copy is its own short document, so it lies in one training sequence,
and every sequence is Poisson-sampled on its own: the r copies are one event, j ~ Binomial(r, q) of
them in a step's batch. The adversary: one who tests for the repeated canary, at the run's delta.

The oracle here is independent of dp_accounting: the privacy-loss distribution of one step of the
mixture against the Gaussian (both directions), on a grid of width h rounded up (pessimistic) and
down (optimistic), composed by FFT; the true ε lies between the two (they differ by T h).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

from memaudit.privacy.ledger import PrivacyLedger
from memaudit.reports.group import group_privacy

# a tiny-config example-level run: 470 training sequences, batches of 16, 200 steps
Q, SIGMA, STEPS, DELTA = 16 / 470, 1.0, 200, 1e-4


def _step_pmfs(q, sigma, k, h, direction):
    """Privacy-loss pmf of one step on a grid of width h: (pessimistic, optimistic) as
    (offset index, probs, mass at +inf)."""
    j = np.arange(k + 1)
    pj = np.array([math.comb(k, int(i)) * q ** i * (1 - q) ** (k - i) for i in j])
    lo, hi = -10 * sigma, k + 10 * sigma
    x = np.linspace(lo, hi, 40001)
    dx = x[1] - x[0]
    log_g = -x ** 2 / (2 * sigma ** 2)
    comps = -(x[None, :] - j[:, None]) ** 2 / (2 * sigma ** 2) + np.log(np.maximum(pj, 1e-300))[:, None]
    log_m = np.logaddexp.reduce(comps, axis=0)
    if direction == "remove":  # P = mixture (with the group), Q = Gaussian
        log_p, log_q = log_m, log_g
    else:
        log_p, log_q = log_g, log_m
    w = np.exp(log_p - 0.5 * math.log(2 * math.pi * sigma ** 2)) * dx
    w = w / w.sum()
    L = log_p - log_q
    out = []
    for rnd in (np.ceil, np.floor):
        idx = rnd(L / h).astype(np.int64)
        # L rises with x: drop each tail of mass < 1e-13 (pessimistic: the upper tail at +inf)
        c = np.cumsum(w)
        keep = (c > 1e-13) & (c < 1 - 1e-13)
        i0 = idx[keep].min()
        pmf = np.bincount(idx[keep] - i0, weights=w[keep])
        out.append((int(i0), pmf))
    return out

def _trim(i0, pmf, tail=1e-16):
    """Drop each tail of mass < `tail`: returns (offset, pmf, mass dropped above)."""
    c = np.cumsum(pmf)
    a = int(np.searchsorted(c, tail))
    b = int(np.searchsorted(c, c[-1] - tail)) + 1
    return i0 + a, pmf[a:b], float(c[-1] - c[b - 1])


def _conv(a, b):
    (ia, pa), (ib, pb) = a, b
    n = len(pa) + len(pb) - 1
    size = 1 << math.ceil(math.log2(n))
    res = np.fft.irfft(np.fft.rfft(pa, size) * np.fft.rfft(pb, size), size)[:n]
    return ia + ib, np.maximum(res, 0.0)


def _compose(i0, pmf, T):
    """T-fold self-convolution by squaring, trimming negligible tails on the way (the mass
    trimmed above is returned: at +inf in a pessimistic bound)."""
    acc, base, inf = None, (i0, pmf), 0.0
    while T:
        if T & 1:
            acc = base if acc is None else _conv(acc, base)
            o, p, up = _trim(*acc)
            acc, inf = (o, p), inf + up
        T >>= 1
        if T:
            o, p, up = _trim(*_conv(base, base))
            base, inf = (o, p), inf + up
    return acc[0], acc[1], inf


def _delta(i0, pmf, h, eps):
    l = (i0 + np.arange(len(pmf))) * h
    m = l > eps
    return float(np.sum(pmf[m] * (1 - np.exp(eps - l[m]))))

@functools.cache
def group_epsilon(q, sigma, k, T, delta, h=1e-3):
    """(lower, upper) on ε at δ of T steps of the k-sequence mixture, both adjacencies."""
    bounds = []
    for direction in ("remove", "add"):
        (ip, pp), (io, po) = _step_pmfs(q, sigma, k, h, direction)
        res = []
        for i0, pmf in ((io, po), (ip, pp)):
            c0, cp, inf = _compose(i0, pmf, T)
            a, b = 0.0, 500.0
            for _ in range(60):
                mid = 0.5 * (a + b)
                if _delta(c0, cp, h, mid) + inf > delta:
                    a = mid
                else:
                    b = mid
            res.append(b)
        bounds.append(res)
    return max(b[0] for b in bounds), max(b[1] for b in bounds)


@pytest.fixture(scope="module")
def ledger():
    led = PrivacyLedger(unit="example", delta=DELTA)
    led.record_steps(Q, SIGMA, STEPS)
    return led


@pytest.mark.parametrize("r", [1, 2, 8])
def test_ledger_epsilon_of_r_sequences_equals_the_independent_pld(ledger, r):
    low, high = group_epsilon(Q, SIGMA, r, STEPS, DELTA)
    assert high - low == pytest.approx(STEPS * 1e-3, abs=1e-6)
    assert low - 1e-3 <= ledger.group_epsilon(r) <= high + 1e-3


@pytest.mark.parametrize("r", [2, 8])
def test_report_states_the_repeated_canarys_epsilon_at_the_runs_delta(ledger, r):
    eps = min(v for v in ledger.epsilons().values() if v is not None)
    canaries = {"inserted": [{"repetitions": r, "owner_kind": "user", "users": ["u1"] * r}]}
    (row,) = group_privacy(canaries, epsilon=eps, unit="example", delta=DELTA,
                           sequences_epsilon=ledger.group_epsilon)
    low, high = group_epsilon(Q, SIGMA, r, STEPS, DELTA)
    assert r * eps < low  # the lemma's figure, read at the run's delta, is below the truth
    assert low - 1e-3 <= row["effective_epsilon"] <= high + 1e-3
    assert row["effective_delta"] == DELTA and "delta = 1e-04" in row["rule"]


def test_without_the_ledgers_events_the_lemma_states_its_own_delta():
    """Where no exact figure is known (user-level, spread over k users) the lemma's k epsilon is
    given with its delta', and called vacuous where that is >= 1."""
    canaries = {"inserted": [{"repetitions": 8, "owner_kind": "spread", "users": [f"u{i}" for i in range(8)]},
                             {"repetitions": 2, "owner_kind": "spread", "users": ["u1", "u2"]}]}
    rows = group_privacy(canaries, epsilon=1.4, unit="user", delta=1e-5)
    two, eight = sorted(rows, key=lambda g: g["repetitions"])
    assert two["effective_epsilon"] == pytest.approx(2.8)
    assert "delta' = " + f"{2 * math.exp(1.4) * 1e-5:.2g}" in two["rule"]
    assert "vacuous" in eight["rule"] and eight["effective_delta"] == 1.0
