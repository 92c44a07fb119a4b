"""The federated backend behind `memaudit train CONFIG --backend federated`.

`FederatedTrainer` (run by `memaudit.run.federated.train_federated(cfg, run)`) prepares the data,
makes every training user a client (its packed
training sequences are its local data), starts from the same seeded weights as the centralized
backend (`memaudit.models.init.initial_state_dict`: a preset's seeded initialisation or the
`model.init_from` checkpoint, converted to the Flax Llama of that shape), and runs
`federated.rounds` rounds of FedAvg (local client-optimizer steps, a server optimizer on the
mean delta: FedAvg / FedAdam / SGD) or FedSGD from `memaudit.federated.algorithms`. Each round
samples a cohort (Poisson by default, or fixed size) as a pure function of (seed, round),
weights clients by their number of sequences, and shards the clients over a `clients` mesh
axis when there is more than one device. It writes metrics.jsonl (one line per round),
resumable state/ (msgpack), the privacy ledger for DP runs, and a Hugging Face checkpoint
with the tokenizer in model/.

`FederatedTrainer` is the JAX backend of the one training driver (`memaudit.run.driver.fit`: the
loop, evaluation schedule, checkpoints, ledger and result are the driver's). Where the clients'
computation runs is its runtime, by composition: `InProcess` (one JAX program, clients sharded
over the mesh) or `memaudit.federated.flower.trainer.FlowerRuntime` (client stages on Flower
SuperNodes).

Exact resume: the cohort, the local batches and the noise of round r are functions of
(seed, r) and the server state alone, so a killed-and-resumed run ends with the same weights.

References:
    McMahan et al. 2017 (FedAvg), Reddi et al. 2021 (FedAdam), McMahan et al. 2018 (DP-FedAvg),
    Rush et al. 2024 (FAX).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from memaudit.backends import Session, StepOutcome
from memaudit.config import Config
from memaudit.errors import MemauditError
from memaudit.federated import algorithms as alg
from memaudit.federated import checkpoint as fckpt
from memaudit.federated.aggregators import mean_aggregator
from memaudit.federated.cohorts import ClientData, cohort_capacity, poisson_capacity, sample_cohort
from memaudit.federated.data import build_client_data
from memaudit.federated.ddp import distributed_dp_from_config, planned_event_of_config
from memaudit.federated.distributed import barrier
from memaudit.federated.dp import dp_fedavg, dp_fedavg_mechanism
from memaudit.federated.mesh import build_mesh
from memaudit.federated.secagg.aggregator import abort_bit_epsilon, secure_aggregation_from_config
from memaudit.federated.secagg.messages import masked_bytes
from memaudit.federated.sharding import (
    MeshAxis,
    clients_axis_size,
    model_axis_size,
    server_shardings,
)
from memaudit.models.convert import hf_to_flax, to_hf_model
from memaudit.models.flax_llama import FlaxLlama, causal_lm_loss, kernel_axes, policy_fields
from memaudit.models.flax_lora import LoraModel, count, initial_lora, torch_lora_model
from memaudit.models.init import flax_config, hf_config, initial_state_dict, model_shape
from memaudit.models.lora import merged_copy, save_adapter, trained_label
from memaudit.models.precision import policy_of_config
from memaudit.privacy.aborts import WithAbortBit, with_abort_bit
from memaudit.privacy.accounting import default_delta
from memaudit.privacy.calibrate import calibration_accountant
from memaudit.privacy.mechanisms import DistributedDiscreteGaussian, calibrate
from memaudit.privacy.plan import PrivacyPlan
from memaudit.privacy.randomness import DPRandomness, dp_randomness
from memaudit.rundir import RunDir

ProgressFn = Callable[[int, int, dict[str, Any]], None]
BACKEND = "federated"


def make_loss_fn(model: Any) -> Callable:
    """`loss_fn(params, batch, rng=None) -> (per-sequence mean token loss (b,), token counts)` for
    algorithms; ``rng``: the key of a training step's adapter dropout (`LoraModel`), None without."""
    def loss_fn(params, batch, rng=None):
        ids, am = batch["input_ids"], batch["attention_mask"]
        kw = {} if rng is None else {"dropout_rng": rng}
        logits = model.apply({"params": params}, ids, am, **kw)  # (b, L, V)
        # position t predicts token t+1; the last position predicts nothing (mask 0). Over all L
        # positions, and as logsumexp - logit[target] rather than from log_softmax, the backward
        # pass has no pad of the (b, L, V) gradient and no (b, L, V) log-probabilities: about 15%
        # of a client step of the tiny preset on CPU, with the same values.
        tgt = jnp.concatenate([ids[:, 1:], jnp.zeros_like(ids[:, :1])], axis=1)  # (b, L)
        m = jnp.concatenate([am[:, 1:] > 0, jnp.zeros_like(am[:, :1], bool)], axis=1)
        m = m.astype(jnp.float32)
        picked = jnp.take_along_axis(logits, tgt[..., None], axis=-1)[..., 0]  # (b, L)
        nll = jax.nn.logsumexp(logits, axis=-1) - picked
        count = jnp.sum(m, axis=1)
        return jnp.sum(nll * m, axis=1) / jnp.maximum(count, 1.0), count

    return loss_fn


class Runtime(Protocol):
    """Where a federated round's client computation runs (composed into `FederatedTrainer`);
    ``map_strategy``: how the round's program runs the clients' local training
    (`memaudit.federated.federated_map`)."""

    map_strategy: str

    def mesh(self, cfg: Config, shape: Any) -> Any:
        """The device mesh the server's process shards clients over (None: none)."""
    def attach(self, trainer: FederatedTrainer) -> None:
        """Called once the algorithm is built (e.g. check it and connect to the nodes)."""
    def round(self, trainer: FederatedTrainer, state: Any, cohort: np.ndarray, r: int, key: Any) -> tuple[Any, dict]:
        """One round of `trainer.algorithm` on the cohort; returns (state, metrics)."""


class InProcess:
    """Every client in this JAX program, sharded over the ``clients`` mesh axis."""

    map_strategy = "auto"

    def mesh(self, cfg: Config, shape: Any) -> Any:
        return build_mesh(cfg.federated.mesh_clients, cfg.federated.mesh_model, shape)

    def attach(self, trainer: FederatedTrainer) -> None:
        """Nothing to connect: the clients' data is on this host."""

    def round(self, trainer: FederatedTrainer, state: Any, cohort: np.ndarray, r: int, key: Any) -> tuple[Any, dict]:
        return trainer.algorithm.round(state, trainer.round_data(cohort), key)


class FederatedTrainer:
    """The federated backend of the training driver (`memaudit.run.driver.Backend`); `is_writer` is
    JAX process 0 (the only one that writes files)."""

    name = BACKEND
    counter = "round"

    def __init__(self, cfg: Config, run: RunDir, *, runtime: Runtime | None = None,
                 progress: ProgressFn | None = None) -> None:
        self.cfg, self.run, self.progress = cfg, run, progress
        self.runtime: Runtime = runtime if runtime is not None else InProcess()
        self.fcfg = cfg.federated
        self.is_writer = jax.process_index() == 0
        self.private = cfg.privacy.enabled
        self.plan: PrivacyPlan | None = None
        self._dp_rand: DPRandomness | None = None
        self.frozen = 0  # parameters of a LoRA run's frozen base (not the algorithm's)

    @property
    def total(self) -> int:
        return self.fcfg.rounds

    @property
    def eval_every(self) -> int:
        return self.fcfg.eval_every

    @property
    def checkpoint_every(self) -> int:
        return self.fcfg.checkpoint_every

    # ------------------------------------------------------------------ set-up
    def running(self, session: Session, resume: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def prepare(self, session: Session) -> None:
        """Data, clients, mesh, model, the DP plan, the algorithm and its initial state."""
        self.session = session
        shape = model_shape(self.cfg.model)  # the checkpoint's with model.init_from, else the preset's
        self.vocab = shape.vocab_size
        # staged and checked (tokenizer size, population) by the lifecycle: checks.check_data
        if self.is_writer:
            self.prepared = session.data()
        self._barrier("data")
        if not self.is_writer:
            self.prepared = session.data()
        self.clients = build_client_data(self.prepared.train)
        self.mesh = self.runtime.mesh(self.cfg, shape)
        self.capacity = self._base_capacity()
        # train.dtype on this backend: bf16 compute with f32 weights on an accelerator, f32 on CPU
        self.policy = policy_of_config(self.cfg)
        self.model = FlaxLlama(flax_config(self.cfg.model, self.vocab, **policy_fields(self.policy)))
        # the same starting weights as the torch trainers (memaudit.models.init)
        if self.cfg.model.lora is None:
            self.params0 = hf_to_flax(initial_state_dict(self.cfg.model, self.vocab),
                                      scan_layers=self.policy.scan_layers)
        else:  # the algorithm's parameters are the adapters; the frozen base is the model's
            base, self.params0 = initial_lora(self.cfg.model, self.vocab)
            self.frozen = int(sum(v.numel() for v in base.values()))
            lora = self.cfg.model.lora
            self.model = LoraModel(self.model, self._to_device(hf_to_flax(base)), lora.alpha / lora.rank,
                                   dropout=lora.dropout)
        self.plan = self._privacy_plan() if self.private else None
        self.algorithm = self.build_algorithm()
        self.runtime.attach(self)
        self._eval = self._build_eval()
        self.state = self.algorithm.init(self._to_device(self.params0))
        self.key_data = self._base_key()
        self.aggregated_rounds = 0  # rounds whose update took in at least one client
        self.secagg_words: int | None = None  # words of a masked input, once a secure round ran

    def _barrier(self, name: str) -> None:
        if jax.process_count() > 1:
            barrier(f"memaudit-{name}")

    def build_aggregator(self) -> Any:
        """The aggregation stack by config: mean; secure aggregation around it; DP-FedAvg (central)
        around that, or distributed DP (discrete Gaussian over its own secure sum). None for the
        plain mean: `fedavg`'s own, which sums the deltas inside the clients' loop."""
        p = self.cfg.privacy
        base = mean_aggregator(self.mesh)
        if self.plan is not None and p.mechanism == "distributed":
            return distributed_dp_from_config(base, self.cfg, noise_multiplier=self.plan.noise_multiplier,
                                              population=self.clients.num_users)
        if p.secure_aggregation.enabled:
            base = secure_aggregation_from_config(base, self.cfg)
        if self.plan is None:
            return base if p.secure_aggregation.enabled else None
        return dp_fedavg(base, clip=p.clip, noise_multiplier=self.plan.noise_multiplier,
                         expected_cohort=float(self.fcfg.cohort), adaptive=p.adaptive_clipping)

    def _privacy_plan(self) -> PrivacyPlan:
        """User-level DP: delta, the mechanism and its (calibrated) noise multiplier z."""
        p, f = self.cfg.privacy, self.fcfg
        population = self.clients.num_users
        sampling_rate = f.cohort / population
        delta = p.delta if p.delta is not None else default_delta(population)
        central = dp_fedavg_mechanism(noise_multiplier=0.0, expected_cohort=float(f.cohort), population=population,
                                      sampling=f.sampling, adaptive=p.adaptive_clipping)
        sigma, calibration = p.noise_multiplier, None
        # whether a secure-aggregation round aborted is public and depends on the cohort: its
        # bit goes into every round's event (memaudit.privacy.aborts)
        secure = self.masked
        bit = abort_bit_epsilon(self.cfg, population) if secure else 0.0
        if sigma is None:  # bisect over the event the ledger records
            acc = "rdp" if f.sampling == "fixed" else calibration_accountant(p.accountant)
            make = lambda z: central.with_noise(z).dp_event()
            if p.mechanism == "distributed":
                make, acc = planned_event_of_config(self.cfg, self.params0, population), "rdp"
            if secure:
                make, acc = (lambda z, m=make: with_abort_bit(m(z), bit)), "rdp"
            sigma = calibrate(p.target_epsilon, make, steps=f.rounds, delta=delta, accountant=acc, unit="user")
            calibration = {"target_epsilon": p.target_epsilon, "accountant": acc, "steps": f.rounds,
                           "sampling_rate": sampling_rate, "noise_multiplier": float(sigma), "unit": "user"}
        mechanism = (DistributedDiscreteGaussian() if p.mechanism == "distributed"
                     else central.with_noise(float(sigma)))
        if secure:
            mechanism = WithAbortBit(mechanism, bit)
        return PrivacyPlan(unit="user", delta=delta, noise_multiplier=float(sigma), sampling_rate=sampling_rate,
                           mechanism=mechanism, calibration=calibration,
                           reproducible_randomness=p.reproducible_randomness)

    def privacy_plan(self) -> PrivacyPlan | None:
        return self.plan

    def build_algorithm(self) -> Any:
        f = self.fcfg
        loss_fn = make_loss_fn(self.model)
        server_opt = alg.make_server_optimizer(f.server_optimizer, self._server_lr())
        weighting = "uniform" if self.private else "examples"
        lora = self.cfg.model.lora
        loss_rng = lora is not None and lora.dropout > 0  # adapter dropout: a key per client step
        if f.algorithm == "fedsgd":  # without DP or secure aggregation (checks refuse it)
            return alg.fedsgd(loss_fn, server_optimizer=server_opt, weighting=weighting, mesh=self.mesh,
                              loss_rng=loss_rng, map_strategy=self.runtime.map_strategy)
        return alg.fedavg(
            loss_fn, client_optimizer=alg.make_client_optimizer(f.client_optimizer, f.client_lr),
            server_optimizer=server_opt, local_steps=f.local_steps, batch_size=f.local_batch_size,
            aggregator=self.build_aggregator(), weighting=weighting, mesh=self.mesh, loss_rng=loss_rng,
            map_strategy=self.runtime.map_strategy, donate=True,  # the trainer keeps only the new state
        )

    def _server_lr(self) -> float:
        # FedAvg proper applies the mean delta as is (server SGD with lr 1, McMahan et al. 2017).
        return 1.0 if self.fcfg.server_optimizer == "fedavg" else self.fcfg.server_lr

    # ------------------------------------------------------------------ rounds
    def cohort(self, r: int) -> np.ndarray:
        f = self.fcfg
        src = self._dp_randomness() if self.private else self.cfg.train.seed
        return sample_cohort(src, self.clients.num_users, f.cohort, f.sampling, round=r)

    def _dp_randomness(self) -> DPRandomness:
        """The DP run's secret randomness (`memaudit.privacy.randomness.dp_randomness`); every JAX process
        gets process 0's. Cohorts and each round's key are derived from it, never from
        train.seed."""
        if self._dp_rand is None:
            rand = dp_randomness(self.run, self.cfg, is_writer=self.is_writer)
            if jax.process_count() > 1:  # one secret per run: process 0's on every process
                sd = rand.state_dict()
                words = np.frombuffer(bytes.fromhex(sd["secret"]), dtype="<u4").copy()
                words = np.asarray(multihost_utils.broadcast_one_to_all(words), dtype="<u4")
                rand = DPRandomness.from_state_dict({**sd, "secret": words.tobytes().hex()})
            self._dp_rand = rand
        return self._dp_rand

    def round_key(self, key: Any, r: int) -> Any:
        """Round r's key: derived from the secret by the PRF under DP (one key per round),
        else folded from the seed's base key."""
        if self.private:
            return self._dp_randomness().jax_key("round", r)
        return jax.random.fold_in(key, r)

    def _base_capacity(self) -> int | None:
        """Clients dim of every round: the cohort (fixed sampling); for Poisson sampling a
        (1 - 1e-3) quantile of the cohort size where absent slots cost (nearly) nothing, else
        None (a power of two per round). Always a multiple of the clients mesh axis."""
        f, k = self.fcfg, clients_axis_size(self.mesh)
        if f.sampling == "fixed":
            return -(-f.cohort // k) * k
        # Clients train one after the other on each device (the scan strategy, a shard_map over a
        # clients mesh axis, on every backend), and a slot without data skips local training.
        # A runtime that batches its clients (vmap) computes every slot: its padding is kept small.
        if self.runtime.map_strategy == "vmap":
            return None
        return -(-poisson_capacity(self.clients.num_users, f.cohort) // k) * k

    def round_capacity(self, size: int) -> int:
        """Clients dim for a cohort of ``size``: the run's fixed capacity, so rounds reuse one
        compiled program, or else (and for a rare larger Poisson cohort) the next power of two."""
        if self.capacity is not None and size <= self.capacity:
            return self.capacity
        return cohort_capacity(max(size, 1), multiple=clients_axis_size(self.mesh))

    def round_data(self, cohort: np.ndarray) -> Any:
        """The cohort's sequences as a padded `cohorts.ClientData` placed on the mesh."""
        cap = self.round_capacity(len(cohort))
        c = self.clients
        s_max, length = c.input_ids.shape[1:]
        ids = np.zeros((cap, s_max, length), np.int32)
        am = np.zeros((cap, s_max, length), np.int32)
        mask = np.zeros((cap, s_max), np.float32)
        # Present clients first: a slot's keys are a function of its index, so the same cohort
        # trains the same way on every mesh layout (dealing clients over the device shards would
        # balance padding but change which keys each client gets).
        ids[: len(cohort)] = c.input_ids[cohort]
        am[: len(cohort)] = c.attention_mask[cohort]
        mask[: len(cohort)] = c.example_mask[cohort]
        return ClientData({"input_ids": self._place(ids), "attention_mask": self._place(am)},
                          self._place(mask))

    def _place(self, x: np.ndarray, replicated: bool = False) -> Any:
        """Host array -> device array sharded over the clients axis (a global array across hosts)."""
        if self.mesh is None:
            return jnp.asarray(x)
        spec = PartitionSpec() if replicated else PartitionSpec(MeshAxis.CLIENTS)
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, NamedSharding(self.mesh, spec), lambda idx: x[idx])

    def _replicate(self, state: Any) -> Any:
        """Keep the server state in one layout, so every round (and a resumed one) reuses one
        executable: replicated over the clients axis, the attention and MLP kernels (and their
        optimizer moments) split over a ``model`` axis."""
        if self.mesh is None:
            return state
        return jax.device_put(state, server_shardings(state, self.mesh, kernel_axes))

    def train_round(self, state: Any, r: int, key: Any) -> tuple[Any, dict[str, Any], dict[str, Any] | None]:
        """Round r: (state, metrics line, what the DP mechanism's event depends on, or None when
        the round released nothing)."""
        t0 = time.perf_counter()
        cohort = self.cohort(r)
        rec: dict[str, Any] = {"round": r + 1, "cohort": len(cohort)}
        if len(cohort) == 0 and not self.private:
            # An empty Poisson cohort sends nothing; FedAdam's momentum must not move the model.
            state = state._replace(round=state.round + 1)
            rec.update(loss=None, update_norm=0.0, tokens_per_s=0.0)
            return state, rec, None
        state, m = self.algorithm_round(state, cohort, r, self.round_key(key, r))
        state = self._replicate(state)
        jax.block_until_ready(state.params)
        dt = time.perf_counter() - t0
        tokens = self._round_tokens(cohort)
        rec.update(loss=m.pop("loss", math.nan), update_norm=m.pop("update_norm", math.nan),
                   tokens_per_s=tokens / dt if dt > 0 else 0.0, round_seconds=dt)
        # An aborted secure-aggregation round released and applied nothing but its abort bit
        # (`step` records that bit; memaudit.privacy.aborts, docs/secure-aggregation.md).
        released = None if int(m.get("secagg_aborted", 0) or 0) else dict(m)
        if released is not None and float(m.get("aggregated_clients", 1) or 0) > 0:
            self.aggregated_rounds += 1
        if "secagg_words" in m:
            self.secagg_words = int(m["secagg_words"])
        rec.update({k: v for k, v in m.items() if k not in ("cohort",)})
        return state, rec, released

    def algorithm_round(self, state: Any, cohort: np.ndarray, r: int, key: Any) -> tuple[Any, dict]:
        """One round of the algorithm on the cohort, on the trainer's runtime."""
        return self.runtime.round(self, state, cohort, r, key)

    def step(self, i: int) -> StepOutcome:
        """The driver's step: one round; under DP every round that was not aborted releases."""
        self.state, rec, released = self.train_round(self.state, i, self.key)
        if released is None and isinstance(getattr(self.plan, "mechanism", None), WithAbortBit):
            released = {"secagg_aborted": 1}  # nothing but the abort bit was released
        return StepOutcome(rec, released=self.private and released is not None, privacy_metrics=released)

    def _round_tokens(self, cohort: np.ndarray) -> int:
        """Token positions the clients processed this round (local batches x steps, or all data)."""
        f = self.fcfg
        L = self.clients.seq_len
        if f.algorithm == "fedsgd":
            return int(self.clients.num_examples[cohort].sum()) * L
        per = np.minimum(self.clients.num_examples[cohort], f.local_batch_size)
        return int(per.sum()) * f.local_steps * L

    # ------------------------------------------------------------------ evaluation
    def _build_eval(self) -> Callable:
        model = self.model

        @jax.jit
        def loss_sum(params, ids, am):
            logits = model.apply({"params": params}, ids, am)
            return causal_lm_loss(logits, ids, am)

        def evaluate(host_params) -> tuple[float, float]:
            h = self.prepared.holdout
            b = self.cfg.train.batch_size
            n = min(len(h), b * self.cfg.train.eval_batches)
            if n == 0:
                return math.nan, math.nan
            total, count = 0.0, 0.0
            for s in range(0, n, b):
                ids = np.zeros((b, h.seq_len), np.int32)
                am = np.zeros((b, h.seq_len), np.int32)
                k = min(b, n - s)
                ids[:k], am[:k] = h.input_ids[s:s + k], h.attention_mask[s:s + k]
                ls, c = loss_sum(host_params, jnp.asarray(ids), jnp.asarray(am))
                total, count = total + float(ls), count + float(c)
            if count == 0:
                return math.nan, math.nan
            loss = total / count
            return loss, math.exp(min(loss, 700.0))

        return evaluate

    def evaluate(self) -> tuple[float, float]:
        return self._eval(self.host(self.state.params))

    # ------------------------------------------------------------------ checkpoints
    def host(self, tree: Any) -> Any:
        """Server-side pytree -> numpy on this host (gathers global arrays across processes)."""

        def one(x):
            if isinstance(x, jax.Array) and not x.is_fully_addressable:
                if x.is_fully_replicated:
                    return np.asarray(x.addressable_data(0))
                return np.asarray(multihost_utils.process_allgather(x, tiled=True))
            return np.asarray(x)

        return jax.tree.map(one, tree)

    def has_checkpoint(self) -> bool:
        return fckpt.has_state(self.run)

    def save(self, session: Session, done: int, scalars: dict[str, Any], files: dict[str, Any]) -> None:
        """The server state after `done` rounds and the run's base key (msgpack + JSON)."""
        host = self.host(self.state)  # a collective across processes: every process takes part
        if not self.is_writer:
            return
        with session.checkpoint(done) as d:
            fckpt.write_state(d, host, {**scalars, "key": self.key_data.tolist(),
                                        "aggregated_rounds": self.aggregated_rounds}, files or None)

    def load(self, session: Session) -> dict[str, Any]:
        """state/ into the server state (its template: the freshly initialised one)."""
        host_state, scalars = fckpt.load_state(self.run, self.host(self.state))
        self.state = self._to_device(host_state)
        self.key_data = np.asarray(scalars["key"], dtype=np.uint32)
        # a checkpoint written before the count: its rounds are taken as having aggregated
        self.aggregated_rounds = int(scalars.get("aggregated_rounds", scalars[self.counter]))
        return scalars

    # ------------------------------------------------------------------ the driver's hooks
    def _base_key(self) -> np.ndarray:
        """Raw key data of the run's base key: train.seed, or under DP one derived from the run's
        secret (`_dp_randomness`; round keys are derived from the secret itself)."""
        if not self.private:
            return np.asarray(jax.random.key_data(jax.random.key(self.cfg.train.seed)), dtype=np.uint32)
        return self._dp_randomness().jax_key_data("federated-base", 0).astype(np.uint32)

    def _to_device(self, tree: Any) -> Any:
        return jax.tree.map(lambda x: self._place(np.asarray(x), replicated=True), tree)

    def begin(self) -> None:
        """The server state in its one layout, the base key, and every process entering the
        first round's collectives together."""
        self.state = self._replicate(self.state)
        self.key = jax.random.wrap_key_data(self.key_data)
        self._barrier("start")

    def export(self, session: Session) -> None:
        """The Hugging Face model into model/; under LoRA the merged model and adapter/, written
        by the torch side's code (`memaudit.models.lora`). A run in which no round aggregated a
        client's update (every secure-aggregation round aborted, or every client was dropped)
        fails here instead, before anything is exported: its model never moved."""
        if self.total > 0 and self.aggregated_rounds == 0:
            raise MemauditError(
                f"no round of {self.total} aggregated a client's update (each aborted or lost all its "
                "clients), so the model learned nothing from the data; check the clients and the secure-aggregation "
                "settings (privacy.secure_aggregation.dropout, min_survivors) and train again")
        params = self.host(self.state.params)
        if not self.is_writer:
            return
        tok = {"tokenizer": self.prepared.tokenizer(), "tokenizer_dir": self.prepared.tokenizer_dir}
        if self.cfg.model.lora is None:
            session.export_hf(to_hf_model(params, config=hf_config(self.cfg.model, vocab_size=self.vocab)), **tok)
            return
        wrapped = torch_lora_model(self.cfg.model, self.vocab, params)
        session.export_hf(merged_copy(wrapped), **tok)
        save_adapter(wrapped, self.run.path, base=self.cfg.model.init_from)

    def finish(self) -> None:
        self._barrier("done")  # no process leaves while the writer still exports

    def train_sequences(self) -> int:
        return len(self.prepared.train)

    def parameters(self) -> int:
        return count(self.params0) + self.frozen

    def details(self) -> dict[str, Any]:
        trained = self.parameters() if self.cfg.model.lora is None else count(self.params0)
        return {"clients": self.clients.num_users, "devices": len(jax.devices()),
                "processes": jax.process_count(), "mesh_clients": clients_axis_size(self.mesh),
                "mesh_model": model_axis_size(self.mesh), "trained": trained_label(self.cfg.model.lora),
                "trained_parameters": trained, "frozen_parameters": self.parameters() - trained,
                "upload_bytes_per_client_per_round": self.upload_bytes(trained),
                "compute_dtype": self.policy.compute_dtype, "scan_layers": self.policy.scan_layers}

    @property
    def masked(self) -> bool:
        """Whether clients send masked inputs: secure aggregation, or distributed DP over it."""
        p = self.cfg.privacy
        return p.secure_aggregation.enabled or p.mechanism == "distributed"

    def upload_bytes(self, trained: int) -> int:
        """A client's update as sent each round: one float32 per trained parameter, or under secure
        aggregation its masked input (`secagg.messages.masked_bytes`: uint32 words mod 2^32, one
        per trained parameter plus the clip indicator when one is summed). Keys, shares and the
        unmasking are the round's overhead beside it (its secagg_bytes_up metric, sensitive under
        DP: it grows with the realised cohort)."""
        if not self.masked:
            return 4 * trained
        return masked_bytes(self.secagg_words if self.secagg_words is not None else trained)
