"""Which weights a probes.json measured: `target.weights_sha256`, the sha256 of the probed
model's safetensors files (name and content, in name order: `models.init.base_model_record`,
the same fingerprint run.json records for a starting checkpoint), taken before the model is
loaded.

A probes.json whose fingerprint is not the model's on disk measured other weights: a probe that
ran while its run was trained again (`--overwrite`) writes the old model's numbers into the new
run, newer than its model. Sweeps probe such a run again (`sweep.point.probe_reason`) and
reports refuse it (`reports.build`). A probes.json written before the fingerprint existed
carries none: sweeps probe it again, reports read it as before. A model folder without
safetensors files (a `.bin` checkpoint; memaudit always writes safetensors) has no fingerprint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from memaudit.models.init import base_model_record

if TYPE_CHECKING:
    from memaudit.probes.document import ProbesDoc


def weights_sha256(model_dir: str | os.PathLike | None) -> str | None:
    """The fingerprint of the weights in `model_dir`, or None where there are no safetensors."""
    if model_dir is None:
        return None
    d = Path(model_dir)
    if not d.is_dir() or not any(d.glob("*.safetensors")):
        return None
    return base_model_record(str(d))["weights_sha256"]


def weights_mismatch(doc: ProbesDoc, model_dir: str | os.PathLike) -> bool:
    """Whether a probes.json that records a fingerprint measured other weights than `model_dir`'s.
    False where `model_dir` holds no weights (a run brought back without them, `memaudit collect`):
    there is nothing to compare with."""
    recorded = doc.weights_sha256
    current = weights_sha256(model_dir)
    return recorded is not None and current is not None and recorded != current
