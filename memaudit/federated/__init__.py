"""Federated backend: federated primitives with federated AD, sharded clients, FedSGD/FedAvg.

Import cost: this package imports jax; import it only from commands that need it.
"""

from memaudit.federated.primitives import (
    PRIMITIVE_NAMES,
    federated_broadcast,
    federated_broadcast_p,
    federated_map,
    federated_mean,
    federated_mean_p,
    federated_sum,
    federated_sum_p,
    federated_weighted_mean,
)
from memaudit.federated.program import ProgramContext, current_context, federated_program
from memaudit.federated.sharding import MeshAxis, padded_clients

__all__ = [
    "PRIMITIVE_NAMES",
    "MeshAxis",
    "ProgramContext",
    "current_context",
    "federated_broadcast",
    "federated_broadcast_p",
    "federated_map",
    "federated_mean",
    "federated_mean_p",
    "federated_program",
    "federated_sum",
    "federated_sum_p",
    "federated_weighted_mean",
    "padded_clients",
]
