"""Aggregators: how clients' model deltas become one server update, as an (init, aggregate) pair.

An `Aggregator` is optax-shaped: ``init(params) -> state`` and
``aggregate(deltas, weights, state, key) -> AggregateResult(update, state, metrics)``.
An aggregator that is a sum over the clients also says so (``fused``, a `FusedAggregation`):
each client's term, and the server's finish on the sums, so FedAvg accumulates the terms in
its loop over the clients and never stacks a delta per client.
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


class FusedAggregation(NamedTuple):
    """An aggregation as a sum over the clients, for a loop that accumulates it.

    ``client(delta, weight, state, norm) -> terms``: one client's terms (a pytree of float32
    or int arrays), given its delta, its aggregation weight (0 for an absent slot), the server's
    aggregator state and the delta's L2 norm (`client_ops.tree_norm`, which the loop computes
    once a client for its metrics, so a clipping aggregation does not read the delta again for
    it); ``finish(sums, state, key) -> AggregateResult``: the update from the
    terms summed over the cohort. ``aggregate`` on the stacked deltas gives the same values up
    to float rounding (a sequential sum instead of a pairwise one). A client of weight 0 (an
    absent slot) has zero terms: FedAvg's loop skips such a slot without computing them."""

    client: Callable[[PyTree, jax.Array, Any, jax.Array], PyTree]
    finish: Callable[[PyTree, Any, jax.Array], AggregateResult]


class Aggregator(NamedTuple):
    init: Callable[[PyTree], Any]
    aggregate: Callable[[PyTree, jax.Array, Any, jax.Array], AggregateResult]
    jittable: bool = True
    # takes a `memaudit.federated.updates.ClientUpdates` and sums the indicators of counted
    # rows under the masks (metric ``within_clip``: secure aggregation, so that no single
    # indicator is revealed); a base without it gets a plain clients-placed pytree
    counts: bool = False
    # the aggregation as a sum over the clients (None: it needs the stacked deltas)
    fused: FusedAggregation | None = None


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

    return Aggregator(init=lambda params: EmptyState(), aggregate=aggregate, fused=_fused_mean())


def _ratio(num: jax.Array, den: jax.Array) -> jax.Array:
    """``num / den``, 0 where ``den`` is 0 (federated_weighted_mean's convention)."""
    return jnp.where(den > 0, num / jnp.where(den > 0, den, jnp.ones((), den.dtype)), jnp.zeros((), num.dtype))


def _fused_mean() -> FusedAggregation:
    """The weighted mean as sums: Σ w_i d_i (float32), Σ w_i and the count of w_i > 0."""

    def client(delta, weight, state, norm):
        del state, norm
        scaled = jax.tree.map(lambda d: d.astype(jnp.promote_types(d.dtype, jnp.float32)) * weight, delta)
        return {"delta": scaled, "weight": weight, "aggregated": (weight > 0).astype(jnp.int32)}

    def finish(sums, state, key):
        del key
        update = jax.tree.map(lambda s: _ratio(s, sums["weight"]), sums["delta"])
        return AggregateResult(update, state, {"total_weight": sums["weight"],
                                               "aggregated_clients": sums["aggregated"]})

    return FusedAggregation(client, finish)


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
