"""Secure-aggregation client (Bonawitz et al. 2017; SecAgg+ of Bell et al. 2020).

A client holds two fresh X25519 key pairs per round: (c_sk, c_pk) to encrypt
Shamir shares to other clients, (s_sk, s_pk) to agree pairwise mask seeds. It
masks its quantised update y = x + PRG(b) + sum_{j>i} PRG(s_ij) - sum_{j<i} PRG(s_ij)
(mod 2^32) over its neighbours j that survived share distribution, and in the
unmasking round reveals, for each client i whose shares it holds, the share of
b_i if i's masked input arrived, else the share of s_sk_i, never both.

The client does not take the server's word for the round's safety (see policy.py for the
threat model): it refuses a threshold below (holders + n_C)/2 before it sends any share, and
before it reveals shares it checks that the survivor set it is shown reaches its threshold and
``min_survivors``. In the malicious-server mode (the default) it also

- signs its keys with its Ed25519 key and verifies its peers' signatures with verification
  keys from the PKI (`pki.KeyRing`), never from the server;
- checks its *view* of the round: the cohort U1 and the graph (kind, seed, degree) the server
  announces, against the neighbours whose keys it received (recomputed here), and binds the
  view's hash into every share it encrypts; a share from a sender with another view aborts
  the round (the server showed different cohorts);
- signs (view, U3) in the consistency round and reveals shares only for the list it signed,
  once more than (|U1| + n_C)/2 survivors of that view signed it too: one list per view, so
  the server cannot fork the survivor list (:class:`InconsistencyDetected` otherwise).

References:
    Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving
    Machine Learning", CCS 2017. Bell et al., "Secure Single-Server Aggregation
    with (Poly)Logarithmic Overhead", CCS 2020.
"""

from __future__ import annotations

import hashlib
import os
import struct

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from memaudit.federated.secagg import prg, shamir
from memaudit.federated.secagg.graph import neighbours_of
from memaudit.federated.secagg.messages import (
    SERVER,
    AuthenticationError,
    Header,
    InconsistencyDetected,
    MessageError,
    MsgType,
    ReplayError,
    SecAggAbort,
    Writer,
    parse,
)
from memaudit.federated.secagg.pki import KeyRing
from memaudit.federated.secagg.policy import Policy

_RAW = (serialization.Encoding.Raw, serialization.PublicFormat.Raw)
SHARE_Y_BYTES = 66  # 521-bit field elements
KIND_SEED, KIND_KEY = 0, 1
VIEW_BYTES = 32
# share plaintext: sender, recipient, x (>III), the sender's view hash, y of b, y of s_sk
_VIEW_AT, _SEED_AT = 12, 12 + VIEW_BYTES
_KEY_AT = _SEED_AT + SHARE_Y_BYTES
GRAPH_CODES = {"full": 0, "sparse": 1}


def kdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def pub_bytes(pk: X25519PublicKey) -> bytes:
    return pk.public_bytes(*_RAW)


def priv_bytes(sk: X25519PrivateKey) -> bytes:
    return sk.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                            serialization.NoEncryption())


def mask_seed(s_sk: X25519PrivateKey, peer_s_pk: bytes, round_id: int) -> bytes:
    """Pairwise mask seed s_ij = HKDF(X25519(s_sk_i, s_pk_j)); symmetric in i and j."""
    shared = s_sk.exchange(X25519PublicKey.from_public_bytes(peer_s_pk))
    return kdf(shared, b"memaudit-secagg-mask" + struct.pack(">Q", round_id))


def share_ad(round_id: int, sender: int, recipient: int) -> bytes:
    return b"memaudit-secagg-share" + struct.pack(">QII", round_id, sender, recipient)


def advert_payload(round_id: int, cid: int, c_pk: bytes, s_pk: bytes) -> bytes:
    """What a client signs in round 0 (malicious mode): its two keys bound to round and id."""
    return b"memaudit-secagg-keys" + struct.pack(">QI", round_id, cid) + c_pk + s_pk


def survivors_payload(round_id: int, survivors, view: bytes = b"") -> bytes:
    """What a client signs in the consistency round: the survivor list U3 of this round, bound
    to the hash of the client's view (cohort and graph)."""
    ids = sorted(survivors)
    return b"memaudit-secagg-u3" + view + struct.pack(f">QI{len(ids)}I", round_id, len(ids), *ids)


def view_hash(round_id: int, cohort: int, kind: str, seed: int, degree: int | None, u1) -> bytes:
    """The hash of a client's view of the round: the cohort size, the graph and U1."""
    ids = sorted(u1)
    head = struct.pack(">QIIII", round_id, cohort, GRAPH_CODES[kind], seed, degree or 0)
    return hashlib.sha256(b"memaudit-secagg-view" + head + struct.pack(f">{len(ids)}I", *ids)).digest()


class Client:
    """One client's side of a round. Methods consume and return wire messages (bytes)."""

    def __init__(self, cid: int, *, round_id: int, policy: Policy | None = None,
                 keys: KeyRing | None = None) -> None:
        self.cid = cid
        self.round_id = round_id
        self.policy = policy or Policy()
        if self.policy.malicious and keys is None:
            raise ValueError("the malicious-server mode needs a KeyRing of Ed25519 keys (pki.KeyRing)")
        self._ring = keys if self.policy.malicious else None
        self._t = 0
        self._u3: frozenset[int] | None = None
        self._c_sk = X25519PrivateKey.generate()
        self._s_sk = X25519PrivateKey.generate()
        self._b = os.urandom(prg.SEED_BYTES)  # self-mask seed
        self._keys: dict[int, tuple[bytes, bytes]] = {}
        self._held: dict[int, bytes] = {}
        self._enc_keys: dict[int, bytes] = {}  # sender -> decrypted share plaintext
        self._u2: frozenset[int] = frozenset()
        self._view = bytes(VIEW_BYTES)  # malicious mode: the hash of the view it was shown
        self._cohort = 0                # |U1| of that view
        self._stage = 0

    def state_dict(self) -> dict:
        """The client's whole round state (its secret keys included) as plain data, for a
        runtime that runs each protocol step in a new process (a Flower ClientApp keeps it on
        its node, `memaudit.federated.secagg.remote`). In the malicious-server mode it holds
        this client's signing key and the verification keys it knows (``ring``)."""
        p = self.policy
        d = {"cid": self.cid, "round_id": self.round_id, "t": self._t, "stage": self._stage,
             "policy": [p.threshold, p.colluding, p.min_survivors, p.mode],
             "c_sk": priv_bytes(self._c_sk), "s_sk": priv_bytes(self._s_sk), "b": self._b,
             "keys": {j: list(k) for j, k in self._keys.items()}, "held": dict(self._held),
             "u2": sorted(self._u2), "view": self._view, "cohort": self._cohort,
             "u3": None if self._u3 is None else sorted(self._u3)}
        if self._ring is not None:
            signing, verifying = self._ring.raw()
            d["ring"] = [{self.cid: signing[self.cid]}, verifying]
        return d

    @classmethod
    def from_state_dict(cls, d: dict) -> Client:
        """The client `state_dict` saved (the AEAD keys are re-derived from the saved keys)."""
        th, col, ms, mode = d["policy"]
        ring = KeyRing.from_raw(*d["ring"]) if d.get("ring") is not None else None
        c = cls(int(d["cid"]), round_id=int(d["round_id"]),
                policy=Policy(threshold=float(th), colluding=int(col), min_survivors=int(ms), mode=mode),
                keys=ring)
        c._t, c._stage = int(d["t"]), int(d["stage"])
        c._c_sk = X25519PrivateKey.from_private_bytes(bytes(d["c_sk"]))
        c._s_sk = X25519PrivateKey.from_private_bytes(bytes(d["s_sk"]))
        c._b = bytes(d["b"])
        c._keys = {int(j): (bytes(k[0]), bytes(k[1])) for j, k in d["keys"].items()}
        c._held = {int(j): bytes(v) for j, v in d["held"].items()}
        c._u2 = frozenset(int(j) for j in d["u2"])
        c._view, c._cohort = bytes(d.get("view", bytes(VIEW_BYTES))), int(d.get("cohort", 0))
        c._u3 = None if d.get("u3") is None else frozenset(int(j) for j in d["u3"])
        return c

    @property
    def ring(self) -> KeyRing | None:
        """The Ed25519 key ring this client signs and verifies with (malicious mode)."""
        return self._ring

    def _header(self, typ: MsgType) -> Header:
        return Header(typ, self.round_id, self.cid, SERVER)

    def _advance(self, stage: int) -> None:
        """Check the protocol step; the step only counts once its message was accepted."""
        if self._stage != stage:
            raise ReplayError(f"client {self.cid}: protocol step {stage} out of order (at {self._stage})")

    def _enc_key(self, peer: int) -> bytes:
        """AEAD key shared with ``peer``: HKDF(X25519(c_sk_self, c_pk_peer)), cached per round."""
        if peer not in self._enc_keys:
            shared = self._c_sk.exchange(X25519PublicKey.from_public_bytes(self._keys[peer][0]))
            self._enc_keys[peer] = kdf(shared, b"memaudit-secagg-enc")
        return self._enc_keys[peer]

    def advertise(self) -> bytes:
        """Round 0: send (c_pk, s_pk)."""
        self._advance(0)
        c_pk, s_pk = pub_bytes(self._c_sk.public_key()), pub_bytes(self._s_sk.public_key())
        w = Writer().blob(c_pk).blob(s_pk)
        if self._ring is not None:
            w.blob(self._ring.signing_key(self.cid).sign(advert_payload(self.round_id, self.cid, c_pk, s_pk)))
        self._stage = 1
        return w.finish(self._header(MsgType.ADVERTISE))

    def share_keys(self, keys_msg: bytes) -> bytes:
        """Round 1: from the neighbours' keys and threshold, send encrypted shares of b and s_sk."""
        self._advance(1)
        _, r = parse(keys_msg, expect=MsgType.KEYS, round_id=self.round_id, recipient=self.cid)
        threshold = r.u32()
        for _ in range(r.u32()):
            j, c_pk, s_pk = r.u32(), r.blob(), r.blob()
            if len(c_pk) != 32 or len(s_pk) != 32:
                raise MessageError("public keys must be 32 bytes")
            if self._ring is not None:  # a key the server substituted fails here
                self._ring.verify(j, r.blob(), advert_payload(self.round_id, j, c_pk, s_pk))
            self._keys[j] = (c_pk, s_pk)
        if self._ring is not None:
            self._check_view(r)
        r.done()
        own = (pub_bytes(self._c_sk.public_key()), pub_bytes(self._s_sk.public_key()))
        if self._keys.get(self.cid, own) != own:
            raise AuthenticationError(f"client {self.cid}: server echoed a different key for this client")
        self._keys[self.cid] = own
        holders = sorted(self._keys)
        if not 1 <= threshold <= len(holders):
            raise MessageError(f"threshold {threshold} impossible with {len(holders)} holders")
        self.policy.check_threshold(threshold, len(holders))  # before any share leaves
        self.policy.check_survivors(len(holders), f"key sharing (client {self.cid}'s holders)")
        self._t = threshold
        xs = [j + 1 for j in holders]
        b_sh = shamir.split_bytes(self._b, threshold=threshold, n=len(holders), xs=xs)
        k_sh = shamir.split_bytes(priv_bytes(self._s_sk), threshold=threshold, n=len(holders), xs=xs)
        w = Writer().u32(len(holders))
        for j, (x, yb), (_, yk) in zip(holders, b_sh, k_sh, strict=True):
            plain = struct.pack(">III", self.cid, j, x) + self._view + yb.to_bytes(SHARE_Y_BYTES, "big") \
                + yk.to_bytes(SHARE_Y_BYTES, "big")
            key = self._enc_key(j)
            nonce = os.urandom(12)
            ct = ChaCha20Poly1305(key).encrypt(nonce, plain, share_ad(self.round_id, self.cid, j))
            w.u32(j).blob(nonce + ct)
        self._stage = 2
        return w.finish(self._header(MsgType.SHARES))

    def masked_input(self, forward_msg: bytes, x: np.ndarray) -> bytes:
        """Round 2: store the shares addressed to us and send the masked update (uint32, mod 2^32)."""
        return Writer().array(self.masked_vector(forward_msg, x)).finish(self._header(MsgType.MASKED))

    def masked_vector(self, forward_msg: bytes, x: np.ndarray) -> np.ndarray:
        """`masked_input`'s vector, unwrapped: for a node that adds up its own clients' masked
        inputs before sending (`memaudit.federated.secagg.remote.node_step`)."""
        self._advance(2)
        _, r = parse(forward_msg, expect=MsgType.FORWARD, round_id=self.round_id, recipient=self.cid)
        self._u2 = frozenset(r.ids())
        for _ in range(r.u32()):
            sender, blob = r.u32(), r.blob()
            if sender not in self._keys or sender in self._held:
                raise ReplayError(f"client {self.cid}: unexpected or duplicate share from {sender}")
            key = self._enc_key(sender)
            try:
                plain = ChaCha20Poly1305(key).decrypt(blob[:12], blob[12:],
                                                      share_ad(self.round_id, sender, self.cid))
            except InvalidTag as e:
                raise AuthenticationError(f"client {self.cid}: share from {sender} failed AEAD "
                                          "verification (tampered or misrouted)") from e
            s, rcpt, _x = struct.unpack(">III", plain[:12])
            if (s, rcpt) != (sender, self.cid):
                raise AuthenticationError("share header does not match its envelope")
            if self._ring is not None and plain[_VIEW_AT:_SEED_AT] != self._view:
                raise InconsistencyDetected(f"client {self.cid}: client {sender} was shown another cohort "
                                            "or graph: inconsistent views detected")
            self._held[sender] = plain
        r.done()
        if self.cid not in self._u2:
            raise ReplayError(f"client {self.cid} is not in the share-distribution survivors")
        self._check_survivors(self._u2, "share distribution")
        y = np.array(x, dtype=np.uint32, copy=True)
        masks = [(self._b, +1)]
        for j in self._keys:
            if j != self.cid and j in self._u2:
                masks.append((mask_seed(self._s_sk, self._keys[j][1], self.round_id),
                              +1 if j > self.cid else -1))
        flat = y.reshape(-1)  # a view: masks are added in place, in one pass over y
        prg.add_masks(flat, masks)
        self._stage = 3
        return y

    def _check_view(self, r) -> None:
        """Malicious mode: read the announced view (cohort size, graph, U1) and check that the
        keys received are exactly this client's neighbours in it that advertised."""
        cohort, code, seed, degree = r.u32(), r.u32(), r.u32(), r.u32()
        u1 = frozenset(r.ids())
        kinds = {v: k for k, v in GRAPH_CODES.items()}
        if code not in kinds or not u1 <= set(range(cohort)) or self.cid not in u1:
            raise MessageError(f"client {self.cid}: malformed view of the round")
        kind = kinds[code]
        deg = degree or None
        want = (neighbours_of(self.cid, cohort, kind, seed=seed, degree=deg) | {self.cid}) & u1
        if set(self._keys) | {self.cid} != want:
            raise InconsistencyDetected(f"client {self.cid}: the keys received are not its neighbours in "
                                        "the announced cohort and graph: inconsistent views detected")
        self._view = view_hash(self.round_id, cohort, kind, seed, deg, u1)
        self._cohort = len(u1)

    def _check_survivors(self, alive: frozenset[int], what: str) -> None:
        """Abort unless ``alive`` has min_survivors clients and t of this client's holders."""
        self.policy.check_survivors(len(alive), what)
        have = len(alive & set(self._keys))
        if have < self._t:
            raise SecAggAbort(f"secure aggregation aborted at {what}: client {self.cid} sees {have} "
                              f"live holders, threshold {self._t}")

    def _check_u3(self, u3: frozenset[int]) -> None:
        if not u3 <= self._u2 or self.cid not in u3:
            raise ReplayError("unmask request names clients outside the survivors")
        self._check_survivors(u3, "unmasking")

    def check(self, request_msg: bytes) -> bytes:
        """Consistency round (malicious mode): sign the survivor list U3 this client is shown."""
        self._advance(3)
        if self._ring is None:
            raise ReplayError("the consistency round runs only in the malicious-server mode")
        _, r = parse(request_msg, expect=MsgType.CHECK_REQUEST, round_id=self.round_id,
                     recipient=self.cid)
        u3 = frozenset(r.ids())
        r.done()
        self._check_u3(u3)
        self._u3 = u3
        sig = self._ring.signing_key(self.cid).sign(survivors_payload(self.round_id, u3, self._view))
        self._stage = 4
        return Writer().blob(sig).finish(self._header(MsgType.CHECK))

    def _verify_consistency(self, u3: frozenset[int], r) -> None:
        """Bonawitz et al.'s check, per view: U3 is the list this client signed, and more than
        (|U1| + n_C)/2 (and at least t and min_survivors) distinct survivors signed the same
        (view, U3)."""
        sigs = [(r.u32(), r.blob()) for _ in range(r.u32())]
        if u3 != self._u3:
            raise InconsistencyDetected(f"client {self.cid}: the unmask request's survivor list differs "
                                        "from the one it signed: inconsistent survivor lists detected")
        payload, signers = survivors_payload(self.round_id, u3, self._view), set()
        for j, sig in sigs:
            if j not in u3 or j in signers:
                raise InconsistencyDetected(f"client {self.cid}: signature by {j} outside the survivors "
                                            "or repeated: inconsistent survivor lists detected")
            try:
                self._ring.verify(j, sig, payload)
            except AuthenticationError:
                raise InconsistencyDetected(f"client {self.cid}: client {j} did not sign this survivor "
                                            "list: inconsistent survivor lists detected") from None
            signers.add(j)
        need = max(self._t, self.policy.min_survivors, self.policy.quorum(self._cohort))
        if len(signers) < need:
            raise InconsistencyDetected(f"secure aggregation aborted at the consistency check: client "
                                        f"{self.cid} sees {len(signers)} signatures on its survivor list, "
                                        f"{need} needed: too many dropped, or inconsistent survivor lists")

    def unmask(self, request_msg: bytes) -> bytes:
        """Round 3: reveal b-shares of survivors U3 and key-shares of U2 \\ U3, after checking
        that U3 reaches the threshold and min_survivors (and, malicious mode, was signed by t)."""
        self._advance(4 if self._ring is not None else 3)
        _, r = parse(request_msg, expect=MsgType.UNMASK_REQUEST, round_id=self.round_id,
                     recipient=self.cid)
        u3 = frozenset(r.ids())
        if self._ring is not None:
            self._verify_consistency(u3, r)
        r.done()
        self._check_u3(u3)
        w = Writer().u32(len(self._held))
        for sender, plain in sorted(self._held.items()):
            x = struct.unpack(">I", plain[8:12])[0]
            if sender in u3:
                kind, y = KIND_SEED, plain[_SEED_AT:_KEY_AT]
            else:
                kind, y = KIND_KEY, plain[_KEY_AT:]
            w.u32(sender).u32(kind).u32(x).blob(y)
        self._stage = 5
        return w.finish(self._header(MsgType.UNMASK))
