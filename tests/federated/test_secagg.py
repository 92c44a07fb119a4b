"""Secure aggregation: exact sums, dropouts, aborts, the server's view, message integrity."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from memaudit.federated.aggregators import mean_aggregator
from memaudit.federated.secagg import (
    AuthenticationError,
    Dropouts,
    MessageError,
    ReplayError,
    SecAggAbort,
    run_round,
)
from memaudit.federated.secagg.aggregator import (
    decode,
    encode,
    quantisation_scale,
    secure_aggregation,
)
from memaudit.federated.secagg.graph import neighbours as make_neighbours
from memaudit.federated.secagg.server import thresholds

D = 16


def _inputs(n, d=D, seed=0):
    return np.random.default_rng(seed).integers(0, 2**32, size=(n, d), dtype=np.uint32)


def _plain_sum(x, ids):
    return x[sorted(ids)].sum(axis=0, dtype=np.uint32)  # wraps mod 2^32


@pytest.mark.parametrize("n,kind,degree", [(2, "full", None), (3, "full", None), (7, "full", None),
                                            (16, "sparse", None), (64, "sparse", None), (64, "full", None),
                                            (8, "sparse", 4)])
def test_sum_equals_plain_sum_mod_2_32(n, kind, degree):
    x = _inputs(n, seed=n)
    r = run_round(x, neighbours=kind, degree=degree, round_id=n, min_survivors=min(3, n))
    assert r.survivors == frozenset(range(n))
    np.testing.assert_array_equal(r.total, _plain_sum(x, range(n)))
    if kind == "sparse":
        assert r.degree < n - 1  # really sparse


def _oracle_ok(n, kind, degree, dropped, frac=0.6):
    """The round must succeed iff every client with shares out has enough live holders and (the
    default mode's signed consistency round) more than half the cohort signs the survivor list."""
    neigh = make_neighbours(n, kind, degree=degree)
    t = thresholds(neigh, frac)
    alive = set(range(n)) - set(dropped)
    return len(alive) > n // 2 and all(len((neigh[i] | {i}) & alive) >= t[i] for i in range(n))


@pytest.mark.parametrize("n,kind,degree", [(6, "full", None), (8, "full", None), (8, "sparse", 4)])
def test_every_dropout_subset_exhaustive(n, kind, degree):
    x = _inputs(n, seed=1)
    t = math.ceil(0.6 * n) if kind == "full" else None
    max_drop = n - t if t else 4  # sparse: beyond 4 of 8 nearly every subset aborts
    checked = 0
    for k in range(max_drop + 1):
        for dropped in itertools.combinations(range(n), k):
            ok = _oracle_ok(n, kind, degree, dropped)
            if kind == "full":
                assert ok  # up to n - t dropouts always recoverable
            if ok:
                r = run_round(x, neighbours=kind, degree=degree, dropouts=Dropouts(before_masked=set(dropped)))
                assert r.survivors == frozenset(range(n)) - set(dropped)
                np.testing.assert_array_equal(r.total, _plain_sum(x, r.survivors))
            else:
                with pytest.raises(SecAggAbort, match="aborted"):
                    run_round(x, neighbours=kind, degree=degree, dropouts=Dropouts(before_masked=set(dropped)))
            checked += 1
    assert checked > 20


@pytest.mark.parametrize("kind", ["full", "sparse"])
def test_sampled_dropouts_large_cohort(kind):
    n = 32
    x = _inputs(n, seed=2)
    rng = np.random.default_rng(3)
    for _ in range(4):
        dropped = set(rng.choice(n, size=int(rng.integers(1, 8)), replace=False).tolist())
        late = set(rng.choice(sorted(set(range(n)) - dropped), size=2, replace=False).tolist())
        early = {min(set(range(n)) - dropped - late)}
        try:
            r = run_round(x, neighbours=kind, dropouts=Dropouts(before_shares=early, before_masked=dropped,
                                                                 before_unmask=late))
        except SecAggAbort:
            assert kind == "sparse"  # a sparse neighbourhood may lose too many holders
            continue
        assert r.survivors == frozenset(range(n)) - dropped - early
        np.testing.assert_array_equal(r.total, _plain_sum(x, r.survivors))


def test_too_few_survivors_abort():
    x = _inputs(5)
    with pytest.raises(SecAggAbort, match="threshold"):
        run_round(x, threshold=0.8, dropouts=Dropouts(before_masked={0, 1}))
    with pytest.raises(SecAggAbort):  # survivors that stop answering during unmasking
        run_round(x, threshold=0.6, dropouts=Dropouts(before_masked={0}, before_unmask={1, 2}))


def test_single_masked_update_looks_uniform():
    seen = {}

    def spy(stage, cid, msg):
        if stage == "masked" and cid == 0:
            seen["msg"] = msg
        return msg

    d = 1 << 15
    x = np.zeros((3, d), dtype=np.uint32)
    x[0] = np.arange(d, dtype=np.uint32) % 7  # a very non-uniform update
    r = run_round(x, tamper=spy)
    np.testing.assert_array_equal(r.total, x.sum(0, dtype=np.uint32))
    y = np.frombuffer(seen["msg"][-4 * d:], dtype="<u4")
    for view in (y >> 24, y & 0xFF):  # top and bottom byte: 128 draws per bin
        _, p = stats.chisquare(np.bincount(view, minlength=256))
        assert p > 1e-3


def _tamper_at(stage, cid, fn):
    return lambda s, c, m: fn(m) if (s, c) == (stage, cid) else m


def test_tampered_share_is_rejected():
    flip = lambda m: m[:-5] + bytes([m[-5] ^ 1]) + m[-4:]  # last byte block: an AEAD ciphertext
    with pytest.raises(AuthenticationError, match="AEAD"):
        run_round(_inputs(4), tamper=_tamper_at("forward", 2, flip))


def test_truncated_messages_are_rejected():
    for stage in ("advertise", "shares", "masked", "unmask", "keys"):
        with pytest.raises(MessageError):
            run_round(_inputs(4), tamper=_tamper_at(stage, 1, lambda m: m[:-3]))


def test_replayed_messages_are_rejected():
    from memaudit.federated.secagg.client import Client
    from memaudit.federated.secagg.pki import KeyRing
    from memaudit.federated.secagg.server import Server

    neigh = make_neighbours(3)
    ring = KeyRing.generate(range(3))
    server = Server(round_id=5, neighbours=neigh, threshold=[2, 2, 2], dim=D, signed=True)
    clients = [Client(i, round_id=5, keys=ring) for i in range(3)]
    msgs = [c.advertise() for c in clients]
    for m in msgs:
        server.receive_advertise(m)
    with pytest.raises(ReplayError, match="duplicate"):
        server.receive_advertise(msgs[0])
    stale = Client(0, round_id=4, keys=ring).advertise()
    with pytest.raises(ReplayError, match="round 4"):
        Server(round_id=5, neighbours=neigh, threshold=[2, 2, 2], dim=D, signed=True).receive_advertise(stale)
    keys = server.keys_for(1)
    with pytest.raises(ReplayError, match="delivered to"):
        clients[0].share_keys(keys)  # addressed to client 1
    shares = [c.share_keys(server.keys_for(c.cid)) for c in clients]
    with pytest.raises(ReplayError, match="expected a SHARES"):
        server.receive_shares(msgs[1])
    for s in shares:
        server.receive_shares(s)
    with pytest.raises(ReplayError, match="duplicate"):
        server.receive_shares(shares[2])


def test_a_nodes_masked_sum_unmasks_to_its_clients_sum():
    """A node holding clients 0-2 adds up their masked inputs (mod 2^32) and sends one vector;
    client 3's comes alone: the round's total is the plain sum. The server refuses a sum naming
    a client twice, a client already in it, or one not expected, and a sum of the wrong width."""
    from memaudit.federated.secagg.client import Client
    from memaudit.federated.secagg.policy import Policy
    from memaudit.federated.secagg.server import Server

    n, x = 4, _inputs(4, seed=9)
    neigh = make_neighbours(n)
    server = Server(round_id=3, neighbours=neigh, threshold=[3] * n, dim=D, min_survivors=3)
    clients = [Client(i, round_id=3, policy=Policy(mode="honest_but_curious")) for i in range(n)]
    for c in clients:
        server.receive_advertise(c.advertise())
    for c in clients:
        server.receive_shares(c.share_keys(server.keys_for(c.cid)))
    ys = [c.masked_vector(server.forward_for(c.cid), x[c.cid]) for c in clients]
    node = np.sum(ys[:3], axis=0, dtype=np.uint32)
    for bad, err in [([0, 0, 1], MessageError), ([0, 1, 7], ReplayError), ([], MessageError)]:
        with pytest.raises(err):
            server.receive_masked_sum(bad, node)
    with pytest.raises(MessageError, match="uint32"):
        server.receive_masked_sum([0, 1, 2], node[:-1])
    with pytest.raises(MessageError, match="uint32"):
        server.receive_masked_sum([0, 1, 2], node.astype(np.int64))
    server.receive_masked_sum([0, 1, 2], node)
    with pytest.raises(ReplayError, match="duplicate"):
        server.receive_masked_sum([2], ys[2])
    server.receive_masked_sum([3], ys[3])
    for c in clients:
        server.receive_unmask(c.unmask(server.unmask_request_for(c.cid)))
    np.testing.assert_array_equal(server.finalize(), _plain_sum(x, range(n)))


def test_wrapper_mean_over_survivors_and_abort():
    rng = np.random.default_rng(0)
    deltas = {"w": jnp.asarray(rng.normal(size=(6, 3, 2)) * 0.3, jnp.float32), "b": jnp.asarray(rng.normal(size=(6, 4)) * 0.3, jnp.float32)}
    weights = jnp.array([1, 1, 0, 1, 1, 1.0])
    agg = secure_aggregation(mean_aggregator(), clip=10.0, bits=24, seed=0)
    res = agg.aggregate(deltas, weights, agg.init(None), jax.random.key(1))
    scale, _ = quantisation_scale(10.0, 24, 5)
    for k in deltas:
        want = np.asarray(deltas[k])[np.asarray(weights) > 0].mean(0)
        np.testing.assert_allclose(np.asarray(res.update[k]), want, atol=1.0 / scale)
    assert float(res.metrics["survivors"]) == 5 and res.state.round == 1
    bad = secure_aggregation(mean_aggregator(), clip=10.0, threshold=1.0, dropout_rate=0.5, seed=0)
    res = bad.aggregate(deltas, jnp.ones(6), bad.init(None), jax.random.key(2))  # aborts, no raise
    assert res.metrics["secagg_aborted"] == 1 and res.state.round == 0
    for k in deltas:
        np.testing.assert_array_equal(np.asarray(res.update[k]), 0.0)


def test_quantised_encoding_is_exact_and_cannot_wrap():
    n, clip = 64, 1.0
    scale, bits = quantisation_scale(clip, 30, n)
    assert bits == 26 and n * (2 ** (bits - 1) - 1) < 2 ** 31
    rows = np.full((n, 3), clip / math.sqrt(3))  # worst case: every client at the clip norm
    q = encode(rows, clip, scale, np.random.default_rng(0))
    total = q.sum(0, dtype=np.uint32)
    np.testing.assert_allclose(decode(total, scale), rows.sum(0), atol=n / scale)


def test_from_config():
    from memaudit.config import Config
    from memaudit.errors import ConfigError
    from memaudit.federated.secagg.aggregator import secure_aggregation_from_config

    cfg = Config.model_validate({"backend": "federated", "privacy": {"clip": 0.5, "secure_aggregation": {
        "enabled": True, "threshold": 0.7, "bits": 16}}})
    agg = secure_aggregation_from_config(mean_aggregator(), cfg)
    d = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)) * 0.1, jnp.float32)
    res = agg.aggregate(d, jnp.ones(4), agg.init(None), jax.random.key(0))
    np.testing.assert_allclose(res.update, np.asarray(d).mean(0), atol=2 * 0.5 / 2**15)
    with pytest.raises(ConfigError, match="finite"):
        secure_aggregation_from_config(mean_aggregator(), Config.model_validate({"privacy": {"clip": "inf"}}))


def test_empty_cohort_gives_zero_update():
    agg = secure_aggregation(mean_aggregator(), clip=1.0, seed=0)
    res = agg.aggregate(jnp.ones((3, 2)), jnp.zeros(3), agg.init(None), jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(res.update), 0.0)
    assert float(res.metrics["survivors"]) == 0
