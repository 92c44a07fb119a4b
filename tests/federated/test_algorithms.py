"""FedSGD and FedAvg against NumPy references; the aggregator protocol; local batches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from memaudit.federated.aggregators import AggregateResult, Aggregator
from memaudit.federated.algorithms import (
    fedavg,
    fedsgd,
    make_client_phase,
    make_server_optimizer,
    sample_local_batch,
)
from memaudit.federated.cohorts import pack_clients

D = 4
SIZES = (3, 7, 1, 5, 0)  # unequal data; the last slot is an absent client


def linreg_loss(params, batch):
    pred = batch["x"] @ params["w"] + params["b"]
    return 0.5 * (pred - batch["y"]) ** 2, None  # per-example (batch,)


@pytest.fixture(scope="module")
def cohort():
    rng = np.random.default_rng(11)
    clients = [
        {"x": rng.normal(size=(k, D)).astype(np.float32),
         "y": rng.normal(size=(k,)).astype(np.float32)}
        for k in SIZES
    ]
    params = {"w": rng.normal(size=(D,)).astype(np.float32), "b": np.float32(0.3)}
    return clients, pack_clients(clients), params


def np_grad(w, b, x, y):
    r = x @ w + b - y
    return x.T @ r / len(y), r.mean()


def np_fedavg_round(params, clients, lr, steps, weighting="examples"):
    """FedAvg's weighted mean delta in float64, full-batch SGD on each present client."""
    w0, b0 = params["w"].astype(np.float64), float(params["b"])
    dw, db, total = np.zeros_like(w0), 0.0, 0.0
    for c in clients:
        k = len(c["y"])
        if k == 0:
            continue
        w, b = w0.copy(), b0
        for _ in range(steps):
            gw, gb = np_grad(w, b, c["x"], c["y"])
            w, b = w - lr * gw, b - lr * gb
        weight = k if weighting == "examples" else 1.0
        dw, db, total = dw + weight * (w - w0), db + weight * (b - b0), total + weight
    return dw / total, db / total


def _algo(**kw):
    defaults = {"client_optimizer": optax.sgd(0.05), "server_optimizer": optax.sgd(1.0),
                "local_steps": 3, "batch_size": 8}
    return fedavg(linreg_loss, **(defaults | kw))


@pytest.mark.parametrize("weighting", ["examples", "uniform"])
def test_one_local_sgd_step_equals_fedsgd(cohort, weighting):
    _, data, params = cohort
    lr = 0.1
    avg = _algo(client_optimizer=optax.sgd(lr), local_steps=1, weighting=weighting)
    sgd = fedsgd(linreg_loss, server_optimizer=optax.sgd(lr), weighting=weighting)
    s_avg, m_avg = avg.round(avg.init(params), data, jax.random.PRNGKey(0))
    s_sgd, m_sgd = sgd.round(sgd.init(params), data, jax.random.PRNGKey(0))
    for k in ("w", "b"):
        np.testing.assert_allclose(s_avg.params[k], s_sgd.params[k], rtol=1e-5, atol=1e-6)
    assert m_avg["cohort"] == m_sgd["cohort"] == 4.0
    assert m_avg["examples"] == m_sgd["examples"] == sum(SIZES)
    np.testing.assert_allclose(m_avg["update_norm"], lr * m_sgd["update_norm"], rtol=1e-4)


def test_fedavg_matches_numpy_example_weighted_reference(cohort):
    clients, data, params = cohort
    algo = _algo()
    state = algo.init(params)
    ref = {"w": params["w"].astype(np.float64), "b": float(params["b"])}
    for r in range(2):
        state, metrics = algo.round(state, data, jax.random.PRNGKey(r))
        dw, db = np_fedavg_round(ref, clients, lr=0.05, steps=3)
        ref = {"w": ref["w"] + dw, "b": ref["b"] + db}
        np.testing.assert_allclose(state.params["w"], ref["w"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state.params["b"], ref["b"], rtol=1e-5, atol=1e-6)
        assert metrics["aggregated_clients"] == 4 and metrics["total_weight"] == sum(SIZES)
    assert int(state.round) == 2
    assert set(metrics) >= {"loss", "cohort", "examples", "update_norm", "delta_norm"}


def test_fedadam_server_step_matches_numpy(cohort):
    clients, data, params = cohort
    lr = 0.01
    algo = _algo(server_optimizer=make_server_optimizer("fedadam", lr))
    state, _ = algo.round(algo.init(params), data, jax.random.PRNGKey(0))
    dw, db = np_fedavg_round(params, clients, lr=0.05, steps=3)
    for k, delta in (("w", dw), ("b", db)):
        g = -np.asarray(delta)  # pseudo-gradient; Adam's first step: m_hat = g, v_hat = g^2
        want = params[k] - lr * g / (np.abs(g) + 1e-3)
        np.testing.assert_allclose(state.params[k], want, rtol=1e-5, atol=1e-6)


def _assert_matches_reference(params_out, params, clients):
    dw, db = np_fedavg_round(params, clients, lr=0.05, steps=3)
    np.testing.assert_allclose(params_out["w"], params["w"] + dw, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(params_out["b"], params["b"] + db, rtol=1e-5, atol=1e-6)


def test_host_side_aggregator_fits_between_the_jitted_phases(cohort):
    clients, data, params = cohort
    calls = []

    def aggregate(deltas, weights, state, key):
        calls.append(1)
        w = np.asarray(weights, np.float64)  # plain NumPy: cannot run under jit
        update = jax.tree.map(lambda d: np.tensordot(w, np.asarray(d), axes=1) / w.sum(), deltas)
        return AggregateResult(update, state + 1, {"host": 1.0})

    algo = _algo(aggregator=Aggregator(init=lambda p: 0, aggregate=aggregate, jittable=False))
    state, metrics = algo.round(algo.init(params), data, jax.random.PRNGKey(4))
    assert calls and state.agg_state == 1 and metrics["host"] == 1.0
    _assert_matches_reference(state.params, params, clients)


def test_fedavg_on_a_mesh_with_padded_clients(cohort):
    clients, data, params = cohort  # 5 clients on a clients axis of 2 -> padded to 6
    mesh = jax.make_mesh((2, 2), ("clients", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    algo = _algo(mesh=mesh)
    state, metrics = algo.round(algo.init(params), data, jax.random.PRNGKey(2))
    _assert_matches_reference(state.params, params, clients)
    assert metrics["cohort"] == 4.0 and metrics["total_weight"] == sum(SIZES)


def test_local_batches_with_fewer_examples_than_the_batch():
    examples = {"x": jnp.arange(6.0)}
    mask = jnp.array([1, 1, 0, 0, 0, 0], jnp.float32)  # 2 real examples
    batch, bmask = sample_local_batch(jax.random.PRNGKey(0), examples, mask, 4)
    np.testing.assert_array_equal(bmask, [1, 1, 0, 0])
    assert sorted(np.asarray(batch["x"][:2]).tolist()) == [0.0, 1.0]
    mask = jnp.array([1, 1, 1, 1, 1, 0], jnp.float32)
    for seed in range(5):
        batch, bmask = sample_local_batch(jax.random.PRNGKey(seed), examples, mask, 2)
        picked = np.asarray(batch["x"]).tolist()
        assert bmask.tolist() == [1, 1] and len(set(picked)) == 2 and 5.0 not in picked


def test_bad_input():
    with pytest.raises(ValueError, match="local_steps must be >= 1, got 0"):
        _algo(local_steps=0)
    with pytest.raises(ValueError, match="local_steps must be >= 1"):
        make_client_phase(linreg_loss, optax.sgd(0.1), local_steps=-1, batch_size=2)
    with pytest.raises(ValueError, match="server optimizer must be"):
        make_server_optimizer("adagrad", 0.1)
