"""FedSGD and FedAvg as federated programs, generic over ``loss_fn(params, batch)``.

``loss_fn(params, batch) -> (per_example_loss, aux)`` with ``per_example_loss`` of shape
(batch,) and ``batch`` one client's examples (leaves (batch, ...)). A cohort's data is a
`ClientData` (leaves (clients, max_examples, ...) and an example mask); clients with fewer
real examples, and absent cohort slots, are handled by the mask and by weights.

With ``loss_rng=True`` the loss also takes ``rng=`` (``loss_fn(params, batch, rng=key)``), the
key of its training randomness (LoRA's adapter dropout): each local step passes
``fold_in(step_key, DROPOUT_STREAM)``, where ``step_key`` is the step's key that also draws its
batch, split from the client slot's key, itself split from the round key. The keys are thus a
function of (seed, round, client slot, local step), so a run repeats and resumes bit for bit,
and the batches drawn are those of the same run without ``loss_rng``. A runtime across
processes needs nothing new: the key is computed inside the client's work from the per-client
key it already receives.

A FedAvg round has three phases, so a host-side aggregator (secure aggregation) fits between:

1. ``client_phase`` (`make_client_phase`, a federated program): broadcast the server params,
   ``local_steps`` client-optimizer steps on each client's own data, return clients-placed
   model deltas, aggregation weights (examples per client, or 1 per present client), metrics;
2. ``aggregator.aggregate``: the server update (mean delta);
3. ``server_update`` (`make_server_update`): the server optimizer takes ``-update`` as
   pseudo-gradient (FedAvg: SGD with lr 1; FedAdam: Adam, Reddi et al. 2021).

With a jittable aggregator `fedavg` compiles the three phases as one program; with
``jittable=False`` (secure aggregation) phases 1 and 3 are jitted and phase 2 runs on the host.
With an aggregator that is a sum over the clients (the weighted mean, DP-FedAvg over it) phases 1
and 2 are one federated program, `make_client_sum_phase`, which sums the (clipped, weighted)
deltas inside the loop over the clients.

FedSGD is ``jax.grad`` of the federated (weighted) mean loss, followed by a server step; its
gradient's jaxpr communicates only through the federated primitives (federated AD).

References:
    McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from Decentralized
    Data" (FedSGD, FedAvg). Reddi et al. 2021, "Adaptive Federated Optimization" (FedAdam).
    Rush et al. 2024, "FAX: Scalable and Differentiable Federated Primitives in JAX".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from memaudit.federated.aggregators import (
    AggregateResult,
    Aggregator,
    EmptyState,
    FusedAggregation,
    mean_aggregator,
)
from memaudit.federated.client_ops import tree_norm
from memaudit.federated.cohorts import ClientData
from memaudit.federated.primitives import (
    federated_broadcast,
    federated_map,
    federated_map_sum,
    federated_sum,
    federated_weighted_mean,
)
from memaudit.federated.program import federated_program

PyTree = Any
LossFn = Callable[[PyTree, PyTree], tuple[jax.Array, Any]]
Weighting = Literal["examples", "uniform"]


class ServerState(NamedTuple):
    params: PyTree
    opt_state: Any
    agg_state: Any
    round: jax.Array  # int32 scalar


class ClientOutput(NamedTuple):
    deltas: PyTree  # clients-placed: leaves (clients, *param.shape)
    weights: jax.Array  # (clients,), 0 for absent clients
    metrics: dict[str, jax.Array]


class HostSplit(NamedTuple):
    """A round whose aggregator runs on the host, as its two halves: ``client_phase(params,
    data, client_key) -> ClientOutput`` (a federated program) and ``finish(state, out,
    agg_key) -> (state, metrics)``; the round key splits as ``jax.random.split(key)`` into
    (client_key, agg_key)."""

    client_phase: Callable
    finish: Callable


class FederatedAlgorithm(NamedTuple):
    """A federated algorithm as pure functions, in the style of ``optax.GradientTransformation``.

    - ``init(params) -> ServerState``;
    - ``round(state, data, key) -> (state, metrics)``: one round, metrics as host floats;
    - ``program``: the round as one traceable, jitted program, ``(state, data, key) -> (state,
      tuple of metric dicts)``, what a runtime across processes partitions
      (`memaudit.federated.flower.partition`); None with a host aggregator;
    - ``jitted``: the jitted round that ``round`` calls, ``program``'s signature; ``program``
      itself, or its twin that donates the state passed in (``fedavg(donate=True)``); None with
      a host aggregator;
    - ``host_split``: with a host aggregator (secure aggregation, distributed DP), the round's
      traceable client phase and the host steps after it (`HostSplit`); else None.

    Exactly one of ``program`` and ``host_split`` is set.
    """

    init: Callable[[PyTree], ServerState]
    round: Callable[[ServerState, ClientData, jax.Array], tuple[ServerState, dict[str, float]]]
    program: Callable | None = None
    jitted: Callable | None = None
    host_split: HostSplit | None = None


def make_client_optimizer(name: str, lr: float) -> optax.GradientTransformation:
    """Client optimizer by config name: ``"sgd"`` or ``"adam"``."""
    if name == "sgd":
        return optax.sgd(lr)
    if name == "adam":
        return optax.adam(lr)
    raise ValueError(f"client optimizer must be 'sgd' or 'adam', got {name!r}")


def make_server_optimizer(name: str, lr: float) -> optax.GradientTransformation:
    """Server optimizer by config name: ``"fedavg"``/``"sgd"`` (SGD; FedAvg proper is lr 1)
    or ``"fedadam"`` (Adam with beta2 0.99 and adaptivity eps 1e-3, Reddi et al. 2021)."""
    if name in ("fedavg", "sgd"):
        return optax.sgd(lr)
    if name == "fedadam":
        return optax.adam(lr, b1=0.9, b2=0.99, eps=1e-3)
    raise ValueError(f"server optimizer must be 'fedavg', 'fedadam' or 'sgd', got {name!r}")


DROPOUT_STREAM = 1  # folded into a local step's key: its loss's key (the step key draws the batch)


def masked_mean_loss(loss_fn: LossFn, params: PyTree, batch: PyTree, mask: jax.Array, **kw: Any):
    """Mean per-example loss over the real examples of one batch (0 when there are none);
    ``kw`` (``rng=``) goes to ``loss_fn``."""
    per_example, _ = loss_fn(params, batch, **kw)  # (batch,)
    mask = mask.astype(per_example.dtype)
    return jnp.sum(per_example * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def sample_local_batch(key, examples: PyTree, mask: jax.Array, batch_size: int):
    """A batch of ``min(batch_size, max_examples)`` distinct real examples of one client.

    Real examples are drawn without replacement; when the client has fewer real examples than
    the batch, all of them are taken and the rest of the batch is masked out.
    """
    size = min(batch_size, mask.shape[0])
    scores = jnp.where(mask > 0, jax.random.uniform(key, mask.shape), 2.0)
    idx = jnp.argsort(scores)[:size]  # real examples first, in random order
    return jax.tree.map(lambda x: x[idx], examples), mask[idx]


def _weights(num_examples: jax.Array, weighting: Weighting) -> jax.Array:
    if weighting == "examples":
        return num_examples
    if weighting == "uniform":
        return (num_examples > 0).astype(num_examples.dtype)
    raise ValueError(f"weighting must be 'examples' or 'uniform', got {weighting!r}")


def _unless_absent(mask: jax.Array, fn: Callable[[], Any]) -> Any:
    """``fn()`` for a client with real examples; zeros of its shape for an absent cohort slot
    (capacity padding, weight 0), without running ``fn``. Run one client at a time (the scan
    strategy) an absent slot costs nothing; batched (vmap) the cond becomes a select and both
    branches run."""
    def absent():
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn))

    return jax.lax.cond(jnp.sum(mask) > 0, fn, absent)


def _present(params, agg_state, examples, mask, key) -> jax.Array:
    """Whether a cohort slot has real examples (an absent slot adds nothing to a round's sums:
    its weight, and so every aggregation term, is 0; see `FusedAggregation`)."""
    del params, agg_state, examples, key
    return jnp.sum(mask) > 0


def _loss_kw(key, loss_rng: bool) -> dict[str, Any]:
    """``loss_fn``'s keyword arguments at a step keyed ``key``: its own ``rng`` when it takes one."""
    return {"rng": jax.random.fold_in(key, DROPOUT_STREAM)} if loss_rng else {}


def _client_keys(key, n: int) -> jax.Array:
    key = jax.random.key_data(key) if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    return jax.random.split(key, n)  # (n, 2) uint32: padding-friendly raw keys


def _make_local_training(loss_fn: LossFn, client_optimizer: optax.GradientTransformation,
                         local_steps: int, batch_size: int, loss_rng: bool = False,
                         peel: bool = True) -> Callable:
    """One present client's FedAvg work: ``(params, examples, mask, key) -> (delta, mean loss,
    delta norm)``. ``loss_rng``: each step's loss gets its own key (see the module docstring).

    The first and the last local step stand outside any loop (the steps between them, if any,
    are a ``lax.scan``): the first reads the server's params themselves, where a loop's carry
    would start from a copy of them, and the last one's update is an expression that XLA fuses
    with the delta, its norm and whatever the caller computes from it (its weighted addition
    to the round's sum, `federated_map_sum`), so that no client writes out its final params
    and its delta and reads them back. The arithmetic is the loop's, step for step: ``peel=False``
    runs every step in the one scan (the step's code compiled once rather than twice), with
    the same values."""
    if not isinstance(local_steps, int) or local_steps < 1:
        raise ValueError(f"local_steps must be >= 1, got {local_steps!r}; set federated.local_steps")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")

    def train(params, examples, mask, key):
        def step(carry, k):
            p, opt_state = carry
            batch, bmask = sample_local_batch(k, examples, mask, batch_size)
            loss, grads = jax.value_and_grad(masked_mean_loss, argnums=1)(loss_fn, p, batch, bmask,
                                                                           **_loss_kw(k, loss_rng))
            updates, opt_state = client_optimizer.update(grads, opt_state, p)
            return (optax.apply_updates(p, updates), opt_state), loss

        keys = jax.random.split(key, local_steps)
        if not peel:
            (local, _), losses = jax.lax.scan(step, (params, client_optimizer.init(params)), keys)
            delta = jax.tree.map(lambda a, b: (a - b).astype(b.dtype), local, params)
            return delta, jnp.mean(losses), tree_norm(delta)
        carry, first = step((params, client_optimizer.init(params)), keys[0])
        losses = [first[None]]
        if local_steps > 2:
            carry, middle = jax.lax.scan(step, carry, keys[1:-1])
            losses.append(middle)
        if local_steps > 1:
            carry, last = step(carry, keys[-1])
            losses.append(last[None])
        local = carry[0]
        delta = jax.tree.map(lambda a, b: (a - b).astype(b.dtype), local, params)
        return delta, jnp.mean(jnp.concatenate(losses)), tree_norm(delta)

    return train


def _make_client_update(loss_fn: LossFn, client_optimizer: optax.GradientTransformation,
                        local_steps: int, batch_size: int, loss_rng: bool = False,
                        peel: bool = True) -> Callable:
    """One client's FedAvg work: ``(params, examples, mask, key) -> (delta, mean loss, delta
    norm)``; an absent cohort slot gets zeros without local training (`_unless_absent`).
    ``loss_rng``: each step's loss gets its own key (see the module docstring)."""
    train = _make_local_training(loss_fn, client_optimizer, local_steps, batch_size, loss_rng, peel)

    def client_update(params, examples, mask, key):
        return _unless_absent(mask, lambda: train(params, examples, mask, key))

    return client_update


def make_client_phase(
    loss_fn: LossFn,
    client_optimizer: optax.GradientTransformation,
    *,
    local_steps: int,
    batch_size: int,
    weighting: Weighting = "examples",
    mesh: Any = None,
    map_strategy: str = "auto",
    loss_rng: bool = False,
    clients_per_step: int = 1,
    peel_local_steps: bool = True,
) -> Callable[[PyTree, ClientData, jax.Array], ClientOutput]:
    """FedAvg phase 1 (not jitted; `fedavg` jits it): ``(params, data, key) -> ClientOutput``.

    ``map_strategy`` runs the clients' local training batched (``"vmap"``), one client after
    the other inside the program (``"scan"``), or picks by backend (``"auto"``); see
    `memaudit.federated.federated_map`. A cohort slot without real examples (capacity padding)
    returns a zero delta, loss and norm; under ``"scan"`` it skips local training entirely.
    ``loss_rng``: each local step's loss gets its own key (see the module docstring);
    ``clients_per_step``: clients per step of the scan strategy's loop (`federated_program`);
    ``peel_local_steps``: the first and last local steps outside the steps' scan
    (`_make_local_training`)."""
    client_update = _make_client_update(loss_fn, client_optimizer, local_steps, batch_size, loss_rng,
                                        peel_local_steps)

    def client_phase(params, data: ClientData, key) -> ClientOutput:
        n = data.mask.shape[0]

        @federated_program(clients=n, mesh=mesh, placed=(1, 2), placed_out=(0, 1),
                           map_strategy=map_strategy, clients_per_step=clients_per_step)
        def program(params, data, keys):
            deltas, losses, norms = federated_map(
                client_update, federated_broadcast(params), data.examples, data.mask, keys
            )
            num = federated_map(jnp.sum, data.mask)  # (clients,) real examples
            present = (num > 0).astype(jnp.float32)
            metrics = {
                "loss": federated_weighted_mean(losses, present),
                "delta_norm": federated_weighted_mean(norms, present),
                "cohort": federated_sum(present),
                "examples": federated_sum(num),
            }
            return deltas, _weights(num, weighting), metrics

        return ClientOutput(*program(params, data, _client_keys(key, n)))

    return client_phase


def make_client_sum_phase(
    loss_fn: LossFn,
    client_optimizer: optax.GradientTransformation,
    *,
    aggregation: FusedAggregation,
    local_steps: int,
    batch_size: int,
    weighting: Weighting = "examples",
    mesh: Any = None,
    map_strategy: str = "auto",
    loss_rng: bool = False,
    clients_per_step: int = 1,
    peel_local_steps: bool = True,
) -> Callable[..., tuple[AggregateResult, dict[str, jax.Array]]]:
    """FedAvg phases 1 and 2 with an aggregator that is a sum over the clients (its
    `FusedAggregation`: the weighted mean, DP-FedAvg's clip-and-sum), as one federated program:
    ``(params, agg_state, data, client_key, agg_key) -> (AggregateResult, client metrics)``.

    Every quantity of the round is a sum over the clients (each client's aggregation terms,
    the metrics' numerators and counts), taken with `federated_map_sum`: run one client after
    the other, the sums accumulate in the loop's carry and the round never holds a delta per
    client (nor, under DP, a clipped one). The aggregator's state (DP-FedAvg's clip) reaches the
    clients by `federated_broadcast`. The values are those of `make_client_phase` followed by
    the aggregator's ``aggregate``, up to float rounding. With ``clients_per_step`` k > 1 each
    step of the loop runs k clients vmapped (their k deltas, clipped under DP, added to the
    carry): a (k, *model) buffer per step.

    One client a step, a client's training and its addition to the sums are one branch taken
    only for a present slot (`federated_map_sum`'s ``when``), and its first and last local steps
    stand outside the steps' loop (``peel_local_steps``, `_make_local_training`): XLA then fuses
    the last update, the delta and its weighted addition to the sum, and no f32 copy of the
    server params seeds the steps' loop.
    """
    train = _make_local_training(loss_fn, client_optimizer, local_steps, batch_size, loss_rng,
                                 peel_local_steps)

    def sums(params, agg_state, examples, mask, key):  # one present client's term of every sum
        delta, loss, norm = train(params, examples, mask, key)
        num = jnp.sum(mask)
        present = (num > 0).astype(jnp.float32)
        return {"agg": aggregation.client(delta, _weights(num, weighting), agg_state, norm),
                "loss": loss * present, "norm": norm * present, "cohort": present, "examples": num}

    def phase(params, agg_state, data: ClientData, client_key, agg_key):
        n = data.mask.shape[0]

        @federated_program(clients=n, mesh=mesh, placed=(2, 3), placed_out=False,
                           map_strategy=map_strategy, clients_per_step=clients_per_step)
        def program(params, agg_state, data, keys):
            return federated_map_sum(sums, federated_broadcast(params), federated_broadcast(agg_state),
                                     data.examples, data.mask, keys, when=_present)

        t = program(params, agg_state, data, _client_keys(client_key, n))
        agg = aggregation.finish(t["agg"], agg_state, agg_key)
        agg = agg._replace(update=jax.tree.map(lambda u, p: u.astype(p.dtype), agg.update, params))
        metrics = {"loss": _ratio(t["loss"], t["cohort"]), "delta_norm": _ratio(t["norm"], t["cohort"]),
                   "cohort": t["cohort"], "examples": t["examples"]}
        return agg, metrics

    return phase


def make_client_mean_phase(loss_fn: LossFn, client_optimizer: optax.GradientTransformation, *,
                           mesh: Any = None, **options: Any):
    """`make_client_sum_phase` with the weighted mean (``mean_aggregator``'s fused form):
    ``(params, data, key) -> (AggregateResult, client metrics)``; the update's ``state`` is the
    aggregator's empty state."""
    phase = make_client_sum_phase(loss_fn, client_optimizer, aggregation=mean_aggregator(mesh).fused,
                                  mesh=mesh, **options)
    return lambda params, data, key: phase(params, EmptyState(), data, key, key)


def _ratio(num, den):  # federated_weighted_mean's convention: 0 when the weights sum to 0
    return jnp.where(den > 0, num / jnp.where(den > 0, den, jnp.ones((), den.dtype)), jnp.zeros((), num.dtype))


def make_server_update(server_optimizer: optax.GradientTransformation):
    """FedAvg phase 3: ``(state, AggregateResult) -> (state, metrics)``; ``-update`` is the
    pseudo-gradient of the server optimizer."""

    def server_update(state: ServerState, agg: AggregateResult):
        pseudo_grad = jax.tree.map(jnp.negative, agg.update)
        updates, opt_state = server_optimizer.update(pseudo_grad, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new = ServerState(params, opt_state, agg.state, state.round + 1)
        return new, {"update_norm": optax.tree.norm(agg.update)}

    return server_update


def _aborted(metrics: dict) -> bool:
    """Whether a host-side aggregator (secure aggregation) aborted the round."""
    return float(metrics.get("secagg_aborted", 0)) > 0


def _mesh_scope(mesh: Any):
    return jax.set_mesh(mesh) if isinstance(mesh, jax.sharding.Mesh) else contextlib.nullcontext()


def host_metrics(*dicts) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in dicts:
        for k, v in jax.device_get(d).items():  # scalars -> float, arrays -> lists (JSON-ready)
            out[k] = float(v) if jnp.ndim(v) == 0 else jnp.asarray(v).tolist()
    return out


def fedavg(
    loss_fn: LossFn,
    *,
    client_optimizer: optax.GradientTransformation,
    server_optimizer: optax.GradientTransformation,
    local_steps: int,
    batch_size: int,
    aggregator: Aggregator | None = None,
    weighting: Weighting = "examples",
    mesh: Any = None,
    map_strategy: str = "auto",
    loss_rng: bool = False,
    fuse: bool = True,
    donate: bool = False,
    clients_per_step: int = 1,
    peel_local_steps: bool = True,
) -> FederatedAlgorithm:
    """Federated averaging with a client and a server optimizer (FedAvg, FedAdam, ...).

    Args:
        loss_fn: ``(params, batch) -> (per_example_loss (batch,), aux)``.
        client_optimizer: optax transformation each client runs for ``local_steps`` steps.
        server_optimizer: applied to ``-mean_delta`` (``optax.sgd(1.0)``: FedAvg).
        local_steps: client steps per round (>= 1).
        batch_size: local batch size; clients with fewer examples use all they have.
        aggregator: turns deltas into the update. Default (None): the weighted mean
            (``mean_aggregator(mesh)``). An aggregator that is a sum over the clients (its
            ``fused``: the mean, DP-FedAvg over it) is fused with the clients' loop
            (`make_client_sum_phase`); others (secure aggregation) get the stacked deltas.
        weighting: aggregation weights, ``"examples"`` (FedAvg) or ``"uniform"`` (user-level).
        mesh: optional mesh with a ``clients`` axis.
        map_strategy: how the clients' local training runs, ``"vmap"``, ``"scan"`` or
            ``"auto"`` (scan when a client computes a matmul; see `federated_map`).
        loss_rng: ``loss_fn`` takes ``rng=``, a key per client and local step (adapter dropout;
            see the module docstring).
        fuse: fuse a summable aggregator with the loop (False: the stacked deltas, the same
            values up to float rounding; for tests and comparisons).
        donate: the jitted round donates the state passed in (its buffers are reused for the
            new state; the caller must not read it afterwards).
        clients_per_step: under the scan strategy, clients per step of the loop over the
            cohort, vmapped within the step (memory for that many clients' training at once;
            the sum and DP clipping stay in the loop). 1: one client after the other.
        peel_local_steps: a client's first and last local steps outside the loop over its
            steps (the same values; at 125m on the CPU a client's model-sized passes beside its
            steps' own fall from 9 to 5-6, for a second copy of the step's code to compile, about
            1.5x the compile time). False: one scan over the steps.
    """
    aggregator = aggregator or mean_aggregator(mesh)
    options = {"local_steps": local_steps, "batch_size": batch_size, "weighting": weighting,
               "mesh": mesh, "map_strategy": map_strategy, "loss_rng": loss_rng,
               "clients_per_step": clients_per_step, "peel_local_steps": peel_local_steps}
    client_phase = make_client_phase(loss_fn, client_optimizer, **options)
    fusable = fuse and aggregator.jittable and aggregator.fused is not None
    sum_phase = make_client_sum_phase(loss_fn, client_optimizer, aggregation=aggregator.fused,
                                      **options) if fusable else None
    server_update = make_server_update(server_optimizer)

    def phases(state: ServerState, data: ClientData, key):
        client_key, agg_key = jax.random.split(key)
        if sum_phase is not None:
            agg, client_metrics = sum_phase(state.params, state.agg_state, data, client_key, agg_key)
        else:
            out = client_phase(state.params, data, client_key)
            agg = aggregator.aggregate(out.deltas, out.weights, state.agg_state, agg_key)
            client_metrics = out.metrics
        state, server_metrics = server_update(state, agg)
        return state, (client_metrics, agg.metrics, server_metrics)

    # A jittable aggregator: one program for the round (the deltas never leave the device
    # program). Otherwise three steps, the aggregator running on the host in between.
    program = jax.jit(phases) if aggregator.jittable else None
    # the round donates the server state: XLA updates the weights and moments in place instead
    # of holding the old and the new (a caller keeps no reference to a state it passed in)
    fused = jax.jit(phases, donate_argnums=0) if aggregator.jittable and donate else None
    fused = fused if fused is not None else program
    client_jit, server_jit = jax.jit(client_phase), jax.jit(server_update)

    def init(params) -> ServerState:
        return ServerState(
            params, server_optimizer.init(params), aggregator.init(params), jnp.zeros((), jnp.int32)
        )

    def host_steps(state: ServerState, out: ClientOutput, agg_key):
        """Phases 2 and 3 after the client phase: the host aggregator, then the server update."""
        agg = aggregator.aggregate(out.deltas, out.weights, state.agg_state, agg_key)
        if _aborted(agg.metrics):
            # An aborted secure-aggregation round releases and applies nothing: params,
            # server-optimizer moments and the aggregators' state (e.g. an adaptive clip)
            # stay; only the round counter moves on.
            state = state._replace(round=state.round + 1)
            server_metrics = {"update_norm": jnp.float32(0.0)}
        else:
            state, server_metrics = server_jit(state, agg)
        return state, host_metrics(out.metrics, agg.metrics, server_metrics)

    def round_(state: ServerState, data: ClientData, key):
        with _mesh_scope(mesh):
            if fused is not None:
                state, metrics = fused(state, data, key)
                return state, host_metrics(*metrics)
            client_key, agg_key = jax.random.split(key)
            out = client_jit(state.params, data, client_key)
            return host_steps(state, out, agg_key)

    # With a host aggregator: the traceable client phase (a runtime across processes
    # partitions it, the deltas staying with the clients) and the host steps after it.
    split = None if fused is not None else HostSplit(client_phase, host_steps)
    return FederatedAlgorithm(init, round_, program=program, jitted=fused, host_split=split)


def federated_loss(loss_fn: LossFn, *, weighting: Weighting = "examples", mesh: Any = None,
                   map_strategy: str = "auto", loss_rng: bool = False):
    """``(params, data, key=None) -> scalar``: the (example- or client-) weighted mean of the
    clients' mean losses over all their real examples, as a federated program. With
    ``loss_rng`` client slot i's loss gets ``rng=fold_in(k_i, DROPOUT_STREAM)``, k_i the i-th
    key split from ``key``; without it ``key`` is not read."""

    def client_loss(p, ex, m, *key):  # key: () or (this client's key,)
        kw = _loss_kw(key[0], True) if key else {}
        return _unless_absent(m, lambda: masked_mean_loss(loss_fn, p, ex, m, **kw))

    def loss(params, data: ClientData, key=None):
        n = data.mask.shape[0]
        if loss_rng and key is None:
            raise ValueError("this federated loss takes a key (loss_rng=True): pass key=")
        keys = (_client_keys(key, n),) if loss_rng else ()

        @federated_program(clients=n, mesh=mesh, placed=(1, 2), map_strategy=map_strategy)
        def program(params, data, keys):
            losses = federated_map(client_loss, federated_broadcast(params), data.examples,
                                   data.mask, *keys)
            num = federated_map(jnp.sum, data.mask)
            return federated_weighted_mean(losses, _weights(num, weighting))

        return program(params, data, keys)

    return loss


def fedsgd(
    loss_fn: LossFn,
    *,
    server_optimizer: optax.GradientTransformation,
    weighting: Weighting = "examples",
    mesh: Any = None,
    map_strategy: str = "auto",
    loss_rng: bool = False,
) -> FederatedAlgorithm:
    """FedSGD: ``jax.grad`` of the federated mean loss, then one server optimizer step.
    ``loss_rng``: each client's loss gets its own key from the round key (`federated_loss`)."""
    objective = federated_loss(loss_fn, weighting=weighting, mesh=mesh, map_strategy=map_strategy,
                               loss_rng=loss_rng)

    @jax.jit
    def step(state: ServerState, data: ClientData, key):
        loss, grads = jax.value_and_grad(objective)(state.params, data, key)  # key unused without loss_rng
        updates, opt_state = server_optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss,
            "cohort": jnp.sum(data.mask.sum(axis=1) > 0).astype(jnp.float32),
            "examples": jnp.sum(data.mask),
            "update_norm": optax.tree.norm(grads),
        }
        return ServerState(params, opt_state, state.agg_state, state.round + 1), metrics

    def init(params) -> ServerState:
        return ServerState(params, server_optimizer.init(params), None, jnp.zeros((), jnp.int32))

    @jax.jit
    def program(state: ServerState, data: ClientData, key):
        state, metrics = step(state, data, key)
        return state, (metrics,)

    def round_(state: ServerState, data: ClientData, key):
        with _mesh_scope(mesh):
            state, metrics = program(state, data, key)
        return state, host_metrics(*metrics)

    return FederatedAlgorithm(init, round_, program=program, jitted=program)
