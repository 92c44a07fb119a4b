"""The cohort's model deltas as one interface, wherever they live.

DP-FedAvg (`memaudit.federated.dp`), secure aggregation
(`memaudit.federated.secagg.aggregator`) and distributed DP (`memaudit.federated.ddp`) are
wrappers that take a :class:`ClientUpdates` and never ask where its rows are:

- :class:`LocalUpdates`: a clients-placed pytree in this process (the in-JAX runtime);
- `memaudit.federated.secagg.remote.ClientRows`: rows kept on the nodes of a runtime across
  machines (Flower), each node clipping and encoding its own users' rows.

Both answer the same operations: ``dim``, ``zeros``, ``unflatten``, ``clipped`` (optionally
with each client's indicator 1[‖Δ‖ <= C] riding along into the secure sum, Andrew et al. 2021),
and ``secure_sum`` (encode the present clients' rows with a frozen
`memaudit.federated.client_ops.Encoding` and sum them under the masks). A raw pytree becomes a
:class:`LocalUpdates` through :func:`client_updates`, the one place that looks at the kind.

References:
    Bonawitz et al., CCS 2017 (the secure sum); Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS
    2021 (the counted indicators).

>>> import jax.numpy as jnp
>>> u = client_updates(jnp.array([[3.0, 4.0], [0.3, 0.4]])).clipped(1.0)
>>> u.dim, float(u.within_count(jnp.ones(2)))
(2, 1.0)
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from memaudit.federated.client_ops import (
    Encoding,
    clip_deltas,
    encode_rows,
    flatten_clients,
    with_bits,
)
from memaudit.federated.secagg.protocol import RoundResult, run_round

PyTree = Any


class ClientUpdates(abc.ABC):
    """The deltas of a cohort (one row per cohort slot), as the aggregation wrappers see them."""

    @property
    @abc.abstractmethod
    def dim(self) -> int:
        """Parameters per client (the length of a flattened delta)."""

    @property
    @abc.abstractmethod
    def counted(self) -> bool:
        """Whether each client's clip indicator rides along into the secure sum."""

    @property
    def clip_bound(self) -> float | None:
        """The L2 norm every row is clipped to (the smallest clip asked for), None before any:
        the sensitivity a secure sum must quantise against (issue 29, Found-4)."""
        return None

    @abc.abstractmethod
    def unflatten(self, v: np.ndarray) -> PyTree:
        """A (dim,) vector as one server-placed pytree shaped like a client's delta."""

    @abc.abstractmethod
    def zeros(self) -> PyTree:
        """A zero server-placed update."""

    @abc.abstractmethod
    def clipped(self, clip: Any, *, count: bool = False) -> ClientUpdates:
        """Each client's delta scaled to global L2 norm <= ``clip``; with ``count`` each row
        also carries 1[‖Δ‖ <= clip] into :meth:`secure_sum`."""

    @abc.abstractmethod
    def secure_sum(self, encoding: Encoding, present: Sequence[int], seeds: Sequence[str], *,
                   secure: bool = True, **protocol: Any) -> RoundResult:
        """The integer sum (mod 2^32) of the present clients' encoded rows, each row from its
        slot's generator (``seeds[cid]`` for cohort slot ``present[cid]``), under one protocol
        round (`memaudit.federated.secagg.protocol.run_round`'s ``protocol`` arguments); the
        clip indicators as the last coordinate when :attr:`counted`. ``secure=False``: a plain
        sum of the rows that did not drop before the masked input, where that is possible.

        Raises:
            SecAggAbort: the round aborted (too few survivors, a refused threshold).
        """

    @abc.abstractmethod
    def tree(self) -> PyTree:
        """The deltas as a clients-placed pytree in this process (for a plain base aggregator)."""

    @abc.abstractmethod
    def within_count(self, presence: jax.Array) -> jax.Array:
        """Σ_i presence_i 1[‖Δ_i‖ <= C] of the last :meth:`clipped` (in the clear)."""


@dataclasses.dataclass(frozen=True, eq=False)
class LocalUpdates(ClientUpdates):
    """A clients-placed pytree of deltas in this process (leading dim: the cohort slots).

    ``within``: (n,) 1[‖Δ_i‖ <= C] of the last clip (None before any); ``count``: whether it
    goes into the secure sum."""

    deltas: PyTree
    within: jax.Array | None = None
    count: bool = False
    clip: Any = None  # () the clip of the last `clipped` (a tracer inside a jitted DP-FedAvg)

    @functools.cached_property
    def _flat(self) -> tuple[np.ndarray, Any]:  # memoised: the value is frozen
        return flatten_clients(self.deltas)

    @property
    def dim(self) -> int:
        return int(self._flat[0].shape[1])

    @property
    def counted(self) -> bool:
        return self.count

    @property
    def clip_bound(self) -> float | None:
        return None if self.clip is None else float(self.clip)  # read host-side, where it is concrete

    def unflatten(self, v: np.ndarray) -> PyTree:
        return self._flat[1](v)

    def zeros(self) -> PyTree:
        return jax.tree.map(lambda x: jnp.zeros_like(x[0]), self.deltas)

    def clipped(self, clip: Any, *, count: bool = False) -> LocalUpdates:
        clipped, norms = clip_deltas(self.deltas, clip)
        bound = clip if self.clip is None else jnp.minimum(self.clip, clip)
        return LocalUpdates(clipped, norms <= clip, count, bound)

    def secure_sum(self, encoding: Encoding, present: Sequence[int], seeds: Sequence[str], *,
                   secure: bool = True, **protocol: Any) -> RoundResult:
        rows = self._flat[0]
        q = encode_rows(encoding, rows if len(present) == rows.shape[0] else rows[present], seeds)
        if self.count:  # one more integer coordinate per row: its indicator
            q = with_bits(q, np.asarray(self.within)[present])
        if secure:
            return run_round(q, **protocol)
        keep = [i for i in range(len(present)) if i not in protocol["dropouts"].before_masked]
        return RoundResult(q[keep].sum(axis=0, dtype=np.uint32), frozenset(keep), 0, 0, 0)

    def tree(self) -> PyTree:
        return self.deltas

    def within_count(self, presence: jax.Array) -> jax.Array:
        return jnp.sum(presence * self.within)


def client_updates(deltas: ClientUpdates | PyTree) -> ClientUpdates:
    """``deltas`` as a :class:`ClientUpdates`: a clients-placed pytree becomes :class:`LocalUpdates`."""
    return deltas if isinstance(deltas, ClientUpdates) else LocalUpdates(deltas)


__all__ = ["ClientUpdates", "LocalUpdates", "client_updates"]
