"""memaudit's layers only point down: no import cycle among its modules, counting the imports
made inside functions, and no module takes another's private name (the counts come from
`scripts/import_graph.py`, which prints them)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "import_graph", Path(__file__).resolve().parents[1] / "scripts" / "import_graph.py")
import_graph = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(import_graph)


def test_no_import_cycle_among_memaudit_modules():
    assert import_graph.sccs(import_graph.graph(module_level_only=False)) == []


def test_no_module_imports_another_modules_private_name():
    assert import_graph.private_imports() == []


def test_the_lifecycle_and_the_checks_import_no_backend():
    """The run lifecycle sits below the trainers: nothing it imports reaches a backend."""
    g = import_graph.graph(module_level_only=False)
    reach, todo = set(), ["memaudit.lifecycle", "memaudit.checks"]
    while todo:
        m = todo.pop()
        for d in g.get(m, ()):
            if d not in reach:
                reach.add(d)
                todo.append(d)
    backends = {"memaudit.train.trainer", "memaudit.federated.trainer", "memaudit.dispatch", "memaudit.driver",
                "memaudit.parallel.launch", "memaudit.federated.flower.trainer"}
    assert reach & backends == set()


def test_every_import_inside_a_function_says_why():
    """An import made inside a function (of a memaudit module or a third-party library) is one
    the rule allows: an optional dependency or a measured import cost, and a comment on its line,
    or just above it (one comment may head a contiguous block of imports), says which
    ("lazy: ..." or "optional dependency: ...")."""
    assert import_graph.unexplained_inner_imports() == []
