"""probes.json: its one reader and writer, and the typed sections the report reads.

`write_probes` writes the document `memaudit probe` (and a sweep's point) made; `read_probes`
reads it back as a `ProbesDoc`, refusing a malformed file in one line. The probes' summaries and
per-unit scores are JSON objects in the file; here they become typed records (`ExposureSummary`,
`ExtractionSummary`, `AttackSummary`, `PiiSummary`, `AuditSummary` and the score rows), so that
the report reads attributes and never a key. Cells are `memaudit.probes.records.Cell`.

>>> doc = ProbesDoc.from_json({"schema": 1, "probes": {"user_inference": {"summary": {
...     "auc": {"value": 0.6, "ci_low": 0.5, "ci_high": 0.7, "n": 20, "unit": "users"}},
...     "scores": [{"user": "u1", "score": 1.5, "training_user": True}]}}})
>>> s = doc.get("user_inference")
>>> s.attack().auc.value, s.user_scores()[0].training_user
(0.6, True)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from memaudit.errors import DataError
from memaudit.io import atomic_write_json, read_json
from memaudit.probes.records import Cell

SCHEMA = 1


def _cell(d: Any) -> Cell | None:
    """A probes.json cell (None where there is none)."""
    return Cell.from_json(d) if isinstance(d, Mapping) and d else None


def _obj(d: Any) -> Mapping[str, Any]:
    return d if isinstance(d, Mapping) else {}


# ----------------------------------------------------------------------------- summaries
@dataclass(frozen=True)
class NamedP:
    """A test as a summary names it: the test's name and its p-value (either may be missing)."""

    name: str | None
    p_value: float | None

    @classmethod
    def from_json(cls, d: Any) -> NamedP | None:
        return cls(name=d.get("test"), p_value=d.get("p_value")) if isinstance(d, Mapping) and d else None


@dataclass(frozen=True)
class ExposureBucket:
    """The canaries inserted `repetitions` times: all of them, their excess over the run's
    references (with its test), and by owner kind ("user", "spread")."""

    all: Cell | None
    excess: Cell | None
    test: NamedP | None
    by_owner: Mapping[str, Cell | None]


@dataclass(frozen=True)
class ExposureSummary:
    method: str | None
    max_exposure: float | None
    inserted: Cell | None
    references: Cell | None
    by_repetitions: Mapping[str, ExposureBucket]  # keyed as probes.json keys them ("1", "4")
    inserted_vs_references: NamedP | None

    @classmethod
    def from_json(cls, s: Mapping[str, Any]) -> ExposureSummary:
        buckets = {r: ExposureBucket(all=_cell(b.get("all")), excess=_cell(b.get("excess")),
                                     test=NamedP.from_json(b.get("test")),
                                     by_owner={o: _cell(b.get(o)) for o in ("user", "spread")})
                   for r, b in _obj(s.get("by_repetitions")).items()}
        return cls(method=s.get("method"), max_exposure=s.get("max_exposure"), inserted=_cell(s.get("inserted")),
                   references=_cell(s.get("references")), by_repetitions=buckets,
                   inserted_vs_references=NamedP.from_json(s.get("inserted_vs_references")))


@dataclass(frozen=True)
class PrefixExtraction:
    """Discoverable extraction at one prefix length: the rates, and the exact rate by how often
    the documents repeat (keyed by bucket, "1", "2-3", ...)."""

    rates: Mapping[str, Cell | None]  # exact, approx_levenshtein, approx_bleu
    exact_by_repeats: Mapping[str, Cell | None]

    @property
    def exact(self) -> Cell | None:
        return self.rates.get("exact")


EXTRACTION_RATES = ("exact", "approx_levenshtein", "approx_bleu")
NON_DISCOVERABLE = ("perplexity", "zlib", "reference")


@dataclass(frozen=True)
class ExtractionSummary:
    discoverable: Mapping[str, PrefixExtraction]  # keyed by prefix length as probes.json keys it
    canary_greedy: Cell | None
    non_discoverable: Mapping[str, Cell | None]  # by ranking: the rate memorised in its top

    @classmethod
    def from_json(cls, s: Mapping[str, Any]) -> ExtractionSummary:
        disc = {k: PrefixExtraction(rates={n: _cell(d.get(n)) for n in EXTRACTION_RATES},
                                    exact_by_repeats={b: _cell(_obj(v).get("exact"))
                                                      for b, v in _obj(d.get("by_repeats")).items()})
                for k, d in _obj(s.get("discoverable")).items()}
        nd = _obj(s.get("non_discoverable"))
        return cls(discoverable=disc, canary_greedy=_cell(_obj(s.get("canaries")).get("greedy")),
                   non_discoverable={n: _cell(_obj(nd.get(n)).get("rate")) for n in NON_DISCOVERABLE})


@dataclass(frozen=True)
class AttackSummary:
    """An attack's AUC and its TPR at each FPR (keyed "0.01", ...), as the probe wrote them."""

    auc: Cell | None
    tpr_at_fpr: Mapping[str, Cell | None]

    @classmethod
    def from_json(cls, s: Any) -> AttackSummary | None:
        """None where `s` names no AUC (not an attack's summary)."""
        if not isinstance(s, Mapping) or not s.get("auc"):
            return None
        return cls(auc=_cell(s.get("auc")),
                   tpr_at_fpr={f: _cell(c) for f, c in _obj(s.get("tpr_at_fpr")).items()})


PII_GROUPS = ("training_users", "heldout_users")
PII_MEASURES = ("extraction", "inference_top1")


@dataclass(frozen=True)
class PiiSummary:
    groups: Mapping[str, Mapping[str, Cell | None]]  # group -> measure -> cell

    @classmethod
    def from_json(cls, s: Mapping[str, Any]) -> PiiSummary:
        return cls(groups={g: {m: _cell(_obj(s.get(g)).get(m)) for m in PII_MEASURES} for g in PII_GROUPS})

    @property
    def training_extraction(self) -> Cell | None:
        return self.groups["training_users"]["extraction"]


@dataclass(frozen=True)
class AuditSummary:
    """The ε audit (Steinke et al. 2023): r guesses, v correct, over m audit canaries."""

    eps_lower_bound: float | None
    m: int | None
    r: int | None
    v: int | None
    p: float | None
    delta: float | None
    confidence: float | None
    ceiling: float | None
    ledger_eps: float | None
    canaries: str | None
    score: str | None
    all_thresholds: Any
    gdp_estimate: Any

    @classmethod
    def from_json(cls, s: Mapping[str, Any]) -> AuditSummary:
        return cls(eps_lower_bound=s.get("eps_lower_bound"), m=s.get("m"), r=s.get("r"), v=s.get("v"),
                   p=s.get("p"), delta=s.get("delta"), confidence=s.get("confidence", 1 - (s.get("p") or 0.05)),
                   ceiling=s.get("ceiling"), ledger_eps=s.get("ledger_eps"),
                   canaries=s.get("canaries", "secret"), score=s.get("score", "mean_log_likelihood"),
                   all_thresholds=s.get("all_thresholds"), gdp_estimate=s.get("gdp_estimate"))


# ----------------------------------------------------------------------------- score rows
@dataclass(frozen=True)
class ExposureScore:
    """One canary's exposure (no secret): its role ("inserted" or "reference"), repetitions and
    owner kind, and whether it sits at the estimator's ceiling."""

    id: Any
    role: str | None
    exposure: float | None
    repetitions: int | None
    owner_kind: str | None
    lower_bound: bool

    @classmethod
    def from_json(cls, r: Mapping[str, Any]) -> ExposureScore:
        return cls(id=r.get("id"), role=r.get("role"), exposure=r.get("exposure"),
                   repetitions=r.get("repetitions"), owner_kind=r.get("owner_kind"),
                   lower_bound=bool(r.get("lower_bound")))


@dataclass(frozen=True)
class DiscoverableScore:
    id: Any
    k: int
    exact: Any
    repeats: int = 1

    @classmethod
    def from_json(cls, r: Mapping[str, Any]) -> DiscoverableScore:
        return cls(id=r.get("id"), k=r.get("k"), exact=r.get("exact"), repeats=r.get("repeats", 1))


@dataclass(frozen=True)
class CanaryCompletion:
    id: Any
    greedy: Any


@dataclass(frozen=True)
class MembershipScore:
    """A document's score under each attack (`scores`, by attack name), and whether it is a member."""

    id: Any
    member: bool
    repeats: Any
    scores: Mapping[str, Any]

    @classmethod
    def from_json(cls, r: Mapping[str, Any]) -> MembershipScore:
        return cls(id=r.get("id"), member=r.get("member"), repeats=r.get("repeats"),
                   scores={k: v for k, v in r.items() if k not in ("id", "member", "repeats")})

    @property
    def loss(self) -> float | None:
        """The loss attack's score (None: the row has none)."""
        return self.scores.get("loss")


@dataclass(frozen=True)
class UserScore:
    user: Any
    score: float
    training_user: bool


@dataclass(frozen=True)
class PiiScore:
    group: str | None
    doc: Any
    type: Any
    extracted: Any


@dataclass(frozen=True)
class GoldfishScore:
    id: Any
    kind: str | None
    repeats: Any
    exact: Any
    rouge_l: Any


# ----------------------------------------------------------------------------- the document
def _weights(target: Any) -> str | None:
    """The weights' fingerprint a probes.json's target records (None: written before it existed)."""
    value = target.get("weights_sha256") if isinstance(target, Mapping) else None
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class ProbeSection:
    """One probe's section: its summary and its per-unit scores, as probes.json holds them, and
    their typed reading (the method named after the probe)."""

    summary: dict
    scores: Any

    @property
    def skipped(self) -> str | None:
        return self.summary.get("skipped")

    @property
    def suffix_tokens(self) -> int | None:
        """goldfish_extraction's m: the last tokens of a document it decodes."""
        return self.summary.get("suffix_tokens")

    def _rows(self, key: str | None = None) -> list[Mapping[str, Any]]:
        rows = self.scores if key is None else _obj(self.scores).get(key)
        return [r for r in rows or [] if isinstance(r, Mapping)]

    def exposure(self) -> ExposureSummary:
        return ExposureSummary.from_json(self.summary)

    def extraction(self) -> ExtractionSummary:
        return ExtractionSummary.from_json(self.summary)

    def attack(self) -> AttackSummary | None:
        """user_inference's summary: one attack."""
        return AttackSummary.from_json(self.summary)

    def attacks(self) -> dict[str, AttackSummary]:
        """membership's summary: every attack (a summary naming an AUC), in the file's order."""
        return {name: AttackSummary(auc=_cell(s.get("auc")),
                                    tpr_at_fpr={f: _cell(c) for f, c in _obj(s.get("tpr_at_fpr")).items()})
                for name, s in self.summary.items() if isinstance(s, Mapping) and "auc" in s}

    def attack_json(self) -> list[dict[str, Any]]:
        """membership's attacks as probes.json holds them: name, AUC cell, TPR cells."""
        return [{"attack": name, "auc": s["auc"], "tpr_at_fpr": s.get("tpr_at_fpr") or {}}
                for name, s in self.summary.items() if isinstance(s, Mapping) and "auc" in s]

    def pii(self) -> PiiSummary:
        return PiiSummary.from_json(self.summary)

    def audit(self) -> AuditSummary:
        return AuditSummary.from_json(self.summary)

    def exposure_scores(self) -> list[ExposureScore]:
        return [ExposureScore.from_json(r) for r in self._rows()]

    def discoverable_scores(self) -> list[DiscoverableScore]:
        return [DiscoverableScore.from_json(r) for r in self._rows("discoverable")]

    def canary_scores(self) -> list[CanaryCompletion]:
        return [CanaryCompletion(id=r.get("id"), greedy=r.get("greedy")) for r in self._rows("canaries")]

    def membership_scores(self) -> list[MembershipScore]:
        return [MembershipScore.from_json(r) for r in self._rows()]

    def user_scores(self) -> list[UserScore]:
        return [UserScore(user=r.get("user"), score=r.get("score"), training_user=r.get("training_user"))
                for r in self._rows()]

    def pii_scores(self) -> list[PiiScore]:
        return [PiiScore(group=r.get("group"), doc=r.get("doc"), type=r.get("type"), extracted=r.get("extracted"))
                for r in self._rows()]

    def goldfish_scores(self) -> list[GoldfishScore]:
        return [GoldfishScore(id=r.get("id"), kind=r.get("kind"), repeats=r.get("repeats"), exact=r.get("exact"),
                              rouge_l=r.get("rouge_l")) for r in self._rows()]


@dataclass(frozen=True)
class TargetInfo:
    """The probed model: its name or path, where it came from (folder, hub, adapter), an
    adapter's base, the membership reference, and the weights' fingerprint."""

    model: str | None
    source: str | None
    base: str | None
    reference: str | None
    weights_sha256: str | None


@dataclass(frozen=True)
class ProbesDoc:
    """probes.json: schema, target and one section per probe."""

    schema: int
    target: dict
    settings: dict
    probes: dict[str, ProbeSection]
    counts: dict = field(default_factory=dict)  # what fitting the context did (documents windowed, ...)
    checks: dict = field(default_factory=dict)  # checks of the inputs (the distribution shift)

    def get(self, name: str) -> ProbeSection | None:
        """The probe's section, or None when it was not run or was skipped."""
        p = self.probes.get(name)
        return None if p is None or p.skipped else p

    @property
    def weights_sha256(self) -> str | None:
        """The fingerprint of the weights it measured (None: written before it existed)."""
        return _weights(self.target)

    @property
    def about(self) -> TargetInfo:
        """What the probed model is, as `memaudit probe` recorded it."""
        t = self.target
        return TargetInfo(model=t.get("model"), source=t.get("source"), base=t.get("base"),
                          reference=t.get("reference"), weights_sha256=self.weights_sha256)

    @property
    def distribution_shift(self) -> dict | None:
        return self.checks.get("distribution_shift")

    @classmethod
    def from_json(cls, obj: Any, source: str = "probes.json") -> ProbesDoc:
        if not isinstance(obj, dict) or not isinstance(obj.get("probes"), dict):
            raise DataError(f"{source} has no 'probes' object; re-run `memaudit probe`")
        schema = obj.get("schema")
        if schema != SCHEMA:
            raise DataError(f"{source} has schema {schema!r}, this memaudit reads {SCHEMA}; re-run probe")
        probes = {}
        for name, p in obj["probes"].items():
            if not isinstance(p, dict) or not isinstance(p.get("summary"), dict):
                raise DataError(f"{source}: probe '{name}' has no 'summary'; re-run `memaudit probe`")
            probes[name] = ProbeSection(summary=p["summary"], scores=p.get("scores") or [])
        target = obj.get("target")
        checks = obj.get("checks")
        return cls(schema=SCHEMA, target=target if isinstance(target, dict) else {},
                   settings=obj.get("settings") or {}, probes=probes, counts=obj.get("counts") or {},
                   checks=checks if isinstance(checks, dict) else {})


@dataclass(frozen=True)
class ProbesStamp:
    """What a probes.json says of how it was made: the probe settings and the weights' fingerprint
    (None where it does not say, or is not a JSON object)."""

    settings: Any
    weights_sha256: str | None


def read_stamp(path: str | os.PathLike) -> ProbesStamp:
    """The stamp of the probes.json at `path`, read without checking the rest of the document:
    whether it is current is all a sweep asks (`memaudit.sweep.point.probe_reason`)."""
    obj = read_json(path)
    if not isinstance(obj, dict):
        return ProbesStamp(settings=None, weights_sha256=None)
    return ProbesStamp(settings=obj.get("settings"), weights_sha256=_weights(obj.get("target")))


def read_probes(path: str | os.PathLike) -> ProbesDoc:
    """The probes.json at `path`; a malformed one is refused in one line naming it."""
    return ProbesDoc.from_json(read_json(path), str(path))


def write_probes(path: str | os.PathLike, document: Mapping[str, Any]) -> None:
    """Write a probes.json document (`memaudit.probes.runner.ProbeResult.document`) atomically."""
    atomic_write_json(path, document)
