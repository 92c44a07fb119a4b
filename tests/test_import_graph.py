"""memaudit's layers only point down: no import cycle among its modules, counting the imports
made inside functions, no module takes another's private name, and the mechanics never import
the run wing (the counts come from
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
    reach, todo = set(), ["memaudit.run.lifecycle", "memaudit.run.checks"]
    while todo:
        m = todo.pop()
        for d in g.get(m, ()):
            if d not in reach:
                reach.add(d)
                todo.append(d)
    backends = {"memaudit.train.trainer", "memaudit.train.jax_trainer", "memaudit.federated.trainer",
                "memaudit.run.dispatch", "memaudit.run.driver", "memaudit.run.launch", "memaudit.run.centralized",
                "memaudit.run.centralized_jax", "memaudit.run.federated", "memaudit.run.flower",
                "memaudit.federated.flower.trainer"}
    assert reach & backends == set()


# the mechanics, and the bottom modules under them: none of them imports the run wing (run/)
MECHANICS = ("train", "parallel", "federated", "models", "privacy", "data", "probes")
BOTTOM = ("config", "io", "errors", "rundir", "checkpoints", "backends")
# the one call up, written down in docs/architecture.md ("Layers"): Flower starts the server
# side's process at memaudit's ServerApp, whose main enters the run wing to train the run
CALLS_UP = {("memaudit.federated.flower.apps", "memaudit.run.flower")}


def run_wing_imports_from_below(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(module below the run wing, run-wing module it imports), at module level or in a function."""
    below = tuple(f"memaudit.{f}" for f in (*MECHANICS, *BOTTOM))
    return {(m, d) for m, deps in graph.items() if m in below or m.startswith(tuple(f"{b}." for b in below))
            for d in deps if d == "memaudit.run" or d.startswith("memaudit.run.")}


def test_the_mechanics_never_import_the_run_wing():
    assert run_wing_imports_from_below(import_graph.graph(module_level_only=False)) == CALLS_UP


def test_an_import_of_the_run_wing_from_below_is_seen_in_a_function_too(tmp_path):
    """The check above sees an import made inside a function as well as one at module level, and
    leaves out a type-checking-only import (it never runs)."""
    files = {
        "memaudit.run.driver": "def fit():\n    pass\n",
        "memaudit.models.top": "from memaudit.run.driver import fit\n",
        "memaudit.train.inner": "def f():\n    from memaudit.run import driver  # lazy\n    return driver\n",
        "memaudit.privacy.typed": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import memaudit.run.driver\n",
    }
    mods = {}
    for name, text in files.items():
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        mods[name] = path
    g = import_graph.graph(module_level_only=False, info=import_graph.scan(mods))
    assert run_wing_imports_from_below(g) == {("memaudit.models.top", "memaudit.run.driver"),
                                              ("memaudit.train.inner", "memaudit.run.driver")}


def test_every_import_inside_a_function_says_why():
    """An import made inside a function (of a memaudit module or a third-party library) is one
    the rule allows: an optional dependency or a measured import cost, and a comment on its line,
    or just above it (one comment may head a contiguous block of imports), says which
    ("lazy: ..." or "optional dependency: ...")."""
    assert import_graph.unexplained_inner_imports() == []
