"""The federated program partitioned at its primitives (memaudit.federated.flower.partition /
execute), run in this process against nodes that hold only their users' data: the result equals
the in-JAX program's, for FedAvg, FedAdam, DP-FedAvg with adaptive clipping and FedSGD (jax.grad
of a federated loss), with no per-algorithm code; plus the bad inputs of the Flower runtime."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp
import optax
from jax import export

from memaudit.federated import algorithms as alg
from memaudit.federated.cohorts import ClientData
from memaudit.federated.flower.execute import LocalNodes, NodeExecutor, run_plan
from memaudit.federated.flower.partition import (
    CLIENT,
    STAGE_PLATFORMS,
    PlanError,
    compile_plan,
    node_stages,
    retrace,
)

U, S, CAP = 6, 3, 4
PLACED = {"[1].examples['x']": "x", "[1].examples['y']": "y", "[1].mask": "example_mask"}
COHORT = [0, 2, 3, 5]  # users in cohort slots 0..3
HOSTS = {"A": ["u0", "u1", "u2"], "B": ["u3", "u4", "u5"]}


def _loss(p, b):
    pred = jnp.tanh(b["x"] @ p["w"]) + p["b"]
    return jnp.mean((pred - b["y"]) ** 2, axis=-1), None


@pytest.fixture(scope="module")
def users():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(U, S, 3)).astype(np.float32)
    y = rng.normal(size=(U, S, 2)).astype(np.float32)
    m = np.ones((U, S), np.float32)
    m[2, 1:] = 0  # user 2 has one example
    return x, y, m


def _params():
    return {"w": jnp.linspace(-1, 1, 6, dtype=jnp.float32).reshape(3, 2), "b": jnp.zeros(2)}


def _algorithm(kind: str):
    if kind == "fedsgd":
        return alg.fedsgd(_loss, server_optimizer=optax.sgd(0.5))
    agg = None
    if kind == "dp-adaptive":
        from memaudit.config import AdaptiveClipConfig
        from memaudit.federated.aggregators import mean_aggregator
        from memaudit.federated.dp import dp_fedavg

        agg = dp_fedavg(mean_aggregator(), clip=0.5, noise_multiplier=0.7, expected_cohort=3.0,
                        adaptive=AdaptiveClipConfig(enabled=True, initial_clip=0.3, count_noise=1.0))
    server = optax.adam(0.05, b1=0.9, b2=0.99, eps=1e-3) if kind == "fedadam" else optax.sgd(1.0)
    return alg.fedavg(_loss, client_optimizer=optax.sgd(0.2), server_optimizer=server,
                      local_steps=2, batch_size=2, aggregator=agg)


def _cohort_data(users, dead_slots=()):
    x, y, m = users
    data = ClientData({"x": np.zeros((CAP, S, 3), np.float32), "y": np.zeros((CAP, S, 2), np.float32)},
                      np.zeros((CAP, S), np.float32))
    for slot, u in enumerate(COHORT):
        if slot in dead_slots:
            continue  # an absent slot: what a dropped user is in the in-JAX program
        data.examples["x"][slot], data.examples["y"][slot], data.mask[slot] = x[u], y[u], m[u]
    return data


def _nodes(users, dead=()):
    x, y, m = users
    ex = {}
    for name, hosted in HOSTS.items():
        idx = [int(u[1:]) for u in hosted]
        ex[name] = NodeExecutor(hosted, {"x": x[idx], "y": y[idx], "example_mask": m[idx]})
    return LocalNodes(ex, dead=dead)


def _assignment():
    out: dict[str, list] = {}
    for slot, u in enumerate(COHORT):
        name = next(n for n, h in HOSTS.items() if f"u{u}" in h)
        out.setdefault(name, []).append((slot, f"u{u}"))
    return out


def _struct(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), tree)


_RUNS: dict = {}


def _two_rounds(kind, users, dead=(), dead_slots=(), shaped=False):
    """(in-JAX state, partitioned state, plan, info) after two rounds from the same state and
    keys (computed once per case in this module); ``shaped``: the nodes run node-shaped stages
    (info then also has "calls", the stage calls the nodes got)."""
    if (kind, dead, shaped) not in _RUNS:
        _RUNS[(kind, dead, shaped)] = _compute_two_rounds(kind, users, dead, dead_slots, shaped)
    return _RUNS[(kind, dead, shaped)]


class _Calls(LocalNodes):
    """LocalNodes that record the stage calls they get."""

    def __init__(self, local):
        super().__init__(local.executors, local.dead)
        self.calls = []

    def run_stage(self, calls):
        self.calls += list(calls.values())
        return super().run_stage(calls)


def _compute_two_rounds(kind, users, dead, dead_slots, shaped=False):
    a = _algorithm(kind)
    ref = got = a.init(_params())
    plan = shape = None
    nodes = _Calls(_nodes(users, dead))
    for r in range(2):
        key = jax.random.fold_in(jax.random.key(3), r)
        ref, _ = a.program(ref, _cohort_data(users, dead_slots), key)
        args = (got, _struct(_cohort_data(users)), key)
        if plan is None:
            plan = compile_plan(a.program, args, PLACED, CAP)
            shape = node_stages(plan, retrace(a.program, args, PLACED, 2)) if shaped else None
        (got, _), info = run_plan(plan, args, nodes, _assignment(), round=r,
                                   node_stages=(lambda _n, _h, s=shape: s) if shaped else None)
    return ref, got, plan, {**info, "calls": nodes.calls} if shaped else info


def _max_diff(a, b):
    return max([float(jnp.max(jnp.abs(jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)], default=0.0)


def test_a_node_says_when_it_runs_a_stage_module_new_to_it(users):
    """`NodeExecutor.new_module`, the stage reply's "compiled" (a round's metrics count those
    nodes as nodes_compiling; benchmarks/federated_round.py times the rounds without one as
    warm): True on a module's first run in the node's process, False on the next rounds."""
    a = _algorithm("fedavg")
    state, plan, seen = a.init(_params()), None, []
    nodes = _nodes(users)
    for r in range(2):
        args = (state, _struct(_cohort_data(users)), jax.random.fold_in(jax.random.key(3), r))
        plan = plan or compile_plan(a.program, args, PLACED, CAP)
        (state, _), _ = run_plan(plan, args, nodes, _assignment(), round=r)
        seen.append({name: e.new_module for name, e in nodes.executors.items()})
    assert seen == [dict.fromkeys(HOSTS, True), dict.fromkeys(HOSTS, False)]


@pytest.mark.parametrize("kind", ["fedavg", "fedadam", "dp-adaptive", "fedsgd"])
def test_partitioned_round_equals_in_jax_program(kind, users):
    ref, got, plan, info = _two_rounds(kind, users)
    # Rows gathered by the server run the same equations: bit for bit; FedAvg's and DP-FedAvg's
    # fused map-and-sum (DP: each delta clipped and summed in the clients' loop) adds the two
    # nodes' partial sums (a float reassociation).
    assert _max_diff(ref.params, got.params) <= (0.0 if kind == "fedsgd" else 1e-6)
    assert _max_diff(ref.opt_state, got.opt_state) <= 1e-6
    assert int(got.round) == 2 and info["dropped_nodes"] == []
    assert all(len(m) > 0 for m in plan.modules.values())  # client stages exported (jax.export)
    # lowered for the platforms the server and the manifests agree on (partition.STAGE_PLATFORMS)
    assert {export.deserialize(bytearray(m)).platforms for m in plan.modules.values()} == {STAGE_PLATFORMS}


@pytest.mark.parametrize("kind", ["fedavg", "fedadam", "dp-adaptive", "fedsgd"])
def test_node_shaped_stages_compute_only_the_nodes_clients_and_equal_in_jax(kind, users):
    """Each node hosts 2 of the cohort's 4 slots: its modules are traced for 2 clients, its
    users take rows 0 and 1, the per-client server inputs (the clients' keys) come cut to its
    slots, and the rounds equal the in-JAX program's as the cohort-shaped ones do."""
    ref, got, plan, info = _two_rounds(kind, users, shaped=True)
    assert _max_diff(ref.params, got.params) <= (0.0 if kind == "fedsgd" else 1e-6)
    assert _max_diff(ref.opt_state, got.opt_state) <= 1e-6
    calls = info["calls"]
    assert len(calls) == 2 * 2 * len(plan.client_stages) and all(c.rows == [0, 1] for c in calls)
    for c in calls:
        exp = export.deserialize(bytearray(c.module))
        assert c.module != plan.modules[c.stage]
        assert {a.shape[0] for (kind_, _), a in zip(c.inputs, exp.in_avals, strict=True) if kind_ != "server"} == {2}
        assert all(np.shape(v)[:1] != (CAP,) for kind_, v in c.inputs if kind_ == "server")


def test_a_client_stage_that_reads_the_cohort_size_keeps_the_cohorts_modules(users):
    """A client equation with the clients count in it (each client's value scaled by 1/n before
    the sum) would compute other numbers with the node's count: no node-shaped stages, the
    nodes run the cohort's. A per-client value the server computes from the count (a row index
    from an iota) reaches each node cut to its slots, so the node-shaped stages give the
    cohort's numbers."""
    from memaudit.federated import federated_program
    from memaudit.federated.primitives import federated_map, federated_sum

    def program(weigh):
        def round_(state, data, key):
            n = data.mask.shape[0]
            fn = federated_program(lambda ex: federated_sum(weigh(federated_map(lambda e: jnp.sum(e["x"]), ex), n)),
                                   clients=n, placed=(0,))
            return state, fn(data.examples)
        return round_

    args = (_params(), _struct(_cohort_data(users)), jax.random.key(0))
    for weigh, shaped in ((lambda x, n: x * (1.0 / n), False),
                          (lambda x, n: x * jnp.arange(n, dtype=x.dtype), True),
                          (lambda x, n: x * 2.0, True)):
        prog = program(weigh)
        plan = compile_plan(prog, args, PLACED, CAP)
        mine = node_stages(plan, retrace(prog, args, PLACED, 2))
        assert plan.client_stages and (mine is not None) is shaped
        if shaped:
            (_, want), _ = run_plan(plan, args, _nodes(users), _assignment(), round=0)
            (_, got), _ = run_plan(plan, args, _nodes(users), _assignment(), round=0, node_stages=lambda _n, _h, m=mine: m)
            (_, ref) = prog(_params(), _cohort_data(users), jax.random.key(0))
            assert float(got) == float(want) and abs(float(got) - float(ref)) <= 1e-5 * abs(float(ref))


def test_vmaps_local_training_is_refused_rather_than_run_on_the_clients_tokens_on_the_server(users, monkeypatch):
    """FedAvg with vmap's local training (what "auto" picks off the CPU): the batched loop over
    the local steps stacks its losses with the clients dim second, so it is no client equation,
    and the server would run it on the rows the nodes send of a copy of their users' examples
    (before: it did, the token rows gathered). The plan is refused in one line; the Flower
    runtime traces its rounds with the scan strategy on every backend, which partitions."""
    from memaudit.federated.flower.manifest import MAP_STRATEGY
    from memaudit.federated.flower.trainer import FlowerRuntime

    # three local steps: the middle one is the steps' loop (the first and last stand outside it,
    # algorithms._make_local_training), whose batched form stacks the losses clients-second
    a = alg.fedavg(_loss, client_optimizer=optax.sgd(0.2), server_optimizer=optax.sgd(1.0),
                   local_steps=3, batch_size=2, map_strategy="vmap")
    args = (a.init(_params()), _struct(_cohort_data(users)), jax.random.key(0))
    with pytest.raises(PlanError, match=r"reads the client data [xy] on the server \(a copy"):
        compile_plan(a.program, args, PLACED, CAP)
    assert FlowerRuntime.map_strategy == MAP_STRATEGY == "scan"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # "auto" would pick vmap here
    a = alg.fedavg(_loss, client_optimizer=optax.sgd(0.2), server_optimizer=optax.sgd(1.0),
                   local_steps=2, batch_size=2, map_strategy=MAP_STRATEGY)
    plan = compile_plan(a.program, args, PLACED, CAP)
    rows = set().union(*(st.rows for st in plan.client_stages))
    assert not any(isinstance(i, int) and i in rows for st in plan.stages if st.kind != CLIENT for op in st.ops
                   if op.eqn.primitive.name not in ("federated_sum", "federated_mean") for i in op.ins)


def test_each_node_gets_its_stages_lowered_for_its_own_platform(users):
    """A CUDA SuperNode gets modules lowered for CUDA alone and a CPU one for the CPU alone (one
    module for both is not the CPU program bit for bit: partition.STAGE_PLATFORMS); a node runs
    only a module lowered for its platform, and its manifest only the platforms its operator
    wrote it for."""
    from memaudit.federated.flower.execute import plan_signatures
    from memaudit.federated.flower.partition import modules_for
    from memaudit.federated.flower.trust import NodeTrust, StageRefused

    a = _algorithm("fedavg")
    args = (a.init(_params()), _struct(_cohort_data(users)), jax.random.key(0))
    plan = compile_plan(a.program, args, PLACED, CAP)
    shaped = node_stages(plan, retrace(a.program, args, PLACED, 2))
    nodes = _Calls(_nodes(users))
    _, info = run_plan(plan, args, nodes, _assignment(), round=0, platforms={"A": "cuda"},
                       node_stages=lambda _n, _h: shaped)
    lowered = {c.users[0]: export.deserialize(bytearray(c.module)).platforms for c in nodes.calls}
    assert lowered == {"u0": ("cuda",), "u3": ("cpu",)}
    assert info["rejected_nodes"] == ["A"]  # this CPU process cannot run A's CUDA module: refused
    cuda_call = next(c for c in nodes.calls if c.users[0] == "u0")
    with pytest.raises(StageRefused, match="lowered for cuda; this node runs cpu"):
        nodes.executors["A"].run(cuda_call)
    with pytest.raises(StageRefused, match="not one of this node's"):
        NodeTrust(frozenset(plan_signatures(plan, shaped))).check_call(cuda_call)
    NodeTrust(frozenset(plan_signatures(plan, shaped, "cuda"))).check_call(cuda_call)
    assert modules_for(plan, "cpu") is plan.modules and modules_for(plan, "cuda") is modules_for(plan, "cuda")
    # a TPU node (lowered here, on a CPU host): TPU-only modules; the CPU node's stay the CPU-only ones
    tpu = modules_for(plan, "tpu")
    assert set(tpu) == set(plan.modules)
    assert all(export.deserialize(bytearray(m)).platforms == ("tpu",) for m in tpu.values())
    assert all(export.deserialize(bytearray(m)).platforms == ("cpu",) for m in plan.modules.values())
    with pytest.raises(PlanError, match="no client stages for platform 'rocm'"):
        modules_for(plan, "rocm")


def test_a_node_refuses_rows_and_slots_the_server_invents(users):
    """Adversary: a server that gives a node's users rows outside its module or twice, or names
    in secure aggregation a cohort slot the node did not serve this round (to make it encode
    rows it keeps for another slot): each refused in one line, no data."""
    import dataclasses

    from memaudit.federated.flower.trust import StageRefused

    a = _algorithm("fedavg")
    args = (a.init(_params()), _struct(_cohort_data(users)), jax.random.key(0))
    plan = compile_plan(a.program, args, PLACED, CAP)
    shaped = node_stages(plan, retrace(a.program, args, PLACED, 2))
    nodes = _Calls(_nodes(users))
    run_plan(plan, args, nodes, _assignment(), round=0, node_stages=lambda _n, _h: shaped)
    call = next(c for c in nodes.calls if c.users[0] == "u0")  # node A: slots 0 and 1, rows 0 and 1
    node = nodes.executors["A"]
    with pytest.raises(StageRefused, match="rows outside the module's 2 clients"):
        node.run(dataclasses.replace(call, rows=[0, 2]))
    with pytest.raises(StageRefused, match="no distinct rows"):
        node.run(dataclasses.replace(call, rows=[1, 1]))
    node.run(call)
    assert node.secagg({"step": "advertise", "round": 0, "clients": [[0, 2]]}) == {
        "abort": "the server named cohort slot 2, which this node did not serve"}
    assert node.secagg({"step": "advertise", "round": 5, "clients": [[0, 0]]}) == {
        "abort": "no client stage of this round ran on this node"}


def test_fedsgd_backward_pass_is_a_second_client_stage(users):
    """jax.grad of the federated loss: forward on the clients, the server's sum, the backward
    on the clients over residuals that stayed on the nodes, the server's sum and update."""
    _, _, plan, _ = _two_rounds("fedsgd", users)
    kinds = [s.kind for s in plan.stages]
    assert kinds.count(CLIENT) == 2
    assert plan.client_stages[0].keep  # residuals kept on the nodes for the backward stage


def _primitives(eqns) -> set[str]:
    """Names of the primitives of ``eqns`` and of every jaxpr nested in their parameters."""
    names = set()
    for e in eqns:
        names.add(e.primitive.name)
        for v in e.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    names |= _primitives(inner.eqns)
    return names


def test_dp_fedavg_clips_on_the_clients(users):
    """DP-FedAvg's per-client clipping is client computation (inside the clients' fused loop,
    which each node runs over its own clients); the noise is the server's."""
    _, _, plan, _ = _two_rounds("dp-adaptive", users)
    client_prims = _primitives([op.eqn for s in plan.client_stages for op in s.ops])
    server_prims = {op.eqn.primitive.name for s in plan.stages if s.kind != CLIENT for op in s.ops}
    assert "sqrt" in client_prims  # the per-client norms
    # the nodes' partial sums of the clipped deltas are added on the server (no per-client row)
    assert not {"federated_sum", "federated_mean"} & server_prims
    assert any(p.startswith("random_bits") or p == "erf_inv" for p in server_prims)


@pytest.mark.parametrize("kind", ["fedavg", "dp-adaptive"])
def test_dead_node_drops_its_users_as_absent_slots(kind, users):
    """Node B dies: its users (slots 2 and 3) count as absent, as in the in-JAX program with
    those slots empty; the round records the drop."""
    ref, got, _, info = _two_rounds(kind, users, dead=("B",), dead_slots=(2, 3))
    assert _max_diff(ref.params, got.params) <= 1e-6
    assert info == {"dropped_nodes": ["B"], "dropped_slots": [2, 3], "alive_nodes": ["A"],
                    "rejected_nodes": [], "advertised": {}}


def test_reading_client_text_on_the_server_is_refused(users):
    def leaky(state, data, key):  # the server reads the clients' raw examples
        return state, ({"x": jnp.sum(data.examples["x"])},)

    with pytest.raises(PlanError, match="reads the client data x on the server"):
        compile_plan(leaky, (_params(), _struct(_cohort_data(users)), jax.random.key(0)), PLACED, CAP)


def test_node_refuses_users_it_does_not_host(users):
    a = _algorithm("fedavg")
    st = a.init(_params())
    key = jax.random.key(0)
    plan = compile_plan(a.program, (st, _struct(_cohort_data(users)), key), PLACED, CAP)
    bad = {"A": [(0, "u0"), (1, "u5")]}  # u5 lives on B
    with pytest.raises(PlanError, match="does not host user 'u5'"):
        run_plan(plan, (st, _struct(_cohort_data(users)), key), _nodes(users), bad, round=0)


# ---------------------------------------------------------------------------- bad input
def test_unknown_runtime_is_one_line_config_error():
    from memaudit.config import load_config
    from memaudit.errors import ConfigError

    with pytest.raises((ConfigError, ValueError)) as e:
        load_config(None, ["federated.runtime=spark"])
    assert "runtime" in str(e.value) and "\n" not in str(e.value).strip()


def test_insecure_superlink_off_localhost_is_refused():
    from memaudit.config import FlowerConfig

    with pytest.raises(ValueError, match="localhost only"):
        FlowerConfig(superlink="10.0.0.5:9091", insecure=True)
    FlowerConfig(superlink="127.0.0.1:9091", insecure=True)


def test_flwr_missing_names_the_extra(monkeypatch):
    import builtins

    from memaudit.errors import ConfigError
    from memaudit.federated.flower import deploy

    real = builtins.__import__

    def no_flwr(name, *a, **kw):
        if name == "flwr" or name.startswith("flwr."):
            raise ImportError(name)
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_flwr)
    with pytest.raises(ConfigError, match=r"memaudit\[flower\]"):
        deploy.require_flwr()


def test_unreachable_superlink_is_one_line():
    from memaudit.errors import MemauditError
    from memaudit.federated.flower.deploy import check_reachable, free_port

    port = free_port()  # nothing listens there
    with pytest.raises(MemauditError, match=f"SuperLink at 127.0.0.1:{port} cannot be reached"):
        check_reachable(f"127.0.0.1:{port}")


def test_cli_train_with_unreachable_superlink_exits_2(tmp_path, capsys):
    import flwr  # noqa: F401 - installed by the set-up; missing it fails the test

    from memaudit.cli import main
    from memaudit.federated.flower.deploy import free_port

    port = free_port()
    rc = main(["train", "configs/tiny.yaml", "--out", str(tmp_path / "run"), "--set", "backend=federated",
               "--set", "federated.runtime=flower", "--set", f"federated.flower.superlink=127.0.0.1:{port}",
               "--set", "federated.flower.insecure=true"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "cannot be reached" in err and len(err.splitlines()) == 1


def test_empty_partition_is_refused(tmp_path):
    from memaudit.errors import DataError
    from memaudit.federated.flower.nodes import load_partition

    p = tmp_path / "node-0.npz"
    np.savez(p, users=np.asarray([], dtype=str), input_ids=np.zeros((0, 1, 4), np.int32),
             attention_mask=np.zeros((0, 1, 4), np.int8), example_mask=np.zeros((0, 1), bool))
    with pytest.raises(DataError, match="holds no users"):
        load_partition(p)


class _FakeGrid:
    """A Grid whose nodes answer the hello with fixed bodies."""

    def __init__(self, bodies, monkeypatch):
        from flwr.supercore.task_identity import TaskIdentity

        for attr in ("_run_id", "_node_id", "_task_id"):  # as inside a ServerApp
            monkeypatch.setattr(TaskIdentity, attr, 1)
        self.bodies = bodies

    def get_node_ids(self):
        return list(self.bodies)

    def push_messages(self, msgs):
        self.sent = {f"m{m.metadata.dst_node_id}": m for m in msgs}
        return list(self.sent)

    def pull_messages(self, ids):  # every reply is there at the first pull
        from flwr.app import Message, Metadata

        from memaudit.federated.flower import wire

        out = []
        for i in ids:
            m = self.sent[i]
            node = m.metadata.dst_node_id
            meta = Metadata(run_id=0, message_id="", src_node_id=node, dst_node_id=0,
                            reply_to_message_id=i, group_id="", created_at=0.0, ttl=60.0,
                            message_type=m.metadata.message_type)
            out.append(Message(metadata=meta, content=wire.content(self.bodies[node])))
        return out


def test_server_refuses_a_node_with_an_empty_partition(monkeypatch):
    import flwr  # noqa: F401 - installed by the set-up; missing it fails the test

    from memaudit.config import FlowerConfig
    from memaudit.errors import MemauditError
    from memaudit.federated.flower.trainer import FlowerNodes

    grid = _FakeGrid({7: {"users": ["a"], "digests": ["d"]},
                      9: {"error": "the node partition 'p.npz' holds no users; give this SuperNode "
                                   "a non-empty partition"}}, monkeypatch)
    with pytest.raises(MemauditError, match="SuperNode 9: the node partition 'p.npz' holds no users"):
        FlowerNodes(grid, FlowerConfig(min_nodes=2)).connect({"a": "d"})


def test_server_refuses_partitions_of_other_data(monkeypatch):
    import flwr  # noqa: F401 - installed by the set-up; missing it fails the test

    from memaudit.config import FlowerConfig
    from memaudit.errors import MemauditError
    from memaudit.federated.flower.trainer import FlowerNodes

    grid = _FakeGrid({7: {"users": ["a"], "digests": ["other"]}, 9: {"users": ["b"], "digests": ["d"]}},
                     monkeypatch)
    with pytest.raises(MemauditError, match="does not match this run's data"):
        FlowerNodes(grid, FlowerConfig(min_nodes=2)).connect({"a": "d", "b": "d"})


def test_server_learns_each_nodes_platform_and_refuses_one_it_lowers_nothing_for(monkeypatch):
    import flwr  # noqa: F401 - installed by the set-up; missing it fails the test

    from memaudit.config import FlowerConfig
    from memaudit.errors import MemauditError
    from memaudit.federated.flower.trainer import FlowerNodes

    grid = _FakeGrid({7: {"users": ["a"], "digests": ["d"], "platform": "cuda"},
                      9: {"users": ["b"], "digests": ["d"]}}, monkeypatch)  # (a node from before: CPU)
    nodes = FlowerNodes(grid, FlowerConfig(min_nodes=2))
    nodes.connect({"a": "d", "b": "d"})
    assert nodes.platforms == {7: "cuda", 9: "cpu"}
    grid = _FakeGrid({7: {"users": ["a"], "digests": ["d"], "platform": "tpu"}}, monkeypatch)
    tpu_nodes = FlowerNodes(grid, FlowerConfig(min_nodes=1))
    tpu_nodes.connect({"a": "d"})
    assert tpu_nodes.platforms == {7: "tpu"}
    grid = _FakeGrid({7: {"users": ["a"], "digests": ["d"], "platform": "rocm"}}, monkeypatch)
    with pytest.raises(MemauditError, match="SuperNode 7 runs JAX on 'rocm', which memaudit lowers no client stages"):
        FlowerNodes(grid, FlowerConfig(min_nodes=1)).connect({"a": "d"})


def test_a_verification_key_directory_on_flower_is_refused_before_submitting():
    """Secure aggregation's default malicious-server mode runs on Flower (test_flower_secagg.py:
    each node makes its clients' keys); a key directory meant for in-process clients does not
    apply there: one line."""
    from memaudit.config import load_config
    from memaudit.errors import ConfigError
    from memaudit.federated.flower.trainer import check_supported

    base = ["backend=federated", "federated.runtime=flower", "privacy.secure_aggregation.enabled=true"]
    check_supported(load_config(None, base))  # the default (malicious-server) mode: runs
    cfg = load_config(None, [*base, "privacy.secure_aggregation.verification_keys=/tmp/keys"])
    with pytest.raises(ConfigError, match="verification_keys does not apply on federated.runtime=flower"):
        check_supported(cfg)


def test_interrupted_submit_stops_the_flower_run(tmp_path, monkeypatch):
    """An interrupted `memaudit train` also stops the run on the SuperLink (flwr stop RUN_ID)."""
    import subprocess

    from memaudit.federated.flower import deploy

    (tmp_path / "flwr-run.log").write_text("Using SuperLink: memaudit\nSuccessfully started run 4242\n")
    seen = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: seen.append(cmd))
    deploy._stop_run(tmp_path, {})
    assert seen and seen[0][1:] == ["stop", "4242", deploy.CONNECTION]


def test_a_stage_message_carries_the_values_all_nodes_share_once(users, monkeypatch):
    """Every node's stage call holds the same module and the same model weights. They travel in
    one shared record, the same object in each node's message, which Flower pushes and stores once
    (objects are content-addressed); each node's own payload keeps only what is its own. Through
    the wire (FlowerNodes, the node's `apps.answer`), two rounds end where the in-JAX program does."""
    import flwr  # noqa: F401 - installed by the set-up; missing it fails the test
    from flwr.app import Message, Metadata
    from flwr.supercore.task_identity import TaskIdentity

    from memaudit.config import FlowerConfig
    from memaudit.federated.flower import trainer, wire
    from memaudit.federated.flower.apps import answer
    from memaudit.federated.flower.messages import SHARED, bytes_of

    for attr in ("_run_id", "_node_id", "_task_id"):  # as inside a ServerApp
        monkeypatch.setattr(TaskIdentity, attr, 1)
    monkeypatch.setattr(trainer, "SHARED_MIN_BYTES", 0)  # this toy model's weights are small
    local = _nodes(users)
    ids = {name: k + 1 for k, name in enumerate(HOSTS)}
    executors = {ids[n]: ex for n, ex in local.executors.items()}

    class Grid:  # the SuperLink and the nodes: each message answered by its node's ClientApp code
        def __init__(self):
            self.exchanges = []

        def push_messages(self, msgs):
            self.exchanges.append(list(msgs))
            self.sent = {f"m{m.metadata.dst_node_id}": m for m in msgs}
            return list(self.sent)

        def pull_messages(self, want):
            out = []
            for i in want:
                m = self.sent[i]
                node = m.metadata.dst_node_id
                body = answer("stage", lambda node=node: executors[node], wire.payload_of(m))
                meta = Metadata(run_id=0, message_id="", src_node_id=node, dst_node_id=0, reply_to_message_id=i,
                                group_id="", created_at=0.0, ttl=60.0, message_type=m.metadata.message_type)
                out.append(Message(metadata=meta, content=wire.content(body)))
            return out

    grid = Grid()
    nodes = trainer.FlowerNodes(grid, FlowerConfig())
    a = _algorithm("fedavg")
    ref = got = a.init(_params())
    assignment = {ids[n]: hosted for n, hosted in _assignment().items()}
    plan = None
    for r in range(2):
        key = jax.random.fold_in(jax.random.key(3), r)
        ref, _ = a.program(ref, _cohort_data(users), key)
        args = (got, _struct(_cohort_data(users)), key)
        plan = plan or compile_plan(a.program, args, PLACED, CAP)
        (got, _), info = run_plan(plan, args, nodes, assignment, round=r)
        assert info["dropped_nodes"] == [] and info["rejected_nodes"] == []
    assert _max_diff(ref.params, got.params) <= 1e-6
    assert grid.exchanges
    for msgs in grid.exchanges:
        shared = [m.content[SHARED] for m in msgs]
        assert len(msgs) == 2 and shared[0] is shared[1]  # one object: pushed and stored once
        values = wire.unpack(bytes_of(shared[0]))
        assert "module" in values and any(k.startswith("input") for k in values)
        for m in msgs:  # a node's own payload names them, and holds none of their bytes
            own = bytes_of(m.content[wire.RECORD])
            assert values["module"] not in own
            assert all(v.tobytes() not in own for k, v in values.items() if k != "module" and v.nbytes > 16)
