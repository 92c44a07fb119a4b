"""Sharding of the clients dim on a (clients=2, model=2) mesh of fake CPU devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from memaudit.federated import (
    federated_broadcast,
    federated_map,
    federated_map_sum,
    federated_mean,
    federated_program,
    federated_sum,
    federated_weighted_mean,
    padded_clients,
)
from memaudit.federated.aggregators import mean_aggregator, sum_aggregator

RNG = np.random.default_rng(3)
X10 = RNG.normal(size=(10,)).astype(np.float32)


@pytest.fixture(scope="module", params=[AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def mesh(request):
    assert jax.device_count() >= 4, "tests/conftest.py must give 8 fake CPU devices"
    return jax.make_mesh((2, 2), ("clients", "model"), axis_types=(request.param,) * 2)


def _program(n, mesh):
    @federated_program(clients=n, mesh=mesh, placed=(1, 2))
    def prog(x, v, w):  # x (10,) server; v (n, 10), w (n,) clients
        y = federated_map(lambda a, b: jnp.tanh(a * b), federated_broadcast(x), v)
        return y, federated_sum(y), federated_mean(y), federated_weighted_mean(y, w)

    return prog


def test_broadcast_shards_the_clients_dim(mesh):
    prog = federated_program(federated_broadcast, clients=100, mesh=mesh)
    with jax.set_mesh(mesh):
        out = jax.jit(prog)(X10)
        assert out.shape == (100, 10)
        assert out.addressable_shards[0].data.shape == (50, 10)
        assert not out.sharding.is_fully_replicated
        x_model = jax.device_put(X10, NamedSharding(mesh, P("model")))
        out_model = jax.jit(prog)(x_model)
    assert out_model.addressable_shards[0].data.shape == (50, 5)
    eager = prog(x_model)  # eager: the program sets the mesh itself
    assert eager.addressable_shards[0].data.shape == (50, 5)
    for o in (out, out_model, eager):
        np.testing.assert_array_equal(o, np.tile(X10, (100, 1)))


@pytest.mark.parametrize("n", [100, 7])
def test_results_equal_the_unsharded_run(mesh, n):
    v = RNG.normal(size=(n, 10)).astype(np.float32)
    w = RNG.uniform(0.5, 2.0, size=(n,)).astype(np.float32)
    want = _program(n, None)(X10, v, w)
    loss = lambda prog: lambda x: jnp.sum(prog(x, v, w)[3] ** 2)
    with jax.set_mesh(mesh):
        got = jax.jit(_program(n, mesh))(X10, v, w)
        grad = jax.jit(jax.grad(loss(_program(n, mesh))))(X10)
    assert got[0].shape == (n, 10)  # padding stripped
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, jax.grad(loss(_program(n, None)))(X10), rtol=1e-5, atol=1e-6)


def test_padding_counts(mesh):
    assert padded_clients(7, mesh) == 8 and padded_clients(100, mesh) == 100
    assert padded_clients(7, None) == 7


def test_map_outputs_pinned_to_the_clients_axis(mesh):
    v = RNG.normal(size=(8, 10)).astype(np.float32)
    prog = federated_program(lambda v: federated_map(jnp.sin, v), clients=8, mesh=mesh, placed=(0,))
    with jax.set_mesh(mesh):
        out = jax.jit(prog)(v)
    assert out.addressable_shards[0].data.shape[0] == 4
    np.testing.assert_allclose(out, np.sin(v), rtol=1e-6)


def test_aggregators_on_a_mesh_with_padding(mesh):
    deltas = {"w": RNG.normal(size=(7, 4)).astype(np.float32)}
    weights = np.array([1, 0, 2, 3, 0, 1, 5], np.float32)
    with jax.set_mesh(mesh):
        mean = jax.jit(mean_aggregator(mesh).aggregate)(deltas, weights, (), None)
        total = jax.jit(sum_aggregator(mesh).aggregate)(deltas, weights, (), None)
    expected_sum = (weights[:, None] * deltas["w"]).sum(0)
    np.testing.assert_allclose(mean.update["w"], expected_sum / weights.sum(), rtol=1e-5)
    np.testing.assert_allclose(total.update["w"], expected_sum, rtol=1e-5)
    assert int(mean.metrics["aggregated_clients"]) == 5


def test_mesh_without_clients_axis_is_unsharded():
    mesh = jax.make_mesh((4,), ("model",), axis_types=(AxisType.Auto,))
    v = RNG.normal(size=(5, 10)).astype(np.float32)
    w = np.ones(5, np.float32)
    got = _program(5, mesh)(X10, v, w)
    want = _program(5, None)(X10, v, w)
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-6)


@pytest.mark.parametrize("strategy", ["scan", "vmap"])
def test_model_sharded_dims_survive_broadcast_map_and_aggregations(mesh, strategy):
    """A server weight split over `model` stays split through every primitive (FAX keeps it
    with shard_alike), and the values are those of the unsharded program."""
    n = 8
    x_host = RNG.normal(size=(6, 10)).astype(np.float32)
    v_host = RNG.normal(size=(n, 6, 10)).astype(np.float32)
    w = RNG.uniform(0.5, 2.0, size=(n,)).astype(np.float32)

    def body(x, v, w):
        y = federated_map(lambda a, b: jnp.tanh(a * b), federated_broadcast(x), v, strategy=strategy)
        fused = federated_map_sum(lambda a, b: a * b, federated_broadcast(x), v, strategy=strategy)
        return y, federated_sum(y), federated_mean(y), federated_weighted_mean(y, w), fused

    want = federated_program(body, clients=n, placed=(1, 2))(x_host, v_host, w)
    x = jax.device_put(x_host, NamedSharding(mesh, P(None, "model")))
    v = jax.device_put(v_host, NamedSharding(mesh, P("clients", None, "model")))
    with jax.set_mesh(mesh):
        got = jax.jit(federated_program(body, clients=n, mesh=mesh, placed=(1, 2)))(x, v, w)
    assert got[0].sharding.spec == P("clients", None, "model")
    for g, e in zip(got, want, strict=True):
        assert g.addressable_shards[0].data.shape[-1] == 5  # the model-split dim
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)
