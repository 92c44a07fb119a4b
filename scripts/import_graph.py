"""memaudit's import graph: cycles among its modules, imports inside functions, private names.

Prints JSON: the strongly connected components (cycles) of the graph of every import of one
memaudit module by another, once over module-level imports only and once over all imports
(function bodies included); the imports of memaudit modules made inside functions, by module;
the imports that take another module's private name (`from memaudit.x import _y`); and the
largest modules and functions. `if TYPE_CHECKING:` imports are left out (they never run).

    python scripts/import_graph.py [--list]
"""

from __future__ import annotations

import ast
import io
import json
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "memaudit"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def extensions() -> set[str]:
    """Compiled modules (the secure-aggregation C extension): imported, never scanned."""
    return {module_name(p.with_name(p.name.split(".")[0] + ".py")) for p in PKG.rglob("*.so")} | {
        "memaudit.federated.secagg._maskadd"}


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _targets(node: ast.Import | ast.ImportFrom, here: str, known: set[str]) -> list[tuple[str, list[str]]]:
    """(imported memaudit module, names taken) for one import statement."""
    out = []
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.name in known:
                out.append((a.name, []))
        return out
    base = node.module or ""
    if node.level:  # relative
        pkg = here.split(".")[: -node.level] if not here.endswith("__init__") else here.split(".")
        base = ".".join([*pkg, base]) if base else ".".join(pkg)
    for a in node.names:
        sub = f"{base}.{a.name}"
        if sub in known:
            out.append((sub, []))
        elif base in known:
            out.append((base, [a.name]))
    return out


def _visit(node: ast.AST, in_func: bool, name: str, known: set[str], out: dict) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _type_checking(child):
            continue
        if isinstance(child, ast.Import | ast.ImportFrom):
            for target, names in _targets(child, name, known):
                if target == name:
                    continue
                (out["inner"].append(target) if in_func else out["top"].add(target))
                out["private"].extend(f"{target}.{n}" for n in names if n.startswith("_") and not n.startswith("__"))
        _visit(child, in_func or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda), name, known, out)


def scan(mods: dict[str, Path]) -> dict[str, dict]:
    """Per module: memaudit modules imported at module level (`top`) and inside functions
    (`inner`), private names taken (`private`), its line count and its functions' lengths."""
    known = set(mods) | extensions()
    info = {}
    for name, path in mods.items():
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
        out: dict = {"top": set(), "inner": [], "private": []}
        _visit(tree, False, name, known, out)
        funcs = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree)
                 if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        info[name] = {**out, "lines": len(text.splitlines()), "funcs": funcs}
    return info


# the two reasons the rule allows for an import inside a function
WHY = re.compile(r"\b(lazy|optional)\b", re.IGNORECASE)


def _inner_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement inside a function body (`if TYPE_CHECKING:` blocks left out)."""
    out: list = []

    def visit(node: ast.AST, in_func: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                continue
            if in_func and isinstance(child, ast.Import | ast.ImportFrom):
                out.append(child)
            visit(child, in_func or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef
                                                    | ast.Lambda))

    visit(tree, False)
    return out


def _comments(text: str) -> dict[int, str]:
    """line number -> the comment on that line."""
    return {tok.start[0]: tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline)
            if tok.type == tokenize.COMMENT}


def _why(stmt: ast.Import | ast.ImportFrom, lines: list[str], comments: dict[int, str],
         import_lines: set[int]) -> str:
    """The comment that explains `stmt`: on its own lines, or in the comment lines just above it
    or above the block of inside-function imports it belongs to (isort's blank lines between
    groups included)."""
    own = " ".join(comments.get(n, "") for n in range(stmt.lineno, stmt.end_lineno + 1))
    k = stmt.lineno - 1
    while k in import_lines or (k - 1 in import_lines and not lines[k - 1].strip()):  # isort's groups
        k -= 1
    above = []
    while k >= 1 and lines[k - 1].strip().startswith("#"):
        above.append(lines[k - 1].strip())
        k -= 1
    return " ".join([own, *reversed(above)]).strip()


def unexplained_inner_imports(mods: dict[str, Path] | None = None) -> list[str]:
    """`path:line` of each import inside a function whose comment does not say why (lazy, for
    a measured import cost, or an optional dependency)."""
    out = []
    for path in (modules() if mods is None else mods).values():
        text = path.read_text(encoding="utf-8")
        stmts = _inner_imports(ast.parse(text))
        lines, comments = text.splitlines(), _comments(text)
        import_lines = {n for s in stmts for n in range(s.lineno, s.end_lineno + 1)}
        out.extend(f"{path.relative_to(ROOT)}:{s.lineno}" for s in stmts
                   if not WHY.search(_why(s, lines, comments, import_lines)))
    return sorted(out)


def sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(out, key=len, reverse=True)


def _parents(name: str) -> set[str]:
    """Importing a.b.c runs a/__init__ and a/b/__init__ first: edges to those packages count."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def graph(*, module_level_only: bool, info: dict[str, dict] | None = None) -> dict[str, set[str]]:
    """module -> the memaudit modules it imports (at module level, or anywhere)."""
    info = scan(modules()) if info is None else info
    return {m: set(i["top"]) | (set() if module_level_only else set(i["inner"])) for m, i in info.items()}


def private_imports(info: dict[str, dict] | None = None) -> list[str]:
    """`module._name` for every import of another module's private name."""
    info = scan(modules()) if info is None else info
    return sorted(p for i in info.values() for p in i["private"])


def main() -> None:
    mods = modules()
    info = scan(mods)
    top = graph(module_level_only=True, info=info)
    every = graph(module_level_only=False, info=info)
    funcs = sorted(((f"{m}.{f}", n) for m, i in info.items() for f, n in i["funcs"]), key=lambda x: -x[1])
    report = {
        "modules": len(mods),
        "cycles_module_level": sccs(top),
        "cycles_all_imports": sccs(every),
        "imports_inside_functions": sum(len(i["inner"]) for i in info.values()),
        "import_statements_inside_functions": sum(
            len(_inner_imports(ast.parse(p.read_text(encoding="utf-8")))) for p in mods.values()),
        "inside_function_imports_without_a_why": len(unexplained_inner_imports(mods)),
        "private_name_imports": private_imports(info),
        "largest_modules": sorted(((m, i["lines"]) for m, i in info.items()), key=lambda x: -x[1])[:8],
        "largest_functions": funcs[:8],
        "functions_over_60_lines": sum(1 for _, n in funcs if n > 60),
        "functions": len(funcs),
    }
    if "--list" in sys.argv:
        report["inside_functions_by_module"] = {m: sorted(set(i["inner"])) for m, i in info.items() if i["inner"]}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
