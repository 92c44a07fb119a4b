"""Federated primitives: values, derivatives (forward and reverse), batching, AD closure."""

from __future__ import annotations

import contextlib

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from memaudit.federated import (
    PRIMITIVE_NAMES,
    ClosureError,
    federated_broadcast,
    federated_map,
    federated_map_sum,
    federated_mean,
    federated_program,
    federated_sum,
    federated_weighted_mean,
)
from memaudit.federated.closure import communication_of as _communication_of

N, D = 100, 3
RNG = np.random.default_rng(0)
X = RNG.normal(size=(D,)).astype(np.float32)  # server-placed
V = RNG.normal(size=(N, D)).astype(np.float32)  # clients-placed
W = RNG.uniform(0.1, 2.0, size=(N,)).astype(np.float32)  # clients-placed weights
CT_CLIENTS = RNG.normal(size=(N, D)).astype(np.float32)
CT_SERVER = RNG.normal(size=(D,)).astype(np.float32)

bcast = federated_program(federated_broadcast, clients=N)
fsum = federated_program(federated_sum, clients=N)
fmean = federated_program(federated_mean, clients=N)
fwmean = federated_program(federated_weighted_mean, clients=N)


def np_wmean(v, w):
    return (w[:, None] * v).sum(0) / w.sum()


def maybe_jit(f, jit):
    return jax.jit(f) if jit else f


@pytest.mark.parametrize("fn", [federated_broadcast, federated_sum, federated_mean])
def test_outside_a_program_is_a_clear_error(fn):
    with pytest.raises(RuntimeError, match="outside a federated program.*@federated_program"):
        fn(jnp.ones((N, D)))


def test_map_and_weighted_mean_outside_a_program():
    with pytest.raises(RuntimeError, match="federated_map was called outside"):
        federated_map(jnp.sin, jnp.ones((N, D)))
    with pytest.raises(RuntimeError, match="federated_weighted_mean was called outside"):
        federated_weighted_mean(jnp.ones((N, D)), jnp.ones(N))


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 13])
def test_sums_over_the_clients_dim_by_halves(n):
    """Per-client values of many elements are summed pairwise (fast on XLA:CPU): the same
    sums as NumPy, for odd n, integer (wrapping) and bool values, and padded clients."""
    rng = np.random.default_rng(n)
    v = rng.normal(size=(n, 4, 5)).astype(np.float32)
    want = v.astype(np.float64).sum(0)
    for prog in (federated_sum, federated_mean):
        got = jax.jit(federated_program(prog, clients=n))(v)
        np.testing.assert_allclose(got, want / (n if prog is federated_mean else 1),
                                   rtol=1e-5, atol=1e-6)
    ints = rng.integers(0, 2**32, size=(n, 6), dtype=np.uint32)
    got = jax.jit(federated_program(federated_sum, clients=n))(ints)
    np.testing.assert_array_equal(got, ints.sum(0, dtype=np.uint64).astype(np.uint32))
    bf = jnp.asarray(v, jnp.bfloat16)
    got = jax.jit(federated_program(federated_sum, clients=n))(bf)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2)
    # n real clients laid out over a padded clients dim: the padding never reaches the sum
    mesh = jax.make_mesh((4,), ("clients",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        got = jax.jit(federated_program(federated_sum, clients=n, mesh=mesh, placed=(0,),
                                        placed_out=False))(v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_map_sum_equals_the_sum_of_the_map():
    """federated_map_sum accumulates in the clients' loop under scan; the values are those of
    federated_sum(federated_map(...)), with server values, bf16 leaves and padded rows."""
    n = 7
    rng = np.random.default_rng(2)
    x = rng.normal(size=(4, 3)).astype(np.float32)  # server
    v = rng.normal(size=(n, 5, 4)).astype(np.float32)  # clients

    def per_client(xs, vi):
        h = jnp.tanh(vi @ xs)  # (5, 3)
        return {"h": h, "low": h.astype(jnp.bfloat16), "count": jnp.int32(1)}

    want = jax.vmap(per_client, in_axes=(None, 0))(x, v)
    want = {"h": np.asarray(want["h"], np.float64).sum(0), "count": n}
    mesh = jax.make_mesh((4,), ("clients",), axis_types=(jax.sharding.AxisType.Auto,))
    for strategy, m in (("scan", None), ("vmap", None), ("scan", mesh)):
        prog = federated_program(
            lambda x, v, s=strategy: federated_map_sum(per_client, federated_broadcast(x), v,
                                                       strategy=s),
            clients=n, mesh=m, placed=(1,), placed_out=False)
        with jax.set_mesh(m) if m is not None else contextlib.nullcontext():
            got = jax.jit(prog)(x, v)
        np.testing.assert_allclose(got["h"], want["h"], rtol=1e-5, atol=1e-5)
        assert got["low"].dtype == jnp.bfloat16 and int(got["count"]) == n
        np.testing.assert_allclose(np.asarray(got["low"], np.float32), want["h"], atol=5e-2)
    # under differentiation it is the map and a federated_sum: the AD closure holds
    loss = federated_program(
        lambda x, v: jnp.sum(federated_map_sum(lambda a, b: jnp.tanh(b @ a), federated_broadcast(x),
                                               v, strategy="scan")),
        clients=n, placed=(1,))
    names = {e.primitive.name for e in jax.make_jaxpr(jax.grad(loss))(x, v).eqns}
    assert {"federated_sum", "federated_broadcast"} <= names
    grad = jax.grad(jax.jit(loss))(x, v)
    ref = jax.grad(lambda x: jnp.sum(jnp.tanh(v @ x)))(x)
    np.testing.assert_allclose(grad, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_values(jit):
    np.testing.assert_allclose(maybe_jit(bcast, jit)(X), np.tile(X, (N, 1)))
    np.testing.assert_allclose(maybe_jit(fsum, jit)(V), V.sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(maybe_jit(fmean, jit)(V), V.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(maybe_jit(fwmean, jit)(V, W), np_wmean(V, W), rtol=1e-5, atol=1e-6)
    mapped = federated_program(lambda v: federated_map(lambda r: r * r.sum(), v), clients=N)
    np.testing.assert_allclose(maybe_jit(mapped, jit)(V), V * V.sum(1, keepdims=True), rtol=1e-5)


@pytest.mark.parametrize("jit", [False, True])
def test_reverse_mode(jit):
    _, vjp = jax.vjp(maybe_jit(bcast, jit), X)
    np.testing.assert_allclose(vjp(CT_CLIENTS)[0], CT_CLIENTS.sum(0), rtol=1e-5, atol=1e-5)
    _, vjp = jax.vjp(maybe_jit(fsum, jit), V)
    np.testing.assert_allclose(vjp(CT_SERVER)[0], np.tile(CT_SERVER, (N, 1)))
    _, vjp = jax.vjp(maybe_jit(fmean, jit), V)
    np.testing.assert_allclose(vjp(CT_SERVER)[0], np.tile(CT_SERVER, (N, 1)) / N, rtol=1e-6)
    _, vjp = jax.vjp(maybe_jit(fwmean, jit), V, W)
    dv, dw = vjp(CT_SERVER)
    np.testing.assert_allclose(dv, np.outer(W, CT_SERVER) / W.sum(), rtol=1e-5, atol=1e-7)
    # d/dw_i of sum_j w_j v_j / sum_j w_j = (v_i - mean) / sum w
    expected_dw = (V - np_wmean(V, W)) @ CT_SERVER / W.sum()
    np.testing.assert_allclose(dw, expected_dw, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_forward_mode(jit):
    t_server, t_clients, t_w = CT_SERVER, CT_CLIENTS, RNG.normal(size=(N,)).astype(np.float32)
    _, out = jax.jvp(maybe_jit(bcast, jit), (X,), (t_server,))
    np.testing.assert_allclose(out, np.tile(t_server, (N, 1)))
    _, out = jax.jvp(maybe_jit(fsum, jit), (V,), (t_clients,))
    np.testing.assert_allclose(out, t_clients.sum(0), rtol=1e-5, atol=1e-5)
    _, out = jax.jvp(maybe_jit(fmean, jit), (V,), (t_clients,))
    np.testing.assert_allclose(out, t_clients.mean(0), rtol=1e-5, atol=1e-6)
    _, out = jax.jvp(maybe_jit(fwmean, jit), (V, W), (t_clients, t_w))
    expected = np_wmean(t_clients, W) + ((V - np_wmean(V, W)).T @ t_w) / W.sum()
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


def test_second_order_and_jacfwd_of_a_program():
    @federated_program(clients=N)
    def f(x):  # mean_i sum(sin(x) * v_i) -> grad cos(x) * mean(v)
        return jnp.sum(federated_mean(federated_map(lambda a, v: jnp.sin(a) * v,
                                                    federated_broadcast(x), jnp.asarray(V))))

    np.testing.assert_allclose(jax.grad(f)(X), np.cos(X) * V.mean(0), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(jax.jacfwd(f)(X), np.cos(X) * V.mean(0), rtol=1e-4, atol=1e-6)
    hess = jax.jit(jax.hessian(f))(X)
    np.testing.assert_allclose(hess, np.diag(-np.sin(X) * V.mean(0)), rtol=1e-4, atol=1e-6)


def test_symbolic_zero_cotangent():
    @jax.jit
    @federated_program(clients=N)
    def two(x, v):  # two outputs; the caller uses only the first
        return federated_mean(federated_broadcast(x) * v), federated_sum(v * 2.0)

    gx, gv = jax.grad(lambda x, v: jnp.sum(two(x, v)[0]), argnums=(0, 1))(X, V)
    np.testing.assert_allclose(gx, V.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gv, np.tile(X, (N, 1)) / N, rtol=1e-6)
    # only the second output: the first output's cotangent is the symbolic zero
    gx, gv = jax.grad(lambda x, v: jnp.sum(two(x, v)[1]), argnums=(0, 1))(X, V)
    np.testing.assert_array_equal(gx, np.zeros(D))
    np.testing.assert_allclose(gv, np.full((N, D), 2.0))


@pytest.mark.parametrize("prim", ["broadcast", "sum", "mean"])
def test_transpose_rules_on_zero_and_real_cotangents(prim):
    from jax.interpreters import ad

    from memaudit.federated import primitives as P

    p = {"broadcast": P.federated_broadcast_p, "sum": P.federated_sum_p,
         "mean": P.federated_mean_p}[prim]
    params = {"n": N, "n_pad": N, "axis": None, "mesh": None}
    x_aval = jax.core.ShapedArray((D,) if prim == "broadcast" else (N, D), jnp.float32)
    y_aval = jax.core.ShapedArray((N, D) if prim == "broadcast" else (D,), jnp.float32)
    rule = ad.primitive_transposes[p]
    (ct,) = rule(ad.Zero(y_aval), ad.UndefinedPrimal(x_aval), **params)
    assert isinstance(ct, ad.Zero) and ct.aval.shape == x_aval.shape
    # a real cotangent: the transpose binds the other federated primitive
    names = {e.primitive.name for e in jax.make_jaxpr(
        lambda c: rule(c, ad.UndefinedPrimal(x_aval), **params)[0])(jnp.ones(y_aval.shape)).eqns}
    assert names & PRIMITIVE_NAMES == {"federated_sum" if prim == "broadcast"
                                       else "federated_broadcast"}


def test_broadcast_row_is_the_server_value_with_the_rows_derivative():
    """broadcast_row(x, row): the value x, the JVP the row's tangent (x's is not read), and
    vmap keeping x's batch dim."""
    from memaudit.federated.primitives_impl import broadcast_row_p

    x, row = jnp.asarray(X), jnp.asarray(X + 1.0)  # a different row shows which one is read
    np.testing.assert_array_equal(jax.jit(broadcast_row_p.bind)(x, row), X)
    _, tangent = jax.jvp(broadcast_row_p.bind, (x, row), (jnp.full(D, 5.0), jnp.full(D, 2.0)))
    np.testing.assert_array_equal(tangent, np.full(D, 2.0))
    got = jax.vmap(broadcast_row_p.bind, in_axes=(1, None))(jnp.stack([x, x + 2.0], 1), row)
    np.testing.assert_array_equal(got, np.stack([X, X + 2.0]))
    assert broadcast_row_p.name not in PRIMITIVE_NAMES  # it moves nothing between placements


def test_mean_keeps_dtype_and_refuses_integers():
    vb = jnp.asarray(V, jnp.bfloat16)
    out = fmean(vb)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), V.mean(0), atol=2e-2)
    assert fsum(vb).dtype == jnp.bfloat16
    assert fwmean(vb, W).dtype == jnp.bfloat16
    assert bcast(jnp.asarray(X, jnp.bfloat16)).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="floating dtype"):
        fmean(jnp.ones((N, D), jnp.int32))


def test_vmap_over_a_program_with_the_batch_dim_anywhere():
    @federated_program(clients=N)
    def prog(x, v):  # x server (D,), v clients (N, D)
        y = federated_map(lambda a, b: a * b, federated_broadcast(x), v)
        return federated_mean(y), federated_sum(y), federated_weighted_mean(y, jnp.asarray(W))

    xs = RNG.normal(size=(4, D)).astype(np.float32)
    vs = RNG.normal(size=(4, N, D)).astype(np.float32)
    y = xs[:, None, :] * vs  # (4, N, D)
    want = (y.mean(1), y.sum(1), (W[None, :, None] * y).sum(1) / W.sum())
    for x_axis, v_axis in [(0, 0), (1, 1), (0, 2)]:
        got = jax.jit(jax.vmap(prog, in_axes=(x_axis, v_axis)))(
            np.moveaxis(xs, 0, x_axis), np.moveaxis(vs, 0, v_axis)
        )
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    # vmap of the derivative too (batching rules of the transposed primitives)
    g = jax.vmap(jax.grad(lambda x, v: jnp.sum(prog(x, v)[0])))(xs, vs)
    np.testing.assert_allclose(g, vs.mean(1), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------- AD closure


def communication_of(jaxpr) -> set[str]:
    """Names of federated primitives; fails on any other eqn that moves data between placements
    (`memaudit.federated.closure`: recursing into scan, cond, while and jit bodies)."""
    return _communication_of(jaxpr, N)


def _spread(x):  # server (D,) -> clients (N, D), through the broadcast primitive
    return bcast(x) * V


CLOSURE_CASES = {
    # name: (function, argument, communication expected in its grad)
    "broadcast": (lambda x: jnp.sum(fmean(jnp.sin(bcast(x)) * V)), X, {"federated_sum"}),
    "sum": (lambda v: jnp.sum(jnp.sin(fsum(v))), V, {"federated_broadcast"}),
    "mean": (lambda v: jnp.sum(jnp.sin(fmean(v))), V, {"federated_broadcast"}),
    "weighted_mean": (lambda v: jnp.sum(jnp.sin(fwmean(v, W))), V, {"federated_broadcast"}),
}
# jacfwd from a server-placed argument (a clients-placed one would build its basis locally)
JACFWD_CASES = {
    "broadcast": lambda x: jnp.sin(bcast(x)),
    "sum": lambda x: jnp.sin(fsum(_spread(x))),
    "mean": lambda x: jnp.sin(fmean(_spread(x))),
    "weighted_mean": lambda x: jnp.sin(fwmean(_spread(x), W)),
}


@pytest.mark.parametrize("case", sorted(CLOSURE_CASES))
def test_ad_closure(case):
    fn, arg, expected_in_grad = CLOSURE_CASES[case]
    forward = communication_of(jax.make_jaxpr(fn)(arg))
    assert forward  # the program itself communicates only through the primitives
    comms = communication_of(jax.make_jaxpr(jax.grad(jax.jit(fn)))(arg))
    assert expected_in_grad <= comms <= PRIMITIVE_NAMES, comms
    fwd = JACFWD_CASES[case]
    comms = communication_of(jax.make_jaxpr(jax.jacfwd(jax.jit(fwd)))(X))
    assert communication_of(jax.make_jaxpr(fwd)(X)) <= comms <= PRIMITIVE_NAMES, comms


def test_closure_check_catches_plain_jnp_communication():
    with pytest.raises(ClosureError, match="non-federated communication"):
        communication_of(jax.make_jaxpr(lambda v: jnp.sum(v, axis=0))(V))


def _carry_sum(v):  # a sum over the clients accumulated in a loop's carry: communication
    return jax.lax.scan(lambda t, r: (t + r, None), jnp.zeros(D), v)[0]


def _while_sum(v):
    def body(c):
        i, t, v = c
        return i + 1, t + v[i], v

    return jax.lax.while_loop(lambda c: c[0] < N, body, (0, jnp.zeros(D), v))[1]


HIDDEN_COMMUNICATION = {
    "scan_carry": _carry_sum,
    "while_carry": _while_sum,
    "in_cond": lambda v: jax.lax.cond(True, lambda v: jnp.sum(v, 0), lambda v: v[0], v),
    "in_jit": jax.jit(lambda v: jnp.mean(v, axis=0)),
    "in_scan_body": lambda v: jax.lax.scan(lambda c, r: (c, jnp.sum(v, 0) + r), 0.0,
                                           jnp.ones((4, D)))[1],
    "psum_over_clients": lambda v: jax.shard_map(
        lambda x: jax.lax.psum(jnp.sum(x, 0), "clients"),
        mesh=jax.make_mesh((4,), ("clients",), axis_types=(jax.sharding.AxisType.Auto,)),
        in_specs=jax.sharding.PartitionSpec("clients"),
        out_specs=jax.sharding.PartitionSpec())(v),
}


@pytest.mark.parametrize("case", sorted(HIDDEN_COMMUNICATION))
def test_closure_check_recurses_into_loops_conds_and_jits(case):
    fn = HIDDEN_COMMUNICATION[case]
    with pytest.raises(ClosureError, match="non-federated communication"):
        communication_of(jax.make_jaxpr(fn)(V))
    # the same structure with the communication done by a primitive passes
    assert communication_of(jax.make_jaxpr(jax.jit(lambda v: jax.lax.cond(
        True, fsum, lambda v: fsum(v * 2.0), v)))(V)) == {"federated_sum"}


def _server_in_loop(strategy, fused):
    """sum_i tanh(v_i @ x) over the clients, a matmul per client (scan under "auto" on CPU)."""
    def per_client(x, vi):
        return jnp.tanh(vi @ x)

    def prog(x, v):
        xs = federated_broadcast(x)
        if fused:
            return jnp.sum(federated_map_sum(per_client, xs, v, strategy=strategy))
        return jnp.sum(federated_sum(federated_map(per_client, xs, v, strategy=strategy)))

    return federated_program(prog, clients=N, placed=(1,))


@pytest.mark.parametrize("strategy", ["scan", "auto", "vmap"])
@pytest.mark.parametrize("fused", [False, True], ids=["map", "map_sum"])
def test_grad_of_jitted_program_sums_the_server_cotangent_federated(strategy, fused):
    """jax.grad(jax.jit(program)): the server value's cotangent leaves through federated_sum,
    not through a scan's carry (before: read inside the loop, reverse mode accumulated it)."""
    x = RNG.normal(size=(D, 4)).astype(np.float32)
    v = RNG.normal(size=(N, 6, D)).astype(np.float32)
    prog = _server_in_loop(strategy, fused)
    for grad in (jax.grad(jax.jit(prog)), jax.grad(prog), jax.jit(jax.grad(prog))):
        comms = communication_of(jax.make_jaxpr(grad)(x, v))
        assert "federated_sum" in comms, comms
        got = grad(x, v)
        want = jax.grad(lambda x: jnp.sum(jnp.tanh(jnp.einsum("nsd,dk->nsk", v, x))))(x)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    forward = communication_of(jax.make_jaxpr(prog)(x, v))
    assert forward <= PRIMITIVE_NAMES | {"federated_map_sum"}, forward


def test_jvp_of_jitted_loop_is_federated():
    x = RNG.normal(size=(D, 4)).astype(np.float32)
    v = RNG.normal(size=(N, 6, D)).astype(np.float32)
    prog = jax.jit(_server_in_loop("scan", True))
    jvp = lambda x, t: jax.jvp(lambda x: prog(x, v), (x,), (t,))
    comms = communication_of(jax.make_jaxpr(jvp)(x, x))
    assert {"federated_broadcast", "federated_sum"} <= comms
    _, tan = jvp(x, np.ones_like(x))
    want = jax.jvp(lambda x: jnp.sum(jnp.tanh(jnp.einsum("nsd,dk->nsk", v, x))), (x,),
                   (np.ones_like(x),))[1]
    np.testing.assert_allclose(tan, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("strategy", ["scan", "vmap"])
@pytest.mark.parametrize("fused", [False, True], ids=["map", "map_sum"])
def test_gradient_of_a_gradient_is_federated(strategy, fused):
    """jax.grad of a function of the program's gradient (what a gradient of FedSGD rounds takes):
    the server value's second-order cotangent also leaves through federated_sum. Under "scan"
    the loop of the first derivative read the server value as a loop constant, so the outer
    reverse pass summed its cotangent over the clients in a scan's carry."""
    x = RNG.normal(size=(D, 4)).astype(np.float32)
    v = RNG.normal(size=(N, 6, D)).astype(np.float32)
    prog = _server_in_loop(strategy, fused)
    ref = lambda x: jnp.sum(jnp.tanh(jnp.einsum("nsd,dk->nsk", v, x)))
    outer = lambda g: lambda x: jnp.sum(g(x) ** 2)
    for grad2 in (jax.grad(outer(lambda x: jax.grad(prog)(x, v))),
                  jax.grad(outer(lambda x: jax.grad(jax.jit(prog))(x, v)))):
        comms = communication_of(jax.make_jaxpr(grad2)(x))
        assert {"federated_broadcast", "federated_sum"} <= comms <= PRIMITIVE_NAMES, comms
        np.testing.assert_allclose(jax.jit(grad2)(x), jax.grad(outer(jax.grad(ref)))(x), rtol=1e-4,
                                   atol=1e-5)


# ------------------------------------------------------------------- federated gradients vs NumPy


def _losses():
    def quad(theta, x, y):
        return 0.5 * jnp.mean((x @ theta - y) ** 2)

    def quad_grad(theta, x, y):
        return x.T @ (x @ theta - y) / len(y)

    def logistic(theta, x, y):
        return jnp.mean(jnp.logaddexp(0.0, -y * (x @ theta)))

    def logistic_grad(theta, x, y):
        s = 1.0 / (1.0 + np.exp(y * (x @ theta)))
        return -(x * (y * s)[:, None]).mean(0)

    return {"quadratic": (quad, quad_grad), "logistic": (logistic, logistic_grad)}


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("loss", ["quadratic", "logistic"])
@pytest.mark.parametrize("weighted", [False, True])
def test_grad_of_federated_mean_loss_matches_numpy_loop(seed, loss, weighted):
    rng = np.random.default_rng(seed)
    n, d, m = int(rng.integers(2, 40)), int(rng.integers(1, 8)), 5
    x = rng.normal(size=(n, m, d))
    y = rng.normal(size=(n, m)) if loss == "quadratic" else rng.choice([-1.0, 1.0], size=(n, m))
    w = rng.uniform(0.0, 3.0, size=n)
    theta = rng.normal(size=d)
    fn, grad_np = _losses()[loss]

    @federated_program(clients=n)
    def objective(theta, x, y, w):
        losses = federated_map(fn, federated_broadcast(theta), x, y)
        return federated_weighted_mean(losses, w) if weighted else federated_mean(losses)

    got = jax.grad(objective)(*(jnp.asarray(a, jnp.float32) for a in (theta, x, y, w)))
    per_client = np.stack([grad_np(theta, x[i], y[i]) for i in range(n)])
    want = (w[:, None] * per_client).sum(0) / w.sum() if weighted else per_client.mean(0)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


# ------------------------------------------------------------------- bad input


def test_wrong_leading_size_is_one_clear_line():
    prog = federated_program(lambda v: federated_sum(v), clients=N, placed=(0,))
    with pytest.raises(ValueError) as err:
        prog(jnp.ones((N - 1, D)))
    msg = str(err.value)
    assert "\n" not in msg and "argument 'v'" in msg and f"leading size {N}" in msg
    unchecked = federated_program(lambda v: federated_mean(v), clients=N)
    with pytest.raises(ValueError, match=f"needs leading size {N}"):
        unchecked(jnp.ones((3, D)))
    with pytest.raises(ValueError, match="clients must be a positive int"):
        federated_program(lambda v: v, clients=0)(1.0)


@pytest.mark.parametrize("fused", [False, True], ids=["map", "map_sum"])
def test_scan_of_a_function_closing_over_a_server_value(fused):
    """A client function that captures a traced server value (instead of taking it from
    federated_broadcast) still gets the right values and gradient under the scan strategy."""
    x = RNG.normal(size=(D, 4)).astype(np.float32)
    v = RNG.normal(size=(N, 6, D)).astype(np.float32)

    def prog(x, v):
        per_client = lambda vi: jnp.tanh(vi @ x)  # x from the closure
        if fused:
            return jnp.sum(federated_map_sum(per_client, v, strategy="scan"))
        return jnp.sum(federated_sum(federated_map(per_client, v, strategy="scan")))

    prog = federated_program(prog, clients=N, placed=(1,))
    ref = lambda x: jnp.sum(jnp.tanh(jnp.einsum("nsd,dk->nsk", v, x)))
    for f in (prog, jax.jit(prog)):
        np.testing.assert_allclose(f(x, v), ref(x), rtol=2e-5)
        np.testing.assert_allclose(jax.grad(f)(x, v), jax.grad(ref)(x), rtol=2e-5, atol=2e-5)
