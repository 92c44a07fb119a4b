"""probes.json of outside models as `memaudit probe MODEL --out FOLDER/probes.json` writes them,
built without a model: per-document attack scores drawn here, summarised by the probe's own
`run_membership` (AUC, TPR at low FPR with the negatives it needs), the shift check's fields as
`memaudit.probes.shift.blind_check` returns them.

`four_models(root)` lays out what a new user audits: a GPT-2 fine-tune on a split that is not IID
(the shift check fires) with too few non-members for TPR at 1% FPR, the same weights probed again
under another folder name, and a hub model and an adapter probed on one IID document set. Every path
names a folder of a user's machine (/home/alice/...), which the report must not show.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memaudit.probes.membership import run_membership

HOME = "/home/alice/models"
ATTACKS = ("loss", "zlib", "min_k", "min_k_pp", "reference")


@dataclass(frozen=True)
class _Doc:
    id: str
    repeats: int = 1


def shift_check(auc: float | None, n1: int, n0: int) -> dict[str, Any]:
    """The shift check's entry of probes.json (`blind_check`'s fields), flagged above AUC 0.6."""
    flagged = auc is not None and auc > 0.6
    note = (f"members and non-members differ in their texts alone: a blind classifier tells them "
            f"apart with AUC {auc:.2f}; attack AUCs on this split measure that shift, not "
            "memorization") if flagged else None
    return {"n_members": n1, "n_nonmembers": n0, "auc": auc, "null_sd": 0.02, "length_ratio": 1.0,
            "flagged": flagged, "note": note}


def probes_doc(*, model: str, source: str, base: str | None, n_members: int, n_nonmembers: int,
               strength: dict[str, float], prefix: str = "doc", seed: int = 0,
               shift_auc: float | None = 0.52, weights: str = "w0") -> dict[str, Any]:
    """probes.json of an outside model: membership only; `strength[attack]` shifts the members'
    scores of that attack (0: no signal); documents named `{prefix}{i}`."""
    rng = np.random.default_rng(seed)
    noise = rng.normal(0, 1, n_members + n_nonmembers)
    scores = {}
    for k, name in enumerate(ATTACKS):
        own = rng.normal(0, 0.3, n_members + n_nonmembers)
        shift = np.r_[np.full(n_members, strength.get(name, 0.0)), np.zeros(n_nonmembers)]
        scores[name] = noise + own + shift + k
    docs = [_Doc(f"{prefix}{i}") for i in range(n_members + n_nonmembers)]
    membership = run_membership(docs[:n_members], docs[n_members:], scores, n_boot=50, seed=seed,
                                fprs=(0.01, 0.001))
    return {
        "schema": 1, "memaudit_version": "t", "created": 0.0,
        "target": {"kind": "model", "path": f"{HOME}/{model}", "model": model if source == "hub" else f"{HOME}/{model}",
                   "reference": base, "source": source, "base": base, "weights_sha256": weights},
        "counts": {"context": 1024, "documents": n_members + n_nonmembers, "documents_windowed": 3,
                   "window_stride": 512, "extraction_ks_dropped": []},
        "checks": {"distribution_shift": shift_check(shift_auc, n_members, n_nonmembers)},
        "settings": {}, "seeds": {},
        "probes": {"membership": membership},
    }


def write_probes(folder: Path, doc: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "probes.json"
    path.write_text(json.dumps(doc))
    return path


def four_models(root: Path) -> list[Path]:
    """The four folders a new user passes to `memaudit report`."""
    gpt2 = probes_doc(model="gpt2-support-ft", source="folder", base=f"{HOME}/gpt2", prefix="web",
                      n_members=400, n_nonmembers=400, shift_auc=0.88, weights="w-gpt2ft",
                      strength={"loss": 0.6, "zlib": 0.5, "min_k": 1.6, "min_k_pp": 1.2, "reference": 1.0})
    copy = json.loads(json.dumps(gpt2))  # the same weights, probed again into another folder
    copy["target"]["path"] = f"{HOME}/gpt2-support-ft-again"
    pythia = probes_doc(model="EleutherAI/pythia-160m-ft", source="hub", base="EleutherAI/pythia-160m",
                        n_members=1000, n_nonmembers=1000, seed=1, weights="w-pythia",
                        strength={"loss": 0.5, "min_k": 0.7})
    qwen = probes_doc(model="qwen-notes-ft", source="adapter", base=f"{HOME}/qwen-0.5b",
                      n_members=1000, n_nonmembers=1000, seed=1, weights="w-qwen", strength={"loss": 0.05})
    folders = []
    for name, doc in (("gpt2-support-ft", gpt2), ("pythia-ft", pythia), ("gpt2-support-ft-again", copy),
                      ("qwen-notes-ft", qwen)):
        write_probes(root / name, doc)
        folders.append(root / name)
    return folders
