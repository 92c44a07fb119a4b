"""A SuperNode trusts nothing the server chooses (memaudit.federated.flower.trust).

Adversary: the server (or anyone submitting a Flower run that drives memaudit's ClientApp),
deviating from memaudit's program to read one user's data. Each test is that adversary trying:
an exported identity module over the node's token ids, an allowed module wired to return what it
keeps or to read another data array, a secure-aggregation policy weaker than the operator's
(`[0.6, 0, 2]` against one colluding client: a 2-client round would reveal client 0's delta to
client 1), a clip above the node's, a distributed-DP noise share below it, a request to encode a
value that is not the round's deltas. The node refuses each with one line and no data; the
stages its manifest allows run unchanged (same values as without checks).
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp
import optax

from memaudit.federated import algorithms as alg
from memaudit.federated.cohorts import ClientData
from memaudit.federated.flower.execute import (
    KEEP,
    ROWS,
    LocalNodes,
    NodeExecutor,
    Refusal,
    StageCall,
    plan_signatures,
    run_plan,
)
from memaudit.federated.flower.partition import PlanError, compile_plan
from memaudit.federated.flower.trust import DPBound, NodeTrust, StageRefused
from tests.federated.toy_nodes import ASSIGN, CAP, HOSTS, PLACED, S, keep_rows, toy_arrays
from tests.federated.toy_nodes import toy_loss as _loss


@pytest.fixture(scope="module")
def toy():
    """Users' arrays, a FedSGD round (a kept residual between its two client stages) and its plan."""
    arrays = toy_arrays(0)
    a = alg.fedsgd(_loss, server_optimizer=optax.sgd(0.5))
    state = a.init({"w": jnp.linspace(-1, 1, 6, dtype=jnp.float32).reshape(3, 2), "b": jnp.zeros(2)})
    data = ClientData({"x": jax.ShapeDtypeStruct((CAP, S, 3), np.float32),
                       "y": jax.ShapeDtypeStruct((CAP, S, 2), np.float32)},
                      jax.ShapeDtypeStruct((CAP, S), np.float32))
    key = jax.random.key(1)
    plan = compile_plan(a.program, (state, data, key), PLACED, CAP)
    return arrays, plan, (state, data, key)


def _executors(arrays, trust):
    out = {}
    for name, hosted in HOSTS.items():
        idx = [int(u[1:]) for u in hosted]
        out[name] = NodeExecutor(hosted, {k: v[idx] for k, v in arrays.items()}, trust=trust)
    return out


class _Recorder:
    def __init__(self, local):
        self.local, self.calls = local, []

    def run_stage(self, calls):
        self.calls.append(dict(calls))
        return self.local.run_stage(calls)


def _identity_call():
    """The attack: an exported identity over the node's ``x`` rows, its output marked as rows."""
    from jax import export

    exp = export.export(jax.jit(lambda x: (x,)), platforms=("cpu",))(
        jax.ShapeDtypeStruct((CAP, S, 3), np.float32))
    return StageCall(bytes(exp.serialize()), "any", 0, 1, [("data", "x")], [ROWS], [0], [0, 1], ["u0", "u2"], [0, 1])


def test_identity_module_is_refused_and_returns_no_data(toy):
    arrays, plan, _ = toy
    trust = NodeTrust(frozenset(plan_signatures(plan)))
    node = _executors(arrays, trust)["A"]
    with pytest.raises(StageRefused, match="not one of this node's") as e:
        node.run(_identity_call())
    assert "\n" not in str(e.value)
    reply = LocalNodes({"A": node}).run_stage({"A": _identity_call()})["A"]
    assert isinstance(reply, Refusal) and arrays["x"][0].tobytes() not in reply.reason.encode()


def test_allowed_module_rewired_is_refused(toy):
    """The FedSGD forward stage's own module, with its kept residuals marked as rows the
    server reads, or reading ``y`` where the program reads ``x``: both refused."""
    import dataclasses

    arrays, plan, args = toy
    trust = NodeTrust(frozenset(plan_signatures(plan)))
    rec = _Recorder(LocalNodes(_executors(arrays, None)))
    run_plan(plan, args, rec, ASSIGN, round=0)
    first = rec.calls[0]["A"]
    assert KEEP in first.outputs  # the residuals stay on the node
    node = _executors(arrays, trust)["A"]
    node.run(first)  # the call as memaudit's server sends it runs
    leak = dataclasses.replace(first, outputs=[ROWS if o == KEEP else o for o in first.outputs])
    swapped = dataclasses.replace(first, inputs=[("data", "y") if x == ("data", "x") else x
                                                 for x in first.inputs])
    for call in (leak, swapped):
        with pytest.raises(StageRefused, match="not one of this node's"):
            node.run(call)


def test_trusted_nodes_give_the_same_round_and_refusing_nodes_fail_it(toy):
    arrays, plan, args = toy
    free, _ = run_plan(plan, args, LocalNodes(_executors(arrays, None)), ASSIGN, round=0)
    trusted, info = run_plan(plan, args, LocalNodes(_executors(arrays, NodeTrust(frozenset(plan_signatures(plan))))),
                             ASSIGN, round=0)
    for a, b in zip(jax.tree.leaves(free), jax.tree.leaves(trusted), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert info["rejected_nodes"] == [] and info["dropped_nodes"] == []
    with pytest.raises(PlanError, match="every SuperNode refused"):  # a manifest of another config
        run_plan(plan, args, LocalNodes(_executors(arrays, NodeTrust(frozenset({"0" * 64})))), ASSIGN, round=0)


# ------------------------------------------------------------------ secure aggregation
def _remote(deltas, hosts, trust, identities=None, nodes=LocalNodes):
    from memaudit.federated.secagg.remote import ClientRows, NodeChannel

    leaves, treedef = jax.tree.flatten(deltas)
    ex = {}
    for node, slots in hosts.items():
        ident = None if identities is None else identities[node]
        ex[node] = keep_rows(NodeExecutor([f"u{s}" for s in slots], {}, trust=trust, identity=ident), leaves, slots)
    return ClientRows(NodeChannel(nodes(ex), hosts, 0), tuple(range(len(leaves))),
                      tuple((x.shape[1:], x.dtype.name) for x in leaves), treedef)


def _deltas(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(0, 0.3, (n, 3, 4)).astype(np.float32), "b": rng.normal(0, 0.3, (n, 5)).astype(np.float32)}


def _trust(policy=(0.6, 1, 3, "malicious"), dp=None, resident=(0, 1)):  # the default mode
    return NodeTrust(frozenset(), frozenset(resident), policy, dp)


def _secagg(**kw):
    from memaudit.federated.aggregators import mean_aggregator
    from memaudit.federated.secagg.aggregator import secure_aggregation

    return secure_aggregation(mean_aggregator(), **{"clip": 1.0, "bits": 16, "seed": 3, **kw})


def _released(agg, rows, n, key):
    """The round's update, or None when it aborted (distributed DP raises the abort; the Flower
    runtime turns it into an aborted round)."""
    from memaudit.federated.secagg.messages import SecAggAbort

    try:
        res = agg.aggregate(rows, jnp.ones(n), agg.init(None), key)
    except SecAggAbort:
        return None
    aborted = res.metrics.get("secagg_aborted", 0) == 1
    return None if aborted and not np.any(_flat(res.update)) else res


def _flat(tree):
    return np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(tree)])


def test_node_takes_the_secagg_policy_from_its_own_config():
    """The server sends [0.6, 0, 2] for a 2-client round; the operator's config has one
    colluding client (min_survivors 3): the node's clients abort, nothing is released."""
    deltas, key = _deltas(2), jax.random.key(4)
    agg = _secagg(min_survivors=2, colluding=0)
    rows = _remote(deltas, {"a": [0], "b": [1]}, _trust())
    res = agg.aggregate(rows, jnp.ones(2), agg.init(None), key)
    assert res.metrics["secagg_aborted"] == 1 and not np.any(_flat(res.update))
    # the same policy on both sides, 4 clients: the round completes with the unchecked value
    deltas = _deltas(4, 1)
    agg = _secagg(min_survivors=3, colluding=1)
    hosts = {"a": [0, 1], "b": [2, 3]}
    checked = agg.aggregate(_remote(deltas, hosts, _trust()), jnp.ones(4), agg.init(None), key)
    free = agg.aggregate(_remote(deltas, hosts, None), jnp.ones(4), agg.init(None), key)
    assert checked.metrics["secagg_aborted"] == 0
    assert np.array_equal(_flat(checked.update), _flat(free.update))


@pytest.mark.parametrize("attack", ["clip", "noise", "leaves", "no-policy"])
def test_node_enforces_its_dp_parameters(attack):
    from memaudit.federated.ddp import distributed_dp

    n, key = 4, jax.random.key(6)
    deltas, hosts = _deltas(n, 2), {"a": [0, 1], "b": [2, 3]}
    policy = (0.6, 0, 3, "malicious")  # the default mode
    if attack == "noise":  # the server asks for noise shares of z = 0.1; the operator set 0.8
        dp = DPBound("distributed", 1.0, 0.8, float(n))
        agg = distributed_dp(clip=1.0, noise_multiplier=0.1, expected_cohort=n, bits=20, seed=3)
        honest = distributed_dp(clip=1.0, noise_multiplier=0.8, expected_cohort=n, bits=20, seed=3)
    else:  # the server quantises against a clip of 5 (the operator's privacy.clip is 1)
        dp = DPBound("central", 1.0)
        agg, honest = _secagg(clip=5.0), _secagg(clip=1.0)
    trust = _trust(policy, dp, resident=(7,) if attack == "leaves" else (0, 1))
    if attack == "no-policy":
        trust = NodeTrust(frozenset(), frozenset((0, 1)), None, dp)
    sent: list[tuple[str, dict]] = []

    class Recorded(LocalNodes):
        def run_secagg(self, payloads):
            out = super().run_secagg(payloads)
            sent.extend((p["step"], out[n]) for n, p in payloads.items() if n in out)
            return out

    assert _released(agg, _remote(deltas, hosts, trust, nodes=Recorded), n, key) is None
    # refused before any share of a client's keys left the node: the encoding comes with the shares
    assert sent and all("abort" in r for step, r in sent if step != "advertise")
    assert {step for step, _ in sent} <= {"advertise", "shares"}
    if attack in ("clip", "noise"):  # the operator's own parameters pass the same checks
        assert _released(honest, _remote(deltas, hosts, _trust(policy, dp)), n, key) is not None


def test_supernode_without_a_manifest_runs_nothing(tmp_path, monkeypatch):
    """The ClientApp of a SuperNode started without ``manifest`` answers a stage with one
    refusal line (no outputs)."""
    import types

    import flwr  # noqa: F401 - installed by the set-up (.[flower]): missing it is a failure, not a skip

    from memaudit.federated.flower import apps, wire
    from memaudit.federated.flower.execute import call_to_wire

    monkeypatch.setattr(apps, "_reply", lambda message, obj: obj)  # the reply's content, unsent
    part = tmp_path / "node-0.npz"
    np.savez(part, users=np.asarray(["u0"]), input_ids=np.zeros((1, 2, 4), np.int32),
             attention_mask=np.ones((1, 2, 4), np.int32), example_mask=np.ones((1, 2), np.float32))
    ctx = types.SimpleNamespace(node_config={"partition": str(part), "cache-dir": str(tmp_path)},
                                node_id=1, run_id=2, run_config={})
    msg = types.SimpleNamespace(content=wire.content(call_to_wire(_identity_call())))
    body = apps.stage(msg, ctx)
    assert set(body) == {"refused"} and "no stage manifest" in body["refused"]
    ctx.node_config["manifest"] = str(tmp_path / "manifest.json")
    (tmp_path / "manifest.json").write_text(
        '{"schema": 1, "stages": [], "resident": [], "policy": null, "dp": null}')
    body = apps.stage(msg, ctx)
    assert set(body) == {"refused"} and "not one of this node's 0 allowed" in body["refused"]


def test_the_deployment_commands_use_tls_node_auth_and_the_manifest():
    from memaudit.errors import ConfigError
    from memaudit.federated.flower.deploy import superlink_args, supernode_args

    link = superlink_args("10.0.0.5", 9091, tls=("ca.crt", "server.pem", "server.key"))
    assert link[link.index("--host") + 1] == "10.0.0.5" and "--enable-supernode-auth" in link
    assert "--insecure" not in link and link[link.index("--ssl-certfile") + 1] == "server.pem"
    node = supernode_args("link.example.org:9091", "node-0.npz", "manifest.json", root_certificates="ca.crt",
                          auth_key="node-0")
    assert "--insecure" not in node and node[node.index("--auth-supernode-private-key") + 1] == "node-0"
    assert node[-1] == "partition='node-0.npz' manifest='manifest.json'"
    for bad in (lambda: superlink_args("0.0.0.0", 9091), lambda: supernode_args("10.0.0.5:9091", "p", "m")):
        with pytest.raises(ConfigError, match="without TLS"):
            bad()


def test_signature_ignores_where_the_program_was_traced_from():
    """The server traces the round from other frames than the operator's manifest (the CLI, a
    worker, another checkout): one computation must give one digest whatever its source
    locations, or a node refuses memaudit's own stage (the multi-process deployment with secure
    aggregation did). A different computation still gives another digest."""
    from jax import export

    from memaudit.federated.flower.trust import module_digest

    def core(x):
        return jnp.sort(x) * 2 + 1

    def direct(x):
        return core(x)

    def helper(x):
        y = core(x)
        return y

    def nested(x):
        return helper(x)

    direct.__name__ = nested.__name__ = "stage"  # the module is named after the function
    spec = jax.ShapeDtypeStruct((4,), jnp.float32)
    a, b = (export.export(jax.jit(f))(spec) for f in (direct, nested))
    assert a.mlir_module().count("\n#loc") != b.mlir_module().count("\n#loc")  # the case at hand
    assert module_digest(a.serialize()) == module_digest(b.serialize())
    other = export.export(jax.jit(lambda x: jnp.sort(x) * 3 + 1))(spec)
    assert module_digest(other.serialize()) != module_digest(a.serialize())


class _Relay(LocalNodes):
    """The server's relay of the shares step, deviating as ``attack`` says, and each node's reply."""

    attack: str = "none"

    def __init__(self, executors):
        super().__init__(executors)
        self.replies = {}

    def run_secagg(self, payloads):
        from memaudit.federated.secagg.pki import KeyRing

        step = next(iter(payloads.values()))["step"]
        if step == "shares" and self.attack != "none":
            p = payloads["a"]  # the target: node a's clients; the server impersonates node b's
            theirs = sorted(c for b in p["signed"] if b["node"] == 1 for c in b["keys"])
            fake = KeyRing.generate(theirs).raw()[1]  # keys whose signing halves the server holds
            verify = {**p["verify"], **fake}
            if self.attack == "swap":  # b's keys replaced, b's signature kept
                signed = [{**b, "keys": fake} if b["node"] == 1 else b for b in p["signed"]]
            elif self.attack == "unsigned":  # b's bundle left out, its keys relayed bare
                signed = [b for b in p["signed"] if b["node"] != 1]
            else:  # "forged": b's keys signed with a key of the server's own, as node b
                from memaudit.federated.flower.identity import new_node_key, sign_keys

                signed = [sign_keys((1, new_node_key()), 0, fake) | {"keys": fake} if b["node"] == 1 else b
                          for b in p["signed"]]
            payloads = {**payloads, "a": {**p, "verify": verify, "signed": signed}}
        out = super().run_secagg(payloads)
        self.replies[step] = out
        return out


@pytest.mark.parametrize("attack", ["none", "swap", "unsigned", "forged"])
def test_node_accepts_only_client_keys_its_manifest_nodes_signed(attack, tmp_path):
    """Adversary: the server swaps node b's clients' verification keys for keys it holds (so it
    could sign as them and collect node a's shares), relays them unsigned, or signs them with a
    key of its own as node b. Node a checks each key against the node keys of its manifest and
    refuses before its clients send a share; honest relaying completes the round with the
    same value as nodes without node keys."""
    from memaudit.federated.flower.identity import (
        load_node_identity,
        new_node_key,
        public_hex,
        write_node_key,
    )

    keys = [new_node_key(), new_node_key()]
    nodes = tuple(public_hex(k) for k in keys)
    idents = {}
    for i, name in enumerate("ab"):  # each node loads its key file, 0600, as a SuperNode does
        path = write_node_key(tmp_path / f"node-{i}.secagg.key", keys[i])
        assert path.stat().st_mode & 0o777 == 0o600
        idents[name] = load_node_identity(path, nodes)
    assert [i for i, _ in idents.values()] == [0, 1]
    trust = NodeTrust(frozenset(), frozenset((0, 1)), (0.6, 1, 3, "malicious"), None, "", nodes)
    n, key, hosts = 4, jax.random.key(5), {"a": [0, 1], "b": [2, 3]}
    deltas, agg = _deltas(n, 3), _secagg(min_survivors=3, colluding=1)
    relays = []

    def relay(executors):
        relays.append(type("Relay", (_Relay,), {"attack": attack})(executors))
        return relays[-1]

    res = _released(agg, _remote(deltas, hosts, trust, idents, nodes=relay), n, key)
    reply = relays[-1].replies["shares"]["a"]
    if attack == "none":
        free = _released(agg, _remote(deltas, hosts, _trust(), None), n, key)
        assert res is not None and np.array_equal(_flat(res.update), _flat(free.update))
        assert "msgs" in reply
    else:
        assert res is None and set(reply) == {"abort"}
        assert {"swap": "substituted", "unsigned": "no verification key",
                "forged": "substituted"}[attack] in reply["abort"]


def test_a_node_reads_a_rounds_protocol_state_once_per_exchange(tmp_path, monkeypatch):
    """The shares step checks the clients' signed keys against the round id of the state it then
    runs on, and the masked step tests the rows of the state it encodes: one read per exchange
    (two reads let a state that changed in between, e.g. another message's, be checked in one
    version and used in the other)."""
    from memaudit.federated.flower.identity import (
        load_node_identity,
        new_node_key,
        public_hex,
        write_node_key,
    )

    reads: list[str] = []
    step_of: list[str] = []
    load, secagg = NodeExecutor._load_protocol, NodeExecutor.secagg

    def counted_load(self, round):
        reads.append(step_of[-1])
        return load(self, round)

    def tagged(self, payload):
        step_of.append(payload.get("step"))
        return secagg(self, payload)

    monkeypatch.setattr(NodeExecutor, "_load_protocol", counted_load)
    monkeypatch.setattr(NodeExecutor, "secagg", tagged)
    keys = [new_node_key(), new_node_key()]
    nodes = tuple(public_hex(k) for k in keys)
    idents = {name: load_node_identity(write_node_key(tmp_path / f"node-{i}.key", keys[i]), nodes)
              for i, name in enumerate("ab")}
    trust = NodeTrust(frozenset(), frozenset((0, 1)), (0.6, 1, 3, "malicious"), None, "", nodes)
    n, hosts = 4, {"a": [0, 1], "b": [2, 3]}
    res = _released(_secagg(min_survivors=3, colluding=1), _remote(_deltas(n, 3), hosts, trust, idents), n,
                    jax.random.key(5))
    assert res is not None  # the round completed
    for step in ("shares", "masked", "check", "unmask"):
        calls = step_of.count(step)
        assert calls == 2 and reads.count(step) == calls, (step, calls, reads.count(step))  # two nodes, a read each
    assert reads.count("advertise") == 0


def test_node_key_must_be_one_of_the_manifest(tmp_path):
    from memaudit.errors import DataError
    from memaudit.federated.flower.identity import (
        load_node_identity,
        new_node_key,
        public_hex,
        write_node_key,
    )

    listed = (public_hex(new_node_key()),)
    with pytest.raises(DataError, match="not one of the stage manifest's 1 nodes"):
        load_node_identity(write_node_key(tmp_path / "node-0.key", new_node_key()), listed)
    (tmp_path / "bad.key").write_text("zz")
    with pytest.raises(DataError, match="cannot be read"):
        load_node_identity(tmp_path / "bad.key", listed)
    trust = NodeTrust(frozenset({"s"}), frozenset({1}), None, None, "f", listed)
    assert NodeTrust.from_json(trust.to_json()) == trust
    with pytest.raises(ValueError, match="identity"):
        NodeExecutor([], {}, trust=trust)


def test_relayed_key_bundles_each_client_once_from_listed_nodes():
    """The bundle rules on their own: a client claimed by two nodes, a node twice, a node
    index outside the manifest and a malformed bundle are refused; signed bundles give the
    union of their keys."""
    from memaudit.federated.flower.identity import (
        authenticated_keys,
        new_node_key,
        public_hex,
        sign_keys,
    )

    keys = [new_node_key(), new_node_key()]
    nodes = tuple(public_hex(k) for k in keys)
    a, b = {0: b"a" * 32, 1: b"b" * 32}, {2: b"c" * 32}

    def bundle(i, ks, rid=7):
        return {**sign_keys((i, keys[i]), rid, ks), "keys": ks}

    assert authenticated_keys([bundle(0, a), bundle(1, b)], nodes, 7) == {**a, **b}
    for bad, why in [([bundle(0, a), bundle(1, {1: b"b" * 32})], "two nodes"),
                     ([bundle(0, a), bundle(0, a)], "came twice"),
                     ([{**bundle(1, b), "node": 2}], "not a manifest node"),
                     ([bundle(0, a, rid=6)], "substituted"),  # another round's bundle replayed
                     ([{"node": 0}], "malformed")]:
        with pytest.raises(StageRefused, match=why):
            authenticated_keys(bad, nodes, 7)
