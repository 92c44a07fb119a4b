"""The clients dim followed through the jaxpr (memaudit.federated.closure): the closure check and
the partitioner (memaudit.federated.flower.partition) read which values are clients-placed from
the dataflow, not from shapes. Rounds run on nodes in this process (LocalNodes), against the
in-JAX program and NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memaudit.federated import algorithms as alg
from memaudit.federated import (
    federated_broadcast,
    federated_map,
    federated_mean,
    federated_program,
)
from memaudit.federated.closure import ClosureError, communication_of
from memaudit.federated.cohorts import ClientData
from memaudit.federated.flower.execute import LocalNodes, NodeExecutor, run_plan
from memaudit.federated.flower.partition import SERVER, PlanError, compile_plan, retrace

S = 3  # examples per client
PLACED = {"[1].examples['x']": "x", "[1].examples['y']": "y", "[1].mask": "example_mask"}


def _data(n: int) -> ClientData:
    rng = np.random.default_rng(n)
    return ClientData({"x": rng.normal(size=(n, S, 3)).astype(np.float32),
                       "y": rng.normal(size=(n, S, 2)).astype(np.float32)}, np.ones((n, S), np.float32))


def _hosts(n: int) -> dict[str, list[int]]:
    return {"A": list(range(n // 2)), "B": list(range(n // 2, n))}


def _run_on_nodes(program, params, data: ClientData):
    """``program(params, data, key)`` partitioned and run on two in-process nodes."""
    n = data.mask.shape[0]
    struct = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), data)
    args = (params, struct, jax.random.key(0))
    plan = compile_plan(program, args, PLACED, n)
    nodes = LocalNodes({name: NodeExecutor([f"u{s}" for s in slots],
                                           {"x": data.examples["x"][slots], "y": data.examples["y"][slots],
                                            "example_mask": data.mask[slots]})
                        for name, slots in _hosts(n).items()})
    assignment = {name: [(s, f"u{s}") for s in slots] for name, slots in _hosts(n).items()}
    out, info = run_plan(plan, args, nodes, assignment, round=0)
    assert info["dropped_nodes"] == []
    return plan, out


def _per_client(p, xi):  # one client's (S,) values
    return jnp.tanh(xi @ p)


def _np_per_client(p, x):  # (n, S)
    return np.tanh(np.einsum("nsd,d->ns", x, p))


def _over_clients(mix):
    """A round whose clients' values ``v`` (n, S) go through ``mix`` before their mean."""
    def round_(p, data, key):
        del key

        @federated_program(clients=data.mask.shape[0], placed=(1,))
        def program(p, x):
            v = federated_map(_per_client, federated_broadcast(p), x)
            return federated_mean(mix(v) ** 2)

        return program(p, data.examples["x"])

    return round_


MIXING = {  # mixing the clients by hand: (jnp, NumPy)
    "matmul": (lambda v: jnp.ones((v.shape[0], v.shape[0])) / v.shape[0] @ v,
               lambda v: np.ones((len(v), len(v))) / len(v) @ v),
    "cumsum": (lambda v: jnp.cumsum(v, axis=0), lambda v: np.cumsum(v, axis=0)),
    "outer": (lambda v: v @ v.T, lambda v: v @ v.T),  # client i's row holds every client's values
    "reverse": (lambda v: v[::-1], lambda v: v[::-1]),
    "roll": (lambda v: jnp.roll(v, 1, axis=0), lambda v: np.roll(v, 1, axis=0)),
}


@pytest.mark.parametrize("case", sorted(MIXING))
def test_mixing_the_clients_by_hand_is_refused_by_the_checker_and_runs_on_the_server(case):
    """Before, ``ones((n, n)) / n @ v`` and a ``cumsum`` over the clients passed the check, and the
    partitioner put them on the nodes, each mixing only the clients it hosts: Flower's answer
    moved 4.9e-2 and 0.20 from the in-JAX one (4 clients on 2 nodes). Now the check refuses them
    as it refuses a hand-written sum, and the partitioner runs them where a hand-written sum
    runs, on the server (which has every client's rows): Flower's answer is NumPy's."""
    n, p = 4, jnp.asarray([0.5, -1.0, 0.25], jnp.float32)
    mix, np_mix = MIXING[case]
    program, data = _over_clients(mix), _data(n)
    with pytest.raises(ClosureError, match="non-federated communication"):
        communication_of(jax.make_jaxpr(program)(p, data, jax.random.key(0)), n)
    _, got = _run_on_nodes(program, p, data)
    want = (np_mix(_np_per_client(np.asarray(p, np.float64), data.examples["x"])) ** 2).mean(0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, program(p, data, None), rtol=1e-6, atol=1e-7)


def test_mixing_through_the_primitives_runs_on_the_nodes_as_in_numpy():
    """The same mean mixed over the clients, written with the primitives (the mean sent back to
    every client), passes and runs on the nodes with NumPy's numbers."""
    n, p = 4, jnp.asarray([0.5, -1.0, 0.25], jnp.float32)

    def mix(v):
        return v - federated_broadcast(federated_mean(v))

    program = _over_clients(mix)
    data = _data(n)
    assert communication_of(jax.make_jaxpr(program)(p, data, jax.random.key(0)), n) == {
        "federated_broadcast", "federated_mean"}
    _, got = _run_on_nodes(program, p, data)
    v = _np_per_client(np.asarray(p), data.examples["x"])
    want = ((v - v.mean(0)) ** 2).mean(0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, program(p, data, None), rtol=1e-6, atol=1e-7)


AGGREGATES = {  # per-client values (n, S) -> what is averaged over the clients, with a dim of size n
    # each client's sum on its own one-hot row: a federated program
    "one_hot": (lambda h: jnp.sum(h, 1)[:, None] * jnp.eye(h.shape[0]),
                lambda h: h.sum(1)[:, None] * np.eye(len(h))),
    # the h @ h.T: mixes the clients (refused by the check, run on the server)
    "gram": (lambda h: h @ h.T, lambda h: h @ h.T),
}


@pytest.mark.parametrize("case", sorted(AGGREGATES))
def test_an_aggregate_with_a_dim_of_size_n_runs_on_the_server(case):
    """``federated_mean`` of an (n, n) value, an (n,) aggregate: before, its output grew with the
    clients in the partitioner's second trace, so it was put in a client stage and `run_plan`
    failed with a KeyError. It is server-placed by dataflow, and the round equals NumPy's."""
    n, p = 4, jnp.asarray([0.5, -1.0, 0.25], jnp.float32)
    mix, np_mix = AGGREGATES[case]

    def round_(p, data, key):
        del key

        @federated_program(clients=data.mask.shape[0], placed=(1,))
        def program(p, x):
            h = federated_map(_per_client, federated_broadcast(p), x)  # (n, S)
            return federated_mean(mix(h))  # (n,)

        return program(p, data.examples["x"])

    data = _data(n)
    jaxpr = jax.make_jaxpr(round_)(p, data, None)
    if case == "one_hot":
        assert communication_of(jaxpr, n) == {"federated_broadcast", "federated_mean"}
    else:
        with pytest.raises(ClosureError, match="pairs every client's value with every other"):
            communication_of(jaxpr, n)
    plan, got = _run_on_nodes(round_, p, data)
    kinds = [st.kind for st in plan.stages for op in st.ops if op.eqn.primitive.name == "federated_mean"]
    assert kinds == [SERVER]
    want = np_mix(_np_per_client(np.asarray(p, np.float64), data.examples["x"])).mean(0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


N_DECLARED = 4


@federated_program(clients=N_DECLARED, placed=(1,))
def _declared(p, x):
    return federated_mean(federated_map(_per_client, federated_broadcast(p), x))


def test_a_program_declared_with_its_clients_count_is_partitioned():
    """``federated_program(clients=N)``: before, the partitioner's second trace with N + 1
    clients tripped the program's own check (ValueError: needs leading size N). Now it is traced
    once and runs on the nodes as in NumPy; the node-shaped retrace, which needs another count,
    is refused in one line that says to read n from the data."""
    p = jnp.asarray([0.5, -1.0, 0.25], jnp.float32)

    def round_(p, data, key):
        return _declared(p, data.examples["x"])

    data = _data(N_DECLARED)
    _, got = _run_on_nodes(round_, p, data)
    want = _np_per_client(np.asarray(p), data.examples["x"]).mean(0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    struct = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), data)
    with pytest.raises(PlanError, match="read n from the data") as err:
        retrace(round_, (p, struct, jax.random.key(0)), PLACED, 2)
    assert "\n" not in str(err.value)


def _loss(p, b):
    pred = jnp.tanh(b["x"] @ p["w"]) + p["b"]
    return jnp.mean((pred - b["y"]) ** 2, axis=-1), None


def _plain_loss(p, data: ClientData):
    """The federated loss of `alg.federated_loss` (example-weighted mean of the clients' mean
    losses) written over all examples in plain jnp: no federated primitive."""
    per_example, _ = _loss(p, data.examples)  # (n, S)
    return jnp.sum(per_example * data.mask) / jnp.sum(data.mask)


@pytest.mark.parametrize("n", [2, 3])
def test_a_model_dim_equal_to_the_clients_count_is_not_theirs(n):
    """``w`` is (3, 2): with 3 clients its leading dim, with 2 its last, equals the clients
    count. Before, the check read placement from shapes and refused the scan strategy (inside
    the loop over the clients, ``x_i @ w`` reduced a dim of size n: "reduce_sum[axes=(0,)]"),
    while it passed vmap's. Both pass now, and the scan strategy's gradient runs on the nodes as
    the plain-jnp gradient."""
    params = {"w": jnp.linspace(-1, 1, 6, dtype=jnp.float32).reshape(3, 2),
              "b": jnp.array([0.1, -0.2], jnp.float32)}
    data = _data(n)
    want = jax.grad(_plain_loss)(params, data)
    for strategy in ("vmap", "scan"):
        objective = alg.federated_loss(_loss, map_strategy=strategy)
        for fn in (objective, jax.grad(objective), jax.jit(jax.grad(objective))):
            comms = communication_of(jax.make_jaxpr(fn)(params, data), n)
            assert {"federated_broadcast", "federated_sum"} <= comms, (strategy, comms)
    # the gradient under scan, the strategy the check refused, runs on the nodes
    grad = jax.grad(alg.federated_loss(_loss, map_strategy="scan"))
    _, got = _run_on_nodes(lambda p, d, k: grad(p, d), params, data)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
