"""Secure aggregation that cannot reveal one client: the threat-model bounds, the survivor floor,
the inconsistent-survivor attack (reproduced, refused, detected) and aborts that apply nothing.

Each test here reproduces a defect of issue 13 ("Secure aggregation reveals a single client") or
issue 14 item 5 (quantisation outside the sensitivity); all of them failed before the fix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from memaudit.federated.aggregators import mean_aggregator
from memaudit.federated.secagg import Dropouts, SecAggAbort, run_round, shamir
from memaudit.federated.secagg.aggregator import secure_aggregation

D = 8


def _inputs(n, d=D, seed=0):
    return np.random.default_rng(seed).integers(0, 2**32, size=(n, d), dtype=np.uint32)


# ----------------------------------------------------------------------------- survivor floor
def test_a_cohort_of_one_is_aborted_not_unmasked():
    """A cohort of one would be unmasked as that client's own update (Poisson cohorts make it
    common); the round aborts instead and releases a zero aggregate."""
    delta = jnp.asarray([[0.3, -0.2, 0.1], [0.0, 0.0, 0.0]], jnp.float32)
    agg = secure_aggregation(mean_aggregator(), clip=10.0, seed=0)
    res = agg.aggregate(delta, jnp.array([1.0, 0.0]), agg.init(None), jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(res.update), 0.0)
    assert float(res.metrics["secagg_aborted"]) == 1
    assert float(res.metrics["survivors"]) == 1


def test_one_survivor_after_dropouts_is_refused_by_the_protocol():
    """Threshold 0.5 with dropouts used to leave one survivor's input as the 'sum'."""
    with pytest.raises(SecAggAbort, match="min_survivors"):
        run_round(_inputs(2), threshold=0.6, dropouts=Dropouts(before_masked={1}))
    with pytest.raises(SecAggAbort, match="min_survivors"):  # the floor holds below the threshold too
        run_round(_inputs(4), threshold=0.6, min_survivors=3, dropouts=Dropouts(before_masked={1, 2}))


def test_survivors_at_the_floor_still_sum_exactly():
    x = _inputs(4, seed=3)
    r = run_round(x, threshold=0.75, min_survivors=3, dropouts=Dropouts(before_masked={2}))
    assert r.survivors == frozenset({0, 1, 3})
    np.testing.assert_array_equal(r.total, x[[0, 1, 3]].sum(0, dtype=np.uint32))


# ----------------------------------------------------------------------------- threshold bounds
def test_threshold_at_or_below_half_the_holders_is_refused():
    with pytest.raises(ValueError, match="threshold"):
        run_round(_inputs(4), threshold=0.5)  # t = 2 of 4 holders: two lists get both shares


def test_threshold_bound_counts_the_colluding_clients():
    run_round(_inputs(5), threshold=0.6)  # t = 3 > 5/2
    with pytest.raises(ValueError, match="colluding"):
        run_round(_inputs(5), threshold=0.6, colluding=1)  # needs t > (5 + 1)/2
    run_round(_inputs(5), threshold=0.8, colluding=1)


def test_both_modes_need_more_than_half_the_holders_plus_the_colluders():
    """Issue 29: the bound is t > (h + n_C)/2 in both modes (derived for both unmasking routes in
    docs/secure-aggregation.md); the malicious mode's signed quorum makes it hold against a
    server that forks the lists, so Bonawitz et al.'s 2/3 (the same bound at n_C = n/3) is not
    needed on top."""
    for mode in ("malicious", "honest_but_curious"):
        with pytest.raises(ValueError, match="colluding"):
            run_round(_inputs(6), threshold=0.6, colluding=2, min_survivors=4, mode=mode)  # t=4, needs 5
    x = _inputs(6, seed=4)
    r = run_round(x, threshold=0.6, mode="malicious")  # t = 4 > 6/2
    np.testing.assert_array_equal(r.total, x.sum(0, dtype=np.uint32))


def test_config_refuses_a_weak_threshold_and_a_low_floor():
    from pydantic import ValidationError

    from memaudit.config import SecAggConfig

    with pytest.raises(ValidationError, match="threshold"):
        SecAggConfig(enabled=True, threshold=0.5)
    SecAggConfig(enabled=True, threshold=0.6, mode="malicious")  # the default mode, t > h/2
    with pytest.raises(ValidationError, match="min_survivors"):
        SecAggConfig(enabled=True, colluding_clients=2, min_survivors=3)
    cfg = SecAggConfig()
    assert cfg.min_survivors >= 3 and cfg.colluding_clients == 0 and cfg.mode == "malicious"


def test_set_up_refuses_a_threshold_below_the_bound_for_the_configured_cohort():
    from memaudit.config import Config
    from memaudit.errors import ConfigError
    from memaudit.federated.secagg.aggregator import secure_aggregation_from_config

    cfg = Config.model_validate({"backend": "federated", "federated": {"cohort": 5}, "privacy": {
        "clip": 1.0, "secure_aggregation": {"enabled": True, "threshold": 0.6, "colluding_clients": 1}}})
    with pytest.raises(ConfigError, match="threshold") as e:
        secure_aggregation_from_config(mean_aggregator(), cfg)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- the attack
def _attack(n, threshold, *, mode="honest_but_curious", announced=None, target=0):
    """A server that shows two different survivor lists: to half of the holders the target
    'dropped' (they reveal shares of its mask key s_sk), to the other half it survived (they
    reveal shares of its self-mask seed b). With both it unmasks the target's input alone.

    Returns (recovered input or None, the target's real input)."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    from memaudit.federated.secagg import prg
    from memaudit.federated.secagg.client import Client, mask_seed
    from memaudit.federated.secagg.graph import neighbours
    from memaudit.federated.secagg.messages import SERVER, Header, MsgType, Writer, parse
    from memaudit.federated.secagg.pki import KeyRing
    from memaudit.federated.secagg.policy import Policy
    from memaudit.federated.secagg.server import Server, thresholds

    x = _inputs(n, seed=9)
    neigh = neighbours(n)
    policy = Policy(threshold=threshold, mode=mode)
    ring = KeyRing.generate(range(n)) if mode == "malicious" else None
    t = announced or thresholds(neigh, threshold)[0]
    server = Server(round_id=1, neighbours=neigh, threshold=[t] * n, dim=D, min_survivors=1,
                    signed=mode == "malicious")
    clients = [Client(i, round_id=1, policy=policy, keys=ring) for i in range(n)]
    for c in clients:
        server.receive_advertise(c.advertise())
    for c in clients:
        server.receive_shares(c.share_keys(server.keys_for(c.cid)))
    masked = {}
    for c in clients:
        msg = c.masked_input(server.forward_for(c.cid), x[c.cid])
        masked[c.cid] = np.array(parse(msg, expect=MsgType.MASKED, round_id=1)[1].array(D))
        server.receive_masked(msg)
    everyone, without = set(range(n)), set(range(n)) - {target}
    key_side = set(range(1, 1 + n // 2))  # told the target dropped
    view = {i: (without if i in key_side else everyone) for i in range(n)}

    sigs: dict[int, bytes] = {}
    if mode == "malicious":  # the consistency round: each client signs the list it was shown
        for i in range(n):
            check = Writer().ids(view[i]).finish(Header(MsgType.CHECK_REQUEST, 1, SERVER, i))
            sigs[i] = parse(clients[i].check(check), expect=MsgType.CHECK, round_id=1)[1].blob()

    def request(i):
        w = Writer().ids(view[i])
        if mode == "malicious":  # every signature on the list this client was shown
            signed = [j for j in sorted(sigs) if view[j] == view[i]]
            w.u32(len(signed))
            for j in signed:
                w.u32(j).blob(sigs[j])
        return w.finish(Header(MsgType.UNMASK_REQUEST, 1, SERVER, i))

    seed_sh, key_sh = [], []
    for i in sorted(everyone):
        _, r = parse(clients[i].unmask(request(i)), expect=MsgType.UNMASK, round_id=1)
        for _ in range(r.u32()):
            owner, kind, xs, y = r.u32(), r.u32(), r.u32(), r.blob()
            if owner == target:
                (seed_sh if kind == 0 else key_sh).append((xs, int.from_bytes(y, "big")))
    if len(seed_sh) < t or len(key_sh) < t:
        return None, x[target]
    b = shamir.reconstruct_bytes(seed_sh[:t], prg.SEED_BYTES)
    s_sk = X25519PrivateKey.from_private_bytes(shamir.reconstruct_bytes(key_sh[:t], 32))
    y = masked[target].copy()
    masks = [(b, -1)] + [(mask_seed(s_sk, server._keys[j][1], 1), -1 if j > target else +1)
                         for j in sorted(neigh[target])]
    prg.add_masks(y, masks)
    return y, x[target]


def test_inconsistent_survivor_attack_recovers_one_input_below_the_bound():
    """The defect: with t <= holders/2 the attack unmasks one client. The client now refuses a
    threshold below (holders + n_C)/2 before it sends any share."""
    with pytest.raises(SecAggAbort, match="threshold"):
        _attack(4, 0.75, announced=2)  # the server announces t = 2 of 4


def test_inconsistent_survivor_attack_fails_above_the_bound():
    recovered, _ = _attack(5, 0.6)  # t = 3 > 5/2: neither list gathers t shares
    assert recovered is None


def test_inconsistent_survivor_attack_is_detected_in_malicious_mode():
    with pytest.raises(SecAggAbort, match="inconsistent"):
        _attack(6, 0.7, mode="malicious")


# ----------------------------------------------------------------------------- abort in training
def _linreg(params, batch):
    pred = batch["x"] @ params["w"]
    return 0.5 * (pred - batch["y"]) ** 2, None


def _cohort(present):
    from memaudit.federated.cohorts import pack_clients

    rng = np.random.default_rng(1)
    return pack_clients([{"x": rng.normal(size=(k, 3)).astype(np.float32),
                          "y": rng.normal(size=(k,)).astype(np.float32)} for k in present])


def test_an_aborted_round_applies_nothing_and_training_goes_on():
    from memaudit.federated.algorithms import fedavg

    agg = secure_aggregation(mean_aggregator(), clip=10.0, bits=24, seed=0)
    alg = fedavg(_linreg, client_optimizer=optax.sgd(0.1), server_optimizer=optax.adam(0.1),
                 local_steps=2, batch_size=4, aggregator=agg)
    state = alg.init({"w": jnp.asarray([0.5, -0.5, 0.2], jnp.float32)})
    state, m = alg.round(state, _cohort([3, 4, 5, 2]), jax.random.key(0))
    assert m["secagg_aborted"] == 0 and m["survivors"] == 4
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    state2, m = alg.round(state, _cohort([3, 0, 0, 0]), jax.random.key(1))  # a cohort of one
    assert m["secagg_aborted"] == 1 and m["survivors"] == 1 and m["update_norm"] == 0
    after = jax.tree.map(np.asarray, (state2.params, state2.opt_state))
    jax.tree.map(np.testing.assert_array_equal, before, after)  # no moment update, no param change
    assert int(state2.round) == int(state.round) + 1
    state3, m = alg.round(state2, _cohort([3, 4, 5, 2]), jax.random.key(2))
    assert m["secagg_aborted"] == 0
    assert not np.array_equal(np.asarray(state3.params["w"]), before[0]["w"])


def test_an_abort_under_dp_fedavg_releases_nothing():
    from memaudit.federated.algorithms import fedavg
    from memaudit.federated.dp import dp_fedavg

    agg = dp_fedavg(secure_aggregation(mean_aggregator(), clip=1.0, seed=0), clip=1.0,
                    noise_multiplier=1.0, expected_cohort=4)
    alg = fedavg(_linreg, client_optimizer=optax.sgd(0.1), server_optimizer=optax.sgd(1.0),
                 local_steps=1, batch_size=4, aggregator=agg, weighting="uniform")
    state = alg.init({"w": jnp.zeros(3, jnp.float32)})
    state2, m = alg.round(state, _cohort([3, 0, 0, 2]), jax.random.key(3))  # 2 < min_survivors
    assert m["secagg_aborted"] == 1 and m["survivors"] == 2
    np.testing.assert_array_equal(np.asarray(state2.params["w"]), 0.0)  # no noise released either
    np.testing.assert_array_equal(np.asarray(state2.agg_state.clip), np.asarray(state.agg_state.clip))


def test_a_protocol_abort_inside_training_does_not_raise():
    """Too few holders answer (dropouts at threshold 1.0): this used to raise SecAggAbort out of
    the round and end training with a traceback."""
    from memaudit.federated.algorithms import fedavg

    agg = secure_aggregation(mean_aggregator(), clip=10.0, threshold=1.0, dropout_rate=0.9, seed=0)
    alg = fedavg(_linreg, client_optimizer=optax.sgd(0.1), server_optimizer=optax.sgd(1.0),
                 local_steps=1, batch_size=4, aggregator=agg)
    state = alg.init({"w": jnp.ones(3, jnp.float32)})
    state2, m = alg.round(state, _cohort([3, 4, 5, 2, 3, 1]), jax.random.key(4))
    assert m["secagg_aborted"] == 1 and m["survivors"] < 6
    np.testing.assert_array_equal(np.asarray(state2.params["w"]), 1.0)


def _clients_after_masking(n, policy):
    """Clients of an honest round up to the masked inputs (complete graph, t = 3 of 5)."""
    from memaudit.federated.secagg.client import Client
    from memaudit.federated.secagg.graph import neighbours
    from memaudit.federated.secagg.server import Server

    server = Server(round_id=2, neighbours=neighbours(n), threshold=[3] * n, dim=D)
    clients = [Client(i, round_id=2, policy=policy) for i in range(n)]  # unsigned: no consistency round
    for c in clients:
        server.receive_advertise(c.advertise())
    for c in clients:
        server.receive_shares(c.share_keys(server.keys_for(c.cid)))
    for c in clients:
        server.receive_masked(c.masked_input(server.forward_for(c.cid), _inputs(n)[c.cid]))
    return clients


def test_a_client_refuses_to_reveal_to_a_survivor_set_below_the_floor():
    """The client checks the survivor set itself: a server that names too few survivors, or
    too few of the client's holders, gets no share, whatever it claims."""
    from memaudit.federated.secagg.messages import SERVER, Header, MsgType, Writer
    from memaudit.federated.secagg.policy import Policy

    short = Writer().ids({0, 1}).finish(Header(MsgType.UNMASK_REQUEST, 2, SERVER, 0))
    with pytest.raises(SecAggAbort, match="min_survivors"):
        _clients_after_masking(5, Policy(mode="honest_but_curious"))[0].unmask(short)
    with pytest.raises(SecAggAbort, match="threshold 3"):  # floor 2 met, but 2 live holders < t
        _clients_after_masking(5, Policy(min_survivors=2, mode="honest_but_curious"))[0].unmask(short)


def test_the_round_time_bound_uses_the_real_cohort():
    """n_C = 1 with threshold 0.6 holds for a cohort of 8 (t = 5 > 4.5) but not for a Poisson
    cohort that came out at 5 (t = 3 < 3.5): that round aborts instead of running unsafely."""
    rng = np.random.default_rng(0)
    deltas = jnp.asarray(rng.normal(size=(8, 4)) * 0.1, jnp.float32)
    agg = secure_aggregation(mean_aggregator(), clip=1.0, colluding=1, seed=0)
    ok = agg.aggregate(deltas, jnp.ones(8), agg.init(None), jax.random.key(0))
    assert ok.metrics["secagg_aborted"] == 0
    np.testing.assert_allclose(np.asarray(ok.update), np.asarray(deltas).mean(0), atol=1e-5)
    small = agg.aggregate(deltas, jnp.array([1, 1, 1, 1, 1, 0, 0, 0.0]), agg.init(None), jax.random.key(1))
    assert small.metrics["secagg_aborted"] == 1 and small.metrics["survivors"] == 5
    np.testing.assert_array_equal(np.asarray(small.update), 0.0)
