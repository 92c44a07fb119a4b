"""Ed25519 keys of the malicious-server mode: a stand-in for a PKI, outside the server.

Each client has a long-term Ed25519 signing key; every other client knows its verification key
from somewhere the server does not control (here: a :class:`KeyRing` handed to the clients, or
a directory of per-client key files). The server object never sees a KeyRing: it only relays
signatures, so it cannot substitute a client's keys or forge a survivor list.

Key files (``write_key_directory``): ``client-<id>.pub`` holds the 32-byte raw verification key
in hex; ``client-<id>.key`` the 32-byte raw signing key in hex (sensitive: only the simulated
client it belongs to reads it; a real deployment keeps it on the device).

References:
    Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine Learning",
    CCS 2017 (the malicious-server protocol assumes a PKI for client signatures).
    Bernstein et al., "High-speed high-security signatures", 2012 (Ed25519).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from memaudit.federated.secagg.messages import AuthenticationError
from memaudit.io import atomic_write_bytes

_RAW_PUB = (serialization.Encoding.Raw, serialization.PublicFormat.Raw)
_RAW_PRIV = (serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
_FILE = re.compile(r"^client-(\d+)\.(pub|key)$")


class KeyRing:
    """Signing keys of the simulated clients and everyone's verification keys, by client id."""

    def __init__(self, signing: dict[int, Ed25519PrivateKey], verifying: dict[int, Ed25519PublicKey]) -> None:
        self._signing = dict(signing)
        self._verifying = dict(verifying)
        self._generated = False

    @classmethod
    def generate(cls, ids: Iterable[int]) -> KeyRing:
        """Fresh key pairs for ``ids``; the ring grows on demand (`ensure`)."""
        ring = cls({}, {})
        ring._generated = True
        ring.ensure(ids)
        return ring

    @classmethod
    def load(cls, directory: str | Path) -> KeyRing:
        """Read ``client-<id>.pub`` (and, where present, ``client-<id>.key``) from ``directory``.

        Raises:
            ValueError: not a directory, no key files, or a file that is not a hex Ed25519 key.
        """
        path = Path(directory)
        if not path.is_dir():
            raise ValueError(f"verification key directory {path} does not exist; create it with "
                             "memaudit.federated.secagg.pki.write_key_directory")
        signing, verifying = {}, {}
        for f in sorted(path.iterdir()):
            m = _FILE.match(f.name)
            if not m:
                continue
            try:
                raw = bytes.fromhex(f.read_text().strip())
                if m.group(2) == "pub":
                    verifying[int(m.group(1))] = Ed25519PublicKey.from_public_bytes(raw)
                else:
                    signing[int(m.group(1))] = Ed25519PrivateKey.from_private_bytes(raw)
            except ValueError as e:
                raise ValueError(f"{f} is not a hex-encoded 32-byte Ed25519 key; regenerate it") from e
        if not verifying:
            raise ValueError(f"{path} holds no client-<id>.pub verification key files")
        for cid, sk in signing.items():
            if verifying.get(cid) is None or _pub(sk.public_key()) != _pub(verifying[cid]):
                raise ValueError(f"{path}: client-{cid}.key does not match client-{cid}.pub")
        return cls(signing, verifying)

    @classmethod
    def from_raw(cls, signing: dict[int, bytes], verifying: dict[int, bytes]) -> KeyRing:
        """A ring from raw 32-byte keys (a node's saved protocol state; `raw`)."""
        return cls({int(c): Ed25519PrivateKey.from_private_bytes(bytes(k)) for c, k in signing.items()},
                   {int(c): Ed25519PublicKey.from_public_bytes(bytes(k)) for c, k in verifying.items()})

    def raw(self) -> tuple[dict[int, bytes], dict[int, bytes]]:
        """(signing, verifying) as raw 32-byte keys by client id (the signing keys are secret)."""
        return ({c: k.private_bytes(*_RAW_PRIV) for c, k in self._signing.items()},
                {c: _pub(k) for c, k in self._verifying.items()})

    def add_verifying(self, keys: dict[int, bytes]) -> None:
        """Add verification keys of other clients (a key of a client this ring signs for must
        match its own: a substituted one is refused)."""
        for cid, raw in keys.items():
            pk = Ed25519PublicKey.from_public_bytes(bytes(raw))
            have = self._verifying.get(int(cid))
            if have is not None and _pub(have) != _pub(pk):
                raise AuthenticationError(f"verification key of client {cid} differs from the one it holds")
            self._verifying[int(cid)] = pk

    def ensure(self, ids: Iterable[int]) -> None:
        """Generate missing key pairs (only for a generated ring; a loaded one is fixed)."""
        if not self._generated:
            return
        for cid in ids:
            if cid not in self._verifying:
                sk = Ed25519PrivateKey.generate()
                self._signing[cid], self._verifying[cid] = sk, sk.public_key()

    def signing_key(self, cid: int) -> Ed25519PrivateKey:
        try:
            return self._signing[cid]
        except KeyError:
            raise AuthenticationError(f"client {cid} has no signing key in the key ring") from None

    def verify(self, cid: int, signature: bytes, message: bytes) -> None:
        """Check ``signature`` by client ``cid`` over ``message`` with its PKI key.

        Raises:
            AuthenticationError: unknown client or invalid signature.
        """
        pk = self._verifying.get(cid)
        if pk is None:
            raise AuthenticationError(f"no verification key for client {cid}; add client-{cid}.pub")
        try:
            pk.verify(signature, message)
        except InvalidSignature:
            raise AuthenticationError(f"signature of client {cid} does not verify (forged or "
                                      "altered by the server)") from None

    @property
    def generated(self) -> bool:
        """Whether this ring makes its keys on demand (no PKI directory behind it)."""
        return self._generated

    @property
    def ids(self) -> frozenset[int]:
        """Clients with a verification key."""
        return frozenset(self._verifying)

    @property
    def signers(self) -> frozenset[int]:
        """Clients whose signing key this ring holds (the simulated clients)."""
        return frozenset(self._signing)


def _pub(pk: Ed25519PublicKey) -> bytes:
    return pk.public_bytes(*_RAW_PUB)


def write_key_directory(ring: KeyRing, directory: str | Path) -> None:
    """Write every key of ``ring`` as ``client-<id>.pub`` / ``client-<id>.key`` (atomic writes)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    for cid in sorted(ring.ids):
        atomic_write_bytes(path / f"client-{cid}.pub", _pub(ring._verifying[cid]).hex().encode())
        if cid in ring._signing:
            raw = ring._signing[cid].private_bytes(*_RAW_PRIV)
            atomic_write_bytes(path / f"client-{cid}.key", raw.hex().encode())


__all__ = ["KeyRing", "write_key_directory"]
