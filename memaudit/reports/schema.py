"""JSON Schema of report.json (draft 2020-12). HTML and Markdown render from a valid report alone."""

from __future__ import annotations

from typing import Any

import jsonschema

from memaudit.backends import BACKENDS
from memaudit.probes.records import Cell, Test
from memaudit.reports.entries import Record

_NUM = {"type": ["number", "null"]}
_CELL = {
    "type": ["object", "null"],
    "required": ["value"],
    "properties": {"value": _NUM, "ci_low": _NUM, "ci_high": _NUM,
                   "n": {"type": ["integer", "null"]}, "unit": {"type": ["string", "null"]},
                   "note": {"type": ["string", "null"]},
                   # the value is a lower bound (canaries at the exposure estimator's ceiling)
                   "lower_bound": {"type": "boolean"}, "ceiling_units": {"type": ["integer", "null"]}},
}

REPORT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "memaudit report",
    "type": "object",
    "required": ["schema", "memaudit_version", "runs", "comparisons", "findings"],
    "properties": {
        "schema": {"const": "memaudit.report/1"},
        "memaudit_version": {"type": "string"},
        "runs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "backend", "privacy", "utility", "leakage", "probe_rows", "model",
                             "data", "mitigation", "noise_per_round", "samples", "probes_summary"],
                "properties": {
                    "id": {"type": "string"},
                    "role": {"type": ["string", "null"]},
                    "backend": {"enum": list(BACKENDS)},
                    "group_privacy": {
                        "type": "array",
                        "items": {"type": "object",
                                  "required": ["repetitions", "owner_kind", "canaries", "owners",
                                               "effective_epsilon", "rule"]},
                    },
                    "privacy": {
                        "type": "object",
                        "required": ["mechanism", "epsilon", "unit", "per_user_text", "description"],
                        "properties": {
                            "epsilon": {"type": ["number", "string"]},
                            "unit": {"enum": ["example", "user", None]},
                        },
                    },
                    "utility": {"type": "object", "properties": {"holdout_perplexity": _NUM, "holdout_loss": _NUM}},
                    "leakage": {"type": "object", "additionalProperties": _CELL},
                    "probe_rows": {
                        "type": "array",
                        "items": {"type": "object", "required": ["probe", "metric", "value"]},
                    },
                    "samples": {"type": "array", "items": {"type": "string"}},  # only with --show-secrets
                    "extracted_members": {"type": "array", "items": {"type": "object",
                                                                     "required": ["id", "length"]}},
                    "noise_per_round": {"type": "array"},
                },
            },
        },
        "targets": {  # probed outside models (memaudit.reports.targets)
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "source", "privacy", "attacks", "leakage", "probe_rows", "counts"],
                "properties": {
                    "id": {"type": "string"},
                    "source": {"enum": ["folder", "hub", "adapter", "unknown"]},
                    "base": {"type": ["string", "null"]},
                    "privacy": {
                        "type": "object",
                        "required": ["epsilon", "unit", "text"],
                        "properties": {"epsilon": {"anyOf": [{"type": "number"}, {"const": "unknown"}]},
                                       "unit": {"enum": ["example", "user", None]}},
                    },
                    "attacks": {"type": "array", "items": {"type": "object",
                                                          "required": ["attack", "auc", "tpr_at_fpr"]}},
                    "leakage": {"type": "object", "additionalProperties": _CELL},
                },
            },
        },
        "comparisons": {
            "type": "object",
            "required": ["matched", "effects", "curves", "matched_utility", "frontier"],
            "properties": {
                "matched": {"type": "array"},
                "effects": {"type": "array"},
                "curves": {"type": "array"},
                "matched_utility": {
                    "type": "object",
                    "required": ["tolerance", "status", "message", "pairs"],
                    "properties": {"status": {"enum": ["pairs", "no pair", "disjoint", "no runs"]},
                                   "pairs": {"type": "array"}},
                },
                "frontier": {"type": "object", "required": ["origin", "metrics"]},
            },
        },
        "findings": {
            "type": "object",
            "required": ["sentences", "caveats", "headline", "no_difference"],
            "properties": {
                "headline": {"type": "array", "maxItems": 6,
                             "items": {"type": "object", "required": ["text", "evidence", "verdict"]}},
                "no_difference": {"type": "array", "items": {"type": "string"}},
                "sentences": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["text", "verdict", "metric", "test", "n"],
                        # a difference between runs is stated only with its test, n and correction
                        "if": {"properties": {"kind": {"const": "comparison"}}},
                        "then": {"required": ["p_value", "p_adjusted", "correction", "family", "unit"]},
                    },
                },
                "caveats": {"type": "array", "items": {"type": "string"}},
            },
        },
    },
}


def as_json(o: Any) -> Any:
    """`o` with its typed records (`memaudit.probes.records`, `memaudit.reports.entries.Record`) as
    the JSON objects they write."""
    if isinstance(o, Cell | Test):
        return o.to_json()
    if isinstance(o, Record):
        return as_json(o.to_json())
    if isinstance(o, dict):
        return {k: as_json(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [as_json(v) for v in o]
    return o


def validate_report(report: dict[str, Any]) -> None:
    """Raise ValueError naming the first schema violation (of a report in memory: of the JSON its
    records write)."""
    try:
        jsonschema.validate(as_json(report), REPORT_SCHEMA)
    except jsonschema.ValidationError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "<root>"
        raise ValueError(f"report.json does not match its schema at '{where}': {e.message}") from None
