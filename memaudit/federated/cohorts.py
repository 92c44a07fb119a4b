"""Cohort sampling and packing of the sampled clients' data into fixed-shape arrays.

A round samples a cohort from the population of training users: Poisson sampling (each user
independently with probability ``cohort / population``, the sampling DP-FedAvg's accounting
assumes) or a fixed-size sample without replacement. Sampling is a pure function of
(key, round), so a resumed run samples the same cohorts. Under DP the key is the run's
secret `DPRandomness` (a Philox generator keyed by HKDF at ("cohort", round)), so the
cohorts cannot be recomputed from ``train.seed``: amplification by sampling assumes they are
hidden from everyone but the server.

The cohort's data is packed as `ClientData`: every leaf (capacity, max_examples, ...) plus an
example mask; absent cohort slots and padded examples have mask 0 and so weight 0. The clients
dim is a fixed capacity (`poisson_capacity`: a high quantile of the Poisson cohort size), so
rounds of varying size reuse one compiled program; `cohort_capacity` rounds a rare larger
cohort up to a power of two.

References:
    McMahan et al. 2018, "Learning Differentially Private Recurrent Language Models" (Poisson
    user sampling for DP-FedAvg).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import jax
import numpy as np

from memaudit.privacy.randomness import DPRandomness

SamplingMode = Literal["poisson", "fixed"]


class ClientData(NamedTuple):
    """A cohort's data: ``examples`` leaves (clients, max_examples, ...), ``mask`` (clients,
    max_examples) float32 with 1 for a real example."""

    examples: Any
    mask: Any

    @property
    def num_examples(self) -> Any:
        """Real examples per client, shape (clients,)."""
        return self.mask.sum(axis=1)


def _seed_words(key_or_seed: Any) -> list[int]:
    if isinstance(key_or_seed, (int, np.integer)):
        if key_or_seed < 0:
            raise ValueError(f"seed must be >= 0, got {key_or_seed}")
        return [int(key_or_seed)]

    arr = key_or_seed
    if jax.dtypes.issubdtype(getattr(arr, "dtype", None), jax.dtypes.prng_key):
        arr = jax.random.key_data(arr)
    return [int(w) for w in np.asarray(arr, dtype=np.uint32).ravel()]


def sample_cohort(
    key_or_seed: Any,
    population: int,
    cohort: int,
    mode: SamplingMode = "poisson",
    round: int = 0,
) -> np.ndarray:
    """Sample the client indices of one round, sorted, deterministic in (seed, round).

    Args:
        key_or_seed: a `DPRandomness` (DP runs), an int seed or a JAX PRNG key.
        population: number of clients to sample from.
        cohort: expected cohort size (Poisson: rate cohort/population) or exact size (fixed).
        mode: ``"poisson"`` (default) or ``"fixed"``.
        round: round number; each round draws independently.

    Returns:
        int64 array of distinct client indices in [0, population), sorted.

    >>> sample_cohort(0, 10, 3, mode="fixed", round=1).shape
    (3,)
    """
    if not isinstance(population, (int, np.integer)) or population < 1:
        raise ValueError(f"population must be a positive int, got {population!r}")
    if not isinstance(cohort, (int, np.integer)) or cohort < 1:
        raise ValueError(f"cohort must be a positive int, got {cohort!r}; set federated.cohort >= 1")
    if cohort > population:
        raise ValueError(
            f"cohort {cohort} is larger than the population of {population} clients; set "
            f"federated.cohort <= {population}"
        )
    if round < 0:
        raise ValueError(f"round must be >= 0, got {round}")

    if isinstance(key_or_seed, DPRandomness):
        rng = key_or_seed.numpy_rng("cohort", int(round))
    else:
        rng = np.random.default_rng(np.random.SeedSequence([*_seed_words(key_or_seed), int(round)]))
    if mode == "poisson":
        return np.flatnonzero(rng.random(population) < cohort / population).astype(np.int64)
    if mode == "fixed":
        return np.sort(rng.choice(population, size=cohort, replace=False)).astype(np.int64)
    raise ValueError(f"sampling mode must be 'poisson' or 'fixed', got {mode!r}")


def cohort_capacity(size: int, multiple: int = 1) -> int:
    """Clients dim to compile for: the next power of two >= size, rounded up to ``multiple``.

    >>> cohort_capacity(5), cohort_capacity(5, multiple=4), cohort_capacity(0)
    (8, 8, 1)
    """
    cap = 1 << max(0, int(size) - 1).bit_length()
    return -(-cap // multiple) * multiple


def poisson_capacity(population: int, expected: float, *, multiple: int = 1,
                     tail: float = 1e-3) -> int:
    """Clients dim that holds a Poisson cohort in all but a ``tail`` fraction of rounds.

    Each of ``population`` users joins a round with probability q = expected / population, so
    the cohort size is Binomial(population, q); this returns its (1 - tail) quantile rounded
    up to ``multiple``. One fixed capacity lets every round reuse one compiled program (a
    power of two per round size compiled 3 programs in a 30-round run with cohort 8, and ran
    cohorts of 9-16 with 16 slots). Absent slots are cheap where clients train one after the
    other: FedAvg's local training skips a client without data.

    >>> poisson_capacity(56, 8), poisson_capacity(56, 8, multiple=4)
    (17, 20)
    """
    # lazy: scipy.stats (~0.3 s) only when called; this module imports without it
    from scipy.stats import binom

    if not isinstance(population, (int, np.integer)) or population < 1:
        raise ValueError(f"population must be a positive int, got {population!r}")
    if not 0 < expected <= population:
        raise ValueError(f"expected cohort must be in (0, {population}], got {expected!r}")
    if not 0 < tail < 1:
        raise ValueError(f"tail must be in (0, 1), got {tail!r}")
    size = max(1, int(binom.isf(tail, int(population), expected / population)))
    return -(-size // multiple) * multiple


def pack_clients(
    per_client: Sequence[Any], *, capacity: int | None = None, max_examples: int | None = None
) -> ClientData:
    """Stack clients' example pytrees (leaves (k_i, ...)) into a padded `ClientData`.

    Args:
        per_client: one pytree per present client; leaves share trailing shapes.
        capacity: clients dim (>= len(per_client)); extra slots are absent (mask 0).
        max_examples: examples dim (>= every k_i); defaults to max k_i (at least 1).
    """
    if not per_client:
        raise ValueError("pack_clients needs at least one client; sample a non-empty cohort")
    counts = [int(np.shape(jax.tree.leaves(c)[0])[0]) for c in per_client]
    capacity = len(per_client) if capacity is None else capacity
    max_examples = max(max(counts), 1) if max_examples is None else max_examples
    if capacity < len(per_client):
        raise ValueError(f"capacity {capacity} < cohort of {len(per_client)} clients")
    if max(counts) > max_examples:
        raise ValueError(f"a client has {max(counts)} examples > max_examples={max_examples}")

    def stack(*leaves):
        first = np.asarray(leaves[0])
        out = np.zeros((capacity, max_examples) + first.shape[1:], first.dtype)
        for i, leaf in enumerate(leaves):
            out[i, : len(leaf)] = leaf
        return out

    examples = jax.tree.map(stack, *per_client)
    mask = np.zeros((capacity, max_examples), np.float32)
    for i, k in enumerate(counts):
        mask[i, :k] = 1.0
    return ClientData(examples, mask)
