"""Simulated coverage of every interval type the report shows, at the smallest n it allows.

Issue 32, item 3: the percentile bootstrap covered a mean over 10-12 canaries 84% of the time
and a user-inference AUC with 12-13 held-out users 90-92%, for a nominal 95%. Each case below
draws seeded data sets at the smallest n that gets an interval (MIN_N; a mean: MEAN_MIN_N),
builds the interval the probe would state, and requires >= 93% coverage of the true value
(Monte-Carlo standard error about 0.5 points at 2,000 draws).

Means are simulated on the shapes exposures take: normal, exponential (a never-inserted canary's
exposure is about Exp(ln 2)) and a bimodal mix (30% memorised near 18 bits). AUCs on a normal
shift at AUC 0.5, 0.7, 0.85 and 0.97, balanced and unbalanced.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import norm

from memaudit.probes.records import Cell
from memaudit.probes.stats import MEAN_MIN_N, MIN_N, attack_summary, mean_summary, rate_summary
from memaudit.probes.user_inference import user_inference_result

TARGET = 0.93
DRAWS = 2000


def _covered(cells, truth) -> float:
    return float(np.mean([c.ci_low <= truth <= c.ci_high for c in cells]))


MEANS = {
    "normal": (lambda r, s: r.normal(3.0, 1.0, s), 3.0),
    "exponential": (lambda r, s: r.exponential(1 / np.log(2), s), 1 / np.log(2)),
    "bimodal": (lambda r, s: np.where(r.random(s) < 0.3, 18 + r.normal(0, 1, s),
                                      r.exponential(1 / np.log(2), s)), 0.3 * 18 + 0.7 / np.log(2)),
}


# issue 68, item 4: skewed shapes the percentile-free bootstrap-t still missed at 10 canaries
SKEWED = {
    # 10% of the canaries memorised near 18 bits: at 10 canaries none is memorised 35% of the time
    "memorised-10%": (lambda r, s: np.where(r.random(s) < 0.1, 18 + r.normal(0, 1, s),
                                            r.exponential(1 / np.log(2), s)), 0.1 * 18 + 0.9 / np.log(2)),
    "lognormal": (lambda r, s: r.lognormal(0.0, 1.0, s), np.exp(0.5)),
}


def _mean_cells(draw, n: int, draws: int, seed: int = 7) -> list[dict]:
    x = draw(np.random.default_rng(seed), (draws, n))
    return [mean_summary(row, unit="canaries", n_boot=1000, seed=i) for i, row in enumerate(x)]


@pytest.mark.parametrize("shape", sorted(MEANS))
def test_mean_of_canaries_covers_at_min_n(shape):
    draw, truth = MEANS[shape]
    cells = _mean_cells(draw, MEAN_MIN_N, DRAWS)
    assert _covered(cells, truth) >= TARGET


@pytest.mark.parametrize("shape", sorted(SKEWED))
def test_mean_of_skewed_canaries_covers_at_the_smallest_n_with_an_interval(shape):
    """At the smallest n that gets an interval (a mean: `MEAN_MIN_N`) the interval covers >= 93%
    on the skewed shapes too (it covered 79% with 10% memorised and 89% on lognormal scores at
    10 canaries, the smallest n that had one); below it, no interval is stated."""
    draw, truth = SKEWED[shape]
    assert _covered(_mean_cells(draw, MEAN_MIN_N, DRAWS // 2), truth) >= TARGET
    assert all(c.ci_low is None and c.note == "n too small"
               for c in _mean_cells(draw, MEAN_MIN_N - 1, 5))


@pytest.mark.parametrize("auc", [0.5, 0.7, 0.85, 0.97])
@pytest.mark.parametrize("sizes", [(MIN_N, MIN_N), (MIN_N, 10 * MIN_N), (10 * MIN_N, MIN_N)])
def test_auc_covers_at_min_n(auc, sizes):
    n1, n0 = sizes
    shift = np.sqrt(2) * norm.ppf(auc)  # AUC of N(shift, 1) vs N(0, 1)
    rng = np.random.default_rng(11)
    cells = [attack_summary(rng.normal(shift, 1, n1), rng.normal(0, 1, n0), fprs=(),
                            n_boot=200, seed=i).auc for i in range(DRAWS // 2)]
    assert _covered(cells, auc) >= TARGET


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5])
def test_binary_rate_covers_at_min_n(p):
    rng = np.random.default_rng(3)
    cells = [rate_summary((rng.random(MIN_N) < p).astype(float)) for _ in range(DRAWS // 4)]
    assert _covered(cells, p) >= TARGET


def test_fractional_rate_covers_at_min_n():
    """Rates of values in [0, 1] (a share of tokens matched): Beta(1, 3) per unit, mean 1/4."""
    rng = np.random.default_rng(5)
    x = rng.beta(1.0, 3.0, (DRAWS, MIN_N))
    cells = [rate_summary(row, n_boot=1000, seed=i) for i, row in enumerate(x)]
    assert _covered(cells, 0.25) >= TARGET
    assert all(0.0 <= c.ci_low and c.ci_high <= 1.0 for c in cells)


def test_user_inference_covers_chance_with_min_n_users():
    """No user signal: 4-8 documents per user, users' own offsets; the AUC's truth is 1/2."""
    rng = np.random.default_rng(13)
    cells = []
    for i in range(DRAWS // 8):
        def users(prefix, n):
            return {f"{prefix}{j}": rng.normal(rng.normal(0, 0.5), 1, rng.integers(4, 9))
                    for j in range(n)}

        r = user_inference_result(users("t", MIN_N + 2), users("h", MIN_N), statistic="x",
                                  n_boot=50, seed=i, fprs=(), draws=50)
        cells.append(Cell.from_json(r["summary"]["auc"]))
    assert _covered(cells, 0.5) >= TARGET


@pytest.mark.parametrize(("fpr", "n_pos", "auc"), [(0.01, 30, 0.6), (0.01, 300, 0.8), (0.1, 30, 0.95)])
def test_tpr_at_fpr_covers_with_the_fewest_negatives_it_allows(fpr, n_pos, auc):
    """TPR at a low FPR with the fewest non-members the report allows (10 / FPR). The percentile
    bootstrap alone covered a true TPR of 0.025 at FPR 1% with 30 members 68% of the time: most
    resamples have no member above the threshold, and it stated [0, 0]."""
    from memaudit.probes.stats import needed_negatives

    shift = np.sqrt(2) * norm.ppf(auc)
    truth = 1 - norm.cdf(norm.ppf(1 - fpr) - shift)  # TPR of N(shift, 1) vs N(0, 1) at this FPR
    rng = np.random.default_rng(5)
    cells = [attack_summary(rng.normal(shift, 1, n_pos), rng.normal(0, 1, needed_negatives(fpr)), fprs=(fpr,),
                            n_boot=200, seed=i).tpr_at_fpr[repr(fpr)] for i in range(300)]
    assert _covered(cells, truth) >= TARGET


@pytest.mark.parametrize("leak", ["some users leak", "beta per user"])
def test_pii_rates_cover_when_a_users_items_go_together(leak):
    """Issue 68, item 5: PII intervals treated 200 items of 13 users as independent. Where what
    the model leaks depends on the user (30% of users have 60% of their items extracted, the rest
    none; or a Beta(0.5, 2) rate per user), the items' Clopper-Pearson interval covered the rate
    51-62% of the time; the interval clustered by user covers >= 93%."""
    from types import SimpleNamespace

    from memaudit.probes.pii import PiiScores, pii_result

    rng = np.random.default_rng(17)
    truth = 0.3 * 0.6 if leak == "some users leak" else 0.2
    cells = []
    for _ in range(400):
        sizes = rng.integers(10, 21, 13)
        rate = (np.where(rng.random(13) < 0.3, 0.6, 0.0) if leak == "some users leak"
                else rng.beta(0.5, 2.0, 13))
        users = np.repeat(np.arange(13), sizes)
        hits = rng.random(len(users)) < rate[users]
        items = [(SimpleNamespace(id=f"d{i}", user=f"u{u}"), {"type": "email", "value": "x"})
                 for i, u in enumerate(users)]
        g = PiiScores(items, list(hits), [1 if h else 2 for h in hits], [10] * len(items))
        out = pii_result({"training_users": g}, n_boot=50)["summary"]["training_users"]
        cells.append(Cell.from_json(out["extraction"]))
        assert out["inference_top1"]["ci_low"] == out["extraction"]["ci_low"]
    assert _covered(cells, truth) >= TARGET
    assert cells[0].extra["users"] == 13 and cells[0].unit == "PII items"
