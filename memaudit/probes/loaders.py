"""Typed loaders for what earlier stages wrote: canaries.json, privacy.json and run.json
(probes.json: `memaudit.probes.document`, its one reader and writer).

Each loader checks the fields it needs once and refuses a malformed file in one line naming the
file, the field and the fix; probe code then reads attributes, never `dict.get`. Secrets are held
in fields left out of every repr.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from memaudit.backends import BACKENDS, CENTRALIZED, backend_name
from memaudit.errors import DataError


def _need(obj: dict, key: str, kind, source: str, where: str = ""):
    v = obj.get(key) if isinstance(obj, dict) else None
    if not isinstance(v, kind):
        name = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise DataError(f"{source}: {where}'{key}' must be a {name}; fix or regenerate the file")
    return v


@dataclass(frozen=True)
class CanaryRecord:
    id: str
    secret: str = field(repr=False)
    text: str = field(repr=False)
    repetitions: int = 0
    owner_kind: str | None = None
    users: tuple[str, ...] = ()


@dataclass(frozen=True)
class AuditRecord:
    id: str
    secret: str = field(repr=False)
    text: str = field(repr=False)
    user: str | None
    included: bool


# The score each kind of audit canary is ranked by, fixed before any inclusion bit is seen (a
# choice made after looking would void the audit): a secret's mean log-likelihood; a message's
# Min-K% (the mean of its k lowest token log-probabilities, Shi et al. 2024), which rests on the
# rare tokens (its PII and facts) that only training on that message makes likely.
AUDIT_SCORES = {"secret": "mean_log_likelihood", "document": "min_k"}


@dataclass(frozen=True)
class Canaries:
    """canaries.json: template, secret space, inserted, reference and audit canaries."""

    template: str
    secret_length: int
    alphabet: str
    inserted: tuple[CanaryRecord, ...] = ()
    references: tuple[CanaryRecord, ...] = ()
    audit: tuple[AuditRecord, ...] = ()
    audit_kind: str = "secret"  # "secret" | "document" (memaudit.data.canaries.audit_documents)

    @property
    def prefix(self) -> str:
        """The template's text before the secret."""
        return self.template.split("{secret}")[0]

    @classmethod
    def from_json(cls, obj: Any, source: str = "canaries.json") -> Canaries:
        if not isinstance(obj, dict):
            raise DataError(f"{source} is not a JSON object; pass a canaries.json")
        template = _need(obj, "template", str, source)
        if template.count("{secret}") != 1:
            raise DataError(f"{source}: 'template' must hold '{{secret}}' exactly once")

        def canary(c: Any, i: int, part: str) -> CanaryRecord:
            where = f"{part}[{i}]."
            secret = _need(c, "secret", str, source, where)
            if isinstance(c, dict) and c.get("text") is None:  # the template filled in
                c = {**c, "text": template.replace("{secret}", secret)}
            return CanaryRecord(
                id=str(_need(c, "id", (str, int), source, where)),
                secret=secret,
                text=_need(c, "text", str, source, where),
                repetitions=int(c.get("repetitions") or 0),
                owner_kind=c.get("owner_kind"),
                users=tuple(str(u) for u in c.get("users") or ()),
            )

        def audit(c: Any, i: int) -> AuditRecord:
            where = f"audit[{i}]."
            return AuditRecord(
                id=str(_need(c, "id", (str, int), source, where)),
                secret=str(c.get("secret", "")),
                text=_need(c, "text", str, source, where),
                user=None if c.get("user") is None else str(c["user"]),
                included=bool(_need(c, "included", bool, source, where)),
            )

        inserted = tuple(canary(c, i, "inserted") for i, c in enumerate(obj.get("inserted") or []))
        references = tuple(
            canary(c, i, "references") for i, c in enumerate(obj.get("references") or []))
        return cls(
            template=template,
            secret_length=_secret_length(obj, (*inserted, *references), source),
            alphabet=str(obj.get("alphabet") or "0123456789"),
            inserted=inserted,
            references=references,
            audit=tuple(audit(c, i) for i, c in enumerate(obj.get("audit") or [])),
            audit_kind=_audit_kind(obj.get("audit_kind", "secret"), source),
        )


def _secret_length(obj: dict, records: tuple[CanaryRecord, ...], source: str) -> int:
    """'secret_length' as given, else the one length every secret has."""
    if "secret_length" in obj or not records:
        return int(_need(obj, "secret_length", int, source))
    lengths = {len(r.secret) for r in records}
    if len(lengths) != 1:
        raise DataError(f"{source}: secrets have lengths {sorted(lengths)}; exposure ranks a "
                        "secret among all strings of one length: give secrets of one length")
    return lengths.pop()


def _audit_kind(kind: Any, source: str) -> str:
    if kind not in AUDIT_SCORES:
        raise DataError(f"{source}: 'audit_kind' is {kind!r}; use one of {', '.join(AUDIT_SCORES)}")
    return kind


@dataclass(frozen=True)
class Privacy:
    """privacy.json as the probes need it: the run's δ and the ledger's ε (None without DP)."""

    unit: str | None
    delta: float | None
    epsilon: float | None

    @classmethod
    def from_json(cls, obj: Any, source: str = "privacy.json") -> Privacy:
        if not isinstance(obj, dict):
            raise DataError(f"{source} is not a JSON object; re-run training to rewrite it")
        # lazy: dp_accounting (~1.5 s) and numpy (~0.4 s) only when called
        from memaudit.privacy.ledger import ledger_summary

        try:  # recomputed from the ledger's events, never the stored number
            summary = ledger_summary(obj, with_document=False)  # only the epsilon is needed here
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{source} holds a privacy ledger this version cannot interpret "
                            f"({type(e).__name__}); re-run training to rewrite it") from None
        e = summary["epsilon"]
        return cls(
            unit=summary["unit"],
            delta=summary["delta"],
            epsilon=None if summary["unit"] is None or math.isnan(e) else e,
        )


def _path(obj: Any, *keys: str, default: Any = None) -> Any:
    for k in keys:
        if not isinstance(obj, dict) or k not in obj:
            return default
        obj = obj[k]
    return default if obj is None else obj


@dataclass(frozen=True)
class RunInfo:
    """run.json as the report needs it (the resolved config's few fields, the training result).

    Tolerant of run directories written by earlier memaudit versions: a missing field takes its
    default; a field of the wrong type is refused in one line.
    """

    backend: str
    seed: int | None
    audit_canaries: int
    preset: str | None
    dp: bool
    target_epsilon: float | None
    dp_mechanism: str | None
    secure_aggregation: bool
    adaptive_clipping: bool
    goldfish: bool
    data_fingerprint: str
    parameters: int | None
    train_sequences: int | None
    final_holdout_loss: float | None
    final_holdout_perplexity: float | None
    trained: str = "full"  # what the run trained: "full", or "lora(r=8, q_proj,v_proj)"
    upload_bytes: int | None = None  # federated: a client's update per round (float32 bytes)
    # centralized DP per user: "els" (examples sampled, each clipped) or "uls" (users sampled, each
    # user's summed gradient clipped); None for the federated backend, example-level DP and no DP
    user_sampling: str | None = None

    @classmethod
    def from_manifest(cls, m: Any, source: str = "run.json") -> RunInfo:
        if not isinstance(m, dict):
            raise DataError(f"{source} is not a JSON object; re-run training to rewrite it")
        cfg = m.get("config") if isinstance(m.get("config"), dict) else {}
        res = m.get("result") if isinstance(m.get("result"), dict) else {}
        # `parallel`: the centralized backend's name in runs written before the rename
        backend = backend_name(m.get("backend") or cfg.get("backend") or CENTRALIZED)
        if backend not in BACKENDS:
            raise DataError(f"{source}: backend '{backend}' is not centralized or federated")

        def num(v, kind=float):
            if v is None:
                return None
            try:
                return kind(v)
            except (TypeError, ValueError):
                raise DataError(f"{source}: '{v}' is not a number; re-run training") from None

        dp = (_path(cfg, "privacy", "noise_multiplier") is not None
              or _path(cfg, "privacy", "target_epsilon") is not None)
        per_user = backend == CENTRALIZED and dp and _path(cfg, "privacy", "unit") == "user"
        return cls(
            backend=backend,
            seed=num(_path(cfg, "train", "seed"), int),
            audit_canaries=num(_path(cfg, "data", "audit_canaries", default=0), int),
            preset=_path(cfg, "model", "preset"),
            dp=dp,
            target_epsilon=num(_path(cfg, "privacy", "target_epsilon")),
            dp_mechanism=_path(cfg, "privacy", "mechanism"),
            secure_aggregation=bool(_path(cfg, "privacy", "secure_aggregation", "enabled", default=False)),
            adaptive_clipping=bool(_path(cfg, "privacy", "adaptive_clipping", "enabled", default=False)),
            goldfish=bool(_path(cfg, "train", "goldfish", "enabled", default=False)),
            data_fingerprint=str(m.get("data_fingerprint") or ""),
            parameters=num(res.get("parameters"), int),
            train_sequences=num(res.get("train_sequences"), int),
            final_holdout_loss=num(res.get("final_holdout_loss")),
            final_holdout_perplexity=num(res.get("final_holdout_perplexity")),
            trained=str(res.get("trained") or "full"),
            upload_bytes=num(res.get("upload_bytes_per_client_per_round"), int),
            user_sampling=str(_path(cfg, "privacy", "user_sampling", default="uls")) if per_user else None,
        )
