"""The stage manifest: what a SuperNode may run and must enforce, computed from the operator's
config (never sent by the server).

`round_plan` is the one place a round's partitioned program is made: the server's
`memaudit.federated.flower.trainer.FlowerRuntime` runs it, and `build_trust` traces the same
program for every cohort capacity the server can use and keeps each client stage's
`memaudit.federated.flower.trust.stage_signature`, the resident deltas' var ids, the
secure-aggregation policy and the DP parameters of the config. The trace takes the server state
as shapes and dtypes only, so a fresh and a resumed run make byte-identical modules.
``python -m memaudit.federated.flower.nodes`` writes it as ``manifest.json`` beside the
partitions; a SuperNode is started with ``--node-config "... manifest='manifest.json'"``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np

from memaudit.federated.cohorts import ClientData, cohort_capacity, poisson_capacity
from memaudit.federated.flower.execute import plan_signatures, resident_vars
from memaudit.federated.flower.partition import (
    STAGE_PLATFORMS,
    NodeStages,
    Plan,
    compile_plan,
    node_stages,
    retrace,
)
from memaudit.federated.flower.trust import DPBound, NodeTrust
from memaudit.federated.trainer import FederatedTrainer
from memaudit.io import atomic_write_json

PLACED = {"[1].examples['input_ids']": "input_ids",
          "[1].examples['attention_mask']": "attention_mask", "[1].mask": "example_mask"}


def data_struct(clients: Any, cap: int) -> ClientData:
    """The cohort data's shapes for a capacity (the server has no client data)."""
    s_max, length = clients.input_ids.shape[1:]
    ids = jax.ShapeDtypeStruct((cap, s_max, length), np.int32)
    return ClientData({"input_ids": ids, "attention_mask": ids}, jax.ShapeDtypeStruct((cap, s_max), np.float32))


def _program(trainer: FederatedTrainer, cap: int, state: Any, key: Any) -> tuple[Any, tuple, tuple]:
    """The round's program, its arguments' shapes at capacity ``cap`` and its resident outputs.
    With a host aggregator (secure aggregation, distributed DP) the program is the client
    phase, whose deltas stay on the nodes (``state`` is then the server params)."""
    split = trainer.algorithm.host_split
    program = trainer.algorithm.program if split is None else split.client_phase
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.numpy.asarray(x).dtype), state)
    return program, (shapes, data_struct(trainer.clients, cap), key), (".deltas",) if split is not None else ()


def round_plan(trainer: FederatedTrainer, cap: int, state: Any, key: Any) -> Plan:
    """The round's partitioned program for a cohort capacity."""
    program, args, resident = _program(trainer, cap, state, key)
    return compile_plan(program, args, PLACED, cap, resident=resident)


def node_plan(trainer: FederatedTrainer, plan: Plan, cap: int, state: Any, key: Any,
              traced: Plan | None = None) -> NodeStages | None:
    """``plan``'s client stages shaped for a node hosting at most ``cap`` slots
    (`memaudit.federated.flower.partition.node_stages`), from ``traced`` (the round at ``cap``,
    compiled) when given, else from a new trace; None when the cohort's modules must run."""
    if cap >= plan.capacity:
        return None
    if traced is None:
        program, args, _ = _program(trainer, plan.capacity, state, key)
        traced = retrace(program, args, PLACED, cap)
    return node_stages(plan, traced)


def node_capacities(cap: int, hosted: int) -> list[int]:
    """The node capacities (`node_capacity`) a node with ``hosted`` users can take in a cohort
    of capacity ``cap``: below ``cap`` only (at ``cap`` the cohort's modules run).

    >>> node_capacities(8, 3), node_capacities(8, 100), node_capacities(1, 1)
    ([1, 2, 4], [1, 2, 4], [])
    """
    return sorted({k for h in range(1, min(hosted, cap) + 1) if (k := node_capacity(h)) < cap})


def node_capacity(hosted: int) -> int:
    """The clients dim of a node's modules when it hosts ``hosted`` of a round's slots: the next
    power of two, so a node compiles few shapes."""
    return cohort_capacity(hosted)


NODE_TAIL = 1e-3  # the fraction of rounds in which a node may host more users than its steady capacity


def steady_node_capacity(node_users: int, population: int, cohort: int, sampling: str,
                         tail: float = NODE_TAIL) -> int:
    """The clients dim (`node_capacity`) of a node's modules in all but a ``tail`` fraction of
    rounds: the (1 - ``tail``) quantile of the number of the round's users a node with
    ``node_users`` of the ``population`` hosts. With ``fixed`` sampling (``cohort`` users drawn
    without replacement) that number is hypergeometric; with ``poisson`` sampling (each user
    joins with probability cohort / population) binomial.

    Shaping a node's modules for the users it hosts in the round instead (1, 2, 4 ... as the
    draw falls) made a node compile a new shape whenever the draw first reached one: on 4
    SuperNodes with 4 users each and cohort 8, 4 of a 10-round run's first 9 rounds waited on a
    node's compile (2-3 s each on 2 cores). A slot the node does not fill is absent (no data,
    weight 0) and skips local training (FedAvg's ``lax.cond``, the clients one after the other).

    >>> steady_node_capacity(4, 16, 8, "fixed"), steady_node_capacity(8, 16, 8, "fixed")
    (4, 8)
    >>> steady_node_capacity(1000, 100_000, 64, "fixed"), steady_node_capacity(1000, 100_000, 64, "poisson")
    (4, 4)
    """
    # lazy: scipy.stats (~0.3 s) only when called
    from scipy.stats import hypergeom

    if not 0 <= node_users <= population or population < 1:
        raise ValueError(f"a node's users must be in [0, {population}], got {node_users!r}")
    if sampling not in ("fixed", "poisson"):
        raise ValueError(f"sampling mode must be 'poisson' or 'fixed', got {sampling!r}")
    if node_users == 0:
        return 1
    if sampling == "poisson":  # the node's users alone, each in with q = cohort / population
        return node_capacity(poisson_capacity(node_users, node_users * min(cohort / population, 1.0), tail=tail))
    return node_capacity(max(1, int(hypergeom.isf(tail, population, node_users, min(cohort, population)))))


MAP_STRATEGY = "scan"
"""How a round on Flower runs the clients' local training (`FlowerRuntime`): one client after
the other, on any backend (vmap's loop would read the clients' data on the server)."""


class _Offline:
    """A runtime that connects to nothing (the manifest only traces the round, as the server
    traces it)."""

    map_strategy = MAP_STRATEGY

    def mesh(self, cfg: Any, shape: Any) -> None:
        return None

    def attach(self, trainer: Any) -> None:
        return None


class _Staged:
    def __init__(self, prepared: Any) -> None:
        self.prepared = prepared

    def data(self) -> Any:
        return self.prepared


class _Tracer(FederatedTrainer):
    """The server's trainer without a run: the run's base key is never needed to trace."""

    def _base_key(self) -> np.ndarray:
        return np.zeros(2, np.uint32)


def capacities(trainer: FederatedTrainer) -> list[int]:
    """Every cohort capacity the server may trace: fixed sampling's one; under Poisson sampling
    the run's capacity and each power of two up to the population (on any backend)."""
    f, population = trainer.fcfg, trainer.clients.num_users
    if f.sampling == "fixed":
        return [trainer.round_capacity(f.cohort)]
    caps = {trainer.round_capacity(k) for k in range(1, population + 1)}
    return sorted(caps | {cohort_capacity(k) for k in range(1, population + 1)})


def build_trust(cfg: Any, prepared: Any, run: Any, hosted: int | None = None,
                platforms: tuple[str, ...] = STAGE_PLATFORMS) -> NodeTrust:
    """The `NodeTrust` of a config: its client stages (the cohort's and the node-shaped ones of a
    node hosting up to ``hosted`` users, default every user; lowered for each of ``platforms``),
    resident deltas, policy and DP bound."""
    trainer = _Tracer(cfg, run, runtime=_Offline())
    trainer.prepare(_Staged(prepared))
    key = jax.random.key(0)
    split = trainer.algorithm.host_split
    state = trainer.state if split is None else trainer.state.params
    stages: set[str] = set()
    resident: set[int] = set()
    plans = {cap: round_plan(trainer, cap, state, key) for cap in capacities(trainer)}
    retraced: dict[int, Plan] = {}
    for cap, plan in plans.items():
        stages.update(*(plan_signatures(plan, platform=p) for p in platforms))
        resident |= resident_vars(plan)
        for k in node_capacities(cap, trainer.clients.num_users if hosted is None else hosted):
            if k not in plans and k not in retraced:
                retraced[k] = retrace(*_program(trainer, cap, state, key)[:2], PLACED, k)
            shaped = node_stages(plan, plans.get(k) or retraced[k])
            if shaped is not None:
                stages.update(*(plan_signatures(plan, shaped, p) for p in platforms))
    p, sa = cfg.privacy, cfg.privacy.secure_aggregation
    distributed = p.enabled and p.mechanism == "distributed"
    policy = dp = None
    if sa.enabled or distributed:
        policy = (float(sa.threshold), int(sa.colluding_clients), int(sa.min_survivors), str(sa.mode))
        dp = DPBound("distributed" if distributed else "central",
                     None if p.adaptive_clipping.enabled else float(p.clip),
                     float(trainer.plan.noise_multiplier) if distributed else None,
                     float(cfg.federated.cohort) if distributed else None)
    return NodeTrust(frozenset(stages), frozenset(resident), policy, dp, str(prepared.fingerprint))


def write_manifest(cfgs: Any, prepared: Any, run: Any, path: Path, nodes: tuple[str, ...] = (),
                   hosted: int | None = None, platforms: tuple[str, ...] = STAGE_PLATFORMS,
                   server: str = "") -> Path:
    """`build_trust` of one config, or the merge (`NodeTrust.merge`) of several on the same
    data, with the nodes' public keys (``nodes``, `memaudit.federated.flower.identity`) and the
    server's (``server``: the nodes answer only what it signed), as JSON at ``path`` (atomic).
    ``hosted``: the most users a node hosts; ``platforms``: the nodes' JAX platforms."""
    cfgs = list(cfgs) if isinstance(cfgs, list | tuple) else [cfgs]
    trust = build_trust(cfgs[0], prepared, run, hosted, platforms)
    for cfg in cfgs[1:]:
        trust = trust.merge(build_trust(cfg, prepared, run, hosted, platforms))
    trust = dataclasses.replace(trust, nodes=tuple(nodes), server=server)
    atomic_write_json(Path(path), trust.to_json())
    return Path(path)


__all__ = ["MAP_STRATEGY", "PLACED", "build_trust", "capacities", "data_struct", "node_capacities", "node_capacity",
           "node_plan", "round_plan", "write_manifest"]
