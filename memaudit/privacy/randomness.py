"""Secret randomness of a DP run: one OS-entropy secret, per-step keys from a cryptographic PRF.

Amplification by subsampling and the Gaussian noise's privacy both assume the adversary
cannot recompute the sample or the noise. So a DP run draws one 256-bit secret from the OS
(``os.urandom``), never from ``train.seed``, and derives every key it needs with HKDF-SHA256
(RFC 5869) keyed by that secret, with ``info = (purpose, step[, index])``:

* Poisson batches and cohorts: a 128-bit key per step seeds numpy's Philox4x64 counter
  generator (``numpy_rng``);
* torch noise: a fresh ``torch.Generator`` per (step, parameter) seeded with a 64-bit PRF
  output (``torch_generator``; torch generators take at most 64 seed bits, so each step's
  noise has its own independent key and learning one reveals neither the secret nor any
  other step);
* JAX: ``jax_key`` derives a key per (purpose, step), threefry (64-bit) or ``rbg`` (128-bit).

Nothing is stateful: a key is a function of (secret, purpose, step), so resuming needs only
the secret. :meth:`DPRandomness.for_run` writes it to ``RUN_DIR/state/dp_secret.json`` before
the first step (a run killed before its first checkpoint resumes with it), and the DP
components' ``state_dict()`` carries it into every checkpoint, whose ``load_state_dict``
restores it in place into the one object the sampler and the noise share. ``state/`` is
sensitive, like ``data/``; probes and reports never read it. The secret is
never printed: ``repr`` hides it. On a parallel grid every rank holds rank 0's secret (the
trainer's ranks read the one the writer kept in ``state/``; ``broadcast`` does it over a
process group), so every replica samples the same batch and adds identical noise.

``privacy.reproducible_randomness: true`` derives the secret from ``train.seed`` instead (for
debugging and for tests that compare two runs); the ledger records it, and its ε are void
against anyone who knows the seed.

References:
    Krawczyk, Eronen, RFC 5869, "HMAC-based Extract-and-Expand Key Derivation Function", 2010.
    Salmon et al., "Parallel Random Numbers: As Easy as 1, 2, 3", SC 2011 (Philox).
    Opacus ``secure_mode`` (Yousefpour et al., "Opacus: User-Friendly Differential Privacy
    Library in PyTorch", 2021), the anchor for CSPRNG-backed DP noise.

>>> r = DPRandomness.from_seed(0)
>>> r.key("poisson", 3) == DPRandomness.from_seed(0).key("poisson", 3), r.reproducible
(True, True)
>>> "secret" in repr(DPRandomness.fresh()) and len(DPRandomness.fresh().key("noise", 0)) == 16
True
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from memaudit.io import atomic_write_json

SECRET_BYTES = 32  # 256 bits of OS entropy
SECRET_FILE = "dp_secret.json"
_SALT = b"memaudit dp randomness v1"
_SEED_SALT = b"memaudit reproducible randomness v1 (NOT secret)"


class DPRandomness:
    """The secret of one DP run and the keys derived from it (see the module docstring)."""

    __slots__ = ("_secret", "reproducible")

    def __init__(self, secret: bytes, *, reproducible: bool = False) -> None:
        if not isinstance(secret, bytes | bytearray) or len(secret) < 16:
            raise ValueError("the DP randomness secret must be at least 16 bytes (128 bits)")
        self._secret = bytes(secret)
        self.reproducible = bool(reproducible)

    # ------------------------------------------------------------------ construction
    @classmethod
    def fresh(cls) -> DPRandomness:
        """A new secret from the OS's cryptographic entropy."""
        return cls(os.urandom(SECRET_BYTES), reproducible=False)

    @classmethod
    def from_seed(cls, seed: int) -> DPRandomness:
        """Keys derived from a public seed: reproducible, and *not* secret."""
        if int(seed) != seed or seed < 0:
            raise ValueError(f"seed must be a whole number >= 0, got {seed}")
        ikm = int(seed).to_bytes(16, "little")
        secret = HKDF(algorithm=hashes.SHA256(), length=SECRET_BYTES, salt=_SEED_SALT, info=b"seed").derive(ikm)
        return cls(secret, reproducible=True)

    @classmethod
    def from_key_words(cls, words: Any, *, reproducible: bool) -> DPRandomness:
        """Randomness expanded from saved JAX key words (the federated checkpoint's ``key``).

        Its entropy is that of the words (64 bits for a threefry key): the federated trainer
        keeps only its base key in ``state/``; saving ``state_dict()`` there instead lifts it
        to the full secret.
        """
        ikm = np.asarray(words, dtype="<u4").tobytes()
        secret = HKDF(algorithm=hashes.SHA256(), length=SECRET_BYTES, salt=_SALT, info=b"key-words").derive(ikm)
        return cls(secret, reproducible=reproducible)

    @classmethod
    def from_config(cls, privacy: Any, seed: int) -> DPRandomness:
        """``privacy.reproducible_randomness``: from ``seed``; otherwise fresh OS entropy."""
        return cls.from_seed(seed) if getattr(privacy, "reproducible_randomness", False) else cls.fresh()

    @classmethod
    def for_run(cls, run_dir: str | os.PathLike, privacy: Any, seed: int, *, write: bool = True) -> DPRandomness:
        """The run's randomness: the secret kept in ``run_dir`` if there is one (resume), else new.

        A new secret is written to ``run_dir/dp_secret.json`` atomically before any step
        uses it (``write``: only the process that writes the run directory; the other ranks
        read it there after the data barrier), so a run killed at any point resumes with the
        same keys. Checkpoints carry it too (the DP state in ``state/extra.pt``).
        """
        path = Path(run_dir) / SECRET_FILE
        want_repro = bool(getattr(privacy, "reproducible_randomness", False))
        if path.exists():
            rand = cls.from_state_dict(json.loads(path.read_text()))
            if rand.reproducible != want_repro:
                raise ValueError(f"the run was trained with privacy.reproducible_randomness={rand.reproducible}; "
                                 "resume with the original privacy settings")
            return rand
        rand = cls.from_config(privacy, seed)
        if write:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, rand.state_dict())
        return rand

    # ------------------------------------------------------------------ keys
    def key(self, purpose: str, step: int, index: int = 0, nbytes: int = 16) -> bytes:
        """HKDF-SHA256(secret, info = purpose/step/index): ``nbytes`` of key material."""
        if step < 0 or index < 0:
            raise ValueError(f"step and index must be >= 0, got {step}, {index}")
        info = f"{purpose}/{int(step)}/{int(index)}".encode()
        return HKDF(algorithm=hashes.SHA256(), length=nbytes, salt=_SALT, info=info).derive(self._secret)

    def numpy_rng(self, purpose: str, step: int, index: int = 0) -> np.random.Generator:
        """A Philox4x64 generator with a 128-bit key from the PRF (sampling)."""
        k = np.frombuffer(self.key(purpose, step, index, 16), dtype="<u8").copy()
        return np.random.Generator(np.random.Philox(key=k))

    def seed64(self, purpose: str, step: int, index: int = 0) -> int:
        """A 63-bit integer from the PRF (torch's ``manual_seed`` takes at most 64 bits)."""
        return int.from_bytes(self.key(purpose, step, index, 8), "little") >> 1

    def torch_generator(self, purpose: str, step: int, index: int = 0, device: Any = "cpu") -> Any:
        """A fresh ``torch.Generator`` on ``device`` keyed by (purpose, step, index)."""
        # lazy: torch (~2 s) only when called; this module imports without it
        import torch

        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed64(purpose, step, index))
        return gen

    def jax_key(self, purpose: str, step: int, index: int = 0, impl: str | None = None) -> Any:
        """A typed JAX key per (purpose, step): threefry (default, 64-bit) or ``impl="rbg"`` (128-bit)."""
        # lazy: jax (~2 s) only when called; this module imports without it
        import jax

        if impl == "rbg":
            data = np.frombuffer(self.key(purpose, step, index, 16), dtype="<u4").copy()
            return jax.random.wrap_key_data(data, impl="rbg")
        return jax.random.wrap_key_data(self.jax_key_data(purpose, step, index))

    def jax_key_data(self, purpose: str, step: int, index: int = 0) -> np.ndarray:
        """Raw threefry key data (2 uint32 words) from the PRF."""
        return np.frombuffer(self.key(purpose, step, index, 8), dtype="<u4").copy()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The secret (hex) and the mode: sensitive; saved only under ``state/``."""
        return {"secret": self._secret.hex(), "reproducible": self.reproducible}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> DPRandomness:
        try:
            secret = bytes.fromhex(str(state["secret"]))
        except (KeyError, ValueError):
            raise ValueError("the saved DP randomness is unreadable; is RUN_DIR/dp_secret.json corrupt?") from None
        return cls(secret, reproducible=bool(state.get("reproducible", False)))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved secret *in place*, so every holder (sampler, noise) follows it."""
        other = DPRandomness.from_state_dict(state)
        self._secret, self.reproducible = other._secret, other.reproducible

    def broadcast(self, src: int = 0) -> DPRandomness:
        """Take rank ``src``'s secret, in place, on every rank of the default process group; returns self."""
        # lazy: torch (~2 s) only when called; this module imports without it
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self
        buf = torch.tensor(list(self._secret) + [int(self.reproducible)], dtype=torch.int64)
        if dist.get_backend() == "nccl":
            buf = buf.cuda()
        dist.broadcast(buf, src=src)
        vals = buf.cpu().tolist()
        self._secret, self.reproducible = bytes(vals[:-1]), bool(vals[-1])
        return self

    def __repr__(self) -> str:
        return f"DPRandomness(secret=<hidden>, reproducible={self.reproducible})"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DPRandomness) and other._secret == self._secret and \
            other.reproducible == self.reproducible

    __hash__ = None  # mutable-free but secret: not meant as a dict key


__all__ = ["SECRET_FILE", "DPRandomness"]


def dp_randomness(run: Any, cfg: Any, *, is_writer: bool) -> DPRandomness:
    """The DP run's one secret, for every backend: `RUN_DIR/dp_secret.json` written by the writer
    before the first step (outside `state/`, which only sealed checkpoints replace, so a run
    killed before its first checkpoint resumes with it), read back on resume and by the other
    ranks (after the data barrier). With `privacy.reproducible_randomness` derived from
    `train.seed` instead (recorded in the ledger). `run` is the `RunDir`, `cfg` the run's config."""
    return DPRandomness.for_run(run.path, cfg.privacy, cfg.train.seed, write=is_writer)
