"""The malicious-server mode: exact sums with dropouts at every stage (both masking paths),
signatures the server cannot forge or substitute, verification keys from outside the server."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pydantic import ValidationError

from memaudit.federated.aggregators import mean_aggregator
from memaudit.federated.secagg import AuthenticationError, Dropouts, SecAggAbort, prg, run_round
from memaudit.federated.secagg.pki import KeyRing, write_key_directory

D = 16
PATHS = [False] + ([True] if prg.NATIVE else [])


def _inputs(n, d=D, seed=0):
    return np.random.default_rng(seed).integers(0, 2**32, size=(n, d), dtype=np.uint32)


@pytest.mark.parametrize("native", PATHS, ids=["numpy", "native"][:len(PATHS)])
@pytest.mark.parametrize("drop", [
    {"before_shares": {9}, "before_masked": {2}, "before_unmask": {5}},
    {"before_masked": {2}, "before_check": {4}},
])
def test_malicious_round_gives_the_exact_survivors_sum_with_dropouts(monkeypatch, native, drop):
    monkeypatch.setattr(prg, "NATIVE", native)
    monkeypatch.setattr(prg, "PARALLEL_MIN_WORDS", 1)  # every native call split over threads:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # two of them (the test workers set 1)
    n, d = 10, prg.CHUNK_WORDS + 5
    x = _inputs(n, d, seed=1)
    r = run_round(x, threshold=0.7, mode="malicious", dropouts=Dropouts(**drop))
    u3 = set(range(n)) - drop.get("before_shares", set()) - drop["before_masked"]
    assert r.survivors == frozenset(u3)
    want = (x[sorted(u3)].astype(np.int64).sum(axis=0) % 2**32).astype(np.uint32)
    np.testing.assert_array_equal(r.total, want)


def test_too_many_drop_before_the_consistency_check_aborts():
    with pytest.raises(SecAggAbort):
        run_round(_inputs(10), threshold=0.7, mode="malicious",
                  dropouts=Dropouts(before_masked={2}, before_check={4, 6, 8}))


def test_a_key_substituted_by_the_server_fails_its_signature():
    header, entry = 30, 4 + 4 + 4 + 8  # message header; threshold, count, first id, blob length

    def swap_key(stage, cid, msg):
        if stage == "keys" and cid == 0:
            return msg[:header + entry] + bytes([msg[header + entry] ^ 1]) + msg[header + entry + 1:]
        return msg

    with pytest.raises(AuthenticationError, match="signature"):
        run_round(_inputs(4), threshold=0.8, mode="malicious", tamper=swap_key)


def test_a_forged_consistency_signature_is_detected():
    def forge(stage, cid, msg):
        if stage == "unmask_request" and cid == 1:
            return msg[:-1] + bytes([msg[-1] ^ 1])  # the last signature's last byte
        return msg

    with pytest.raises(SecAggAbort, match="inconsistent"):
        run_round(_inputs(4), threshold=0.8, mode="malicious", tamper=forge)


def test_verification_keys_from_a_directory(tmp_path):
    write_key_directory(KeyRing.generate(range(5)), tmp_path / "pki")
    ring = KeyRing.load(tmp_path / "pki")
    assert ring.ids == frozenset(range(5))
    x = _inputs(5, seed=2)
    r = run_round(x, threshold=0.8, mode="malicious", keys=ring)
    np.testing.assert_array_equal(r.total, x.sum(0, dtype=np.uint32))
    (tmp_path / "pki" / "client-4.pub").write_text(KeyRing.generate([0])._verifying[0].public_bytes_raw().hex())
    with pytest.raises(ValueError, match="client-4.key does not match"):
        KeyRing.load(tmp_path / "pki")
    with pytest.raises(ValueError, match="does not exist"):
        KeyRing.load(tmp_path / "nowhere")


def test_malicious_mode_from_config_with_a_key_directory(tmp_path):
    from memaudit.config import Config
    from memaudit.errors import ConfigError
    from memaudit.federated.secagg.aggregator import secure_aggregation_from_config

    write_key_directory(KeyRing.generate(range(4)), tmp_path)

    def cfg(**sa):
        return Config.model_validate({"backend": "federated", "federated": {"cohort": 4}, "privacy": {
            "clip": 1.0, "secure_aggregation": {"enabled": True, "mode": "malicious", "threshold": 0.8,
                                                 **sa}}})

    agg = secure_aggregation_from_config(mean_aggregator(), cfg(verification_keys=str(tmp_path)))
    d = jnp.asarray(np.random.default_rng(0).normal(size=(5, 3)) * 0.1, jnp.float32)
    res = agg.aggregate(d[:4], jnp.ones(4), agg.init(None), jax.random.key(0))
    assert res.metrics["secagg_aborted"] == 0
    np.testing.assert_allclose(res.update, np.asarray(d[:4]).mean(0), atol=1e-5)
    with pytest.raises(ValueError, match="no key for cohort slot 4"):
        agg.aggregate(d, jnp.ones(5), agg.init(None), jax.random.key(1))
    with pytest.raises(ConfigError, match="verification_keys"):
        secure_aggregation_from_config(mean_aggregator(), cfg(verification_keys=str(tmp_path / "x")))


def test_malicious_mode_runs_on_the_sparse_graph():
    """Issue 29: the malicious-server mode (the default) runs on SecAgg+ graphs: each client
    checks its keys against the announced cohort and graph, and the quorum is over the cohort."""
    from memaudit.config import SecAggConfig

    x = _inputs(40)
    drop = Dropouts(before_masked={3}, before_check={5}, before_unmask={7})
    r = run_round(x, neighbours="sparse", dropouts=drop)
    assert r.degree < 39
    want = (x[sorted(r.survivors)].astype(np.int64).sum(axis=0) % 2**32).astype(np.uint32)
    np.testing.assert_array_equal(r.total, want)
    assert SecAggConfig(neighbours="sparse").mode == "malicious"
    with pytest.raises(ValidationError, match="mode=malicious"):
        SecAggConfig(verification_keys="/tmp/keys", mode="honest_but_curious")
