"""Example-level DP names its unit: the per-document ε of a ledger whose documents span up to m
packed sequences, against dp_accounting's mixture of Gaussians computed here; between the
sequence's ε and the group-privacy bound; the sequence's own ε at m = 1; unknown without m."""

from __future__ import annotations

import math

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import PLDAccountant

from memaudit.privacy.accounting import MIXTURE_PLD_DISCRETIZATION, dpsgd_event, group_privacy_bound
from memaudit.privacy.ledger import PrivacyLedger, ledger_summary

Q, SIGMA, STEPS, DELTA = 0.02, 1.0, 300, 1e-5


def _mixture_pld(q, sigma, steps, delta, k):
    """dp_accounting's own ELS event for k sequences of one document, built here."""
    probs = [math.comb(k, j) * q ** j * (1 - q) ** (k - j) for j in range(k + 1)]
    acc = PLDAccountant(value_discretization_interval=MIXTURE_PLD_DISCRETIZATION)
    acc.compose(dp_event.SelfComposedDpEvent(
        dp_event.MixtureOfGaussiansDpEvent(sigma, [float(j) for j in range(k + 1)], probs), steps))
    return acc.get_epsilon(delta)


def _ledger(m):
    led = PrivacyLedger(unit="example", delta=DELTA, max_sequences_per_document=m)
    led.record_steps(Q, SIGMA, STEPS - 100)
    led.record_steps(Q, SIGMA, 100)  # coalesced, as a resumed run's steps are
    return led


@pytest.mark.parametrize("m", [2, 3])
def test_document_epsilon_is_the_mixture_of_gaussians_between_sequence_and_group_bound(m):
    led = _ledger(m)
    doc = led.document()
    assert doc["unit"] == "document" and doc["max_sequences_per_document"] == m
    assert doc["epsilon"]["rdp"] is None  # only PLD interprets the mixture
    assert doc["epsilon"]["pld"] == pytest.approx(_mixture_pld(Q, SIGMA, STEPS, DELTA, m), rel=1e-9)
    seq = led.epsilons()["pld"]
    group = group_privacy_bound(dpsgd_event(Q, SIGMA, STEPS), DELTA, m, "pld")
    assert seq < doc["epsilon"]["pld"] < group
    assert f"up to {m} packed sequences" in doc["composed_as"]
    # written and read back: recomputed from the events, the same figure
    obj = led.to_json()
    assert obj["document"]["epsilon"]["pld"] == pytest.approx(doc["epsilon"]["pld"], rel=1e-12)
    assert obj["protects"]["unit"] == "sequence"
    assert ledger_summary(obj)["document"]["epsilon"]["pld"] == pytest.approx(doc["epsilon"]["pld"], rel=1e-12)


def test_one_sequence_per_document_gives_the_sequence_epsilon():
    led = _ledger(1)
    doc = led.document()
    assert doc["epsilon"] == led.epsilons()
    assert "no document crosses a packed-sequence boundary" in doc["composed_as"]


def test_unknown_m_reports_unknown_and_user_ledgers_have_no_document_figure():
    led = _ledger(None)
    doc = led.document()
    assert doc["epsilon"] is None and doc["max_sequences_per_document"] is None
    assert doc["composed_as"].startswith("unknown")
    old = led.to_json()
    for key in ("document", "max_sequences_per_document", "protects"):  # a ledger written before them
        del old[key]
    s = ledger_summary(old)
    assert s["document"]["epsilon"] is None and s["document"]["composed_as"].startswith("unknown")
    assert s["epsilon"] == pytest.approx(led.epsilons()["pld"])
    user = PrivacyLedger(unit="user", delta=DELTA)
    user.record_steps(Q, SIGMA, 10)
    assert user.document() is None and user.to_json()["document"] is None
    assert user.protects()["unit"] == "user"
    with pytest.raises(ValueError, match="max_sequences_per_document"):
        PrivacyLedger(unit="example", delta=DELTA, max_sequences_per_document=0)


def test_user_level_ledgers_name_their_contribution_bound():
    from memaudit.privacy.mechanisms import ExampleSampledUsers, SampledGaussian

    els = PrivacyLedger(unit="user", delta=DELTA)
    els.record_mechanism(ExampleSampledUsers(noise_multiplier=1.0, population=100, expected=5,
                                             max_examples_per_user=3), steps=2)
    assert els.protects() == {"unit": "user", "contribution_bound": "at most 3 training sequences per user, "
                                                                    "clipped to C"}
    fed = PrivacyLedger(unit="user", delta=DELTA)
    fed.record_mechanism(SampledGaussian(name="DP-FedAvg", unit="user", noise_multiplier=1.0, population=100,
                                         expected=5), steps=2)
    assert fed.protects()["contribution_bound"] == "one clipped model update per user per round"
    assert els.document() is None and fed.document() is None
