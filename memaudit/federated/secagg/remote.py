"""Secure aggregation with each client's side on the machine that holds its data.

The in-JAX aggregators (`memaudit.federated.secagg.aggregator.secure_aggregation`,
`memaudit.federated.ddp.distributed_dp`, with `memaudit.federated.dp.dp_fedavg` around the
first) see the cohort's deltas as arrays and drive every protocol `Client` in one process. On
a runtime across machines (``federated.runtime: flower``) the deltas stay on the nodes: the
aggregators get a `ClientRows` handle instead, and the same code paths run the client's half
there:

- `ClientRows` names the deltas' leaves as the nodes keep them (var ids of the partitioned
  client stage) and carries the per-client transforms an outer aggregator asks for (DP-FedAvg's
  clip to C, and the indicator 1[‖Δ‖ <= C] that adaptive clipping counts: appended to the
  user's encoded row as one integer coordinate, so it is summed under the masks too, as
  `memaudit.federated.updates.LocalUpdates` does in JAX): a
  `memaudit.federated.client_ops.ClientStep`; both implement
  `memaudit.federated.updates.ClientUpdates`;
- `run_remote_round` is `memaudit.federated.secagg.protocol.run_round` with the server's
  `Server` here and the protocol's `Client` s on the nodes, over four message exchanges
  (advertise, share keys, masked input, unmask) and, in the malicious-server mode (the
  default), the consistency check between the last two; a node that stops answering drops its
  clients at that step, exactly as a simulated dropout there would. The advertise step needs
  nothing the round's clients compute, so on Flower it rides on the round's last client stage
  (`advertisement`, `Advertised`): the round then runs from the share-keys step, and the
  round's encoding travels with the shares;
- in the malicious-server mode each node generates its clients' Ed25519 signing keys for the
  round (kept in its state, never in a reply) and returns their verification keys with the
  advertisements; the server relays every client's verification key to every node. That relay
  is the mode's key distribution on a runtime across machines: it stops a server that forks
  survivor lists or shows different cohorts, and a server that also substitutes verification
  keys in the relay is outside what it stops (docs/secure-aggregation.md, "Flower");
- `node_step` is a node's side of one exchange: it makes its clients, keeps their secret keys
  and received shares in the node's own state (never in a reply), and at the masked-input step
  quantises its own users' rows (the round's frozen encoding,
  `memaudit.federated.secagg.quantise.SecAggEncoding` or, for distributed DP with each user's
  discrete-Gaussian noise share, `memaudit.federated.client_ops.DDGEncoding`) with a per-slot
  generator, and sends its clients' masked inputs added up (mod 2^32): one vector a node, which
  the server adds to its sum once (`Server.receive_masked_sum`). The masks between two clients
  of one node cancel in it; the self masks and the masks shared with other nodes' clients stay.

Per-slot randomness: `memaudit.federated.client_ops.slot_seed` derives each slot's rounding seed
one-way (sha256) from the round key, ``train.seed``, the round and the slot, so the in-JAX run
and a node round the same bits for the same user while the round key never leaves the server.
A distributed-DP noise share is not derived from it: each client draws it from its own fresh
secret on the node (`memaudit.federated.client_ops.fresh_secret`), which the server never sees.

References:
    Bonawitz et al., CCS 2017; Bell et al., CCS 2020 (SecAgg+); Kairouz, Liu, Steinke,
    ICML 2021 (conditional rounding, the distributed discrete Gaussian).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from memaudit.federated.client_ops import (
    ClientStep,
    DDGEncoding,
    Encoding,
    encode_rows,
    flatten_clients,
    slot_rng,
    slot_seed,
    with_bits,
)
from memaudit.federated.flower.wire import dtype_of
from memaudit.federated.secagg.client import Client
from memaudit.federated.secagg.graph import neighbours as make_neighbours
from memaudit.federated.secagg.messages import AuthenticationError, SecAggAbort, masked_bytes
from memaudit.federated.secagg.pages import ordinary_pages
from memaudit.federated.secagg.pki import KeyRing
from memaudit.federated.secagg.policy import DEFAULT_MODE, Policy
from memaudit.federated.secagg.protocol import Dropouts, RoundResult
from memaudit.federated.secagg.quantise import SecAggEncoding
from memaudit.federated.secagg.server import Server, policy_thresholds
from memaudit.federated.updates import ClientUpdates

STEPS = ("advertise", "shares", "masked", "check", "unmask")
ENCODINGS: dict[str, Any] = {"secagg": SecAggEncoding, "ddp": DDGEncoding}  # wire "kind" -> class


def encoding_from_wire(d: dict[str, Any]) -> Encoding:
    """The frozen encoding a node received in its wire form (``{"kind": ..., fields}``)."""
    if d.get("kind") not in ENCODINGS:
        raise ValueError(f"unknown secure-sum encoding {d.get('kind')!r}")
    return ENCODINGS[d["kind"]].from_wire(d)


# ------------------------------------------------------------------ the server's side
@dataclasses.dataclass(frozen=True)
class Advertised:
    """Advertisements the nodes made with the round's last client stage (`advertisement`):
    the protocol's round id, the policy and the cohort slots (client ``cid`` is ``slots[cid]``)
    they were made for, each node's reply (node -> ``{"msgs": ..., "verify": ...}``) and the
    payload it answered."""

    round_id: int
    policy: tuple
    slots: tuple[int, ...]
    replies: dict[Any, Any]
    payloads: dict[Any, dict]


def advertisement(hosts: dict[Any, list[int]], round_id: int, policy: Sequence[Any]) -> dict[Any, dict]:
    """Each node's advertise payload for the clients of the cohort slots ``hosts`` (node ->
    its slots), numbered in slot order over all nodes: what a node runs right after the
    round's last client stage and answers with its outputs, so the round needs no advertise
    exchange of its own when every slot's client is present after the stage (`Advertised`).
    Nothing in it depends on the clients' data: a client's keys are fresh for the round."""
    cid = {s: k for k, s in enumerate(sorted(s for slots in hosts.values() for s in slots))}
    return {node: {"round_id": int(round_id), "policy": list(policy),
                   "clients": [[cid[s], int(s)] for s in sorted(slots)]}
            for node, slots in hosts.items() if slots}


class NodeChannel:
    """The nodes holding a round's client rows: one payload per node, the replies of those that
    answered; a node that did not answer once is out for the rest of the round.

    Args:
        nodes: has ``run_secagg(payloads: node -> dict) -> node -> dict`` (the nodes that answered).
        hosts: node -> the cohort slots whose rows it holds (the nodes alive after the client stage).
        round: the round number (the nodes key their kept rows by it).
    """

    def __init__(self, nodes: Any, hosts: dict[Any, list[int]], round: int,
                 early: Advertised | None = None) -> None:
        self.nodes, self.round = nodes, int(round)
        self.host = {s: n for n, slots in hosts.items() for s in slots}
        self.alive = set(hosts)
        self.dropped: list[Any] = []
        self.early = early

    def call(self, payloads: dict[Any, dict]) -> dict[Any, dict]:
        payloads = {n: {**p, "round": self.round} for n, p in payloads.items() if n in self.alive}
        if not payloads:
            return {}
        return self._answered(payloads, dict(self.nodes.run_secagg(payloads)))

    def _answered(self, asked: Any, replies: dict[Any, dict]) -> dict[Any, dict]:
        """``replies`` of the nodes ``asked``: those that did not answer are out for the round;
        a node whose clients refused aborts it."""
        lost = sorted(set(asked) - set(replies), key=str)
        self.alive -= set(lost)
        self.dropped.extend(lost)
        for n in sorted(replies, key=str):
            if "abort" in replies[n]:
                raise SecAggAbort(f"node {n}: {replies[n]['abort']}")
        return replies

    def advertised(self, slots: Sequence[int], policy: tuple) -> Advertised | None:
        """The advertisements the nodes sent with the round's client stage, when they are this
        round's: made for the clients ``slots`` (client ``cid`` is ``slots[cid]``) under
        ``policy``. Used once; None otherwise (the round then runs its advertise exchange).
        Nodes that check the replies of an exchange (``nodes.advertised(payloads, replies)``,
        `memaudit.federated.flower.guard.SecAggGuard`) check these as an advertise exchange's;
        a node without a valid one is out of the round, as one that did not answer."""
        early, self.early = self.early, None
        if early is None or early.slots != tuple(int(s) for s in slots) or early.policy != tuple(policy):
            return None
        alive = {self.host.get(s) for s in early.slots} & self.alive
        replies = {n: r for n, r in early.replies.items() if n in alive}
        check = getattr(self.nodes, "advertised", None)
        if check is not None:
            replies = check({n: early.payloads[n] for n in alive}, replies)
        return dataclasses.replace(early, replies=self._answered(alive, replies))


@dataclasses.dataclass(frozen=True)
class ClientRows(ClientUpdates):
    """A clients-placed pytree (the cohort's model deltas) whose rows stay on the nodes.

    ``leaves``: the var id under which every node keeps each leaf (its rows for the slots it
    hosts); ``shapes``: each leaf's per-client shape and dtype name; ``step``: what each node
    does to its users' rows before encoding (the clips an outer aggregator asks for, and
    whether 1[‖Δ‖ <= C] of the delta before them is appended to the encoded row).
    """

    channel: NodeChannel
    leaves: tuple[int, ...]
    shapes: tuple[tuple[tuple[int, ...], str], ...]
    treedef: Any
    step: ClientStep = dataclasses.field(default_factory=ClientStep)

    @property
    def dim(self) -> int:
        return int(sum(int(np.prod(s)) for s, _ in self.shapes))

    @property
    def counted(self) -> bool:
        return self.step.count is not None

    @property
    def clip_bound(self) -> float | None:
        return min(self.step.clips) if self.step.clips else None

    def clipped(self, clip: Any, *, count: bool = False) -> ClientRows:
        """These rows, each scaled on its node to global L2 norm <= ``clip``; with ``count``
        each row also carries 1[norm <= clip] into the secure sum."""
        return dataclasses.replace(self, step=self.step.then_clip(clip, count=count))

    def unflatten(self, v: np.ndarray) -> Any:
        out, o = [], 0
        for shape, dtype in self.shapes:
            size = int(np.prod(shape))
            out.append(jax.numpy.asarray(np.asarray(v[o:o + size]).reshape(shape), dtype=dtype_of(dtype)))
            o += size
        return jax.tree.unflatten(self.treedef, out)

    def zeros(self) -> Any:
        return self.unflatten(np.zeros(self.dim))

    def secure_sum(self, encoding: Encoding, present: Sequence[int], seeds: Sequence[str], *,
                   secure: bool = True, **protocol: Any) -> RoundResult:
        """`run_remote_round`: rows on the nodes are only ever summed through the protocol, so
        ``secure=False`` runs it too."""
        del secure
        dim = encoding.width(self.dim) + self.counted
        return run_remote_round(self, encoding, present, seeds, dim=dim, **protocol)

    def tree(self) -> Any:
        raise ValueError("the deltas stay on the nodes (federated.runtime=flower): a plain base "
                         "aggregator cannot read them; wrap it in secure aggregation")

    def within_count(self, presence: Any) -> Any:
        raise ValueError("the clip indicators of deltas kept on the nodes are only summed under "
                         "secure aggregation; wrap the base aggregator in secure aggregation")


def run_remote_round(rows: ClientRows, encoding: Encoding, present: Sequence[int],
                     seeds: Sequence[str], *, dim: int, round_id: int, neighbours: str = "full",
                     threshold: float = 0.6, graph_seed: int = 0, degree: int | None = None,
                     dropouts: Any = None, colluding: int = 0, min_survivors: int = 3,
                     mode: str = DEFAULT_MODE, keys: Any = None) -> Any:
    """`memaudit.federated.secagg.protocol.run_round` with the clients on the nodes.

    ``encoding``: the round's frozen client encoding (sent in its wire form). Client ``cid``
    (0..n-1) is cohort slot ``present[cid]`` on the node that holds that slot's rows;
    ``seeds[cid]`` its slot seed; ``dim`` the length of an encoded row. Simulated
    ``dropouts`` (`Dropouts`) leave a client out of a step as in-JAX; a node that does not
    answer a step drops all its clients there.

    Raises:
        SecAggAbort: as `run_round` (too few survivors, a threshold below the bound), or a
            client on a node refused a step.
    """
    policy = Policy(threshold=threshold, colluding=colluding, min_survivors=min_survivors, mode=mode)
    if keys is not None and not keys.generated:  # a generated ring stays unused: nodes make theirs
        raise ValueError("a verification key directory is for clients in this process; on a runtime "
                         "across machines each node makes its clients' keys (leave verification_keys unset)")
    drop = dropouts or Dropouts()
    n = len(present)
    neigh = make_neighbours(n, neighbours, seed=graph_seed, degree=degree)
    t = policy_thresholds(neigh, policy)
    policy.check_survivors(n, "the start of the round")
    ch = rows.channel
    early = ch.advertised(present, (threshold, colluding, min_survivors, mode))
    if early is not None:  # the keys came with the client stage, bound to its round id
        round_id = early.round_id
    server = Server(round_id=round_id, neighbours=neigh, threshold=t, dim=dim,
                    min_survivors=min_survivors, signed=policy.malicious,
                    graph=(neighbours, graph_seed, degree), colluding=colluding)
    node_of = {cid: ch.host[int(s)] for cid, s in enumerate(present)}
    traffic = {"up": 0, "down": 0, "masked": 0}

    def exchange(step: str, msgs: dict[int, bytes], receive: Callable[..., None],
                 extra: dict | None = None, per_node: Callable[[list[int]], dict] | None = None) -> list[int]:
        """Send ``msgs`` (cid -> bytes) to the nodes, with ``extra`` and ``per_node(its cids)``
        in each node's payload; feed the replies to ``receive``; return the cids whose node
        answered. At the masked-input step a node's reply is one vector, its clients' masked
        inputs added up there (`node_step`): ``receive(cids, vector)``."""
        payloads: dict[Any, dict] = {}
        for cid, m in msgs.items():
            traffic["down"] += len(m)
            payloads.setdefault(node_of[cid], {"step": step, "msgs": {}, **(extra or {})})["msgs"][cid] = m
        for p in payloads.values():
            p.update(per_node(sorted(p["msgs"])) if per_node else {})
        replies = ch.call(payloads)
        for node in sorted(replies, key=str):
            if step == "masked":
                size = masked_bytes(len(replies[node]["sum"]))
                traffic["up"] += size
                traffic["masked"] += size
                receive(replies[node]["cids"], replies[node]["sum"])
                continue
            for _cid, m in sorted(replies[node]["msgs"].items()):
                traffic["up"] += len(m)
                receive(m)
        return sorted(cid for cid in msgs if node_of[cid] in replies)

    if early is not None:
        replies = early.replies
    else:
        start: dict[Any, list[int]] = {}
        for cid, s in enumerate(present):
            start.setdefault(node_of[cid], []).append(int(s))
        replies = ch.call({node: {"step": "advertise", **p} for node, p in advertisement(
            start, round_id, [threshold, colluding, min_survivors, mode]).items()})
    verify: dict[int, bytes] = {}
    signed: list[dict] = []  # each node's signature over its clients' keys (node PKI)
    for node in sorted(replies, key=str):
        for _cid, m in sorted(replies[node]["msgs"].items()):
            traffic["up"] += len(m)
            server.receive_advertise(m)
        keys = {int(c): bytes(k) for c, k in (replies[node].get("verify") or {}).items()}
        verify.update(keys)
        if replies[node].get("keys_sig"):
            signed.append({**replies[node]["keys_sig"], "keys": keys})
    alive = [cid for cid in range(n) if node_of[cid] in replies and cid not in drop.before_shares]
    # the round's encoding goes with the shares: a node checks it against its own DP bound
    # before any share of its clients' keys leaves it, and its rows are encoded only after that
    code = {"spec": encoding.to_wire(), "leaves": list(rows.leaves), **rows.step.to_wire()}
    alive = exchange("shares", {i: server.keys_for(i) for i in alive}, server.receive_shares,
                     {"verify": verify, "signed": signed} if policy.malicious else None,
                     lambda cids: {"encoding": {**code, "seeds": [[c, seeds[c]] for c in cids]}})
    forwards = {i: server.forward_for(i) for i in alive}
    alive = exchange("masked", {i: forwards[i] for i in alive if i not in drop.before_masked},
                     server.receive_masked_sum)
    if policy.malicious:
        checks = {i: server.check_request_for(i) for i in alive}
        alive = exchange("check", {i: checks[i] for i in alive if i not in drop.before_check},
                         server.receive_check)
    requests = {i: server.unmask_request_for(i) for i in alive}
    exchange("unmask", {i: requests[i] for i in alive if i not in drop.before_unmask},
             server.receive_unmask)
    total = server.finalize()
    return RoundResult(total, frozenset(server.u3), max(len(s) for s in neigh), traffic["up"],
                       traffic["down"], traffic["masked"])


# ------------------------------------------------------------------ a node's side
@ordinary_pages()  # the node's encoded rows and masked sum (memaudit.federated.secagg.pages)
def node_step(payload: dict[str, Any], *, kept: Callable[[int, int], np.ndarray],
              load: Callable[[int], dict], save: Callable[[int, dict | None], None]) -> dict[str, Any]:
    """A node's answer to one exchange of a remote round.

    Args:
        payload: from `run_remote_round` (``step``, ``round``, ...).
        kept: ``(round, var id) -> array`` of the rows this node keeps (its cohort slots filled).
        load, save: this node's protocol state of a round (its clients' secret keys and the
            shares they hold); ``save(round, None)`` deletes it. It never goes into a reply.

    Returns:
        ``{"msgs": {cid: bytes}}``, or ``{"abort": one line}`` when one of
        this node's clients refuses the step (a threshold or survivor check).
    """
    step, rnd = payload["step"], int(payload["round"])

    def encoded(cids: list[int], st: dict) -> np.ndarray:
        """These clients' inputs to the secure sum, from their kept deltas."""
        slots = [st["slots"][c][0] for c in cids]
        leaves = [np.asarray(kept(rnd, int(v)))[slots] for v in st["leaves"]]
        clipped, bits = ClientStep.from_wire(st).apply_counted(leaves)
        rows, _ = flatten_clients(clipped)
        q = encode_rows(encoding_from_wire(st["spec"]), rows, [st["slots"][c][1] for c in cids])
        return q if bits is None else with_bits(q, bits)

    if step not in STEPS:
        raise ValueError(f"unknown secure-aggregation step {step!r}")
    try:
        if step == "advertise":
            th, col, ms, mode = payload["policy"]
            policy = Policy(threshold=float(th), colluding=int(col), min_survivors=int(ms), mode=mode)
            st = {"round_id": payload["round_id"], "slots": {int(c): [int(s), None] for c, s in payload["clients"]}}
            ring = KeyRing.generate(st["slots"]) if policy.malicious else None  # this node's clients' keys
            clients = {c: Client(c, round_id=int(payload["round_id"]), policy=policy, keys=ring)
                       for c in st["slots"]}
            msgs = {c: cl.advertise() for c, cl in clients.items()}
            extra = {} if ring is None else {"verify": ring.raw()[1]}
        else:
            st = load(rnd)
            clients = {int(c): Client.from_state_dict(d) for c, d in st["clients"].items()}
            asked = {int(c): bytes(m) for c, m in payload["msgs"].items()}
            extra = {}
            if step == "shares":
                code = payload["encoding"]
                seeds = {int(c): str(seed) for c, seed in code["seeds"]}
                if set(seeds) != set(asked) or not set(asked) <= set(st["slots"]):
                    raise SecAggAbort("the round's encoding does not name the clients asked for shares")
                st.update({k: code.get(k) for k in ("spec", "pre", "leaves", "count")})
                for c, seed in seeds.items():
                    st["slots"][c][1] = seed
                for c in asked:
                    if clients[c].ring is not None:
                        clients[c].ring.add_verifying(payload.get("verify") or {})
                msgs = {c: clients[c].share_keys(m) for c, m in asked.items()}
            elif step == "masked":  # one vector: the node's clients' masked inputs, added up
                cids = sorted(asked)
                q = encoded(cids, st)
                total = np.zeros(q.shape[1], np.uint32)
                for k, c in enumerate(cids):
                    np.add(total, clients[c].masked_vector(asked[c], q[k]), out=total)  # mod 2^32
                msgs, extra = None, {"cids": cids, "sum": total}
            elif step == "check":
                msgs = {c: clients[c].check(m) for c, m in asked.items()}
            else:
                msgs = {c: clients[c].unmask(m) for c, m in asked.items()}
    except (SecAggAbort, AuthenticationError) as e:  # a client refused: the round aborts
        save(rnd, None)
        return {"abort": str(e).splitlines()[0] if str(e) else type(e).__name__}
    if step == "unmask":
        save(rnd, None)
    else:
        st["clients"] = {c: cl.state_dict() for c, cl in clients.items()}
        save(rnd, st)
    return extra if msgs is None else {"msgs": msgs, **extra}


__all__ = ["ENCODINGS", "Advertised", "ClientRows", "NodeChannel", "advertisement", "encoding_from_wire",
           "node_step", "run_remote_round", "slot_rng", "slot_seed"]
