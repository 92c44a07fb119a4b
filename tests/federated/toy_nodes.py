"""The six-user toy federation that the SuperNode tests share: two nodes, a cohort of four."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

U, S, CAP = 6, 3, 4
PLACED = {"[1].examples['x']": "x", "[1].examples['y']": "y", "[1].mask": "example_mask"}
HOSTS = {"A": ["u0", "u1", "u2"], "B": ["u3", "u4", "u5"]}
ASSIGN = {"A": [(0, "u0"), (1, "u2")], "B": [(2, "u3"), (3, "u5")]}


def toy_loss(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w"]) + p["b"] - b["y"]) ** 2, axis=-1), None


def toy_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    """Each user's S examples: x (3 features), y (2 targets), all present."""
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(U, S, 3)).astype(np.float32),
            "y": rng.normal(size=(U, S, 2)).astype(np.float32), "example_mask": np.ones((U, S), np.float32)}


def keep_rows(executor, leaves, slots, rnd: int = 0):
    """``executor`` keeping each leaf's rows of ``slots`` (zeros elsewhere) under var ids 0, 1, ...
    and the round's (slots, rows) map, as a cohort-shaped client stage leaves them: secure
    aggregation on the nodes without running the stage."""
    from memaudit.federated.flower.execute import ROW_MAP

    for v, x in enumerate(leaves):  # a node keeps its own users' rows only
        full = np.zeros_like(x)
        full[slots] = x[slots]
        executor.store[(rnd, v)] = full
    executor.store[(rnd, ROW_MAP)] = np.asarray([slots, slots])
    return executor
