"""Run the chosen probes on a resolved target and build the `probes.json` document.

>>> parse_probes("exposure, audit")
('exposure', 'audit')
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from memaudit import __version__
from memaudit.probes import PROBES, SCHEMA
from memaudit.probes.targets import Codec, Target, load_tokenizer

Progress = Callable[[int, int, dict], None] | None


@dataclass(frozen=True, kw_only=True)
class ProbeSettings:
    probes: tuple[str, ...] = PROBES
    device: str = "cpu"
    dtype: str = "auto"
    batch_size: int = 32
    reference: str | None = None
    seed: int = 0
    n_boot: int = 1000
    fprs: tuple[float, ...] = (0.01, 0.001)
    max_tokens: int = 1024
    min_k: float = 0.2
    exposure_enumerate_max: int = 10_000
    exposure_samples: int = 10_000
    extraction_ks: tuple[int, ...] = (32, 50)
    extraction_m: int = 50
    extraction_max_docs: int = 1000
    canary_samples: int = 8
    top_k: int = 40
    nd_samples: int = 256
    nd_length: int = 64
    nd_top_n: int = 100
    nd_ngram: int = 50
    pii_candidates: int = 9
    pii_max_items: int = 200
    audit_r: tuple[int, ...] = ()
    audit_p: float = 0.05
    audit_delta: float | None = None


@dataclass
class ProbeResult:
    document: dict  # what probes.json holds: no secrets, no raw text
    secrets: dict[str, str] = field(default_factory=dict)  # id -> secret, for --show-secrets only


def parse_probes(spec: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in spec.split(",") if n.strip())
    bad = [n for n in names if n not in PROBES]
    if bad or not names:
        raise ValueError(
            f"unknown probe '{bad[0] if bad else spec}'; choose from {', '.join(PROBES)}"
        )
    return tuple(dict.fromkeys(names))


def _ledger_eps(privacy: dict | None) -> float | None:
    if not privacy:
        return None
    eps = privacy.get("epsilon") or {}
    vals = [float(v) for v in (eps.get("pld"), eps.get("rdp")) if v is not None]
    return min(vals) if vals else None


def _skip(reason: str) -> dict:
    return {"summary": {"skipped": reason}, "scores": []}


def _stage(progress: Progress, name: str) -> Progress:
    if progress is None:
        return None
    return lambda done, total, info: progress(done, total, {**info, "stage": name})


def run_probes(
    target: Target,
    settings: ProbeSettings,
    *,
    progress: Progress = None,
    model=None,
    tokenizer=None,
) -> ProbeResult:
    """Load the model (unless given), run each selected probe, return probes.json + secrets."""
    from memaudit.probes.scoring import load_causal_lm

    if model is None:
        model = load_causal_lm(str(target.model_path), device=settings.device, dtype=settings.dtype)
    codec = Codec(tokenizer or load_tokenizer(target.tokenizer_path), start_id=target.eos_id)
    reference = None
    if settings.reference:
        reference = (
            load_causal_lm(settings.reference, device=settings.device, dtype=settings.dtype),
            Codec(load_tokenizer(settings.reference)),
        )
    probes, timings, secrets = {}, {}, {}
    ctx = _Context(target, settings, model, codec, reference, progress)
    for name in settings.probes:
        t0 = time.perf_counter()
        probes[name] = getattr(ctx, name)()
        timings[name] = time.perf_counter() - t0
    secrets.update(ctx.secrets)
    doc = {
        "schema": SCHEMA,
        "memaudit_version": __version__,
        "created": time.time(),
        "target": {
            "kind": target.kind,
            "path": str(target.path),
            "model": str(target.model_path),
            "reference": settings.reference,
        },
        "settings": {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(settings).items()
        },
        "seeds": {
            "bootstrap": settings.seed,
            "sampling": settings.seed,
            "exposure_candidates": settings.seed,
        },
        "probes": probes,
        "timings": timings,
    }
    return ProbeResult(document=doc, secrets=secrets)


class _Context:
    """The shared state of one probe run: per-document scores are computed once."""

    def __init__(self, target, settings, model, codec, reference, progress) -> None:
        self.t, self.s, self.model, self.codec, self.ref, self.progress = (
            target,
            settings,
            model,
            codec,
            reference,
            progress,
        )
        self.secrets: dict[str, str] = {}
        self._doc_scores = None

    def _scores(self):
        from memaudit.probes.membership import doc_scores

        if self._doc_scores is None:
            docs = self.t.members + self.t.nonmembers + self.t.heldout_user_docs
            self._doc_scores = doc_scores(
                self.model,
                self.codec,
                docs,
                batch_size=self.s.batch_size,
                k=self.s.min_k,
                max_tokens=self.s.max_tokens,
                reference=self.ref,
                progress=_stage(self.progress, "scoring"),
            )
        return self._doc_scores

    def exposure(self) -> dict:
        from memaudit.probes.exposure import run_exposure

        if not self.t.canaries or not (
            self.t.canaries.get("inserted") or self.t.canaries.get("references")
        ):
            return _skip("no canaries (pass --canaries or probe a run with canaries.json)")
        for c in self.t.canaries.get("inserted", []) + self.t.canaries.get("references", []):
            self.secrets[c["id"]] = c["secret"]
        return run_exposure(
            self.model,
            self.codec,
            self.t.canaries,
            batch_size=self.s.batch_size,
            enumerate_max=self.s.exposure_enumerate_max,
            n_samples=self.s.exposure_samples,
            seed=self.s.seed,
            n_boot=self.s.n_boot,
            progress=_stage(self.progress, "exposure"),
        )

    def extraction(self) -> dict:
        from memaudit.probes import extraction as ex

        s, out = self.s, {"summary": {}, "scores": {}}
        docs = self.t.members[: s.extraction_max_docs]
        if docs:
            r = ex.discoverable(
                self.model,
                self.codec,
                docs,
                ks=s.extraction_ks,
                m=s.extraction_m,
                batch_size=s.batch_size,
                n_boot=s.n_boot,
                seed=s.seed,
                progress=_stage(self.progress, "extraction"),
            )
            out["summary"]["discoverable"], out["scores"]["discoverable"] = (
                r["summary"],
                r["scores"],
            )
        if self.t.canaries and self.t.canaries.get("inserted"):
            r, completions = ex.canary_completion(
                self.model,
                self.codec,
                self.t.canaries,
                samples=s.canary_samples,
                top_k=s.top_k,
                batch_size=s.batch_size,
                seed=s.seed,
                n_boot=s.n_boot,
            )
            out["summary"]["canaries"], out["scores"]["canaries"] = r["summary"], r["scores"]
            self.secrets.update({f"{k}:completion": v for k, v in completions.items()})
        if s.nd_samples > 0:
            train = [self.codec.encode(d.text) for d in self.t.members]
            if self.t.canaries:
                train += [
                    self.codec.encode(c["text"])
                    for c in self.t.canaries.get("inserted", [])
                    if "text" in c
                ]
            r = ex.non_discoverable(
                self.model,
                self.codec,
                train,
                n_samples=s.nd_samples,
                length=s.nd_length,
                top_k=s.top_k,
                top_n=s.nd_top_n,
                ngram=s.nd_ngram,
                batch_size=s.batch_size,
                seed=s.seed,
                reference=self.ref,
                n_boot=s.n_boot,
                progress=_stage(self.progress, "sampling"),
            )
            out["summary"]["non_discoverable"], out["scores"]["non_discoverable"] = (
                r["summary"],
                r["scores"],
            )
        return out

    def membership(self) -> dict:
        from memaudit.probes.membership import run_membership

        n1, n0 = len(self.t.members), len(self.t.nonmembers)
        if not n1 or not n0:
            return _skip(f"membership needs members and non-members, got {n1} and {n0}")
        scores = {k: v[: n1 + n0] for k, v in self._scores().items()}
        return run_membership(
            self.t.members,
            self.t.nonmembers,
            scores,
            n_boot=self.s.n_boot,
            seed=self.s.seed,
            fprs=self.s.fprs,
        )

    def user_inference(self) -> dict:
        from memaudit.probes.user_inference import run_user_inference

        docs = self.t.members + self.t.nonmembers + self.t.heldout_user_docs
        if any(d.user is None for d in docs):
            return _skip("documents carry no user ids")
        key = "reference" if self.ref is not None else "loss"
        score = self._scores()[key]
        train_users = {d.user for d in self.t.members}
        idx_pos = [i for i, d in enumerate(docs) if d.role == "holdout" and d.user in train_users]
        if (
            not idx_pos
        ):  # no unseen documents of training users: fall back to their training documents
            idx_pos = list(range(len(self.t.members)))
        idx_neg = [
            i for i, d in enumerate(docs) if d.role != "member" and d.user not in train_users
        ]
        if not idx_neg:
            return _skip("no held-out users to compare with")
        return run_user_inference(
            [docs[i] for i in idx_pos],
            [docs[i] for i in idx_neg],
            score[idx_pos],
            score[idx_neg],
            statistic="mean_llr_vs_reference" if self.ref else "mean_log_likelihood",
            n_boot=self.s.n_boot,
            seed=self.s.seed,
            fprs=self.s.fprs,
        )

    def pii(self) -> dict:
        from memaudit.probes.pii import run_pii

        return run_pii(
            self.model,
            self.codec,
            self.t.members,
            self.t.heldout_user_docs
            or [d for d in self.t.nonmembers if d.user not in {m.user for m in self.t.members}],
            n_candidates=self.s.pii_candidates,
            max_items=self.s.pii_max_items,
            batch_size=self.s.batch_size,
            seed=self.s.seed,
            n_boot=self.s.n_boot,
        )

    def audit(self) -> dict:
        from memaudit.probes.audit import run_audit
        from memaudit.probes.scoring import token_logprobs

        aud = (self.t.canaries or {}).get("audit") or []
        if not aud:
            return _skip("no audit canaries (set data.audit_canaries in the run's config)")
        self.secrets.update({c["id"]: c["secret"] for c in aud if "secret" in c})
        lp = token_logprobs(
            self.model, [self.codec.encode(c["text"]) for c in aud], batch_size=self.s.batch_size
        ).logp
        scores = np.array([x.mean() for x in lp])
        m = len(aud)
        grid = (
            self.s.audit_r
            or tuple(sorted({r for r in (m // 20, m // 10, m // 4, m // 2) if r >= 2}))
            or (m,)
        )
        delta = self.s.audit_delta or float((self.t.privacy or {}).get("delta") or 1e-5)
        eps = _ledger_eps(self.t.privacy)
        return run_audit(
            scores,
            np.array([bool(c["included"]) for c in aud]),
            [c["id"] for c in aud],
            r_grid=grid,
            delta=delta,
            p=self.s.audit_p,
            ledger_eps=None if eps is None or math.isnan(eps) else eps,
        )
