"""Count string-key lookups per line in memaudit's report code (and the probes' statistics).

A *string-key lookup* is one of these, where the key is a string constant:

- a subscript read or write: ``x["k"]`` (the target of an assignment or ``del`` counts too);
- a dict method call naming the key: ``x.get("k")``, ``x.pop("k")``, ``x.setdefault("k")``;
- a membership test of a string constant: ``"k" in x`` / ``"k" not in x``.

Dict displays (``{"k": v}``) and keyword arguments are not lookups: they build a value, they do
not read one by name. f-strings and other computed keys are not counted. *Lines* are the
physical lines of each file (``wc -l``), blank lines and comments included.

Usage: ``python scripts/key_lookups.py [PATH ...]`` (default: ``memaudit/reports`` and
``memaudit/probes/stats.py``); prints JSON: per file and per group, lookups, lines and their
ratio.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ("memaudit/reports", "memaudit/probes/stats.py")
METHODS = {"get", "pop", "setdefault"}


def _is_str(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _is_lookup(node: ast.AST) -> bool:
    if isinstance(node, ast.Subscript):
        return _is_str(node.slice)
    if isinstance(node, ast.Call):
        f = node.func
        return isinstance(f, ast.Attribute) and f.attr in METHODS and bool(node.args) and _is_str(node.args[0])
    if isinstance(node, ast.Compare):
        return _is_str(node.left) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops)
    return False


def lookups(source: str) -> int:
    """The string-key lookups of one module's source (see the module docstring)."""
    n = 0
    for node in ast.walk(ast.parse(source)):
        n += _is_lookup(node)
    return n


def count(path: Path) -> dict[str, dict[str, float]]:
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
    out = {}
    for f in files:
        text = f.read_text(encoding="utf-8")
        k, lines = lookups(text), len(text.splitlines())
        out[str(f.relative_to(ROOT))] = {"lookups": k, "lines": lines,
                                         "per_line": round(k / lines, 3) if lines else 0.0}
    return out


def main(argv: list[str]) -> int:
    groups = {}
    for p in argv or DEFAULT:
        files = count(ROOT / p)
        k = sum(v["lookups"] for v in files.values())
        lines = sum(v["lines"] for v in files.values())
        groups[p] = {"lookups": k, "lines": lines, "per_line": round(k / lines, 3) if lines else 0.0,
                     "files": files}
    print(json.dumps(groups, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
