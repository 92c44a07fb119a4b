"""federated_map execution strategies: "scan" (lax.map inside the program, per device shard on
a mesh) gives the values and gradients of "vmap" and of a NumPy loop over clients."""

from contextlib import nullcontext as _nullcontext

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
from memaudit.federated.algorithms import (
    fedavg,
    fedsgd,
    make_client_mean_phase,
    make_client_phase,
    make_server_optimizer,
)
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


def _lin_cohort(rng, n: int, m: int, keep: float, d_in: int = 4, d_out: int = 2):
    """n clients of m examples for `_lin_loss` (each example real with probability keep), and
    random (d_in, d_out) weights."""
    data = ClientData({"x": rng.normal(size=(n, m, d_in)).astype(np.float32),
                       "y": rng.normal(size=(n, m, d_out)).astype(np.float32)},
                      (rng.random((n, m)) < keep).astype(np.float32))
    return data, {"w": jnp.asarray(rng.normal(size=(d_in, d_out)), jnp.float32)}


@pytest.mark.parametrize("algo", ["fedavg", "fedsgd"])
def test_algorithms_give_the_same_round_with_either_strategy(algo):
    data, params = _lin_cohort(np.random.default_rng(3), n=6, m=5, keep=0.8)
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


def _padded(data: ClientData, capacity: int) -> ClientData:
    """The same cohort in a larger clients dim: absent slots with zero data and mask 0."""
    pad = capacity - data.mask.shape[0]

    def grow(x):
        return np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)])

    return ClientData(jax.tree.map(grow, data.examples), grow(data.mask))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_padded_cohort_gives_the_unpadded_aggregate_under_scan(optimizer):
    n = 5
    data, params = _lin_cohort(np.random.default_rng(5), n=n, m=6, keep=0.7)
    data.mask[:, 0] = 1.0  # every real client has an example
    client_opt = optax.sgd(0.05) if optimizer == "sgd" else optax.adam(0.05)
    kw = {"client_optimizer": client_opt, "server_optimizer": optax.sgd(1.0), "local_steps": 3,
          "batch_size": 2, "map_strategy": "scan"}
    phase = jax.jit(make_client_phase(_lin_loss, client_opt, local_steps=3, batch_size=2,
                                      map_strategy="scan"))
    key = jax.random.key(7)
    ref_out = phase(params, data, key)
    ref_state, ref_metrics = fedavg(_lin_loss, **kw).round(
        fedavg(_lin_loss, **kw).init(params), data, key)
    for capacity in (8, 13):
        out = phase(params, _padded(data, capacity), key)
        # real clients: the same local training (their keys do not depend on the capacity)
        np.testing.assert_array_equal(out.deltas["w"][:n], ref_out.deltas["w"])
        np.testing.assert_array_equal(out.weights[:n], ref_out.weights)
        # padded clients: exactly zero delta and weight
        assert not np.any(np.asarray(out.deltas["w"][n:])) and not np.any(out.weights[n:])
        alg = fedavg(_lin_loss, **kw)
        state, metrics = alg.round(alg.init(params), _padded(data, capacity), key)
        np.testing.assert_allclose(state.params["w"], ref_state.params["w"], rtol=1e-6, atol=1e-7)
        for k in ("loss", "delta_norm", "cohort", "examples", "total_weight"):
            np.testing.assert_allclose(metrics[k], ref_metrics[k], rtol=1e-6)


def _compiled_scan_phase(make_phase, seed: int) -> str:
    """Optimised HLO of a scan-strategy client phase: 6 clients, a (40, 24) linear model."""
    data, params = _lin_cohort(np.random.default_rng(seed), n=6, m=3, keep=1.0, d_in=40, d_out=24)
    phase = make_phase(_lin_loss, optax.sgd(0.1), local_steps=2, batch_size=2, map_strategy="scan")
    return jax.jit(phase).lower(params, data, jax.random.key(0)).compile().as_text()


def test_scan_skips_absent_clients_and_reads_the_broadcast_model_once():
    """The compiled round has a conditional around local training, and no (clients, *param)
    copy of the broadcast model (the scan reads the server value)."""
    hlo = _compiled_scan_phase(make_client_phase, seed=0)
    assert " conditional(" in hlo
    entry = hlo[hlo.index("ENTRY"):]
    stacked = [line for line in entry.splitlines() if "= f32[6,40,24]" in line]
    assert stacked  # the per-client deltas, stacked ...
    assert not [line for line in stacked if "broadcast" in line and "constant" not in line]


@pytest.mark.parametrize("mesh_axes", [None, AxisType.Auto, AxisType.Explicit])
def test_scan_reading_the_server_value_matches_vmap(mesh_axes):
    n = 7
    theta, x, y, _ = _data(n, seed=3)
    mesh = None if mesh_axes is None else jax.make_mesh(
        (2, 2), ("clients", "model"), axis_types=(mesh_axes,) * 2)

    def program(strategy):
        return federated_program(
            lambda t, x, y: federated_map(_mlp_loss, federated_broadcast(t), x, y,
                                          strategy=strategy),
            clients=n, mesh=mesh, placed=(1, 2))

    want = jax.vmap(_mlp_loss, in_axes=(None, 0, 0))(theta, x, y)
    with jax.set_mesh(mesh) if mesh is not None else _nullcontext():
        got = jax.jit(program("scan"))(theta, x, y)
        got_bs = jax.jit(federated_program(
            lambda t, x, y: federated_map(_mlp_loss, federated_broadcast(t), x, y,
                                          strategy="scan", batch_size=2),
            clients=n, mesh=mesh, placed=(1, 2)))(theta, x, y)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_bs, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("weighting", ["examples", "uniform"])
def test_fused_mean_round_equals_the_mean_aggregator_on_stacked_deltas(weighting):
    """fedavg's default aggregator sums the weighted deltas inside the clients' loop; the
    round equals the one with mean_aggregator() over the stacked deltas, metrics included."""
    from memaudit.federated.aggregators import mean_aggregator

    rng = np.random.default_rng(9)
    n, m = 6, 5
    data = _padded(ClientData({"x": rng.normal(size=(n, m, 4)).astype(np.float32),
                               "y": rng.normal(size=(n, m, 2)).astype(np.float32)},
                              (rng.random((n, m)) < 0.7).astype(np.float32)), 8)
    data.mask[1] = 0.0  # an absent client among the real slots
    params = {"w": jnp.asarray(rng.normal(size=(4, 2)), jnp.float32),
              "b": jnp.zeros((2,), jnp.bfloat16)}  # a low-precision leaf: float32 sums
    kw = {"client_optimizer": optax.sgd(0.05), "server_optimizer": make_server_optimizer(
        "fedadam", 0.01), "local_steps": 2, "batch_size": 2, "weighting": weighting}

    def loss(p, batch):
        pred = batch["x"] @ p["w"] + p["b"].astype(jnp.float32)
        return jnp.sum((pred - batch["y"]) ** 2, axis=-1), None

    results = {}
    for name, agg, fuse in (("fused", None, True), ("stacked", mean_aggregator(), False)):
        for strategy in ("scan", "vmap"):
            alg = fedavg(loss, aggregator=agg, map_strategy=strategy, fuse=fuse, **kw)
            state = alg.init(params)
            for r in range(2):
                state, metrics = alg.round(state, data, jax.random.key(r))
            results[(name, strategy)] = (state, metrics)
    ref_state, ref_metrics = results[("stacked", "vmap")]
    for state, metrics in results.values():
        np.testing.assert_allclose(state.params["w"], ref_state.params["w"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(state.params["b"], np.float32),
                                   np.asarray(ref_state.params["b"], np.float32), atol=1e-2)
        assert set(metrics) == set(ref_metrics)
        for k, v in ref_metrics.items():
            np.testing.assert_allclose(metrics[k], v, rtol=1e-4, atol=1e-7, err_msg=k)  # bf16 b
    assert ref_metrics["cohort"] == n - 1 and ref_metrics["aggregated_clients"] == n - 1


def test_fused_mean_round_holds_no_delta_per_client():
    hlo = _compiled_scan_phase(make_client_mean_phase, seed=1)
    assert "f32[40,24]" in hlo and "f32[6,40,24]" not in hlo


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("mesh_clients", [None, 2])
def test_fused_dp_fedavg_equals_dp_fedavg_on_stacked_deltas(adaptive, mesh_clients):
    """DP-FedAvg over the mean clips each delta and sums it inside the clients' loop; with the
    same keys the rounds (clipped and unclipped clients, an absent one, noise, the adaptive
    clip's noisy count) equal the aggregator's on the stacked deltas, metrics included."""
    from memaudit.config import AdaptiveClipConfig
    from memaudit.federated.aggregators import mean_aggregator
    from memaudit.federated.dp import dp_fedavg

    data, params = _lin_cohort(np.random.default_rng(5), n=6, m=4, keep=0.8, d_in=5, d_out=3)
    data.mask[2] = 0.0  # an absent client
    data = _padded(data, 8)
    mesh = None if mesh_clients is None else jax.make_mesh((mesh_clients,), ("clients",))
    ada = AdaptiveClipConfig(enabled=True, initial_clip=2.0, lr=0.3, count_noise=1.0) if adaptive else None
    results = {}
    for fuse in (True, False):
        agg = dp_fedavg(mean_aggregator(mesh), clip=2.0, noise_multiplier=0.7, expected_cohort=5.0,
                        adaptive=ada)
        alg = fedavg(_lin_loss, client_optimizer=optax.sgd(0.1), server_optimizer=optax.sgd(1.0),
                     local_steps=2, batch_size=2, aggregator=agg, weighting="uniform", mesh=mesh,
                     map_strategy="scan", fuse=fuse, donate=fuse)
        state = alg.init(jax.tree.map(jnp.array, params))  # a copy: the fused round donates it
        rounds = []
        for r in range(3):
            state, metrics = alg.round(state, data, jax.random.key(r))
            rounds.append(metrics)
        results[fuse] = (jax.tree.map(np.asarray, state), rounds)
    (got, got_rounds), (ref, ref_rounds) = results[True], results[False]
    np.testing.assert_allclose(got.params["w"], ref.params["w"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got.agg_state.clip, ref.agg_state.clip, rtol=1e-6)
    for gm, rm in zip(got_rounds, ref_rounds, strict=True):
        assert set(gm) == set(rm)
        for k, v in rm.items():
            np.testing.assert_allclose(gm[k], v, rtol=1e-6, atol=1e-7, err_msg=k)
    # round 1 has clipped and unclipped clients (delta norms 1.6 to 3.9 around the clip 2)
    assert 0 < ref_rounds[0]["clip_fraction"] < 1


def test_fused_dp_round_holds_no_delta_per_client():
    from memaudit.federated.dp import dp_fedavg

    data, params = _lin_cohort(np.random.default_rng(1), n=6, m=3, keep=1.0, d_in=40, d_out=24)
    hlo = {}
    for fuse in (True, False):
        alg = fedavg(_lin_loss, client_optimizer=optax.sgd(0.1), server_optimizer=optax.sgd(1.0),
                     local_steps=2, batch_size=2, map_strategy="scan", fuse=fuse,
                     aggregator=dp_fedavg(clip=1.0, noise_multiplier=1.0, expected_cohort=6.0))
        hlo[fuse] = alg.program.lower(alg.init(params), data, jax.random.key(0)).compile().as_text()
    assert "f32[6,40,24]" in hlo[False]  # the stacked version holds a clipped delta per client
    assert "f32[40,24]" in hlo[True] and "f32[6,40,24]" not in hlo[True]
