"""Secure-aggregation server.

The server routes messages and accumulates masked vectors into one running sum
as they arrive; it never stores a client's masked vector, let alone an unmasked
one. After the unmasking round it reconstructs the self-mask seeds b_i of the
survivors and the mask keys s_sk_i of clients that dropped after sharing, and
removes those masks from the sum, leaving sum_{i in U3} x_i (mod 2^32).

The server is the party the protocol protects against (policy.py): it aborts a round with
fewer than ``min_survivors`` survivors, but the clients do not rely on it for that; they
check thresholds and survivor sets themselves. With ``signed=True`` (malicious-server mode)
it relays the clients' Ed25519 signatures on their keys, announces each client's view (the
cohort size, the graph and U1, which the client checks against the keys it receives) and runs
the consistency round (CHECK_REQUEST / CHECK), without holding any verification key itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from memaudit.federated.secagg import prg, shamir
from memaudit.federated.secagg.client import GRAPH_CODES, KIND_KEY, KIND_SEED, mask_seed
from memaudit.federated.secagg.messages import (
    SERVER,
    Header,
    MessageError,
    MsgType,
    ReplayError,
    SecAggAbort,
    Writer,
    parse,
)
from memaudit.federated.secagg.policy import Policy


def check_masked_sum(senders: Sequence[int], y: object, dim: int) -> None:
    """The form of a node's masked sum (`Server.receive_masked_sum`): clients named once each,
    and a uint32 vector of `dim` words. Raises MessageError naming what is wrong."""
    if not senders or len(set(senders)) != len(senders):
        raise MessageError("a masked sum must name its clients, each once")
    if not isinstance(y, np.ndarray) or y.dtype != np.dtype("<u4") or y.shape != (dim,):
        got = f"{y.dtype}{list(y.shape)}" if isinstance(y, np.ndarray) else type(y).__name__
        raise MessageError(f"masked sum is {got}, expected uint32[{dim}]")


def thresholds(neigh: Sequence[frozenset[int]], fraction: float) -> list[int]:
    """Per-client Shamir threshold: ceil(fraction * |holders|), holders = neighbours + self."""
    if not 0 < fraction <= 1:
        raise ValueError(f"threshold fraction must be in (0, 1], got {fraction}")
    return [max(1, math.ceil(fraction * (len(s) + 1) - 1e-9)) for s in neigh]


def policy_thresholds(neigh: Sequence[frozenset[int]], policy: Policy) -> list[int]:
    """Per-client thresholds of ``policy``, each checked against the threat model's bound for
    its real holder count (raises :class:`ThresholdError`)."""
    return [policy.holder_threshold(len(s) + 1) for s in neigh]


class Server:
    """Server side of one round, for clients 0..n-1 with the given neighbour sets."""

    def __init__(self, *, round_id: int, neighbours: Sequence[frozenset[int]], threshold: Sequence[int],
                 dim: int, min_survivors: int = 1, signed: bool = False,
                 graph: tuple[str, int, int | None] = ("full", 0, None), colluding: int = 0) -> None:
        self.round_id = round_id
        self.colluding = colluding
        self.graph = graph  # (kind, seed, degree) the neighbour sets were drawn from
        self.min_survivors = min_survivors
        self.signed = signed
        self._sigs: dict[int, bytes] = {}   # advertisement signatures (signed mode)
        self._checks: dict[int, bytes] = {}  # consistency-round signatures on U3
        self.n = len(neighbours)
        self.neigh = list(neighbours)
        self.t = list(threshold)
        self.dim = dim
        self._keys: dict[int, tuple[bytes, bytes]] = {}
        self._shares: dict[int, dict[int, bytes]] = {}  # sender -> recipient -> ciphertext
        self._sum = np.zeros(dim, dtype=np.uint32)
        self.u3: set[int] = set()
        self._revealed: dict[int, dict[int, list]] = {KIND_SEED: {}, KIND_KEY: {}}
        self._unmasked_from: set[int] = set()

    # -- helpers
    def _recv(self, msg: bytes, typ: MsgType, seen: Sequence[int] | set[int], allowed) -> tuple[Header, object]:
        h, r = parse(msg, expect=typ, round_id=self.round_id, recipient=SERVER)
        if h.sender not in allowed:
            raise ReplayError(f"{typ.name} from client {h.sender}, which is not expected at this step")
        if h.sender in seen:
            raise ReplayError(f"duplicate {typ.name} from client {h.sender} (replay)")
        return h, r

    def _out(self, typ: MsgType, cid: int, w: Writer) -> bytes:
        return w.finish(Header(typ, self.round_id, SERVER, cid))

    def _abort_if_short(self, alive: set[int], what: str) -> None:
        if len(alive) < self.min_survivors:
            raise SecAggAbort(f"secure aggregation aborted at {what}: {len(alive)} survivors, fewer than "
                              f"min_survivors={self.min_survivors}")
        for i in alive:
            have = len((self.neigh[i] | {i}) & alive)
            if have < self.t[i]:
                raise SecAggAbort(f"secure aggregation aborted at {what}: client {i} has {have} live "
                                  f"holders, threshold {self.t[i]}; lower the dropout rate or threshold")

    # -- round 0
    def receive_advertise(self, msg: bytes) -> None:
        h, r = self._recv(msg, MsgType.ADVERTISE, self._keys, range(self.n))
        c_pk, s_pk = r.blob(), r.blob()
        if self.signed:
            self._sigs[h.sender] = r.blob()
        r.done()
        if len(c_pk) != 32 or len(s_pk) != 32 or c_pk == s_pk:
            raise MessageError("ADVERTISE must carry two distinct 32-byte X25519 keys")
        self._keys[h.sender] = (c_pk, s_pk)

    def keys_for(self, cid: int) -> bytes:
        u1 = set(self._keys)
        self._abort_if_short(u1, "key advertisement")
        peers = sorted((self.neigh[cid] | {cid}) & u1)
        w = Writer().u32(self.t[cid]).u32(len(peers))
        for j in peers:
            w.u32(j).blob(self._keys[j][0]).blob(self._keys[j][1])
            if self.signed:
                w.blob(self._sigs[j])
        if self.signed:  # the view the client checks its keys against and binds its shares to
            kind, seed, degree = self.graph
            w.u32(self.n).u32(GRAPH_CODES[kind]).u32(int(seed)).u32(int(degree or 0)).ids(u1)
        return self._out(MsgType.KEYS, cid, w)

    # -- round 1
    def receive_shares(self, msg: bytes) -> None:
        h, r = self._recv(msg, MsgType.SHARES, self._shares, self._keys)
        out = {}
        for _ in range(r.u32()):
            j, ct = r.u32(), r.blob()
            if j not in (self.neigh[h.sender] | {h.sender}) or j in out:
                raise MessageError(f"client {h.sender} sent a share to non-neighbour or twice to {j}")
            out[j] = ct
        r.done()
        self._shares[h.sender] = out

    def forward_for(self, cid: int) -> bytes:
        u2 = set(self._shares)
        self._abort_if_short(u2, "share distribution")
        w = Writer().ids(u2)
        inbox = [(i, s[cid]) for i, s in sorted(self._shares.items()) if cid in s]
        w.u32(len(inbox))
        for i, ct in inbox:
            w.u32(i).blob(ct)
        return self._out(MsgType.FORWARD, cid, w)

    # -- round 2
    def receive_masked(self, msg: bytes) -> None:
        h, r = self._recv(msg, MsgType.MASKED, self.u3, self._shares)
        y = r.array(self.dim)
        r.done()
        np.add(self._sum, y, out=self._sum)  # only the running sum is kept
        self.u3.add(h.sender)

    def receive_masked_sum(self, senders: Sequence[int], y: np.ndarray) -> None:
        """The masked inputs of clients ``senders`` added up (mod 2^32) where they were made, on
        the node that holds them all: added to the running sum once. Each sender is checked as
        `receive_masked` checks one message's (expected at this step, not already in U3), and
        the vector is the round's width of uint32 words."""
        senders = [int(c) for c in senders]
        check_masked_sum(senders, y, self.dim)
        for c in senders:
            if c not in self._shares:
                raise ReplayError(f"MASKED from client {c}, which is not expected at this step")
            if c in self.u3:
                raise ReplayError(f"duplicate MASKED from client {c} (replay)")
        np.add(self._sum, y, out=self._sum)
        self.u3.update(senders)

    def check_request_for(self, cid: int) -> bytes:
        """Consistency round (signed mode): ask client ``cid`` to sign the survivors U3."""
        self._abort_if_short(set(self.u3), "masked input collection")
        return self._out(MsgType.CHECK_REQUEST, cid, Writer().ids(self.u3))

    def receive_check(self, msg: bytes) -> None:
        h, r = self._recv(msg, MsgType.CHECK, self._checks, self.u3)
        sig = r.blob()
        r.done()
        self._checks[h.sender] = sig

    def unmask_request_for(self, cid: int) -> bytes:
        """U3; in signed mode also the consistency-round signatures on it (from U4)."""
        self._abort_if_short(set(self._checks) if self.signed else set(self.u3),
                             "consistency check" if self.signed else "masked input collection")
        quorum = (len(self._keys) + self.colluding) // 2 + 1
        if self.signed and len(self._checks) < quorum:  # the clients would refuse (policy.quorum)
            raise SecAggAbort(f"secure aggregation aborted at the consistency check: {len(self._checks)} "
                              f"survivors signed, more than half the cohort ({quorum}) needed")
        w = Writer().ids(self.u3)
        if self.signed:  # as many signatures as the client needs (each one costs it a verification)
            need = max(self.t[cid], self.min_survivors, quorum)
            sigs = sorted(self._checks.items())[:need]
            w.u32(len(sigs))
            for j, sig in sigs:
                w.u32(j).blob(sig)
        return self._out(MsgType.UNMASK_REQUEST, cid, w)

    # -- round 3
    def receive_unmask(self, msg: bytes) -> None:
        allowed = set(self._checks) if self.signed else self.u3
        h, r = self._recv(msg, MsgType.UNMASK, self._unmasked_from, allowed)
        entries = []
        for _ in range(r.u32()):
            owner, kind, x, y = r.u32(), r.u32(), r.u32(), r.blob()
            want = KIND_SEED if owner in self.u3 else KIND_KEY
            if kind != want or owner not in self._shares:
                raise MessageError(f"client {h.sender} revealed the wrong kind of share for {owner}")
            entries.append((owner, kind, (x, int.from_bytes(y, "big"))))
        r.done()
        self._unmasked_from.add(h.sender)
        for owner, kind, share in entries:
            self._revealed[kind].setdefault(owner, []).append(share)

    def finalize(self) -> np.ndarray:
        """Remove all masks and return sum_{i in U3} x_i mod 2^32.

        Every seed is reconstructed first (so a short share count aborts before any work on
        the sum), then all masks are removed in one batched pass over the sum
        (`prg.add_masks`, as the client adds them): PRG(b_i) of every survivor i, and for
        every client i that dropped after sharing, the pairwise mask each surviving neighbour
        j added for it (+PRG(s_ij) if i > j, else -PRG(s_ij)).
        """
        u2, u3 = set(self._shares), self.u3
        masks = [(self._reconstruct(i, KIND_SEED, prg.SEED_BYTES), -1) for i in sorted(u3)]
        for i in sorted(u2 - u3):
            s_sk = X25519PrivateKey.from_private_bytes(self._reconstruct(i, KIND_KEY, 32))
            masks.extend((mask_seed(s_sk, self._keys[j][1], self.round_id), -1 if i > j else +1)
                         for j in sorted(self.neigh[i] & u3))
        total = self._sum.copy()
        prg.add_masks(total, masks)
        return total

    def _reconstruct(self, owner: int, kind: int, length: int) -> bytes:
        shares = self._revealed[kind].get(owner, [])
        if len(shares) < self.t[owner]:
            what = "self-mask seed" if kind == KIND_SEED else "mask key"
            raise SecAggAbort(f"secure aggregation aborted: only {len(shares)} shares of client {owner}'s "
                              f"{what}, threshold {self.t[owner]}; lower the dropout rate or threshold")
        return shamir.reconstruct_bytes(shares[: self.t[owner]], length)
