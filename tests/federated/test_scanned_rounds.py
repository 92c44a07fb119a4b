"""Multi-round programs written with ``lax.scan`` over the rounds: ``jax.grad``, ``jit`` and
``remat`` of three scanned FedSGD rounds pass the closure check and partition onto the nodes
(memaudit.federated.closure, memaudit.federated.flower.partition), with the numbers of the
same rounds unrolled in Python and of the rounds written with drjax (an independent oracle),
under both client strategies: ``vmap`` and ``scan`` (a loop over the clients, the CPU default)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memaudit.federated import algorithms as alg
from memaudit.federated import federated_map, federated_program, federated_sum
from memaudit.federated.closure import ClosureError, communication_of
from memaudit.federated.cohorts import ClientData
from memaudit.federated.flower.execute import LocalNodes, NodeExecutor, run_plan
from memaudit.federated.flower.partition import CLIENT, SERVER, PlanError, compile_plan, trace
from memaudit.federated.primitives import PRIMITIVE_NAMES

N, S, R, LR = 4, 3, 3, 0.5  # clients, examples per client, rounds, server learning rate
PLACED = {"[1].examples['x']": "x", "[1].examples['y']": "y", "[1].mask": "example_mask"}
HOSTS = {"A": [0, 1], "B": [2, 3]}  # node -> cohort slots (one user per slot)


def _loss(p, b):
    pred = jnp.tanh(b["x"] @ p["w"]) + p["b"]
    return jnp.mean((pred - b["y"]) ** 2, axis=-1), None


def _data() -> ClientData:
    rng = np.random.default_rng(0)
    mask = np.ones((N, S), np.float32)
    mask[2, 1:] = 0  # client 2 has one example: the example weighting matters
    return ClientData({"x": rng.normal(size=(N, S, 3)).astype(np.float32),
                       "y": rng.normal(size=(N, S, 2)).astype(np.float32)}, mask)


def _params():
    return {"w": jnp.linspace(-1, 1, 6, dtype=jnp.float32).reshape(3, 2),
            "b": jnp.array([0.1, -0.2], jnp.float32)}


def _rounds(strategy: str, scanned: bool, remat_body: bool = False, rounds: int = R, mesh=None):
    """``(params, data) -> loss`` after ``rounds`` FedSGD rounds (p <- p - LR * grad of the federated
    loss), as a ``lax.scan`` over the rounds or unrolled in Python."""
    objective = alg.federated_loss(_loss, map_strategy=strategy, mesh=mesh)

    def one_round(p, data):
        g = jax.grad(objective)(p, data)
        return jax.tree.map(lambda a, b: a - LR * b, p, g)

    body = jax.remat(one_round) if remat_body else one_round

    def program(params, data):
        if scanned:
            params, _ = jax.lax.scan(lambda p, _: (body(p, data), None), params, None, length=rounds)
        else:
            for _ in range(rounds):
                params = body(params, data)
        return objective(params, data)

    return program


TRANSFORMS = {
    "grad": lambda f: jax.grad(f),
    "jit_grad": lambda f: jax.jit(jax.grad(f)),
    "grad_remat": lambda f: jax.grad(jax.remat(f)),
}
STRATEGIES = ["vmap", "scan"]


def _drjax_grad():
    """The gradient of the same R rounds written with drjax (broadcast, map_fn, reduce_sum)."""
    import drjax  # the dev extra installs it: missing is a failure

    @drjax.program(placements={"clients": N})
    def objective(p, x, y, m):
        def client(p_i, x_i, y_i, m_i):
            per_example, _ = _loss(p_i, {"x": x_i, "y": y_i})
            num = jnp.sum(m_i)
            return jnp.sum(per_example * m_i) / jnp.maximum(num, 1.0) * num, num

        losses, nums = drjax.map_fn(client, (drjax.broadcast(p), x, y, m))
        return drjax.reduce_sum(losses) / drjax.reduce_sum(nums)

    def program(params, data):
        args = (data.examples["x"], data.examples["y"], data.mask)
        for _ in range(R):
            g = jax.grad(objective)(params, *args)
            params = jax.tree.map(lambda a, b: a - LR * b, params, g)
        return objective(params, *args)

    return jax.grad(program)


def _max_diff(a, b) -> float:
    return max(float(jnp.max(jnp.abs(jnp.asarray(x) - jnp.asarray(y))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
def test_scanned_rounds_pass_the_closure_check(transform, strategy):
    """The held example: the derivative of three scanned FedSGD rounds communicates only
    through the federated primitives, as the unrolled rounds do."""
    for scanned in (False, True):
        fn = TRANSFORMS[transform](_rounds(strategy, scanned))
        comms = communication_of(jax.make_jaxpr(fn)(_params(), _data()), N)
        assert {"federated_broadcast", "federated_sum"} <= comms <= PRIMITIVE_NAMES, comms
    body_remat = jax.grad(_rounds(strategy, True, remat_body=True))
    assert communication_of(jax.make_jaxpr(body_remat)(_params(), _data()), N) <= PRIMITIVE_NAMES


@pytest.fixture(scope="module")
def drjax_want():
    """The drjax rounds' gradient: the oracle of both client strategies (it has none of its own),
    compiled once."""
    return jax.jit(_drjax_grad())(_params(), _data())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_scanned_rounds_equal_unrolled_rounds_and_drjax(strategy, drjax_want):
    want = drjax_want
    unrolled = jax.jit(jax.grad(_rounds(strategy, False)))(_params(), _data())
    assert _max_diff(unrolled, want) <= 1e-6
    # (jit and remat change how the gradient is compiled, not its value: their structure is
    # checked by the closure and partition tests)
    got = jax.jit(jax.grad(_rounds(strategy, True)))(_params(), _data())
    assert _max_diff(got, want) <= 1e-6


def test_scanned_rounds_on_a_clients_mesh_under_scan():
    """With a ``clients`` mesh axis the scan strategy's loop is a ``shard_map`` (each device
    looping over its clients): the gradient of the scanned rounds still communicates only
    through the primitives, with the numbers of the vmap rounds. (Eight clients, four per
    device: no parameter dim has the per-device clients size, which placement reads.)"""
    rng = np.random.default_rng(1)
    n = 8
    data = ClientData({"x": rng.normal(size=(n, S, 3)).astype(np.float32),
                       "y": rng.normal(size=(n, S, 2)).astype(np.float32)},
                      np.ones((n, S), np.float32))
    mesh = jax.make_mesh((2,), ("clients",), axis_types=(jax.sharding.AxisType.Auto,))
    grad = jax.grad(_rounds("scan", True, mesh=mesh))
    comms = communication_of(jax.make_jaxpr(grad)(_params(), data), n)
    assert {"federated_broadcast", "federated_sum"} <= comms <= PRIMITIVE_NAMES, comms
    want = jax.jit(jax.grad(_rounds("vmap", True)))(_params(), data)
    assert _max_diff(jax.jit(grad)(_params(), data), want) <= 1e-6


def test_a_scan_over_the_rounds_that_sums_over_the_clients_is_still_refused():
    """Scanning over the rounds does not hide plain communication in the loop's body."""
    def leaky(params, data):
        def body(p, _):
            return p + jnp.sum(data.examples["x"], axis=0).mean(0) @ p, None  # a sum over clients

        return jnp.sum(jax.lax.scan(body, params["w"], None, length=R)[0])

    with pytest.raises(ClosureError, match="non-federated communication"):
        communication_of(jax.make_jaxpr(jax.grad(leaky))(_params(), _data()), N)


def test_a_server_value_captured_by_the_scanned_clients_is_still_refused():
    """What the scan strategy reads as a loop constant must come from ``federated_broadcast``: a
    client function that captures the server parameters from its closure runs (values right),
    but the gradient of its rounds sums their cotangent over the clients in a loop's carry."""
    def objective(p, data):
        def program(examples, mask):
            per_client = lambda ex, m: jnp.sum(_loss(p, ex)[0] * m)  # p from the closure
            return federated_sum(federated_map(per_client, examples, mask, strategy="scan"))

        return federated_program(program, clients=N, placed=(0, 1))(data.examples, data.mask)

    def rounds(params, data):
        step = lambda p, _: (jax.tree.map(lambda a, g: a - LR * g, p,
                                          jax.grad(objective)(p, data)), None)
        return objective(jax.lax.scan(step, params, None, length=R)[0], data)

    assert jnp.isfinite(jax.jit(jax.grad(rounds))(_params(), _data())["w"]).all()
    with pytest.raises(ClosureError, match="carries a server value"):
        communication_of(jax.make_jaxpr(jax.grad(rounds))(_params(), _data()), N)


def _nodes(data: ClientData) -> LocalNodes:
    ex = {}
    for name, slots in HOSTS.items():
        arrays = {"x": data.examples["x"][slots], "y": data.examples["y"][slots],
                  "example_mask": data.mask[slots]}
        ex[name] = NodeExecutor([f"u{s}" for s in slots], arrays)
    return LocalNodes(ex)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_scanned_rounds_partition_onto_the_nodes(strategy):
    """The gradient of the scanned rounds runs as client and server stages (the scan over the
    rounds interpreted round by round: the stages of the unrolled program, also under ``jit``
    and ``remat``), the server never reading the clients' examples, with the in-JAX gradient."""
    data = _data()
    struct = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), data)
    args = (_params(), struct, jax.random.key(0))

    def as_round(fn):  # a round's signature: (state, data, key)
        return lambda p, d, k: fn(p, d)

    unrolled = trace(as_round(jax.grad(_rounds(strategy, False))), args, PLACED, N)
    kinds = [s.kind for s in unrolled.stages]
    assert kinds.count(CLIENT) >= 2 * R  # forward and backward of every round on the clients
    for transform in sorted(TRANSFORMS):
        plan = trace(as_round(TRANSFORMS[transform](_rounds(strategy, True))), args, PLACED, N)
        assert [s.kind for s in plan.stages] == kinds, transform
    grad = jax.grad(_rounds(strategy, True, rounds=2))  # (run two rounds: fewer stages to compile)
    plan = compile_plan(as_round(grad), args, PLACED, N)
    assignment = {name: [(s, f"u{s}") for s in slots] for name, slots in HOSTS.items()}
    got, info = run_plan(plan, args, _nodes(data), assignment, round=0)
    assert info["dropped_nodes"] == []
    assert _max_diff(got, jax.jit(grad)(_params(), data)) <= 1e-6
    server_reads = {i for s in plan.stages if s.kind == SERVER for i in s.inputs}
    assert not server_reads & set(plan.data_leaves)  # no raw example reaches the server
    # nor does any per-client value, but through an aggregation (under "scan", before the
    # derivative loop broadcast the server values, a transposed loop over the clients ran on
    # the server on rows of the clients' examples)
    assert _server_ops_on_client_rows(plan) <= {"federated_sum", "federated_mean"}


def _server_ops_on_client_rows(plan) -> set[str]:
    """Names of the server equations that read values gathered row by row from the clients."""
    rows = set().union(*(s.rows for s in plan.client_stages))
    return {op.eqn.primitive.name for s in plan.stages if s.kind == SERVER for op in s.ops
            if any(isinstance(i, int) and i in rows for i in op.ins)}


def test_a_while_loop_over_rounds_is_refused_in_one_line():
    """Rounds with no static count cannot be laid out as stages: the plan says how to write them."""
    objective = alg.federated_loss(_loss, map_strategy="vmap")

    def rounds(p, data, key, n):
        step = lambda _, p: jax.tree.map(lambda a, g: a - LR * g, p, jax.grad(objective)(p, data))
        return jax.lax.fori_loop(0, n, step, p)

    struct = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _data())
    n = jax.ShapeDtypeStruct((), jnp.int32)  # a traced round count: a while loop
    with pytest.raises(PlanError, match="while loop over federated rounds"):
        trace(rounds, (_params(), struct, jax.random.key(0), n), PLACED, N)


def test_scanned_fedavg_rounds_with_per_round_keys_partition():
    """FedAvg rounds scanned over their keys (a server ``xs`` sliced round by round; the fused
    map-and-sum as each round's client stage) run on the nodes with the in-JAX scan's weights."""
    import optax

    a = alg.fedavg(_loss, client_optimizer=optax.sgd(0.2), server_optimizer=optax.sgd(1.0),
                   local_steps=2, batch_size=2)

    def rounds(state, data, key):
        return jax.lax.scan(lambda st, k: (a.program(st, data, k)[0], None), state,
                            jax.random.split(key, 2))[0]

    def unrolled(state, data, key):
        for k in jax.random.split(key, 2):
            state = a.program(state, data, k)[0]
        return state

    data, key = _data(), jax.random.key(3)
    state = a.init(_params())
    struct = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), data)
    plan = compile_plan(rounds, (state, struct, key), PLACED, N)
    want = trace(unrolled, (state, struct, key), PLACED, N)
    assert [s.kind for s in plan.stages] == [s.kind for s in want.stages]
    assert len(plan.client_stages) == 2  # a round's clients run as one stage (the fused mean)
    assignment = {name: [(s, f"u{s}") for s in slots] for name, slots in HOSTS.items()}
    got, _ = run_plan(plan, (state, struct, key), _nodes(data), assignment, round=0)
    assert _max_diff(got.params, jax.jit(rounds)(state, data, key).params) <= 1e-6
