"""Who a user-level ε holds against (issue 61, item 2).

ELS and ULS are central DP-SGD: the process that runs training computes the clipped sum before
it adds noise, so nothing holds against it. Their ledgers used to reach the distributed-DP branch
("the release's epsilon also holds against the server", or "no DP guarantee (distributed DP ...)").
The adversary: the party that runs training, reading the ledger's server view.
"""

from __future__ import annotations

import json
import math

import pytest

from memaudit.privacy.ledger import PrivacyLedger, ledger_summary
from memaudit.privacy.mechanisms import DistributedDiscreteGaussian
from memaudit.train.user_dp import els_mechanism, uls_mechanism

DELTA = 1e-6


def _ledger(mech, steps=50, metrics=None):
    led = PrivacyLedger(unit="user", delta=DELTA)
    led.record_mechanism(mech, metrics, steps=steps)
    return led


@pytest.mark.parametrize("mech", [
    uls_mechanism(noise_multiplier=1.0, users=200, expected_users=10, k=4),
    els_mechanism(noise_multiplier=1.0, population=800, expected=40, k=4),
], ids=["ULS", "ELS"])
def test_central_dpsgd_per_user_states_no_guarantee_against_the_trainer(mech, tmp_path):
    led = _ledger(mech)
    server = led.to_json()["guarantees"]["server"]
    assert math.isinf(server["epsilon"]["rdp"]) and math.isinf(server["epsilon"]["pld"])
    assert "distributed" not in server["why"]
    assert "runs training" in server["why"] and "no DP guarantee" in server["why"]
    s = ledger_summary(json.loads(json.dumps(led.to_json(), allow_nan=True)), with_document=False)
    assert math.isinf(s["server_epsilon"]) and "distributed" not in s["server_note"]


def test_ledger_written_before_the_fix_is_read_right():
    """A ULS ledger on disk holds server_view "n/a" (what the mechanism declared then): the view is
    derived when read, so an old privacy.json states the same."""
    led = _ledger(uls_mechanism(noise_multiplier=1.0, users=200, expected_users=10, k=4))
    obj = led.to_json()
    obj["mechanisms"][0]["server_view"] = "n/a"
    s = ledger_summary(obj, with_document=False)
    assert math.isinf(s["server_epsilon"]) and "runs training" in s["server_note"]


def test_distributed_dp_still_holds_against_the_server():
    metrics = {"survivors": 9.0, "ddp_l2": 300.0, "ddp_l1": 3000.0, "ddp_local_std": 250.0, "ddp_dim": 1024}
    led = _ledger(DistributedDiscreteGaussian(), steps=1, metrics=metrics)
    server = led.to_json()["guarantees"]["server"]
    assert server["epsilon"]["rdp"] == pytest.approx(led.epsilon("rdp"))
    assert server["why"].startswith("distributed DP")
