"""The import graph of memaudit.federated: module-level imports form no cycle, and the wrappers
(DP-FedAvg, secure aggregation, distributed DP) never ask where the deltas live.

The graph is `scripts/import_graph.py`'s (the whole package's cycles: tests/test_import_graph.py).
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
_graph = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_graph)
PACKAGE = "memaudit.federated"
# the wrappers that take a ClientUpdates (in-process arrays or node-held rows) without asking which
WRAPPERS = ("memaudit/federated/dp.py", "memaudit/federated/ddp.py",
            "memaudit/federated/secagg/aggregator.py", "memaudit/federated/secagg/remote.py")
DELTA_KINDS = re.compile(r"isinstance\([^)]*\b(ClientRows|Counted|LocalUpdates|ClientUpdates|np\.ndarray|jax\.Array)\b")


def import_graph(*, module_level_only: bool) -> dict[str, set[str]]:
    """memaudit.federated module -> the memaudit.federated modules it imports."""
    g = _graph.graph(module_level_only=module_level_only)
    return {m: {d for d in deps if d.startswith(PACKAGE)} for m, deps in g.items() if m.startswith(PACKAGE)}


cycles = _graph.sccs


def delta_kind_checks() -> dict[str, int]:
    """How often each wrapper tests ``isinstance`` on a kind of client deltas."""
    return {p: len(DELTA_KINDS.findall((ROOT / p).read_text())) for p in WRAPPERS}


def test_no_module_level_cycle():
    assert cycles(import_graph(module_level_only=True)) == []


def test_no_cycle_counting_imports_inside_functions():
    assert cycles(import_graph(module_level_only=False)) == []


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
