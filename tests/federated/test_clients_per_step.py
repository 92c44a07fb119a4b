"""federated.clients_per_step: the scan strategy's loop over the cohort runs k clients a step,
vmapped within the step, with FedAvg's sum (and DP-FedAvg's clipping) still inside the loop.

Oracles: the one-client-per-step round (k = 1, itself checked against vmap and a NumPy loop in
test_map_strategy.py) and NumPy loops over the clients; rows that only fill the last step must
count for nothing, also on a clients mesh where each device fills its own last step.
"""

from __future__ import annotations

from contextlib import nullcontext

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

from memaudit.config import ConfigError, load_config
from memaudit.federated import (
    federated_broadcast,
    federated_map,
    federated_map_sum,
    federated_program,
    federated_sum,
)
from memaudit.federated.aggregators import mean_aggregator
from memaudit.federated.algorithms import fedavg
from memaudit.federated.cohorts import ClientData
from memaudit.federated.dp import dp_fedavg


def _loss(params, batch):  # a matmul per client: one client's work is a real training step
    pred = jnp.tanh(batch["x"] @ params["w"])
    return jnp.mean((pred - batch["y"]) ** 2, axis=-1), None


def _cohort(n, absent, d_in=5, d_out=2, seed=0):
    rng = np.random.default_rng(seed)
    mask = (rng.random((n, 6)) < 0.8).astype(np.float32)
    mask[:, 0] = 1.0
    mask[n - absent:] = 0.0  # absent slots (capacity padding): weight 0, no training
    data = ClientData({"x": rng.normal(size=(n, 6, d_in)).astype(np.float32),
                       "y": rng.normal(size=(n, 6, d_out)).astype(np.float32)}, mask)
    return data, {"w": rng.normal(size=(d_in, d_out)).astype(np.float32)}


def _fedavg(k, dp, present, mesh=None):
    agg = dp_fedavg(mean_aggregator(mesh), clip=0.05, noise_multiplier=1.0,
                    expected_cohort=float(present)) if dp else None
    return fedavg(_loss, client_optimizer=optax.sgd(0.3), server_optimizer=optax.sgd(1.0),
                  local_steps=3, batch_size=4, aggregator=agg, weighting="uniform" if dp else "examples",
                  mesh=mesh, map_strategy="scan", clients_per_step=k)


@pytest.mark.parametrize("dp", [False, True], ids=["fedavg", "dp_fedavg"])
@pytest.mark.parametrize(("n", "absent"), [(8, 0), (7, 2)], ids=["divisible", "padded"])
def test_k_clients_per_step_give_the_one_client_round(dp, n, absent):
    data, params = _cohort(n, absent)
    key = jax.random.key(3)  # the same round key: the same client keys and the same DP noise
    ref = _fedavg(1, dp, n - absent)
    want, want_m = ref.round(ref.init(params), data, key)
    assert not np.allclose(want.params["w"], params["w"])  # the round moved the model
    if dp:
        assert want_m["clip_fraction"] > 0 and want_m["noise_std"] > 0  # clipped and noised
    for k in (2, 4):
        algo = _fedavg(k, dp, n - absent)
        got, got_m = algo.round(algo.init(params), data, key)
        np.testing.assert_allclose(got.params["w"], want.params["w"], rtol=1e-5, atol=1e-6)
        for name in ("loss", "delta_norm", "cohort", "examples", *(("clip_fraction",) if dp else ())):
            np.testing.assert_allclose(got_m[name], want_m[name], rtol=1e-5, err_msg=name)


def _rows_np(theta, x):  # one client's outputs; not zero for a zero row
    return {"s": float(np.sum(np.tanh(x @ theta))) + 1.0, "v": np.tanh(x @ theta).sum(axis=0) + 1.0}


def _rows(theta, x):
    y = jnp.tanh(x @ theta)
    return {"s": jnp.sum(y) + 1.0, "v": y.sum(axis=0) + 1.0}


@pytest.mark.parametrize(("k", "devices", "axis_type"), [
    (2, 1, None), (4, 1, None), (2, 2, AxisType.Auto), (4, 2, AxisType.Auto), (2, 2, AxisType.Explicit)])
def test_rows_that_fill_the_last_step_count_for_nothing(k, devices, axis_type):
    n = 5  # 5 clients: the last step of 2 or 4 is filled; on 2 devices each fills its own
    mesh = None if devices == 1 else jax.make_mesh((devices,), ("clients",), axis_types=(axis_type,))
    rng = np.random.default_rng(1)
    theta = rng.normal(size=(3, 2)).astype(np.float32)
    x = rng.normal(size=(n, 4, 3)).astype(np.float32)
    want = [_rows_np(theta, x[i]) for i in range(n)]

    @federated_program(clients=n, mesh=mesh, placed=(1,), map_strategy="scan", clients_per_step=k)
    def program(theta, x):
        th = federated_broadcast(theta)
        return federated_map_sum(_rows, th, x), federated_map(_rows, th, x)

    with jax.set_mesh(mesh) if mesh is not None else nullcontext():
        total, each = jax.jit(program)(theta, x)
    np.testing.assert_allclose(total["s"], sum(w["s"] for w in want), rtol=1e-5)
    np.testing.assert_allclose(total["v"], sum(w["v"] for w in want), rtol=1e-5)
    np.testing.assert_allclose(each["s"], [w["s"] for w in want], rtol=1e-5)
    np.testing.assert_allclose(each["v"], np.stack([w["v"] for w in want]), rtol=1e-5)


def test_gradient_of_a_grouped_program_with_a_branch_per_client():
    """A derivative's loop runs one client per step (a batched JVP of a per-client lax.cond
    cannot be transposed): the gradient is the one-client program's."""
    n = 5
    rng = np.random.default_rng(2)
    theta = rng.normal(size=(3, 2)).astype(np.float32)
    x = rng.normal(size=(n, 4, 3)).astype(np.float32)
    x[3] = 0.0  # a client that skips its work

    def client(th, xi):
        return jax.lax.cond(jnp.sum(jnp.abs(xi)) > 0, lambda: jnp.sum(jnp.tanh(xi @ th)),
                            lambda: jnp.zeros((), jnp.float32))

    def objective(k):
        @federated_program(clients=n, placed=(1,), map_strategy="scan", clients_per_step=k)
        def program(theta, x):
            return federated_sum(federated_map(client, federated_broadcast(theta), x)) \
                + federated_map_sum(client, federated_broadcast(theta), x)

        return program

    want = jax.grad(objective(1))(theta, x)
    np.testing.assert_allclose(jax.grad(objective(2))(theta, x), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.jit(objective(4))(theta, x), jax.jit(objective(1))(theta, x), rtol=1e-5)


def test_a_dp_round_holds_k_clipped_deltas_a_step_never_the_cohorts():
    n, k = 12, 4
    data, params = _cohort(n, 0, d_in=40, d_out=24)
    algo = _fedavg(k, True, n)
    hlo = algo.jitted.lower(algo.init(params), data, jax.random.key(0)).compile().as_text()
    assert "f32[4,40,24]" in hlo  # the step's k deltas
    assert "f32[12,40,24]" not in hlo  # no delta per client of the cohort


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_clients_per_step_is_refused_unless_a_positive_int(bad):
    with pytest.raises(ValueError, match="clients_per_step must be a positive int") as e:
        federated_program(lambda x: x, clients=3, clients_per_step=bad)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("overrides", "says"), [
    (["federated.clients_per_step=0"], "greater than or equal to 1"),
    (["federated.clients_per_step=2", "federated.runtime=flower"], "federated.runtime=jax only"),
    (["federated.clients_per_step=2", "federated.algorithm=fedsgd"], "FedAvg's local training"),
])
def test_config_refuses_clients_per_step_where_it_does_not_run(overrides, says):
    with pytest.raises(ConfigError, match=says) as e:
        load_config(None, overrides)
    assert "\n" not in str(e.value)
    assert load_config(None, ["federated.clients_per_step=4"]).federated.clients_per_step == 4
