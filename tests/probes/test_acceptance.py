"""Acceptance: a tiny Llama trained to memorise canaries and documents; its untrained weights."""

import math

import numpy as np
import pytest
from scipy.stats import mannwhitneyu, spearmanr

from memaudit.probes.exposure import (
    at_ceiling,
    estimated_exposure,
    exact_exposure,
    sample_secrets,
    score_secrets,
    tail_mask,
)
from memaudit.probes.membership import doc_scores
from memaudit.probes.stats import attack_summary
from memaudit.probes.targets import Codec, Doc
from tests.probes.conftest import SEQ_WORDS, make_corpus

LOG2R = math.log2(10**4)


def test_exposure_grows_with_repetitions(probed):
    doc, _ = probed
    exp = doc["probes"]["exposure"]
    assert exp["summary"]["method"] == "enumeration" and exp["summary"][
        "max_exposure"
    ] == pytest.approx(LOG2R)
    ins = [s for s in exp["scores"] if s["role"] == "inserted"]
    rho = spearmanr([s["repetitions"] for s in ins], [s["exposure"] for s in ins]).statistic
    assert rho > 0.5
    by = exp["summary"]["by_repetitions"]
    assert by["32"]["all"]["value"] >= LOG2R - 2.0  # near the maximum
    assert by["32"]["all"]["value"] > by["1"]["all"]["value"]
    assert {"all", "user", "spread", "excess", "test"} <= set(by["32"])
    # inserted canaries as excess over the same run's references, with a per-bucket test
    assert by["32"]["test"]["p_holm"] < 0.05 and by["32"]["excess"]["value"] > 5
    assert by["32"]["all"]["n"] == 2 and by["32"]["all"]["ci_low"] is None  # n too small
    # references stay at the null even in the trained model
    assert exp["summary"]["references"]["value"] == pytest.approx(1 / math.log(2), abs=0.5)
    assert "secret" not in exp["scores"][0]


def test_extraction_membership_audit_trained(probed):
    doc, _ = probed
    p = doc["probes"]
    by = p["extraction"]["summary"]["discoverable"]["8"]["by_repeats"]
    assert by["16-31"]["exact"]["value"] >= 0.8
    assert by["16-31"]["exact"]["value"] >= by["1"]["exact"]["value"]
    auc = p["membership"]["summary"]["loss"]["auc"]
    assert auc["value"] > 0.75 and auc["ci_low"] > 0.6
    for attack in ("zlib", "min_k", "min_k_pp"):
        assert p["membership"]["summary"][attack]["auc"]["value"] > 0.6
    a = p["audit"]["summary"]
    assert 0 < a["eps_lower_bound"] <= a["ceiling"]
    assert a["m"] == 200 and a["ledger_eps"] is None
    pii = p["pii"]["summary"]
    assert (
        pii["training_users"]["extraction"]["value"] > pii["heldout_users"]["extraction"]["value"]
    )
    assert (
        pii["training_users"]["inference_top1"]["value"]
        > pii["heldout_users"]["inference_top1"]["value"]
    )
    # decoys of held-out users' PII rank the true value first at chance, 1/k, within its CI
    held = pii["heldout_users"]
    assert held["inference_top1"]["ci_low"] <= held["chance_top1"] <= held["inference_top1"]["ci_high"]
    assert held["chance_top1"] == pytest.approx(1 / 6)
    ui = p["user_inference"]["summary"]
    assert ui["n_pos"] == 20 and ui["n_neg"] == 10 and ui["docs_per_user"] == 3
    # 10 held-out users cannot give TPR at 1% FPR: the cell says so instead of a number
    assert ui["tpr_at_fpr"]["0.01"]["value"] is None
    assert ui["tpr_at_fpr"]["0.01"]["note"] == "needs >= 1000 non-member users"
    assert p["membership"]["summary"]["loss"]["tpr_at_fpr"]["0.01"]["note"] == (
        "needs >= 1000 non-member documents")
    nd = p["extraction"]["summary"]["non_discoverable"]
    assert nd["perplexity"]["memorised_in_top"] >= 1  # the top-ranked samples hold training text
    assert doc["schema"] == 1 and set(doc["probes"]) == {
        "exposure",
        "extraction",
        "goldfish_extraction",
        "membership",
        "user_inference",
        "pii",
        "audit",
    }


def test_untrained_exposure_is_null(probed):
    _, init = probed
    s = init["probes"]["exposure"]["scores"]
    ins = [x["exposure"] for x in s if x["role"] == "inserted"]
    ref = [x["exposure"] for x in s if x["role"] == "reference"]
    assert mannwhitneyu(ins, ref).pvalue > 0.05
    assert np.mean(ref) == pytest.approx(
        1 / math.log(2), abs=0.5
    )  # 100 references: sd of the mean ~0.14
    assert init["probes"]["audit"]["summary"]["eps_lower_bound"] == 0.0
    # defect 1: an untrained model yields no finding: no repetition bucket beats the references
    by = init["probes"]["exposure"]["summary"]["by_repetitions"]
    assert all(b["test"]["p_holm"] > 0.05 for b in by.values())


def test_untrained_membership_auc_is_chance(trained):
    """1000 vs 1000 exchangeable documents: the AUC's sd is ~0.013, so ±0.05 is ~4 sd."""
    words, _, _ = make_corpus(0)
    rng = np.random.default_rng(5)
    docs = [Doc(id=str(i), text=" ".join(rng.choice(words, SEQ_WORDS))) for i in range(2000)]
    s = doc_scores(trained.init_model, Codec(trained.tokenizer), docs, batch_size=500)
    for name in ("loss", "zlib", "min_k", "min_k_pp"):
        auc = attack_summary(s[name][:1000], s[name][1000:], n_boot=100).auc.value
        assert abs(auc - 0.5) < 0.05, name


def test_enumeration_equals_sampling_with_extrapolation(trained, probed):
    """Stated tolerance: mean |difference| <= 0.5 bit and every canary within 1.5 bits, from 3000
    sampled candidates out of |R| = 10^4 (skew-normal extrapolation for the most exposed ones)."""
    doc, _ = probed
    rows = doc["probes"]["exposure"]["scores"]
    lp = np.array([r["log_perplexity"] for r in rows])
    exact = np.array([r["exposure"] for r in rows])
    codec = Codec(trained.tokenizer, start_id=0)
    sampled = score_secrets(
        trained.model,
        codec,
        "my pin is {secret}",
        sample_secrets("0123456789", 4, 3000, 1),
        batch_size=500,
    )
    est = estimated_exposure(lp, sampled, 10**4)
    tail = tail_mask(lp, sampled)
    # issue 32: canaries inside the sample that it does not resolve are held at the ceiling
    # (monotone), so they are compared among the unresolved ones, not within 1.5 bits
    held = at_ceiling(lp, sampled)
    diff = np.abs(est - exact)[~held]
    assert diff.mean() <= 0.5 and diff.max() <= 1.5, (diff.mean(), diff.max())
    # defect 9: beyond the sample the value is a lower bound: never above the exact exposure
    assert tail.any() and (est[tail] <= exact[tail] + 1e-9).all()
    assert est[tail] == pytest.approx(np.log2(1e4) - np.log2(1 + 1e4 * (1 - 0.05 ** (1 / 3000))))
    # the exact path agrees with a direct count
    space = score_secrets(
        trained.model,
        codec,
        "my pin is {secret}",
        [f"{i:04d}" for i in range(10**4)][:50],
        batch_size=500,
    )
    assert exact_exposure(space[:1], space)[0] == pytest.approx(
        math.log2(50) - math.log2(1 + (space < space[0]).sum())
    )
