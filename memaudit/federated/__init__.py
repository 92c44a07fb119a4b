"""Federated backend: federated primitives with federated AD, sharded clients, FedSGD/FedAvg.

Import cost: the package itself imports nothing; each name below loads its submodule (and jax and
optax) when it is first used (PEP 562), so a SuperNode's ClientApp imports
`memaudit.federated.flower.node` without JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

# the submodule that defines each name the package hands on
_SUBMODULE = {
    "aggregators": ("AggregateResult", "Aggregator", "EmptyState", "mean_aggregator", "sum_aggregator"),
    "algorithms": (
        "ClientOutput", "FederatedAlgorithm", "ServerState", "fedavg", "federated_loss", "fedsgd",
        "make_client_optimizer", "make_client_phase", "make_server_optimizer", "make_server_update",
    ),
    "closure": ("ClosureError", "communication_of"),
    "cohorts": ("ClientData", "cohort_capacity", "pack_clients", "sample_cohort"),
    "primitives": (
        "PRIMITIVE_NAMES", "federated_broadcast", "federated_broadcast_p", "federated_map",
        "federated_map_sum", "federated_mean", "federated_mean_p", "federated_sum", "federated_sum_p",
        "federated_weighted_mean",
    ),
    "program": ("ProgramContext", "current_context", "federated_program", "program_context"),
    "sharding": ("MeshAxis", "padded_clients"),
}
_WHERE = {name: sub for sub, names in _SUBMODULE.items() for name in names}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'memaudit.federated' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"memaudit.federated.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "PRIMITIVE_NAMES",
    "AggregateResult",
    "Aggregator",
    "ClientData",
    "ClientOutput",
    "ClosureError",
    "EmptyState",
    "FederatedAlgorithm",
    "MeshAxis",
    "ProgramContext",
    "ServerState",
    "cohort_capacity",
    "communication_of",
    "current_context",
    "fedavg",
    "federated_broadcast",
    "federated_broadcast_p",
    "federated_loss",
    "federated_map",
    "federated_map_sum",
    "federated_mean",
    "federated_mean_p",
    "federated_program",
    "federated_sum",
    "federated_sum_p",
    "federated_weighted_mean",
    "fedsgd",
    "make_client_optimizer",
    "make_client_phase",
    "make_server_optimizer",
    "make_server_update",
    "mean_aggregator",
    "pack_clients",
    "padded_clients",
    "program_context",
    "sample_cohort",
    "sum_aggregator",
]
