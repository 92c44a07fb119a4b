"""Drive one secure-aggregation round between separate client and server objects.

Messages pass as bytes, as over a network. Dropouts are simulated at four
points: before sharing keys, before sending the masked input, before the
consistency check (malicious-server mode only), and before answering the
unmasking request.

The round runs under a :class:`~memaudit.federated.secagg.policy.Policy` (threat model,
threshold bounds, survivor floor; see policy.py). In the malicious-server mode (the default)
the clients get their Ed25519 keys from a :class:`~memaudit.federated.secagg.pki.KeyRing` that
the server object never sees (generated for the round when none is given), check their view
of the round, and the round adds Bonawitz et al.'s consistency check, on either graph.

References:
    Bonawitz et al., CCS 2017 (Figure 4: the malicious-server protocol with signatures).
    Bell et al., CCS 2020 (SecAgg+).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from memaudit.federated.secagg.client import Client
from memaudit.federated.secagg.graph import neighbours as make_neighbours
from memaudit.federated.secagg.pki import KeyRing
from memaudit.federated.secagg.policy import DEFAULT_MODE, Policy
from memaudit.federated.secagg.server import Server, policy_thresholds


@dataclass(frozen=True)
class RoundResult:
    total: np.ndarray           # (d,) uint32: sum of the survivors' inputs mod 2^32
    survivors: frozenset[int]   # U3: clients whose masked input is in the sum
    degree: int                 # max neighbours per client
    bytes_up: int               # client -> server traffic
    bytes_down: int             # server -> client traffic
    bytes_masked: int = 0       # of bytes_up, the masked inputs (`messages.masked_bytes` each)


@dataclass
class Dropouts:
    before_shares: set[int] = field(default_factory=set)
    before_masked: set[int] = field(default_factory=set)
    before_check: set[int] = field(default_factory=set)
    before_unmask: set[int] = field(default_factory=set)


def run_round(inputs: np.ndarray, *, round_id: int = 0, neighbours: str = "full",
              threshold: float = 0.6, graph_seed: int = 0, degree: int | None = None,
              dropouts: Dropouts | None = None, tamper=None, colluding: int = 0,
              min_survivors: int = 3, mode: str = DEFAULT_MODE,
              keys: KeyRing | None = None) -> RoundResult:
    """Securely sum ``inputs`` (n, d) uint32 over the clients that survive.

    Args:
        inputs: (n, d) uint32, one row per client.
        round_id: the round id bound into every message.
        neighbours: "full" (SecAgg) or "sparse" (SecAgg+).
        threshold: Shamir threshold as a fraction of each client's holders.
        graph_seed, degree: SecAgg+ graph.
        dropouts: which clients drop, and when.
        tamper: optional test hook ``f(stage, cid, msg) -> msg`` applied to messages in transit.
        colluding: n_C, clients that may collude with the server.
        min_survivors: the round aborts with fewer survivors.
        mode: "malicious" (default: signatures, views and the consistency check) or
            "honest_but_curious" (none of them; not safe against a server that forks lists).
        keys: the clients' Ed25519 keys (malicious mode); default a fresh ring for this round.

    Raises:
        ThresholdError (a ValueError and a SecAggAbort): the threshold is below the bound for
            the real holder counts (policy.py).
        SecAggAbort: too few survivors to unmask, or (malicious mode) an attack detected.
    """
    policy = Policy(threshold=threshold, colluding=colluding, min_survivors=min_survivors, mode=mode)
    inputs = np.asarray(inputs, dtype=np.uint32)
    n, d = inputs.shape
    drop = dropouts or Dropouts()
    tamper = tamper or (lambda stage, cid, m: m)
    neigh = make_neighbours(n, neighbours, seed=graph_seed, degree=degree)
    t = policy_thresholds(neigh, policy)  # refuses a threshold below the bound
    policy.check_survivors(n, "the start of the round")
    if policy.malicious:
        keys = keys if keys is not None else KeyRing.generate(range(n))
        keys.ensure(range(n))
    server = Server(round_id=round_id, neighbours=neigh, threshold=t, dim=d,
                    min_survivors=min_survivors, signed=policy.malicious,
                    graph=(neighbours, graph_seed, degree), colluding=colluding)
    clients = [Client(i, round_id=round_id, policy=policy, keys=keys) for i in range(n)]
    up = down = masked = 0

    def send(stage, cid, msg, handler):
        nonlocal up, masked
        msg = tamper(stage, cid, msg)
        up += len(msg)
        masked += len(msg) if stage == "masked" else 0
        handler(msg)

    def deliver(stage, cid, msg):
        nonlocal down
        msg = tamper(stage, cid, msg)
        down += len(msg)
        return msg

    alive: Iterable[int] = range(n)
    for c in clients:
        send("advertise", c.cid, c.advertise(), server.receive_advertise)
    alive = [i for i in alive if i not in drop.before_shares]
    for i in alive:
        send("shares", i, clients[i].share_keys(deliver("keys", i, server.keys_for(i))), server.receive_shares)
    forwards = {i: deliver("forward", i, server.forward_for(i)) for i in alive}
    alive = [i for i in alive if i not in drop.before_masked]
    for i in alive:
        send("masked", i, clients[i].masked_input(forwards[i], inputs[i]), server.receive_masked)
    if policy.malicious:
        checks = {i: deliver("check_request", i, server.check_request_for(i)) for i in alive}
        alive = [i for i in alive if i not in drop.before_check]
        for i in alive:
            send("check", i, clients[i].check(checks[i]), server.receive_check)
    requests = {i: deliver("unmask_request", i, server.unmask_request_for(i)) for i in alive}
    for i in alive:
        if i not in drop.before_unmask:
            send("unmask", i, clients[i].unmask(requests[i]), server.receive_unmask)
    total = server.finalize()
    return RoundResult(total, frozenset(server.u3), max(len(s) for s in neigh), up, down, masked)
