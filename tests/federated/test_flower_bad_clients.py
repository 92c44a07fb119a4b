"""A bad client costs a round, never the run (memaudit.federated.flower.execute.valid_reply,
memaudit.federated.flower.guard.SecAggGuard, FederatedTrainer's end-of-run check).

Adversary: a client (a SuperNode) that sends truncated, reshaped, oversized, non-finite or
foreign replies. Before: a wrong-shape row reply raised in the server's assembly, a NaN update
went into the model, a masked input 4 bytes short raised ``MessageError`` out of the round, and a
run in which every round aborted was reported complete. Each case's oracle is the same round
with the bad node dead (it did not answer): exact equality.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp
import optax

from memaudit.federated import algorithms as alg
from memaudit.federated.cohorts import ClientData
from memaudit.federated.flower.execute import LocalNodes, NodeExecutor, run_plan, valid_reply
from memaudit.federated.flower.partition import compile_plan
from memaudit.run.driver import run_trainer
from tests.federated.toy_nodes import ASSIGN, CAP, HOSTS, PLACED, S, keep_rows, toy_arrays
from tests.federated.toy_nodes import toy_loss as _loss


@pytest.fixture(scope="module")
def toy():
    """DP-FedAvg (deltas and metrics gathered by rows) on six users, and its plan."""
    from memaudit.federated.aggregators import mean_aggregator
    from memaudit.federated.dp import dp_fedavg

    arrays = toy_arrays(0)
    agg = dp_fedavg(mean_aggregator(), clip=0.5, noise_multiplier=0.7, expected_cohort=4.0)
    a = alg.fedavg(_loss, client_optimizer=optax.sgd(0.2), server_optimizer=optax.sgd(1.0), local_steps=2,
                   batch_size=2, aggregator=agg)
    state = a.init({"w": jnp.linspace(-1, 1, 6, dtype=jnp.float32).reshape(3, 2), "b": jnp.zeros(2)})
    data = ClientData({"x": jax.ShapeDtypeStruct((CAP, S, 3), np.float32),
                       "y": jax.ShapeDtypeStruct((CAP, S, 2), np.float32)},
                      jax.ShapeDtypeStruct((CAP, S), np.float32))
    args = (state, data, jax.random.key(2))
    return arrays, compile_plan(a.round.program, args, PLACED, CAP), args


def _local(arrays, dead=()):
    ex = {}
    for name, hosted in HOSTS.items():
        idx = [int(u[1:]) for u in hosted]
        ex[name] = NodeExecutor(hosted, {k: v[idx] for k, v in arrays.items()})
    return LocalNodes(ex, dead=dead)


TAMPER = {
    "short": lambda x: x.reshape(-1)[:-1],  # one float (4 bytes) short
    "shape": lambda x: x[None],
    "oversized": lambda x: np.concatenate([np.atleast_1d(x)] * 64),  # a partial sum is 0-d
    "nan": lambda x: np.full_like(x, np.nan) if np.issubdtype(x.dtype, np.floating) else x,
    "dtype": lambda x: x.astype(np.float64),
}


class _Bad:
    """Node B's every reply tampered with (``kind``: TAMPER, or "missing" / "garbage")."""

    def __init__(self, local, kind):
        self.local, self.kind = local, kind

    def run_stage(self, calls):
        out = self.local.run_stage(calls)
        if "B" in out:
            r = dict(out["B"])
            if self.kind == "garbage":
                out["B"] = "not a reply"
            elif self.kind == "missing":
                r.pop(min(r))
                out["B"] = r
            else:
                out["B"] = {k: TAMPER[self.kind](np.asarray(v)) for k, v in r.items()}
        return out


@pytest.mark.parametrize("kind", [*TAMPER, "missing", "garbage"])
def test_a_bad_stage_reply_drops_its_node_and_the_round_goes_on(kind, toy):
    arrays, plan, args = toy
    (want, _), dead = run_plan(plan, args, _local(arrays, dead=("B",)), ASSIGN, round=0)
    (got, _), info = run_plan(plan, args, _Bad(_local(arrays), kind), ASSIGN, round=0)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert info["rejected_nodes"] == ["B"] and info["dropped_slots"] == dead["dropped_slots"] == [2, 3]
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(got.params))


def test_a_reply_that_is_not_memaudit_message_is_rejected(monkeypatch, toy):
    """On the wire: a payload 4 bytes short (not msgpack any more), a foreign record, a payload
    field that is not bytes, and a refusal line: the first three are rejected replies, the fourth
    a refusal; nothing raises."""
    pytest.importorskip("flwr")
    from flwr.app import ConfigRecord, Message, Metadata, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from memaudit.config import FlowerConfig
    from memaudit.federated.flower import wire
    from memaudit.federated.flower.execute import Refusal, StageCall
    from memaudit.federated.flower.trainer import FlowerNodes

    for attr in ("_run_id", "_node_id", "_task_id"):  # as inside a ServerApp
        monkeypatch.setattr(TaskIdentity, attr, 1)
    good = wire.pack({"outputs": {"0": np.zeros(3, np.float32)}})
    bodies = {1: wire.record(good[:-4]),
              2: RecordDict({"other": ConfigRecord({"x": b"1"})}),
              4: RecordDict({wire.RECORD: ConfigRecord({wire.FIELD: 7})}),
              3: wire.content({"refused": "stage abc is not one of this node's allowed stages"})}

    class Grid:  # the SuperLink: every node's reply is there at the first pull
        def push_messages(self, msgs):
            self.sent = {f"m{m.metadata.dst_node_id}": m.metadata.dst_node_id for m in msgs}
            return list(self.sent)

        def pull_messages(self, ids):
            return [Message(metadata=Metadata(run_id=0, message_id="", src_node_id=self.sent[i], dst_node_id=0,
                                              reply_to_message_id=i, group_id="", created_at=0.0, ttl=60.0,
                                              message_type="train.memaudit_stage"), content=bodies[self.sent[i]])
                    for i in ids]

    call = StageCall(b"m", "k", 0, 1, [], [], [], [], [], [])
    out = FlowerNodes(Grid(), FlowerConfig()).run_stage({n: call for n in bodies})
    assert out[1] is None and out[2] is None and out[4] is None and isinstance(out[3], Refusal)
    st = toy[1].client_stages[0]
    assert all(valid_reply(toy[1], st, out[n], 2) is not None for n in bodies)


# ------------------------------------------------------------------ secure aggregation
N, HOSTS_SA = 6, {"a": [0, 1, 2, 3], "b": [4, 5]}  # t = 4 of 6: node a alone can unmask


def _deltas():
    rng = np.random.default_rng(3)
    return {"w": rng.normal(0, 0.3, (N, 3, 4)).astype(np.float32), "b": rng.normal(0, 0.3, (N, 5)).astype(np.float32)}


class _BadSecAgg:
    """Node b's replies at one step corrupted (or, ``kind="dead"``, node b not answering)."""

    def __init__(self, local, step, kind):
        self.local, self.step, self.kind = local, step, kind

    def run_secagg(self, payloads):
        step = next(iter(payloads.values()))["step"]
        if step == self.step and self.kind == "dead":
            self.local.dead.add("b")
        out = self.local.run_secagg(payloads)
        if step != self.step or "b" not in out or self.kind == "dead":
            return out
        if step == "masked":  # one vector: node b's clients' masked inputs, added up
            out["b"] = self.bad_sum(dict(out["b"]))
            return out
        msgs = dict(out["b"]["msgs"])
        cid = min(msgs)
        if self.kind == "short":  # any message 4 bytes short
            msgs[cid] = msgs[cid][:-4]
        elif self.kind == "padded":
            msgs[cid] = msgs[cid] + b"\0\0\0\0"
        elif self.kind == "missing":
            msgs.pop(cid)
        out["b"] = {"msgs": msgs}
        return out

    def bad_sum(self, reply):
        y, cids = reply["sum"], list(reply["cids"])
        if self.kind == "short":  # one uint32 word short
            return {**reply, "sum": y[:-1]}
        if self.kind == "padded":
            return {**reply, "sum": np.append(y, np.uint32(0))}
        if self.kind == "wide-words":  # the same values as 64-bit words
            return {**reply, "sum": y.astype(np.uint64)}
        if self.kind == "sender":  # a client of node a named as node b's
            return {**reply, "cids": [*cids[:-1], min(HOSTS_SA["a"])]}
        if self.kind == "repeated":
            return {**reply, "cids": [*cids, cids[0]]}
        if self.kind == "extra":  # the sum and each client's own masked input
            return {**reply, "msgs": {}}
        return {**reply, "sum": b"MASA" + bytes(40)}  # garbage


def _round(step, kind):
    from memaudit.federated.aggregators import mean_aggregator
    from memaudit.federated.flower.guard import SecAggGuard
    from memaudit.federated.secagg.aggregator import secure_aggregation
    from memaudit.federated.secagg.remote import ClientRows, NodeChannel

    deltas = _deltas()
    leaves, treedef = jax.tree.flatten(deltas)
    ex = {node: keep_rows(NodeExecutor([f"u{s}" for s in slots], {}), leaves, slots)
          for node, slots in HOSTS_SA.items()}
    guard = SecAggGuard(_BadSecAgg(LocalNodes(ex), step, kind), sum(int(np.prod(x.shape[1:])) for x in leaves))
    rows = ClientRows(NodeChannel(guard, HOSTS_SA, 0), tuple(range(len(leaves))),
                      tuple((x.shape[1:], x.dtype.name) for x in leaves), treedef)
    agg = secure_aggregation(mean_aggregator(), clip=1.0, bits=16, seed=3)
    return agg.aggregate(rows, jnp.ones(N), agg.init(None), jax.random.key(7)), guard


@pytest.mark.parametrize("step,kind", [
    ("masked", "short"), ("masked", "padded"), ("masked", "wide-words"), ("masked", "sender"),
    ("masked", "repeated"), ("masked", "extra"), ("masked", "garbage"), ("shares", "missing"),
    ("advertise", "short"), ("unmask", "short")])
def test_a_bad_secagg_reply_drops_its_node_as_if_it_died(step, kind):
    """Oracle: the same round with node b dead at that step (its users out of the sum, or, at
    the unmask step, in it and unmasked by node a)."""
    (want, _), (got, guard) = _round(step, "dead"), _round(step, kind)
    assert got.metrics["secagg_aborted"] == want.metrics["secagg_aborted"] == 0
    assert float(got.metrics["survivors"]) == float(want.metrics["survivors"])
    for a, b in zip(jax.tree.leaves(want.update), jax.tree.leaves(got.update), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert guard.rejected == ["b"]


# ------------------------------------------------------------------ config and the whole run
def test_expected_survivors_below_min_survivors_is_refused_before_training():
    from memaudit.config import load_config
    from memaudit.errors import ConfigError
    from memaudit.run.checks import check_before_disk

    over = ["backend=federated", "federated.cohort=4", "privacy.secure_aggregation.enabled=true"]
    with pytest.raises(ConfigError, match="expects 0.2 survivors per round") as e:
        check_before_disk(load_config(None, [*over, "privacy.secure_aggregation.dropout=0.95"]))
    assert "\n" not in str(e.value)
    check_before_disk(load_config(None, [*over, "privacy.secure_aggregation.dropout=0.2"]))  # 3.2 >= 3


OVERRIDES = [
    "backend=federated", "data.synth.users=12", "data.synth.docs_per_user=3", "data.seq_len=32",
    "data.canaries.repetitions=[1]", "federated.rounds=1", "federated.cohort=6",
    "federated.sampling=fixed", "federated.local_steps=1", "federated.local_batch_size=2",
    "federated.client_lr=0.2", "federated.eval_every=10", "federated.checkpoint_every=1",
    "federated.mesh_clients=1", "train.batch_size=8", "train.eval_batches=1", "federated.runtime=flower",
    "privacy.clip=0.5", "privacy.noise_multiplier=0.8", "privacy.reproducible_randomness=true",
]


class _TrainerNodes:
    """In-process SuperNodes with the partitions' stage manifest; ``bad``: nodes whose every
    reply is tampered with (NaN rows, or a masked sum a word short)."""

    def __init__(self, partitions, manifest, bad=()):
        from pathlib import Path

        from memaudit.federated.flower.identity import load_node_identity
        from memaudit.federated.flower.nodes import load_partition
        from memaudit.federated.flower.trust import NodeTrust

        trust = NodeTrust.load(manifest)
        self.local = LocalNodes({i: NodeExecutor(
            *load_partition(p), trust=trust,
            identity=load_node_identity(Path(p).with_suffix(".secagg.key"), trust.nodes) if trust.nodes else None)
            for i, p in enumerate(partitions)})
        self.bad = set(bad)
        self.aborts: list[str] = []  # the steps at which a node's clients refused (abort replies)

    def connect(self, digests):
        return {u: node for node, ex in self.local.executors.items() for u in ex.users}

    def run_stage(self, calls):
        out = self.local.run_stage(calls)
        return {n: ({k: np.full_like(np.asarray(v), np.nan) if np.issubdtype(np.asarray(v).dtype, np.floating)
                     else v for k, v in r.items()} if n in self.bad else r) for n, r in out.items()}

    def run_secagg(self, payloads):
        out = self.local.run_secagg(payloads)
        step = next(iter(payloads.values()))["step"]
        self.aborts += [step for r in out.values() if "abort" in r]
        for n in self.bad & set(out):
            if step == "masked" and "sum" in out[n]:
                out[n] = {**out[n], "sum": out[n]["sum"][:-1]}
        return out


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """One set of partitions; the stage manifests of the central-DP and the secure-aggregation
    configs (same data)."""
    from memaudit.config import load_config
    from memaudit.data import load_prepared
    from memaudit.federated.flower.manifest import write_manifest
    from memaudit.federated.flower.nodes import write_partitions
    from memaudit.rundir import RunDir

    root = tmp_path_factory.mktemp("flower-bad")
    i = write_partitions(load_config(None, OVERRIDES), root / "parts", nodes=2)
    over = [*OVERRIDES, f"data.tokenizer={i['tokenizer']}"]
    secagg = [*over, "privacy.secure_aggregation.enabled=true"]
    scratch = RunDir(root / "parts" / "prepared")
    m = write_manifest(load_config(None, secagg), load_prepared(scratch), scratch, root / "secagg.json")
    return root, {"central": (over, i["partitions"], i["manifest"]), "secagg": (secagg, i["partitions"], str(m))}


def test_a_bad_node_costs_its_users_never_the_run(parts):
    """Node 1 sends NaN updates: it is dropped (counted in the 0600 sensitive metrics, not the
    public ones), and the run completes with finite weights."""
    from safetensors.numpy import load_file

    from memaudit.config import load_config
    from memaudit.federated.flower.trainer import flower_trainer
    from memaudit.rundir import RunDir

    root, info = parts
    over, partitions, manifest = info["central"]
    run = root / "one-bad"
    run_trainer(flower_trainer(load_config(None, over), RunDir(run), _TrainerNodes(partitions, manifest, bad=[1])))
    assert json.loads((run / "run.json").read_text())["status"] == "complete"
    sensitive = [json.loads(x) for x in (run / "sensitive_metrics.jsonl").read_text().splitlines()]
    assert [m["rejected_nodes"] for m in sensitive] == [1] and sensitive[0]["dropped_users"] > 0
    assert (run / "sensitive_metrics.jsonl").stat().st_mode & 0o777 == 0o600
    assert "rejected_nodes" not in (run / "metrics.jsonl").read_text()
    w = load_file(str(run / "model" / "model.safetensors"))
    assert all(np.all(np.isfinite(x)) for x in w.values())


def test_a_run_in_which_no_round_aggregated_fails_with_one_line(parts):
    """Every node sends a masked sum a word short: every secure-aggregation round aborts.
    Before, the run was reported complete with a model that never moved."""
    from memaudit.config import load_config
    from memaudit.errors import MemauditError
    from memaudit.federated.flower.trainer import flower_trainer
    from memaudit.rundir import RunDir

    root, info = parts
    over, partitions, manifest = info["secagg"]
    run = root / "all-bad"
    nodes = _TrainerNodes(partitions, manifest, bad=[0, 1])
    with pytest.raises(MemauditError, match="no round of 1 aggregated a client's update") as e:
        run_trainer(flower_trainer(load_config(None, over), RunDir(run), nodes))
    assert nodes.aborts == []  # the manifest's policy and DP bound let the honest steps through
    assert "\n" not in str(e.value)
    manifest_json = json.loads((run / "run.json").read_text())
    assert manifest_json["status"] == "failed" and not (run / "model" / "model.safetensors").exists()
    sensitive = [json.loads(x) for x in (run / "sensitive_metrics.jsonl").read_text().splitlines()]
    assert [m["secagg_aborted"] for m in sensitive] == [1]
