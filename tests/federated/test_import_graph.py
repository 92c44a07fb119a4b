"""The import graph of memaudit.federated: module-level imports form no cycle, and the wrappers
(DP-FedAvg, secure aggregation, distributed DP) never ask where the deltas live.

Run as a script (``python tests/federated/test_import_graph.py``) to print the cycles, at
module level and counting the imports inside functions too.
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = "memaudit.federated"
# the wrappers that take a ClientUpdates (in-process arrays or node-held rows) without asking which
WRAPPERS = ("memaudit/federated/dp.py", "memaudit/federated/ddp.py",
            "memaudit/federated/secagg/aggregator.py", "memaudit/federated/secagg/remote.py")
DELTA_KINDS = re.compile(r"isinstance\([^)]*\b(ClientRows|Counted|LocalUpdates|ClientUpdates|np\.ndarray|jax\.Array)\b")


def _modules() -> dict[str, pathlib.Path]:
    base = ROOT / "memaudit" / "federated"
    out = {}
    for path in sorted(base.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _targets(node: ast.AST, module: str, is_pkg: bool, known: set[str]) -> list[str]:
    """The memaudit.federated modules one import statement names."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:  # relative: resolve against this module's package
            pkg = module.split(".") if is_pkg else module.split(".")[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            src = ".".join(pkg + ([node.module] if node.module else []))
        else:
            src = node.module or ""
        pkg_dir = ROOT.joinpath(*src.split("."))
        names = [f"{src}.{a.name}" if f"{src}.{a.name}" in known or _native(pkg_dir, a.name) else src
                 for a in node.names]
    return sorted({n for n in names if n in known})


def _native(pkg_dir: pathlib.Path, name: str) -> bool:
    """A compiled submodule (``_maskadd.c`` built in place), not the package's ``__init__``."""
    return pkg_dir.is_dir() and any(pkg_dir.glob(f"{name}.*"))


def import_graph(*, module_level_only: bool) -> dict[str, set[str]]:
    """module -> the memaudit.federated modules it imports (at module level, or anywhere)."""
    mods = _modules()
    known = set(mods)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        is_pkg = path.name == "__init__.py"
        nodes = tree.body if module_level_only else list(ast.walk(tree))
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name].update(t for t in _targets(node, name, is_pkg, known) if t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
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
            visit(v)
    return sorted(out)


def delta_kind_checks() -> dict[str, int]:
    """How often each wrapper tests ``isinstance`` on a kind of client deltas."""
    return {p: len(DELTA_KINDS.findall((ROOT / p).read_text())) for p in WRAPPERS}


def test_no_module_level_cycle():
    assert cycles(import_graph(module_level_only=True)) == []


# being rewritten into one training driver (issue 28): the federated trainer imports the Flower
# trainer in a function, which subclasses it (and names the apps' message types from the apps)
DRIVERS = ("memaudit.federated.trainer", "memaudit.federated.flower.trainer")


def test_no_cycle_counting_imports_inside_functions():
    graph = {m: deps - set(DRIVERS) for m, deps in import_graph(module_level_only=False).items()
             if m not in DRIVERS}
    assert cycles(graph) == []


def test_wrappers_do_not_ask_where_deltas_live():
    assert delta_kind_checks() == dict.fromkeys(WRAPPERS, 0)


def test_client_loop_imports_only_public_primitives():
    tree = ast.parse((ROOT / "memaudit/federated/client_loop.py").read_text())
    private = [(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
               for a in n.names if a.name.startswith("_") and (n.module or "").startswith("memaudit")]
    assert private == []


def test_client_ops_is_a_bottom_module():
    """memaudit.federated.client_ops imports no other memaudit.federated module."""
    assert import_graph(module_level_only=False)["memaudit.federated.client_ops"] == set()


if __name__ == "__main__":
    print("module-level cycles:", cycles(import_graph(module_level_only=True)))
    print("cycles counting imports in functions:", cycles(import_graph(module_level_only=False)))
    print("isinstance on delta kinds:", delta_kind_checks())
