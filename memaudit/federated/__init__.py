"""Federated backend: federated primitives with federated AD, sharded clients, FedSGD/FedAvg.

Import cost: this package imports jax and optax; import it only from commands that need it.
"""

from memaudit.federated.aggregators import (
    AggregateResult,
    Aggregator,
    EmptyState,
    mean_aggregator,
    sum_aggregator,
)
from memaudit.federated.algorithms import (
    ClientOutput,
    FederatedAlgorithm,
    ServerState,
    fedavg,
    federated_loss,
    fedsgd,
    make_client_optimizer,
    make_client_phase,
    make_server_optimizer,
    make_server_update,
)
from memaudit.federated.closure import ClosureError, communication_of
from memaudit.federated.cohorts import ClientData, cohort_capacity, pack_clients, sample_cohort
from memaudit.federated.primitives import (
    PRIMITIVE_NAMES,
    federated_broadcast,
    federated_broadcast_p,
    federated_map,
    federated_map_sum,
    federated_mean,
    federated_mean_p,
    federated_sum,
    federated_sum_p,
    federated_weighted_mean,
)
from memaudit.federated.program import (
    ProgramContext,
    current_context,
    federated_program,
    program_context,
)
from memaudit.federated.sharding import MeshAxis, padded_clients

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
