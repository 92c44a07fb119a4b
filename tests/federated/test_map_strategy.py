"""federated_map execution strategies: "scan" (lax.map inside the program, per device shard on
a mesh) gives the values and gradients of "vmap" and of a NumPy loop over clients."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from memaudit.federated import (
    federated_broadcast,
    federated_map,
    federated_mean,
    federated_program,
    federated_weighted_mean,
)
from memaudit.federated.algorithms import fedavg, fedsgd
from memaudit.federated.cohorts import ClientData
from memaudit.federated.primitives import PRIMITIVE_NAMES, resolve_map_strategy

D, H, M = 5, 6, 4  # features, hidden units, examples per client


def _mlp_loss(theta, x, y):
    """One client's mean squared error of a 1-hidden-layer tanh MLP (matmuls: scan on CPU)."""
    h = jnp.tanh(x @ theta["w1"])
    return 0.5 * jnp.mean((h @ theta["w2"] - y) ** 2)


def _mlp_loss_np(theta, x, y):
    h = np.tanh(x @ theta["w1"])
    return 0.5 * np.mean((h @ theta["w2"] - y) ** 2)


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    theta = {"w1": rng.normal(size=(D, H)).astype(np.float32),
             "w2": rng.normal(size=(H,)).astype(np.float32)}
    x = rng.normal(size=(n, M, D)).astype(np.float32)
    y = rng.normal(size=(n, M)).astype(np.float32)
    w = rng.uniform(0.5, 2.0, size=n).astype(np.float32)
    return theta, x, y, w


def _objective(n, strategy, mesh=None, batch_size=None):
    @federated_program(clients=n, mesh=mesh, placed=(1, 2, 3), map_strategy=strategy)
    def objective(theta, x, y, w):
        losses = federated_map(_mlp_loss, federated_broadcast(theta), x, y, batch_size=batch_size)
        return federated_weighted_mean(losses, w), losses

    return objective


def _value_and_grad(obj):
    """jit of ((weighted mean loss, per-client losses), d mean / d theta): one compile."""
    return jax.jit(jax.value_and_grad(obj, has_aux=True))


def test_scan_matches_vmap_and_a_numpy_loop():
    n = 7
    theta, x, y, w = _data(n)
    want_losses = np.array([_mlp_loss_np(theta, x[i], y[i]) for i in range(n)])
    want = float((w * want_losses).sum() / w.sum())
    results = {}
    for strategy, bs in (("vmap", None), ("scan", None), ("scan", 3)):
        obj = _objective(n, strategy, batch_size=bs)
        (val, losses), grad = _value_and_grad(obj)(theta, x, y, w)
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(float(val), want, rtol=1e-5)
        results[(strategy, bs)] = grad
    # gradient oracle: central finite differences of the NumPy objective (float64)
    t64 = {k: v.astype(np.float64) for k, v in theta.items()}

    def f(t):
        return (w * np.array([_mlp_loss_np(t, x[i], y[i]) for i in range(n)])).sum() / w.sum()

    eps = 1e-6
    for name in ("w1", "w2"):
        num = np.zeros_like(t64[name])
        for idx in np.ndindex(num.shape):
            tp = {k: v.copy() for k, v in t64.items()}
            tm = {k: v.copy() for k, v in t64.items()}
            tp[name][idx] += eps
            tm[name][idx] -= eps
            num[idx] = (f(tp) - f(tm)) / (2 * eps)
        for grad in results.values():
            np.testing.assert_allclose(grad[name], num, rtol=2e-4, atol=2e-5)
    for grad in results.values():  # vmap and scan agree to float32 round-off
        for name in theta:
            np.testing.assert_allclose(grad[name], results[("vmap", None)][name],
                                       rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_scan_on_a_mesh_matches_the_unsharded_run(axis_type):
    n = 7  # padded to 8 on the 2-device clients axis
    mesh = jax.make_mesh((2, 2), ("clients", "model"), axis_types=(axis_type,) * 2)
    theta, x, y, w = _data(n, seed=n)
    (ref_val, ref_losses), ref_grad = _value_and_grad(_objective(n, "vmap"))(theta, x, y, w)
    with jax.set_mesh(mesh):
        (val, losses), grad = _value_and_grad(_objective(n, "scan", mesh=mesh))(theta, x, y, w)
        # the per-client outputs stay laid out over the clients axis
        pinned = federated_program(lambda t, x, y: federated_map(
            _mlp_loss, federated_broadcast(t), x, y, strategy="scan"),
            clients=8, mesh=mesh, placed=(1, 2))
        out = jax.jit(pinned)(theta, *_data(8)[1:3])
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("clients")), 1)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(val), float(ref_val), rtol=1e-5)
    for name in theta:
        np.testing.assert_allclose(grad[name], ref_grad[name], rtol=1e-5, atol=1e-6)


def _eqns(jaxpr):
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        subs = [getattr(s, "jaxpr", s) for v in eqn.params.values()
                for s in (v if isinstance(v, (tuple, list)) else (v,))
                if isinstance(s, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr))]
        yield eqn
        for sub in subs:
            yield from _eqns(sub)


def test_scan_gradient_is_still_a_federated_program():
    n = 5
    theta, x, y, _ = _data(n)

    @federated_program(clients=n, map_strategy="scan")
    def loss(theta):
        return federated_mean(federated_map(_mlp_loss, federated_broadcast(theta), x, y))

    names = {e.primitive.name for e in _eqns(jax.make_jaxpr(jax.grad(loss))(theta))}
    assert {"federated_sum", "federated_broadcast"} <= names  # transposes of mean/broadcast
    assert "scan" in names  # the clients really run in a loop
    assert not names & {"psum", "all_gather", "all_to_all", "ppermute"}
    assert names & PRIMITIVE_NAMES


def test_auto_strategy_and_bad_values():
    x = jnp.ones((3, 4, D))
    want = "scan" if jax.default_backend() == "cpu" else "vmap"
    assert resolve_map_strategy(lambda t, x: x @ t, (jnp.ones((3, D)), x), "auto") == want
    assert resolve_map_strategy(jnp.sin, (x,), "auto") == "vmap"  # elementwise: batched
    assert resolve_map_strategy(jnp.sin, (x,), "scan") == "scan"
    with pytest.raises(ValueError, match="strategy must be one of"):
        resolve_map_strategy(jnp.sin, (x,), "loop")
    with pytest.raises(ValueError, match="map_strategy must be"):
        federated_program(lambda v: v, clients=3, map_strategy="pmap")
    prog = federated_program(lambda v: federated_map(jnp.sin, v, batch_size=0), clients=3)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        prog(x)


def _lin_loss(params, batch):
    return jnp.sum((batch["x"] @ params["w"] - batch["y"]) ** 2, axis=-1), None


@pytest.mark.parametrize("algo", ["fedavg", "fedsgd"])
def test_algorithms_give_the_same_round_with_either_strategy(algo):
    rng = np.random.default_rng(3)
    n, m = 6, 5
    data = ClientData({"x": rng.normal(size=(n, m, 4)).astype(np.float32),
                       "y": rng.normal(size=(n, m, 2)).astype(np.float32)},
                      (rng.random((n, m)) < 0.8).astype(np.float32))
    params = {"w": jnp.asarray(rng.normal(size=(4, 2)), jnp.float32)}
    out = {}
    for strategy in ("vmap", "scan"):
        if algo == "fedavg":
            alg = fedavg(_lin_loss, client_optimizer=optax.sgd(0.05),
                         server_optimizer=optax.sgd(1.0), local_steps=3, batch_size=2,
                         map_strategy=strategy)
        else:
            alg = fedsgd(_lin_loss, server_optimizer=optax.sgd(0.1), map_strategy=strategy)
        state, metrics = alg.round(alg.init(params), data, jax.random.key(0))
        out[strategy] = (state.params["w"], metrics["loss"])
    np.testing.assert_allclose(out["scan"][0], out["vmap"][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["scan"][1], out["vmap"][1], rtol=1e-5)
    assert not np.allclose(out["scan"][0], params["w"])  # the round did move the model
