"""The federated trainer on Flower: the same run, its client computation on SuperNodes.

``memaudit train CONFIG federated.runtime=flower`` calls `memaudit.run.flower.train_on_flower`
(the run wing): it checks that Flower is installed and the
SuperLink reachable, writes a small Flower App (`memaudit.federated.flower.deploy`) and submits
it with ``flwr run``. The SuperLink starts memaudit's ``ServerApp``, which runs
`FederatedTrainer` on the run directory with a `FlowerRuntime` (the same driver, cohorts, keys,
ledger, metrics, checkpoints, Hugging Face export and resume as in JAX), whose rounds run the partitioned program
(`memaudit.federated.flower.partition`): server stages in the ServerApp, client stages on the
SuperNodes that host the sampled users. A SuperNode that does not answer a stage within
``federated.flower.stage_timeout`` is dropped for the round with all its users (their slots
count as absent: weight 0), which the round's metrics record (``dropped_users``,
``dropped_nodes``).

With a host aggregator (secure aggregation, distributed DP: the algorithm's ``host_split``) the client
phase runs on the SuperNodes with its deltas kept there, and the aggregator runs here on a
`memaudit.federated.secagg.remote.ClientRows`: the protocol's server object here, its clients
on the nodes (`FlowerNodes.run_secagg`); a node that stops answering drops its users at that
protocol step. Only a verification key directory is refused (`check_supported`).

References:
    Rush et al. 2024, "FAX: Scalable and Differentiable Federated Primitives in JAX";
    Beutel et al. 2020, "Flower: A Friendly Federated Learning Research Framework".
"""

from __future__ import annotations

import collections
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from memaudit.errors import ConfigError, MemauditError
from memaudit.federated.algorithms import host_metrics
from memaudit.federated.flower import wire
from memaudit.federated.flower.execute import ADVERTISED, Refusal, Resident, call_to_wire, run_plan
from memaudit.federated.flower.guard import SecAggGuard
from memaudit.federated.flower.manifest import (
    MAP_STRATEGY,
    data_struct,
    node_capacity,
    node_plan,
    round_plan,
    steady_node_capacity,
)
from memaudit.federated.flower.messages import server_key, sign_messages
from memaudit.federated.flower.nodes import client_digests
from memaudit.federated.flower.partition import PLATFORMS, STAGE_PLATFORMS
from memaudit.federated.flower.wire import HELLO, SECAGG, STAGE
from memaudit.federated.secagg.aggregator import protocol_round_id
from memaudit.federated.secagg.messages import SecAggError
from memaudit.federated.secagg.remote import Advertised, ClientRows, NodeChannel, advertisement
from memaudit.federated.trainer import FederatedTrainer


# ------------------------------------------------------------------ the nodes, over a Grid
class FlowerNodes:
    """The SuperNodes of a Flower run, as `memaudit.federated.flower.execute.Nodes`."""

    POLL_S = 0.05  # Flower's own send_and_receive sleeps 3 s between polls of the SuperLink

    def __init__(self, grid: Any, fcfg: Any) -> None:
        self.grid, self.fcfg = grid, fcfg
        self.platforms: dict[int, str] = {}  # node -> the platform its stages are lowered for
        # nodes that said they ran a stage module for the first time since `new_round` (a
        # diagnostic the round's metrics count as nodes_compiling; nothing else reads it)
        self.compiling: set[int] = set()

    def new_round(self) -> None:
        self.compiling = set()

    def exchange(self, messages: list[Any], timeout: float) -> list[Any]:
        """Push `messages` and pull their replies until every node has answered or `timeout`
        seconds have passed (a node that has not answered is absent): at most every `POLL_S`
        seconds, counting the time an ask was held (memaudit's SuperLink holds it until a reply
        is there, `memaudit.federated.flower.transport.longpoll`)."""
        key = server_key()  # memaudit's SuperLink's (--server-key): the nodes answer only what it signed
        if key is not None:
            sign_messages(messages, key, int(self.grid.run.run_id))
        ids = set(self.grid.push_messages(messages))
        deadline = time.monotonic() + timeout
        out: list[Any] = []
        while ids:
            asked = time.monotonic()
            got = list(self.grid.pull_messages(ids))
            out += got
            ids -= {m.metadata.reply_to_message_id for m in got}
            if not ids or time.monotonic() >= deadline:
                break
            time.sleep(max(0.0, self.POLL_S - (time.monotonic() - asked)))
        return out

    def _wait_for_nodes(self) -> list[int]:
        deadline = time.monotonic() + self.fcfg.connect_timeout
        while True:
            nodes = sorted(self.grid.get_node_ids())
            if len(nodes) >= self.fcfg.min_nodes:
                return nodes
            if time.monotonic() > deadline:
                raise MemauditError(
                    f"{len(nodes)} of federated.flower.min_nodes={self.fcfg.min_nodes} SuperNodes "
                    f"connected within {self.fcfg.connect_timeout:g} s; start more SuperNodes or "
                    "lower federated.flower.min_nodes")
            time.sleep(0.5)

    def connect(self, digests: dict[str, str]) -> dict[str, int]:
        """Ask every node which users it hosts and its JAX platform (``platforms``); returns
        user -> node. One-line errors for a node without a partition, a user hosted twice or by
        no node, data that is not the run's, or a platform memaudit lowers no stages for."""
        from flwr.app import Message  # flwr: the optional flower extra

        nodes = self._wait_for_nodes()
        msgs = [Message(wire.content({}), dst_node_id=n, message_type=f"query.{HELLO}") for n in nodes]
        replies = list(self.exchange(msgs, self.fcfg.connect_timeout))
        host: dict[str, int] = {}
        answered = [r for r in replies if not r.has_error()]  # an unavailable node is no host
        if len(answered) < self.fcfg.min_nodes:
            raise MemauditError(
                f"{len(answered)} of federated.flower.min_nodes={self.fcfg.min_nodes} SuperNodes "
                "answered; check their logs, or lower federated.flower.min_nodes")
        for r in sorted(answered, key=lambda m: m.metadata.src_node_id):
            node = r.metadata.src_node_id
            body = wire.read(r)
            if "error" in body:
                raise MemauditError(f"SuperNode {node}: {body['error']}")
            platform = str(body.get("platform", STAGE_PLATFORMS[0]))
            if platform not in PLATFORMS:
                raise MemauditError(f"SuperNode {node} runs JAX on {platform!r}, which memaudit lowers no client "
                                    f"stages for ({', '.join(PLATFORMS)}); run it with a CPU, CUDA or TPU jax")
            self.platforms[node] = platform
            for u, d in zip(body["users"], body["digests"], strict=True):
                if u in host:
                    raise MemauditError(f"user {u!r} is in the partitions of SuperNodes {host[u]} "
                                        f"and {node}; give each user to one node")
                if u not in digests or digests[u] != d:
                    raise MemauditError(
                        f"SuperNode {node}'s partition does not match this run's data (user {u!r}); "
                        "write the partitions from the run's config with the same data.tokenizer")
                host[u] = node
        missing = [u for u in digests if u not in host]
        if missing:
            raise MemauditError(f"{len(missing)} training users (e.g. {missing[0]!r}) are on no "
                                "connected SuperNode; start the SuperNodes of every partition")
        return host

    def run_secagg(self, payloads: dict[Any, dict]) -> dict[Any, dict]:
        """One exchange of a secure-aggregation round; a node that fails or does not answer
        within ``federated.flower.stage_timeout`` is absent from the replies (it dropped). What
        a reply holds is checked by `memaudit.federated.flower.guard.SecAggGuard`."""
        from flwr.app import Message  # flwr: the optional flower extra

        msgs = [Message(wire.content(p), dst_node_id=n, message_type=f"train.{SECAGG}",
                        group_id=f"{p['round']}-{p['step']}") for n, p in payloads.items()]
        out: dict[Any, dict] = {}
        for r in self.exchange(msgs, self.fcfg.stage_timeout):
            if not r.has_error():
                out[r.metadata.src_node_id] = _read(r)
        return out

    def run_stage(self, calls: dict[Any, Any]) -> dict[Any, Any]:
        """One client stage; a node's reply is its outputs, a `Refusal`, or (a reply that is not
        memaudit's) whatever it held, which `memaudit.federated.flower.execute.valid_reply`
        rejects."""
        from flwr.app import Message  # flwr: the optional flower extra

        bodies, shared = shared_values([call_to_wire(c) for c in calls.values()])
        record = wire.shared_record(wire.pack(shared)) if shared else None  # one object in every message
        msgs = [Message(wire.content(b, record), dst_node_id=n, message_type=f"train.{STAGE}",
                        group_id=str(c.round)) for (n, c), b in zip(calls.items(), bodies, strict=True)]
        out: dict[Any, Any] = {}
        for r in self.exchange(msgs, self.fcfg.stage_timeout):
            if r.has_error():  # the node died, or its ClientApp failed: dropped for the round
                continue
            body = _read(r)
            if isinstance(body, dict) and body.get("compiled") is True:
                self.compiling.add(r.metadata.src_node_id)
            out[r.metadata.src_node_id] = _stage_reply(body)
        return out


SHARED_MIN_BYTES = 1 << 16  # smaller values travel in each node's own payload


def shared_values(bodies: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The stage calls of an exchange (`call_to_wire`) with the values every node's call holds as
    one object (the module, when the nodes run the same one, and each server value not cut to a
    node's rows: the model's weights) replaced by `wire.Shared` references, and those values by
    key. A message to every node then carries the weights once for all of them (`wire.content`);
    with one node nothing is shared.

    >>> import numpy as np
    >>> w, mine = np.zeros(1 << 15, np.float32), [np.ones(2), np.ones(2)]
    >>> calls = [{"module": b"m", "inputs": [("server", w), ("server", x), ("data", "ids")]} for x in mine]
    >>> bodies, shared = shared_values(calls)
    >>> sorted(shared), [type(v).__name__ for _, v in bodies[1]["inputs"]]
    (['input0'], ['Shared', 'ndarray', 'str'])
    """
    shared: dict[str, Any] = {}
    if len(bodies) < 2:
        return bodies, shared
    out = [dict(b, inputs=list(b["inputs"])) for b in bodies]

    def common(values: list[Any]) -> bool:
        size = values[0].nbytes if isinstance(values[0], np.ndarray) else len(values[0])
        return size >= SHARED_MIN_BYTES and all(v is values[0] for v in values)

    if isinstance(bodies[0]["module"], bytes) and common([b["module"] for b in bodies]):
        shared["module"] = bodies[0]["module"]
        for b in out:
            b["module"] = wire.Shared("module")
    for i, (kind, value) in enumerate(bodies[0]["inputs"]):
        column = [b["inputs"][i][1] if i < len(b["inputs"]) else None for b in bodies]
        if kind == "server" and isinstance(value, np.ndarray) and common(column):
            shared[f"input{i}"] = value
            for b in out:
                b["inputs"][i] = (kind, wire.Shared(f"input{i}"))
    return out, shared


def _read(reply: Any) -> Any:
    """A node's reply, or None when it is not a memaudit message (truncated, not msgpack)."""
    try:
        return wire.read(reply)
    except Exception:  # noqa: BLE001 - anything a client sends: a bad reply drops its node, not the run
        return None


def _stage_reply(body: Any) -> Any:
    if isinstance(body, dict) and isinstance(body.get("refused"), str):
        return Refusal(body["refused"].splitlines()[0] if body["refused"] else "refused")
    outputs = body.get("outputs") if isinstance(body, dict) else None
    if not isinstance(outputs, dict):
        return None
    try:
        return {k if k == ADVERTISED else int(k): v for k, v in outputs.items()}
    except (TypeError, ValueError):
        return None


# ------------------------------------------------------------------ the runtime
class FlowerRuntime:
    """The Flower runtime of `FederatedTrainer`: each round runs the partitioned program against
    ``nodes`` (`FlowerNodes`, or any `memaudit.federated.flower.execute.Nodes`).

    The round is traced with the clients' local training one client after the other (``scan``),
    whatever the server's backend: vmap's batched local-training loop stacks its per-step losses
    with the clients dim second, so the partitioner cannot place that loop on the clients, and
    it would read the clients' token ids on the server (`memaudit.federated.flower.partition`
    refuses that). Each node loops over its own clients.
    """

    map_strategy = MAP_STRATEGY

    def __init__(self, nodes: Any) -> None:
        self.nodes = nodes
        self._plans: dict[int, Any] = {}
        self._shaped: dict[tuple[int, int], Any] = {}
        self.user_node: dict[str, int] = {}
        self.platforms: dict[Any, str] = {}  # node -> its platform (CPU when a node did not say)
        self.steady: dict[Any, int] = {}  # node -> the clients dim of its modules in most rounds

    def mesh(self, cfg: Any, shape: Any) -> None:
        """Each node runs its own clients: no clients mesh in the server's process."""
        return

    def attach(self, trainer: FederatedTrainer) -> None:
        """Refuse what does not run on Flower, then map each training user to its node."""
        check_supported(trainer.cfg)
        if trainer.algorithm.program is None and trainer.algorithm.host_split is None:
            raise ConfigError("this algorithm's round is not one traceable program; use "
                              "federated.runtime=jax")
        self.user_node = self.nodes.connect(client_digests(trainer.clients))
        self.platforms = dict(getattr(self.nodes, "platforms", {}))
        f, population = trainer.fcfg, trainer.clients.num_users
        hosts = collections.Counter(self.user_node.values())
        self.steady = {n: steady_node_capacity(m, population, f.cohort, f.sampling) for n, m in hosts.items()}

    def plan(self, trainer: FederatedTrainer, cap: int, state: Any, key: Any) -> Any:
        """The round's partitioned program for a cohort capacity (traced once per capacity,
        `memaudit.federated.flower.manifest.round_plan`: the program the nodes' manifests allow)."""
        if cap not in self._plans:
            self._plans[cap] = round_plan(trainer, cap, state, key)
        return self._plans[cap]

    def node_stages(self, trainer: FederatedTrainer, plan: Any, state: Any, key: Any) -> Any:
        """(node, hosted) -> the client stages for that node when it hosts that many of the
        round's slots, or None for the cohort's: shaped for the node's steady capacity
        (`steady_node_capacity`), or for the hosted count in a rare round that exceeds it
        (`memaudit.federated.flower.manifest.node_plan`, traced once per node capacity)."""
        def shaped(node: Any, hosted: int) -> Any:
            k = max(node_capacity(hosted), self.steady.get(node, 1))
            if (plan.capacity, k) not in self._shaped:
                self._shaped[(plan.capacity, k)] = node_plan(trainer, plan, k, state, key, self._plans.get(k))
            return self._shaped[(plan.capacity, k)]

        return shaped

    def round(self, trainer: FederatedTrainer, state: Any, cohort: np.ndarray, r: int, key: Any) -> tuple[Any, dict]:
        if hasattr(self.nodes, "new_round"):
            self.nodes.new_round()
        state, m = self._round(trainer, state, cohort, r, key)
        # nodes that ran a stage module new to their process this round: a round that waited on
        # a compile (benchmarks/federated_round.py times the rounds without one as warm)
        m["nodes_compiling"] = len(getattr(self.nodes, "compiling", ()))
        return state, m

    def _round(self, trainer: FederatedTrainer, state: Any, cohort: np.ndarray, r: int, key: Any) -> tuple[Any, dict]:
        cap = trainer.round_capacity(len(cohort))
        assignment: dict[int, list[tuple[int, str]]] = {}
        for slot, k in enumerate(cohort):
            user = trainer.clients.users[int(k)]
            assignment.setdefault(self.user_node[user], []).append((slot, user))
        split = trainer.algorithm.host_split
        if split is not None:
            return self._host_round(trainer, split, cap, state, assignment, r, key)
        plan = self.plan(trainer, cap, state, key)
        (state, metrics), info = run_plan(plan, (state, data_struct(trainer.clients, cap), key), self.nodes,
                                           assignment, round=r, platforms=self.platforms,
                                           node_stages=self.node_stages(trainer, plan, state, key))
        state = jax.tree.map(jnp.asarray, state)
        m = host_metrics(*metrics)
        m.update(dropped_users=len(info["dropped_slots"]), dropped_nodes=len(info["dropped_nodes"]),
                 rejected_nodes=len(info["rejected_nodes"]))
        return state, m

    def _host_round(self, trainer: FederatedTrainer, split: Any, cap: int, state: Any, assignment: dict,
                    r: int, key: Any) -> tuple[Any, dict]:
        """A round with a host aggregator: the client phase on the nodes (its deltas kept
        there; its last stage carries the secure sum's advertise step), then the aggregator with
        the nodes' rows as `ClientRows` (secure aggregation with the protocol clients on the
        nodes), then the server update, here."""
        client_key, agg_key = jax.random.split(key)
        plan = self.plan(trainer, cap, state.params, client_key)
        policy = secure_sum_policy(trainer)
        hosted = {n: [s for s, _ in users] for n, users in assignment.items() if users}
        # the protocol's advertise step rides on the client stage: the keys depend on nothing
        # the stage computes, so the round needs no exchange for them (used when every slot's
        # client is present after the stage, `NodeChannel.advertised`)
        round_id = protocol_round_id(r, key, b"advertised with the client stage")
        ads = advertisement(hosted, round_id, policy) if policy is not None else None
        out, info = run_plan(plan, (state.params, data_struct(trainer.clients, cap), client_key), self.nodes,
                              assignment, round=r, platforms=self.platforms,
                              node_stages=self.node_stages(trainer, plan, state.params, client_key),
                              advertise=ads)
        leaves, treedef = jax.tree.flatten(out.deltas, is_leaf=lambda x: isinstance(x, Resident))
        hosts = {n: [s for s, _ in assignment[n]] for n in info["alive_nodes"]}
        shapes = tuple((tuple(x.aval.shape[1:]), x.aval.dtype.name) for x in leaves)
        guard = SecAggGuard(self.nodes, sum(int(np.prod(s)) for s, _ in shapes))
        early = None if ads is None else Advertised(
            round_id, policy, tuple(sorted(s for v in hosted.values() for s in v)), info["advertised"], ads)
        channel = NodeChannel(guard, hosts, r, early)
        rows = ClientRows(channel, tuple(x.var for x in leaves), shapes, treedef)
        try:
            state, m = split.finish(state, out._replace(deltas=rows), agg_key)
        except SecAggError:  # a reply the guard let through and the protocol refused: an abort
            state, m = _aborted(state, out, sum(len(v) for v in hosts.values()))
        lost = [s for n in channel.dropped for s in hosts[n]]
        m.update(dropped_users=len(info["dropped_slots"]) + len(lost),
                 dropped_nodes=len(info["dropped_nodes"]) + len(channel.dropped),
                 rejected_nodes=len(info["rejected_nodes"]) + len(set(guard.rejected)))
        return state, m


def secure_sum_policy(trainer: FederatedTrainer) -> tuple | None:
    """The protocol policy (threshold, colluding clients, min survivors, mode) of the trainer's
    secure sum (secure aggregation, distributed DP: `FederatedTrainer.build_aggregator`), as its
    aggregator passes it to `memaudit.federated.secagg.remote.run_remote_round`; None without."""
    p = trainer.cfg.privacy
    if not (p.secure_aggregation.enabled or (trainer.plan is not None and p.mechanism == "distributed")):
        return None
    sa = p.secure_aggregation
    return (sa.threshold, sa.colluding_clients, sa.min_survivors, sa.mode)


def _aborted(state: Any, out: Any, cohort: int) -> tuple[Any, dict]:
    """An aborted secure-aggregation round (as the aggregator's own abort): nothing released
    or applied, only the round counter moves on."""
    m = host_metrics(out.metrics, {"secagg_aborted": 1, "survivors": 0.0, "aggregated_clients": 0.0,
                                   "cohort": float(cohort)}, {"update_norm": 0.0})
    return state._replace(round=state.round + 1), m


def flower_trainer(cfg: Any, run: Any, nodes: Any, *, progress: Any = None) -> FederatedTrainer:
    """The federated backend whose rounds run on ``nodes`` (the ServerApp's trainer)."""
    return FederatedTrainer(cfg, run, runtime=FlowerRuntime(nodes), progress=progress)


# ------------------------------------------------------------------ the two processes
def check_supported(cfg: Any) -> None:
    """One-line error for what does not run on Flower: a verification key directory for secure
    aggregation's malicious-server mode (each node makes its own clients' signing keys)."""
    sa = cfg.privacy.secure_aggregation
    uses_secagg = sa.enabled or (cfg.privacy.enabled and cfg.privacy.mechanism == "distributed")
    if uses_secagg and sa.verification_keys is not None:
        raise ConfigError("privacy.secure_aggregation.verification_keys does not apply on "
                          "federated.runtime=flower (each node makes its clients' keys); remove it")
