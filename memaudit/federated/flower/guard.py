"""The server's side of a bad client: every secure-aggregation reply is checked before the
protocol's server reads it, so a malformed one drops its node for the round instead of ending
the run.

Adversary: a client (a SuperNode, or whoever runs one) that sends truncated, padded, misaddressed
or wrongly sized messages to fail the run or to fake its progress. `SecAggGuard` sits between
the protocol's `memaudit.federated.secagg.remote.NodeChannel` and the nodes: a reply that is not
exactly the step's message for each client the node was asked about (header, sender, round id,
every field's length; at the masked-input step one vector of the round's width for all the
clients asked, their masked inputs added up on the node) is dropped, and the node counts as
one that stopped answering (the protocol's dropout handling takes it from there). A step at which
no node sent a valid reply aborts the round (`SecAggAbort`: nothing is released). A client can
still add any value within the modulus to the masked sum (no proof of a bounded input): that
costs the round's accuracy, not anyone's privacy.

References:
    Bonawitz et al., CCS 2017 (dropouts at each step of the protocol).
"""

from __future__ import annotations

import struct
from typing import Any

from memaudit.federated.secagg.messages import (
    SERVER,
    MessageError,
    MsgType,
    ReplayError,
    SecAggAbort,
    SecAggError,
    parse,
)
from memaudit.federated.secagg.remote import encoding_from_wire
from memaudit.federated.secagg.server import check_masked_sum

TYPES = {"advertise": MsgType.ADVERTISE, "shares": MsgType.SHARES, "unmask": MsgType.UNMASK}


class SecAggGuard:
    """The nodes of one remote secure-aggregation round (``run_secagg``, as
    `memaudit.federated.flower.execute.Nodes`), each reply checked first.

    Args:
        nodes: the nodes (``run_secagg(payloads) -> replies``).
        dim: the length of a client's flattened delta (the masked vector's width follows from
            the round's encoding, sent at the shares step).
    """

    def __init__(self, nodes: Any, dim: int) -> None:
        self.nodes, self.dim = nodes, int(dim)
        self.round_id: int | None = None
        self.width: int | None = None
        self.rejected: list[Any] = []

    def run_secagg(self, payloads: dict[Any, dict]) -> dict[Any, dict]:
        first = next(iter(payloads.values()))
        step = first["step"]
        if step == "advertise":
            self.round_id = int(first["round_id"])
        if step == "shares":  # the round's encoding: the width of a masked vector
            code = first["encoding"]
            self.width = encoding_from_wire(code["spec"]).width(self.dim) + int(code.get("count") is not None)
        return self._checked(step, payloads, dict(self.nodes.run_secagg(payloads)))

    def advertised(self, payloads: dict[Any, dict], replies: dict[Any, Any]) -> dict[Any, dict]:
        """The advertise replies the nodes sent with the round's client stage (node -> reply to
        its payload ``payloads[node]``; `memaudit.federated.secagg.remote.advertisement`), each
        checked as an advertise exchange's."""
        self.round_id = int(next(iter(payloads.values()))["round_id"])
        return self._checked("advertise", payloads, replies)

    def _checked(self, step: str, payloads: dict[Any, dict], replies: dict[Any, Any]) -> dict[Any, dict]:
        out: dict[Any, dict] = {}
        for node, reply in replies.items():
            if node in payloads and self.why_not(step, payloads[node], reply) is None:
                out[node] = reply
            else:
                self.rejected.append(node)
        if not out:
            raise SecAggAbort(f"secure aggregation aborted at {step}: no node sent a valid reply")
        return out

    def why_not(self, step: str, payload: dict, reply: Any) -> str | None:
        """None when ``reply`` is a valid answer to ``payload``; otherwise why not."""
        if not isinstance(reply, dict):
            return "not a map"
        if "abort" in reply:  # the node's clients refused the step: the round aborts
            return None if set(reply) == {"abort"} and isinstance(reply["abort"], str) else "bad abort"
        if step == "masked":  # one vector a node: its clients' masked inputs, added up there
            cids = reply.get("cids")
            if set(reply) != {"cids", "sum"} or not isinstance(cids, list):
                return "not one masked sum"
            if not all(isinstance(c, int) for c in cids) or set(cids) != {int(c) for c in payload["msgs"]}:
                return "not the clients it was asked about"
            try:
                check_masked_sum(cids, reply["sum"], self.width)
            except MessageError as e:
                return str(e)
            return None
        msgs = reply.get("msgs")
        # at the advertise step of the malicious-server mode a node also sends its clients'
        # Ed25519 verification keys (the server relays them): one 32-byte key per client asked,
        # and with node keys in the manifest the node's signature over them
        extra = set(reply) - {"msgs"}
        if not isinstance(msgs, dict) or extra - ({"verify", "keys_sig"} if step == "advertise" else set()):
            return "no messages"
        asked = ({int(c[0]) for c in payload["clients"]} if step == "advertise"
                 else {int(c) for c in payload["msgs"]})
        if not all(isinstance(c, int) for c in msgs) or set(msgs) != asked:
            return "not the clients it was asked about"
        if "verify" in reply:
            keys = reply["verify"]
            if (not isinstance(keys, dict) or set(keys) != asked
                    or not all(isinstance(k, bytes) and len(k) == 32 for k in keys.values())):
                return "verification keys are not one 32-byte key per client asked"
        if "keys_sig" in reply:  # the node's signature over those keys (memaudit.federated.flower.identity)
            sig = reply["keys_sig"]
            if (not isinstance(sig, dict) or set(sig) != {"node", "sig"} or not isinstance(sig["node"], int)
                    or not isinstance(sig["sig"], bytes) or len(sig["sig"]) != 64 or "verify" not in reply):
                return "the key signature is not a node index and a 64-byte signature"
        for cid, m in msgs.items():
            if not isinstance(m, bytes):
                return f"client {cid}: not bytes"
            try:
                self._check(step, cid, m)
            except (SecAggError, struct.error, ValueError, OverflowError) as e:
                return f"client {cid}: {e}"
        return None

    def _check(self, step: str, cid: int, m: bytes) -> None:
        if step not in TYPES:  # a step this guard does not know: the protocol's server checks it
            return
        h, r = parse(m, expect=TYPES[step], round_id=self.round_id, recipient=SERVER)
        if h.sender != cid:
            raise ReplayError(f"message of client {h.sender} sent as client {cid}")
        if step == "advertise":
            c_pk, s_pk = r.blob(), r.blob()
            if len(c_pk) != 32 or len(s_pk) != 32 or c_pk == s_pk:
                raise MessageError("ADVERTISE must carry two distinct 32-byte keys")
            try:
                r.done()
            except MessageError:  # the malicious-server mode signs the keys
                r.blob()
                r.done()
        elif step == "shares":
            seen: set[int] = set()
            for _ in range(r.u32()):
                j = r.u32()
                r.blob()
                if j in seen:
                    raise MessageError(f"two shares for client {j}")
                seen.add(j)
            r.done()
        else:
            for _ in range(r.u32()):
                r.u32(), r.u32(), r.u32(), r.blob()
            r.done()


__all__ = ["TYPES", "SecAggGuard"]
