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
