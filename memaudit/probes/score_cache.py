"""What a sweep's points would each compute alike, computed once: the reference's scores and the
split's shift check.

Every point of a sweep is scored against the same membership reference (its public base,
`memaudit.sweep.point.point_probe_config`) on the same documents (the points share their data):
the reference's forward passes over every member, non-member and held-out document are the same
work at each point, and the public base's own zero-fine-tuning run does that work once more as
its target. `ScoreCache` keeps what the reference attack reads from them, each document's mean
token log-likelihood, keyed by everything that decides it: the model's weights
(`memaudit.probes.weights.weights_sha256`), the engine and precision that scored it, the scoring
window, stride and batch size, and the token ids of every document. A key that differs in any of
them is another entry; a point whose data differ from the others' computes its own. It keeps the
blind shift check of a member/non-member split too (`memaudit.probes.shift.blind_check`, a
function of the texts and the seed alone), keyed by both.

The values are computed from the private documents and are not privatised: every entry is
written atomically and readable by its owner only (0600), in the sweep's folder (or the one
`memaudit probe --cache` names), never in the reference's (a public base may be shared) and never
in what `memaudit collect` brings back.

>>> import tempfile
>>> m = ScoreCache(tempfile.mkdtemp()).model({"weights": "w", "engine": "torch", "dtype": "float32"})
>>> m.get([[1, 2]], window=8, stride=4, batch_size=2) is None
True
>>> m.put([[1, 2]], np.array([-1.5]), window=8, stride=4, batch_size=2)
>>> m.get([[1, 2]], window=8, stride=4, batch_size=2).tolist()
[-1.5]
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from memaudit.io import atomic_write_bytes

SCHEMA = 1


class ScoreCache:
    """Mean log-likelihood per document (float64, one entry per document list) under `root`."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    @staticmethod
    def key(*, weights: str, engine: str, dtype: str, window: int, stride: int | None, batch_size: int,
            seqs: Sequence[Sequence[int]]) -> str:
        h = hashlib.sha256(json.dumps({"schema": SCHEMA, "weights": weights, "engine": engine, "dtype": dtype,
                                       "window": window, "stride": stride, "batch_size": batch_size,
                                       "docs": len(seqs)}, sort_keys=True).encode())
        for s in seqs:  # each document's ids, length-prefixed: no two lists share a byte string
            ids = np.asarray(s, dtype=np.int64)
            h.update(np.int64(ids.size).tobytes())
            h.update(ids.tobytes())
        return h.hexdigest()

    def model(self, ident: dict) -> ModelScores:
        """The entries of one model (`ident`: its weights, engine and precision)."""
        return ModelScores(self, ident)

    def _path(self, key: str) -> Path:
        return self.root / f"{key}.npy"

    def get(self, key: str) -> np.ndarray | None:
        """The entry, or None when there is none (or it cannot be read: it is computed again)."""
        try:
            return np.load(self._path(key), allow_pickle=False)
        except (OSError, ValueError):
            return None

    def put(self, key: str, values: np.ndarray) -> None:
        self._private_root()
        buf = io.BytesIO()
        np.save(buf, np.asarray(values, dtype=np.float64), allow_pickle=False)
        atomic_write_bytes(self._path(key), buf.getvalue())  # mkstemp's file: 0600

    @staticmethod
    def check_key(name: str, seed: int, *sides: Sequence[str]) -> str:
        """The key of a check computed from texts alone (`name`, e.g. the shift check)."""
        h = hashlib.sha256(json.dumps({"schema": SCHEMA, "check": name, "seed": seed}).encode())
        for side in sides:
            h.update(np.int64(len(side)).tobytes())
            for t in side:
                b = t.encode("utf-8")
                h.update(np.int64(len(b)).tobytes())
                h.update(b)
        return h.hexdigest()

    def get_check(self, key: str) -> dict | None:
        try:
            return json.loads((self.root / f"{key}.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def put_check(self, key: str, value: dict) -> None:
        self._private_root()
        atomic_write_bytes(self.root / f"{key}.json", json.dumps(value).encode("utf-8"))

    def _private_root(self) -> None:
        """`root` and every folder made for it: 0700."""
        missing, p = [], self.root
        while not p.exists():
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            d.mkdir(mode=0o700, exist_ok=True)


@dataclass(frozen=True)
class ModelScores:
    """One model's mean log-likelihoods in a `ScoreCache`, by document list and scoring window."""

    cache: ScoreCache
    ident: dict

    def _key(self, seqs: Sequence[Sequence[int]], window: int, stride: int | None, batch_size: int) -> str:
        return self.cache.key(**self.ident, window=window, stride=stride, batch_size=batch_size, seqs=seqs)

    def get(self, seqs: Sequence[Sequence[int]], *, window: int, stride: int | None,
            batch_size: int) -> np.ndarray | None:
        """One mean per document of `seqs`, or None where nothing (whole) is kept."""
        found = self.cache.get(self._key(seqs, window, stride, batch_size))
        return found if found is not None and found.shape == (len(seqs),) else None

    def put(self, seqs: Sequence[Sequence[int]], values: np.ndarray, *, window: int, stride: int | None,
            batch_size: int) -> None:
        self.cache.put(self._key(seqs, window, stride, batch_size), values)
