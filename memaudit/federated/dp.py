"""DP-FedAvg with optional adaptive clipping, as a wrapper around a mean aggregator.

Each client's whole model delta is clipped to global L2 norm C (user-level
privacy), the clipped deltas are summed over the present clients, Gaussian noise
N(0, (z C)^2) is added to the sum, and the result is divided by the *expected*
cohort size (the fixed-denominator estimator, whose sensitivity does not depend
on how many clients showed up).

The base aggregator computes the mean of the clipped deltas over the clients
that contributed (``mean_aggregator()``, or ``secure_aggregation(mean_aggregator())``);
this wrapper turns it back into a sum with the count the base reports
(``metrics["survivors"]``, else ``metrics["aggregated_clients"]``). The deltas are a
`memaudit.federated.updates.ClientUpdates` (a clients-placed pytree is taken as
`memaudit.federated.updates.LocalUpdates`): the wrapper asks them to clip themselves and never
asks where they live (on the nodes of a runtime across machines,
`memaudit.federated.secagg.remote.ClientRows`, each node clips its own users' deltas).
Over secure aggregation (a base with ``counts``, which takes the ClientUpdates itself) the
indicators 1[‖Δ_i‖ <= C] are summed under the masks with the rows, so the count (adaptive
clipping's, and ``clip_fraction``) is over the survivors and no single indicator reaches the
server; a plain base gets the clipped pytree and the count is taken in the clear.

Adaptive clipping (Andrew et al. 2021) tracks the γ-quantile of the update norms:
C <- C exp(-η (b̃ - γ)), b̃ = (Σ_i b_i + N(0, σ_b²)) / expected cohort + 1/2 with
b_i = 1[‖Δ_i‖ <= C] - 1/2 ∈ {-1/2, +1/2}, the paper's encoding: one user moves the noised
count by 1/2, which is what the split z_Δ = (z^-2 - (2σ_b)^-2)^(-1/2) assumes, so the total
noise multiplier stays z and the ledger records one Gaussian with multiplier z per round
(``memaudit.privacy.mechanisms.SampledGaussian`` with ``count_noise``). Summing raw {0, 1}
indicators instead moves it by 1 and leaves less noise than the ledger counts.

References:
    McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private Recurrent
    Language Models", ICLR 2018.
    Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning with
    Adaptive Clipping", NeurIPS 2021.

>>> import jax, jax.numpy as jnp
>>> from memaudit.federated.aggregators import mean_aggregator
>>> agg = dp_fedavg(mean_aggregator(), clip=1.0, noise_multiplier=0.0, expected_cohort=2)
>>> res = agg.aggregate(jnp.array([[3.0, 4.0], [0.3, 0.4]]), jnp.ones(2), agg.init(None), jax.random.key(0))
>>> [round(float(v), 3) for v in res.update]
[0.45, 0.6]
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from memaudit.config import AdaptiveClipConfig
from memaudit.federated.aggregators import (
    AggregateResult,
    Aggregator,
    FusedAggregation,
    mean_aggregator,
)
from memaudit.federated.client_ops import clip_deltas, global_norms
from memaudit.federated.updates import client_updates
from memaudit.privacy.federated import dpfedavg_mechanism
from memaudit.privacy.mechanisms import adaptive_noise_split, effective_noise_multiplier

PyTree = Any


class DPFedAvgState(NamedTuple):
    base: Any
    clip: jax.Array  # () float32, the clip norm for the next round


def adaptive_count_noise(adaptive: AdaptiveClipConfig | None, expected_cohort: float) -> float | None:
    """σ_b of adaptive clipping's noisy count (default expected cohort / 20); None when off."""
    if adaptive is None or not adaptive.enabled:
        return None
    return float(adaptive.count_noise if adaptive.count_noise is not None else expected_cohort / 20)


def dp_fedavg_mechanism(*, noise_multiplier: float, expected_cohort: float, population: int,
                        sampling: str = "poisson", adaptive: AdaptiveClipConfig | None = None):
    """What :func:`dp_fedavg` with these settings adds, as a privacy mechanism.

    ``mechanism.dp_event()`` is one round's event for the ledger (and for calibration);
    ``mechanism.declaration()`` its unit, adjacency and sensitivity.
    """
    return dpfedavg_mechanism(cohort=expected_cohort, population=population, noise_multiplier=noise_multiplier,
                              sampling=sampling, count_noise=adaptive_count_noise(adaptive, expected_cohort))


def contributors(metrics: dict, presence: jax.Array) -> jax.Array:
    """How many clients the base aggregated (survivors of secure aggregation if reported)."""
    for k in ("survivors", "aggregated_clients"):
        if k in metrics:
            return jnp.asarray(metrics[k], jnp.float32)
    return jnp.sum(presence)


def dp_fedavg(base: Aggregator | None = None, *, clip: float, noise_multiplier: float,
              expected_cohort: float, adaptive: AdaptiveClipConfig | None = None) -> Aggregator:
    """DP-FedAvg around ``base`` (a mean over contributing clients; default ``mean_aggregator()``).

    Args:
        base: the aggregator computing the mean of the clipped deltas.
        clip: L2 clip norm C (``inf``: no clipping); with adaptive clipping enabled the
            initial norm is ``adaptive.initial_clip`` instead.
        noise_multiplier: total noise multiplier z (noise std z*C on the sum).
        expected_cohort: the fixed denominator (expected cohort size under Poisson sampling).
        adaptive: adaptive clipping settings; used when given and ``enabled``.

    Returns:
        An :class:`Aggregator`; metrics: ``clip``, ``clip_fraction`` (present clients whose
        delta was clipped), ``noise_std`` (std of the noise on the averaged update),
        ``effective_noise`` (total z), ``survivors``, ``cohort`` and, when adaptive,
        ``next_clip`` and ``unclipped_fraction`` (the noised b̃).
    """
    base = mean_aggregator() if base is None else base
    if not expected_cohort > 0:
        raise ValueError(f"expected_cohort must be > 0, got {expected_cohort}; use the cohort size")
    if not noise_multiplier >= 0:
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
    use_adaptive = adaptive is not None and adaptive.enabled
    if use_adaptive:
        sigma_b = adaptive_count_noise(adaptive, expected_cohort)
        z_delta = adaptive_noise_split(noise_multiplier, sigma_b)
        clip0 = adaptive.initial_clip
    else:
        sigma_b, z_delta, clip0 = 0.0, float(noise_multiplier), float(clip)
        if not clip0 > 0:
            raise ValueError(f"clip must be > 0 (or inf), got {clip}")
    z_total = float(noise_multiplier)

    def init(params):
        return DPFedAvgState(base.init(params), jnp.asarray(clip0, jnp.float32))

    def release(res: AggregateResult, state: DPFedAvgState, cohort: jax.Array, unclipped: jax.Array | None,
                k_noise: jax.Array, k_count: jax.Array) -> AggregateResult:
        """The base's mean of the clipped deltas back to a sum (x contributors), noised and divided
        by the expected cohort; metrics and the next clip. ``cohort``: the present clients;
        ``unclipped``: how many were within the clip (None: a secure base's masked count)."""
        m = contributors(res.metrics, cohort[None])
        c = state.clip
        leaves, tdef = jax.tree.flatten(res.update)
        keys = jax.random.split(k_noise, len(leaves))
        std = z_delta * c if z_delta > 0 else jnp.float32(0.0)  # avoids 0 * inf with clip = inf
        noisy = [(x * m + std * jax.random.normal(k, x.shape, jnp.float32).astype(x.dtype)) / expected_cohort
                 for x, k in zip(leaves, keys, strict=True)]
        update = jax.tree.unflatten(tdef, noisy)
        if unclipped is None:  # a secure sum: the survivors' indicators, summed under the masks
            counted = m
            unclipped = jnp.asarray(res.metrics.get("within_clip", 0.0), jnp.float32)
        else:
            counted = cohort
        metrics = dict(res.metrics)
        metrics.pop("within_clip", None)  # the un-noised count: only as clip_fraction (sensitive)
        metrics.update(clip=c, clip_fraction=(counted - unclipped) / jnp.maximum(counted, 1.0),
                       noise_std=std / expected_cohort, effective_noise=jnp.float32(z_total),
                       survivors=m, cohort=cohort)
        new_clip = c
        if use_adaptive:
            half = unclipped - 0.5 * counted  # Σ_i (1[unclipped] - 1/2): sensitivity 1/2 per user
            b = (half + sigma_b * jax.random.normal(k_count, (), jnp.float32)) / expected_cohort + 0.5
            new_clip = c * jnp.exp(-adaptive.lr * (b - adaptive.target_quantile))
            metrics.update(next_clip=new_clip, unclipped_fraction=b)
        return AggregateResult(update, DPFedAvgState(res.state, new_clip), metrics)

    def aggregate(deltas, weights, state, key):
        k_base, k_noise, k_count = jax.random.split(key, 3)
        presence = (weights > 0).astype(jnp.float32)
        # each client clips its own delta; a secure base sums the indicators under the masks
        clipped = client_updates(deltas).clipped(state.clip, count=base.counts)
        res = base.aggregate(clipped if base.counts else clipped.tree(), presence, state.base, k_base)
        unclipped = None if base.counts else clipped.within_count(presence)
        return release(res, state, jnp.sum(presence), unclipped, k_noise, k_count)

    def fused_client(delta, weight, state, norm):
        """One client's terms: its delta clipped to the clip, as the base's terms with weight 1
        (0 when absent), and its presence and within-clip indicator; `norm` is the delta's
        (`client_ops.tree_norm`, computed once by the loop)."""
        presence = (weight > 0).astype(jnp.float32)
        factor = jnp.minimum(1.0, state.clip / jnp.maximum(norm, 1e-30))  # clip = inf -> 1
        clipped = jax.tree.map(lambda x: x * factor.astype(x.dtype), delta)
        within = (norm <= state.clip).astype(jnp.float32) * presence
        return {"base": base.fused.client(clipped, presence, state.base, norm * factor),
                "cohort": presence,
                "within": within}

    def fused_finish(sums, state, key):
        k_base, k_noise, k_count = jax.random.split(key, 3)
        res = base.fused.finish(sums["base"], state.base, k_base)
        return release(res, state, sums["cohort"], sums["within"], k_noise, k_count)

    # over a plain base that is a sum, DP-FedAvg is one too: FedAvg clips and sums in its loop
    fused = FusedAggregation(fused_client, fused_finish) if base.fused is not None and not base.counts else None

    return Aggregator(init=init, aggregate=aggregate, jittable=base.jittable, fused=fused)


__all__ = ["DPFedAvgState", "adaptive_count_noise", "adaptive_noise_split", "clip_deltas", "dp_fedavg",
           "dp_fedavg_mechanism",
           "effective_noise_multiplier", "global_norms"]
