"""The scan strategy on a multi-device clients axis: a shard_map manual over `clients`.

Each device loops over its own clients, so an absent cohort slot's `lax.cond` stays a branch
(under the former vmap over the device shards it became a select and both branches ran), and
the sum over the clients adds halves on each device before the all-reduce.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jnp = jax.numpy

from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from memaudit.federated import (
    federated_program,
    federated_sum,
)
from tests.federated.test_algorithms import np_fedavg_round


def _loss(params, batch):  # a matmul per client: "auto" picks the scan strategy on CPU
    pred = jnp.tanh(batch["x"] @ params["w"])  # (b, 2)
    return jnp.mean((pred - batch["y"]) ** 2, axis=-1), None


def _cohort(n, absent):
    from memaudit.federated.cohorts import ClientData

    rng = np.random.default_rng(n)
    x = rng.normal(size=(n, 6, 5)).astype(np.float32)
    y = rng.normal(size=(n, 6, 2)).astype(np.float32)
    mask = np.ones((n, 6), np.float32)
    mask[n - absent:] = 0
    return ClientData({"x": x, "y": y}, mask)


def _fedavg(mesh, map_strategy="auto"):
    from memaudit.federated.algorithms import fedavg

    return fedavg(_loss, client_optimizer=optax.sgd(0.3), server_optimizer=optax.sgd(1.0),
                  local_steps=3, batch_size=4, mesh=mesh, map_strategy=map_strategy)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_absent_slots_skip_training_on_a_clients_mesh(axis_type):
    mesh = jax.make_mesh((2,), ("clients",), axis_types=(axis_type,))
    params = {"w": np.random.default_rng(0).normal(size=(5, 2)).astype(np.float32)}
    data = _cohort(8, absent=4)
    algo = _fedavg(mesh)
    state = algo.init(params)
    with jax.set_mesh(mesh):
        placed = jax.device_put(data, NamedSharding(mesh, P("clients")))
        compiled = algo.jitted.lower(state, placed, jax.random.key(0)).compile()
        new, _ = compiled(state, placed, jax.random.key(0))
    # the per-client skip is a real branch in the compiled round, not a select of both
    assert "conditional(" in compiled.as_text()
    # oracle: the same round on one device (the same 8 slots, so the same client keys)
    one = _fedavg(None).round(algo.init(params), data, jax.random.key(0))[0]
    np.testing.assert_allclose(new.params["w"], one.params["w"], rtol=1e-5, atol=1e-6)


def test_sum_over_a_clients_mesh_adds_halves_per_device():
    mesh = jax.make_mesh((2,), ("clients",), axis_types=(AxisType.Auto,))
    # per device [1e8, 1, -1e8, 1]: halves give (1e8 - 1e8) + (1 + 1) = 2 exactly, a running
    # sum 1e8 + 1 -> 1e8 (float32) loses the ones
    col = np.array([1e8, 1, -1e8, 1, 0, 0, 0, 0], np.float32)
    v = np.stack([col, 2 * col], axis=1)  # (8 clients, 2)
    prog = federated_program(federated_sum, clients=8, mesh=mesh, placed=(0,))
    with jax.set_mesh(mesh):
        lowered = jax.jit(prog).lower(v)
        got = jax.jit(prog)(v)
    np.testing.assert_array_equal(np.asarray(got), [2.0, 4.0])
    text = lowered.as_text()
    assert "stablehlo.reduce(" not in text and "all_reduce" in text


# --- a client's training and its addition to the round's sums (issue 63's round targets) ---


def _linreg(params, batch):
    pred = batch["x"] @ params["w"] + params["b"]
    return 0.5 * (pred - batch["y"]) ** 2, None


def _linreg_cohort():
    from memaudit.federated.cohorts import pack_clients

    rng = np.random.default_rng(5)
    clients = [{"x": rng.normal(size=(k, 3)).astype(np.float32), "y": rng.normal(size=(k,)).astype(np.float32)}
               for k in (4, 0, 2, 3, 0)]  # two absent slots
    params = {"w": rng.normal(size=(3,)).astype(np.float32), "b": np.float32(-0.2)}
    return clients, pack_clients(clients), params


@pytest.mark.parametrize("dp", [False, True])
@pytest.mark.parametrize("steps", [1, 2, 3])
def test_peeled_local_steps_give_the_scanned_steps_round_bit_for_bit(steps, dp):
    from memaudit.federated.aggregators import mean_aggregator
    from memaudit.federated.algorithms import fedavg
    from memaudit.federated.dp import dp_fedavg

    clients, data, params = _linreg_cohort()
    agg = dp_fedavg(mean_aggregator(), clip=0.05, noise_multiplier=0.5, expected_cohort=3.0) if dp else None

    def algo(peel):
        return fedavg(_linreg, client_optimizer=optax.sgd(0.1), server_optimizer=optax.sgd(1.0),
                      local_steps=steps, batch_size=8, aggregator=agg, map_strategy="scan",
                      weighting="uniform" if dp else "examples", peel_local_steps=peel)

    (peeled, m_peeled), (scanned, m_scanned) = (
        a.round(a.init(params), data, jax.random.key(3)) for a in (algo(True), algo(False)))
    for k in ("w", "b"):
        np.testing.assert_array_equal(peeled.params[k], scanned.params[k])
    assert m_peeled == m_scanned
    assert m_peeled["cohort"] == 3.0
    if not dp:  # oracle: the same round in NumPy (float64)
        dw, db = np_fedavg_round(params, clients, lr=0.1, steps=steps)
        np.testing.assert_allclose(peeled.params["w"], params["w"] + dw, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(peeled.params["b"], params["b"] + db, rtol=1e-5, atol=1e-6)


def _counted_sum(strategy, clients_per_step=1, mesh=None):
    """Σ over the clients whose x's first entry is >= 0 of tanh(x @ w) (a matmul), and how many
    clients ran the function (host callbacks). A padding row (zeros) passes ``when``: the
    program's padding mask alone keeps it out."""
    from memaudit.federated import federated_broadcast, federated_map_sum

    ran = []

    def fn(w, x):
        jax.debug.callback(lambda: ran.append(1))
        return {"v": jnp.tanh(x @ w), "n": jnp.float32(1.0)}

    def when(w, x):
        return x[0, 0] >= 0

    prog = federated_program(lambda w, x: federated_map_sum(fn, federated_broadcast(w), x, when=when),
                             clients=5, mesh=mesh, placed=(1,), map_strategy=strategy,
                             clients_per_step=clients_per_step)
    return prog, ran


@pytest.mark.parametrize("strategy,clients_per_step", [("scan", 1), ("scan", 2), ("vmap", 1)])
def test_a_sum_over_the_clients_adds_only_where_when_holds(strategy, clients_per_step):
    rng = np.random.default_rng(2)
    w = rng.normal(size=(4, 3)).astype(np.float32)
    x = rng.normal(size=(5, 2, 4)).astype(np.float32)
    x[:, 0, 0] = [1.0, -1.0, 2.0, -3.0, 0.5]  # clients 1 and 3 do not count
    keep = x[:, 0, 0] > 0
    want = np.tanh(np.einsum("cbd,de->cbe", x.astype(np.float64), w))[keep].sum(axis=0)
    prog, ran = _counted_sum(strategy, clients_per_step)
    got = prog(w, x)
    jax.effects_barrier()
    np.testing.assert_allclose(got["v"], want, rtol=1e-5)
    assert float(got["n"]) == 3.0
    if strategy == "scan" and clients_per_step == 1:  # one client a step: the others never ran
        assert len(ran) == 3
    # the derivative stays the map's: d/dw of the counted clients' sum, against NumPy
    g = jax.grad(lambda w: jnp.sum(prog(w, x)["v"]))(w)
    t = np.tanh(np.einsum("cbd,de->cbe", x.astype(np.float64), w))
    want_g = np.einsum("cbd,cbe->de", x[keep], 1 - t[keep] ** 2)
    np.testing.assert_allclose(g, want_g, rtol=1e-4, atol=1e-5)


def test_a_sum_over_a_padded_clients_mesh_adds_only_where_when_holds():
    mesh = jax.make_mesh((2,), ("clients",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(4)
    w = rng.normal(size=(4, 3)).astype(np.float32)
    x = rng.normal(size=(5, 2, 4)).astype(np.float32)  # 5 clients on 2 devices: a padding row
    x[:, 0, 0] = [1.0, -1.0, 2.0, -3.0, 0.5]
    keep = x[:, 0, 0] > 0
    prog, _ = _counted_sum("scan", mesh=mesh)
    with jax.set_mesh(mesh):
        got = jax.jit(prog)(w, x)
    np.testing.assert_allclose(got["v"], np.tanh(np.einsum("cbd,de->cbe", x, w))[keep].sum(axis=0), rtol=1e-5)
    assert float(got["n"]) == 3.0
