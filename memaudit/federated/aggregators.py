"""Aggregators: how clients' model deltas become one server update, as an (init, aggregate) pair.

An `Aggregator` is optax-shaped: ``init(params) -> state`` and
``aggregate(deltas, weights, state, key) -> AggregateResult(update, state, metrics)``.
``deltas`` is a clients-placed pytree (leading clients dim n), ``weights`` a (n,) float array
that is 0 for padded or absent clients. Wrappers (DP-FedAvg, secure aggregation) take a base
aggregator and return the same type; ``jittable=False`` marks one that must run on the host
between the jitted client phase and the jitted server update.

References:
    McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from Decentralized
    Data" (example-weighted FedAvg).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from memaudit.federated.primitives import federated_map, federated_sum, federated_weighted_mean
from memaudit.federated.program import federated_program

PyTree = Any


class AggregateResult(NamedTuple):
    update: PyTree  # server-placed, like the params
    state: Any
    metrics: dict[str, jax.Array | float]


class Aggregator(NamedTuple):
    init: Callable[[PyTree], Any]
    aggregate: Callable[[PyTree, jax.Array, Any, jax.Array], AggregateResult]
    jittable: bool = True
    # takes a `memaudit.federated.updates.ClientUpdates` and sums the indicators of counted
    # rows under the masks (metric ``within_clip``: secure aggregation, so that no single
    # indicator is revealed); a base without it gets a plain clients-placed pytree
    counts: bool = False


class EmptyState(NamedTuple):
    """State of a stateless aggregator."""


def _n_of(weights: jax.Array) -> int:
    if jnp.ndim(weights) != 1:
        raise ValueError(f"weights must have shape (clients,), got {jnp.shape(weights)}")
    return int(jnp.shape(weights)[0])


def _base_metrics(weights: jax.Array) -> dict[str, jax.Array]:
    return {
        "total_weight": jnp.sum(weights),
        "aggregated_clients": jnp.sum(weights > 0).astype(jnp.int32),
    }


def mean_aggregator(mesh: Any = None) -> Aggregator:
    """Weighted mean of the deltas: sum_i w_i d_i / sum_i w_i (0 when all weights are 0).

    With weights = examples per client this is FedAvg's example-weighted mean; with 0/1
    weights the uniform mean over present clients.

    >>> agg = mean_aggregator()
    >>> res = agg.aggregate(jnp.array([[1.0], [3.0]]), jnp.array([1.0, 3.0]), agg.init(None), None)
    >>> float(res.update[0])
    2.5
    """

    def aggregate(deltas, weights, state, key):
        del key
        program = federated_program(
            lambda d, w: federated_weighted_mean(d, w),
            clients=_n_of(weights), mesh=mesh, placed=(0, 1), placed_out=False,
        )
        return AggregateResult(program(deltas, weights), state, _base_metrics(weights))

    return Aggregator(init=lambda params: EmptyState(), aggregate=aggregate)


def sum_aggregator(mesh: Any = None) -> Aggregator:
    """Weighted sum of the deltas: sum_i w_i d_i (with 0/1 weights, the sum over present
    clients; the base a DP wrapper divides by the expected cohort size)."""

    def body(deltas, weights):
        scaled = jax.tree.map(
            lambda d: federated_map(lambda di, wi: di * wi.astype(di.dtype), d, weights), deltas
        )
        return federated_sum(scaled)

    def aggregate(deltas, weights, state, key):
        del key
        program = federated_program(
            body, clients=_n_of(weights), mesh=mesh, placed=(0, 1), placed_out=False
        )
        return AggregateResult(program(deltas, weights), state, _base_metrics(weights))

    return Aggregator(init=lambda params: EmptyState(), aggregate=aggregate)
