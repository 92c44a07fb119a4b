"""The federated trainer behind `memaudit train CONFIG --backend federated`.

`train_federated(cfg, run)` prepares the data, makes every training user a client (its packed
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

Exact resume: the cohort, the local batches and the noise of round r are functions of
(seed, r) and the server state alone, so a killed-and-resumed run ends with the same weights.

References:
    McMahan et al. 2017 (FedAvg), Reddi et al. 2021 (FedAdam), McMahan et al. 2018 (DP-FedAvg),
    Rush et al. 2024 (FAX).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from memaudit.config import Config
from memaudit.errors import MemauditError
from memaudit.rundir import RunDir

ProgressFn = Callable[[int, int, dict[str, Any]], None]


def train_federated(cfg: Config, run: RunDir, *, resume: bool = False,
                    progress: ProgressFn | None = None, **session_kw: Any) -> dict[str, Any]:
    """Train `cfg` federated into `run`; returns the result summary written to run.json.

    Args:
        cfg: the resolved config (`cfg.federated` holds rounds, cohort, sampling, local steps,
            client/server optimizers, mesh_clients).
        run: the run directory, already checked by `prepare_new_run` / `open_for_resume`.
        resume: continue from the last checkpoint in state/.
        progress: called as progress(done_rounds, total_rounds, info) after every round.
        session_kw: passed to the run lifecycle (`overwrite`, `lock_held`).

    Returns:
        {"steps" (= rounds), "rounds", "final_holdout_loss", "final_holdout_perplexity",
         "initial_holdout_loss", "initial_holdout_perplexity", "final_train_loss", ...}
    """
    if cfg.federated.runtime == "flower":  # the client computation on Flower SuperNodes
        from memaudit.federated.flower.trainer import train_on_flower

        return train_on_flower(cfg, run, resume=resume, progress=progress, **session_kw)
    from memaudit.federated.distributed import maybe_initialize

    maybe_initialize()
    return FederatedTrainer(cfg, run, progress=progress).fit(resume=resume, **session_kw)


def check_population(cfg: Config, population: int) -> None:
    """One-line errors for a cohort the data cannot supply."""
    f = cfg.federated
    if population < 2:
        raise MemauditError(
            f"the training data has {population} user(s) with sequences; federated training needs at "
            "least 2 clients: add users (data.synth.users) or lower data.heldout_users")
    if f.cohort > population:
        raise MemauditError(
            f"federated.cohort={f.cohort} is larger than the population of {population} training "
            f"users; set federated.cohort <= {population} or add users")
    if f.local_steps < 1:
        raise MemauditError(f"federated.local_steps={f.local_steps} must be >= 1")


def build_mesh(mesh_clients: int | None, mesh_model: int = 1, preset: Any = None) -> Any:
    """The federated device mesh: ``clients`` x ``model`` (None on one device).

    ``mesh_model`` devices split each client's attention and MLP weights (tensor parallel,
    `memaudit.models.flax_llama.PARTITION_RULES`); ``mesh_clients`` (default: all devices /
    mesh_model) share the clients. With mesh_model 1 the mesh is the 1-D ``clients`` one. A
    mesh larger than the visible devices, or a model axis that does not divide the preset's
    heads, kv heads or intermediate size, is a one-line error.
    """
    import jax

    devices = jax.devices()
    if mesh_model < 1:
        raise MemauditError(f"federated.mesh_model={mesh_model} must be >= 1")
    k = max(len(devices) // mesh_model, 1) if mesh_clients is None else mesh_clients
    if k * mesh_model > len(devices):
        raise MemauditError(
            f"federated.mesh_clients={k} x federated.mesh_model={mesh_model} = {k * mesh_model} "
            f"devices exceeds the {len(devices)} visible devices; make the product at most "
            f"{len(devices)}")
    if preset is not None and mesh_model > 1:  # a preset name, or a shape (`LlamaPreset`)
        from memaudit.models.flax_llama import check_model_axis
        from memaudit.models.presets import get_preset

        shape = get_preset(preset) if isinstance(preset, str) else preset
        what = f"model.preset={preset}" if isinstance(preset, str) else "the model.init_from checkpoint"
        try:
            check_model_axis(shape, mesh_model)
        except ValueError as e:
            raise MemauditError(f"{e} ({what})") from None
    if k * mesh_model <= 1:
        return None
    auto = jax.sharding.AxisType.Auto
    if mesh_model == 1:
        return jax.make_mesh((k,), ("clients",), axis_types=(auto,), devices=devices[:k])
    return jax.make_mesh((k, mesh_model), ("clients", "model"), axis_types=(auto, auto),
                         devices=devices[: k * mesh_model])


def make_loss_fn(model: Any) -> Callable:
    """`loss_fn(params, batch) -> (per-sequence mean token loss (b,), token counts)` for algorithms."""
    import jax
    import jax.numpy as jnp

    def loss_fn(params, batch):
        ids, am = batch["input_ids"], batch["attention_mask"]
        logits = model.apply({"params": params}, ids, am)  # (b, L, V)
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


class FederatedTrainer:
    """One federated training run; `is_writer` is process 0 (the only one that writes files)."""

    def __init__(self, cfg: Config, run: RunDir, *, progress: ProgressFn | None = None) -> None:
        import jax

        self.cfg, self.run, self.progress = cfg, run, progress
        self.fcfg = cfg.federated
        self.is_writer = jax.process_index() == 0
        self.private = cfg.privacy.enabled
        self.ledger: Any = None
        self.initial_holdout = (math.nan, math.nan)

    # ------------------------------------------------------------------ set-up
    def prepare(self, resume: bool) -> None:
        from memaudit.federated.data import build_client_data
        from memaudit.models.convert import hf_to_flax
        from memaudit.models.flax_llama import FlaxLlama
        from memaudit.models.init import flax_config, initial_state_dict, model_shape

        shape = model_shape(self.cfg.model)  # the checkpoint's with model.init_from, else the preset's
        self.vocab = shape.vocab_size
        # staged and checked (tokenizer size, population) by the lifecycle: dispatch.check_data
        if self.is_writer:
            self.prepared = self.session.data()
        self._barrier("data")
        if not self.is_writer:
            self.prepared = self.session.data()
        self.clients = build_client_data(self.prepared.train)
        self.mesh = build_mesh(self.fcfg.mesh_clients, self.fcfg.mesh_model, shape)
        self.capacity = self._base_capacity()
        self.model = FlaxLlama(flax_config(self.cfg.model, self.vocab))
        # the same starting weights as the torch trainers (memaudit.models.init)
        self.params0 = hf_to_flax(initial_state_dict(self.cfg.model, self.vocab))
        self.algorithm = self.build_algorithm()
        self._eval = self._build_eval()

    def _barrier(self, name: str) -> None:
        import jax

        if jax.process_count() > 1:
            from memaudit.federated.distributed import barrier

            barrier(f"memaudit-{name}")

    def build_aggregator(self) -> Any:
        """The aggregation stack by config: mean; secure aggregation around it; DP-FedAvg (central)
        around that, or distributed DP (discrete Gaussian over its own secure sum). None for the
        plain mean: `fedavg`'s own, which sums the deltas inside the clients' loop."""
        from memaudit.federated.aggregators import mean_aggregator

        p = self.cfg.privacy
        base = mean_aggregator(self.mesh)
        if self.private and p.mechanism == "distributed":
            from memaudit.federated.ddp import distributed_dp_from_config

            return distributed_dp_from_config(base, self.cfg, noise_multiplier=self._setup_ledger())
        if p.secure_aggregation.enabled:
            from memaudit.federated.secagg.aggregator import secure_aggregation_from_config

            base = secure_aggregation_from_config(base, self.cfg)
        if not self.private:
            return base if p.secure_aggregation.enabled else None
        from memaudit.federated.dp import dp_fedavg

        return dp_fedavg(base, clip=p.clip, noise_multiplier=self._setup_ledger(),
                         expected_cohort=float(self.fcfg.cohort), adaptive=p.adaptive_clipping)

    def _setup_ledger(self) -> float:
        """User-level ledger, delta, the mechanism and its (calibrated) noise multiplier z."""
        from memaudit.federated.dp import dp_fedavg_mechanism
        from memaudit.privacy.accounting import default_delta
        from memaudit.privacy.ledger import PrivacyLedger
        from memaudit.privacy.mechanisms import DistributedDiscreteGaussian, calibrate

        p, f = self.cfg.privacy, self.fcfg
        population = self.clients.num_users
        self.sampling_rate = f.cohort / population
        self.delta = p.delta if p.delta is not None else default_delta(population)
        central = dp_fedavg_mechanism(noise_multiplier=0.0, expected_cohort=float(f.cohort), population=population,
                                      sampling=f.sampling, adaptive=p.adaptive_clipping)
        sigma = p.noise_multiplier
        if sigma is None:  # bisect over the event the ledger records
            acc = "rdp" if p.accountant == "both" or f.sampling == "fixed" else p.accountant
            make = lambda z: central.with_noise(z).dp_event()
            if p.mechanism == "distributed":
                from memaudit.federated.ddp import planned_event_of_config

                make, acc = planned_event_of_config(self.cfg, self.params0), "rdp"
            sigma = calibrate(p.target_epsilon, make, steps=f.rounds, delta=self.delta, accountant=acc, unit="user")
        self.noise_multiplier = float(sigma)
        self.mechanism = (DistributedDiscreteGaussian() if p.mechanism == "distributed"
                          else central.with_noise(self.noise_multiplier))
        self.ledger = PrivacyLedger(unit="user", delta=self.delta,
                                    reproducible_randomness=p.reproducible_randomness)
        return self.noise_multiplier

    def record_privacy(self, metrics: dict[str, Any]) -> None:
        """Record this round's noise in the ledger (every round adds noise, even an empty one)."""
        self.ledger.record_mechanism(self.mechanism, metrics)  # the mechanism declares its event

    def build_algorithm(self) -> Any:
        from memaudit.federated import algorithms as alg

        f = self.fcfg
        loss_fn = make_loss_fn(self.model)
        server_opt = alg.make_server_optimizer(f.server_optimizer, self._server_lr())
        weighting = "uniform" if self.private else "examples"
        if f.algorithm == "fedsgd":  # without DP or secure aggregation (dispatch checks)
            return alg.fedsgd(loss_fn, server_optimizer=server_opt, weighting=weighting, mesh=self.mesh)
        return alg.fedavg(
            loss_fn, client_optimizer=alg.make_client_optimizer(f.client_optimizer, f.client_lr),
            server_optimizer=server_opt, local_steps=f.local_steps, batch_size=f.local_batch_size,
            aggregator=self.build_aggregator(), weighting=weighting, mesh=self.mesh,
        )

    def _server_lr(self) -> float:
        # FedAvg proper applies the mean delta as is (server SGD with lr 1, McMahan et al. 2017).
        return 1.0 if self.fcfg.server_optimizer == "fedavg" else self.fcfg.server_lr

    # ------------------------------------------------------------------ rounds
    def cohort(self, r: int) -> np.ndarray:
        from memaudit.federated.cohorts import sample_cohort

        f = self.fcfg
        src = self._dp_randomness() if self.private else self.cfg.train.seed
        return sample_cohort(src, self.clients.num_users, f.cohort, f.sampling, round=r)

    def _dp_randomness(self) -> Any:
        """The DP run's secret randomness (256 bits of OS entropy, or derived from train.seed
        with privacy.reproducible_randomness): RUN_DIR/dp_secret.json, written by process 0
        before the first round and read back on resume; every JAX process gets process 0's.
        Cohorts and each round's key are derived from it, never from train.seed."""
        if getattr(self, "_dp_rand", None) is None:
            import jax

            from memaudit.privacy.randomness import DPRandomness

            rand = DPRandomness.for_run(self.run.path, self.cfg.privacy, self.cfg.train.seed,
                                        write=self.is_writer)
            if jax.process_count() > 1:  # one secret per run: process 0's on every process
                from jax.experimental import multihost_utils

                sd = rand.state_dict()
                words = np.frombuffer(bytes.fromhex(sd["secret"]), dtype="<u4").copy()
                words = np.asarray(multihost_utils.broadcast_one_to_all(words), dtype="<u4")
                rand = DPRandomness.from_state_dict({**sd, "secret": words.tobytes().hex()})
            self._dp_rand = rand
        return self._dp_rand

    def round_key(self, key: Any, r: int) -> Any:
        """Round r's key: derived from the secret by the PRF under DP (one key per round),
        else folded from the seed's base key."""
        import jax

        if self.private:
            return self._dp_randomness().jax_key("round", r)
        return jax.random.fold_in(key, r)

    def _base_capacity(self) -> int | None:
        """Clients dim of every round: the cohort (fixed sampling); for Poisson sampling a
        (1 - 1e-3) quantile of the cohort size where absent slots cost (nearly) nothing, else
        None (a power of two per round). Always a multiple of the clients mesh axis."""
        import jax

        from memaudit.federated.cohorts import poisson_capacity
        from memaudit.federated.sharding import clients_axis_size

        f, k = self.fcfg, clients_axis_size(self.mesh)
        if f.sampling == "fixed":
            return -(-f.cohort // k) * k
        # On CPU clients train one after the other on each device (the scan strategy, a
        # shard_map over a clients mesh axis), and a slot without data skips local training.
        # Batched (vmap, on accelerators) every slot computes, so the padding is kept small.
        if jax.default_backend() == "cpu":
            return -(-poisson_capacity(self.clients.num_users, f.cohort) // k) * k
        return None

    def round_capacity(self, size: int) -> int:
        """Clients dim for a cohort of ``size``: the run's fixed capacity, so rounds reuse one
        compiled program, or else (and for a rare larger Poisson cohort) the next power of two."""
        from memaudit.federated.cohorts import cohort_capacity
        from memaudit.federated.sharding import clients_axis_size

        if self.capacity is not None and size <= self.capacity:
            return self.capacity
        return cohort_capacity(max(size, 1), multiple=clients_axis_size(self.mesh))

    def round_data(self, cohort: np.ndarray) -> Any:
        """The cohort's sequences as a padded `cohorts.ClientData` placed on the mesh."""
        from memaudit.federated.cohorts import ClientData

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
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec

        if self.mesh is None:
            return jnp.asarray(x)
        spec = PartitionSpec() if replicated else PartitionSpec("clients")
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, NamedSharding(self.mesh, spec), lambda idx: x[idx])

    def _replicate(self, state: Any) -> Any:
        """Keep the server state in one layout, so every round (and a resumed one) reuses one
        executable: replicated over the clients axis, the attention and MLP kernels (and their
        optimizer moments) split over a ``model`` axis."""
        import jax

        from memaudit.federated.sharding import server_shardings
        from memaudit.models.flax_llama import kernel_axes

        if self.mesh is None:
            return state
        return jax.device_put(state, server_shardings(state, self.mesh, kernel_axes))

    def run_round(self, state: Any, r: int, key: Any) -> tuple[Any, dict[str, Any]]:
        import jax

        t0 = time.perf_counter()
        cohort = self.cohort(r)
        rec: dict[str, Any] = {"round": r + 1, "cohort": len(cohort)}
        if len(cohort) == 0 and not self.private:
            # An empty Poisson cohort sends nothing; FedAdam's momentum must not move the model.
            state = state._replace(round=state.round + 1)
            rec.update(loss=None, update_norm=0.0, tokens_per_s=0.0)
            return state, rec
        state, m = self.algorithm_round(state, cohort, r, self.round_key(key, r))
        state = self._replicate(state)
        jax.block_until_ready(state.params)
        dt = time.perf_counter() - t0
        tokens = self._round_tokens(cohort)
        rec.update(loss=m.pop("loss", math.nan), update_norm=m.pop("update_norm", math.nan),
                   tokens_per_s=tokens / dt if dt > 0 else 0.0, round_seconds=dt)
        # An aborted secure-aggregation round released and applied nothing: no privacy event.
        # (Whether a round aborts depends on the realized cohort; `docs/secure-aggregation.md`.)
        if self.ledger is not None and not int(m.get("secagg_aborted", 0) or 0):
            self.record_privacy(m)
        rec.update({k: v for k, v in m.items() if k not in ("cohort",)})
        return state, rec

    def algorithm_round(self, state: Any, cohort: np.ndarray, r: int, key: Any) -> tuple[Any, dict]:
        """One round of the algorithm on the cohort's data (the Flower runtime overrides it)."""
        return self.algorithm.round(state, self.round_data(cohort), key)

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
        import jax
        import jax.numpy as jnp

        from memaudit.models.flax_llama import causal_lm_loss

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

    # ------------------------------------------------------------------ checkpoints
    def host(self, tree: Any) -> Any:
        """Server-side pytree -> numpy on this host (gathers global arrays across processes)."""
        import jax

        def one(x):
            if isinstance(x, jax.Array) and not x.is_fully_addressable:
                if x.is_fully_replicated:
                    return np.asarray(x.addressable_data(0))
                from jax.experimental import multihost_utils

                return np.asarray(multihost_utils.process_allgather(x, tiled=True))
            return np.asarray(x)

        return jax.tree.map(one, tree)

    def save_checkpoint(self, state: Any, key_data: np.ndarray) -> None:
        from memaudit.federated import run as fr

        host = self.host(state)
        if not self.is_writer:
            return
        r = int(host.round)
        scalars = {"round": r, "metrics_count": r, "key": key_data.tolist(),
                   "initial_holdout_loss": self.initial_holdout[0],
                   "initial_holdout_perplexity": self.initial_holdout[1]}
        files = {"privacy.json": self.ledger.to_json()} if self.ledger is not None else None
        with self.session.checkpoint(r) as d:
            fr.write_state(d, host, scalars, files)
        self.write_ledger()

    def restore_checkpoint(self, template: Any) -> tuple[Any, np.ndarray]:
        from memaudit.federated import run as fr

        state, scalars = fr.load_state(self.run, self.host(template))
        if self.ledger is not None:
            saved = self.session.state_file("privacy.json")
            if saved is not None:
                from memaudit.privacy.ledger import PrivacyLedger

                self.ledger = PrivacyLedger.from_json(saved)
        self.initial_holdout = (scalars["initial_holdout_loss"], scalars["initial_holdout_perplexity"])
        return state, np.asarray(scalars["key"], dtype=np.uint32)

    def write_ledger(self) -> None:
        if self.ledger is not None:
            self.session.write_ledger(self.ledger.to_json())

    # ------------------------------------------------------------------ driver
    def _base_key(self) -> np.ndarray:
        """Raw key data of the run's base key: train.seed, or under DP one derived from the run's
        secret (`_dp_randomness`; round keys are derived from the secret itself)."""
        import jax

        if not self.private:
            return np.asarray(jax.random.key_data(jax.random.key(self.cfg.train.seed)), dtype=np.uint32)
        return self._dp_randomness().jax_key_data("federated-base", 0).astype(np.uint32)

    def _to_device(self, tree: Any) -> Any:
        import jax

        return jax.tree.map(lambda x: self._place(np.asarray(x), replicated=True), tree)

    def _notify(self, done: int, info: dict[str, Any]) -> None:
        if self.progress is not None:
            self.progress(done, self.fcfg.rounds, info)

    def _train(self, resume: bool) -> dict[str, Any]:
        import jax

        from memaudit.federated.sharding import clients_axis_size, model_axis_size

        t0 = time.perf_counter()
        self.prepare(resume)
        state = self.algorithm.init(self._to_device(self.params0))
        from memaudit.federated import run as fr

        if resume and fr.has_state(self.run):
            host_state, key_data = self.restore_checkpoint(state)
            state = self._to_device(host_state)
        else:
            key_data = self._base_key()
            self.initial_holdout = self._eval(self.params0)
        state = self._replicate(state)
        start = int(self.host(state.round))
        self.session.start(start)
        key = jax.random.wrap_key_data(key_data)
        total, last = self.fcfg.rounds, {}
        self._barrier("start")  # processes enter the first round's collectives together
        self._notify(start, {"phase": "training"})
        for r in range(start, total):
            state, rec = self.run_round(state, r, key)
            done = r + 1
            if done % self.fcfg.eval_every == 0 or done == total:
                rec["holdout_loss"], rec["holdout_perplexity"] = self._eval(self.host(state.params))
            self.session.log(rec)
            if done % self.fcfg.checkpoint_every == 0 and done < total:
                self.save_checkpoint(state, key_data)
            self._notify(done, rec)
            last = rec
        params = self.host(state.params)
        final = ((last["holdout_loss"], last["holdout_perplexity"]) if "holdout_loss" in last
                 else self._eval(params))
        if self.is_writer:
            from memaudit.models.convert import to_hf_model
            from memaudit.models.init import hf_config

            hf = to_hf_model(params, config=hf_config(self.cfg.model, vocab_size=self.vocab))
            self.session.export_hf(hf, tokenizer=self.prepared.tokenizer(), tokenizer_dir=self.prepared.tokenizer_dir)
        self.write_ledger()
        self._barrier("done")  # no process leaves while the writer still exports
        result = {
            "steps": total, "rounds": total,
            "final_holdout_loss": final[0], "final_holdout_perplexity": final[1],
            "initial_holdout_loss": self.initial_holdout[0],
            "initial_holdout_perplexity": self.initial_holdout[1],
            # the training loss is a statistic of the private data: not in run.json under DP
            "final_train_loss": None if self.private else last.get("loss"),
            "clients": self.clients.num_users, "train_sequences": len(self.prepared.train),
            "parameters": int(sum(np.size(x) for x in jax.tree.leaves(params))),
            "devices": len(jax.devices()), "processes": jax.process_count(),
            "mesh_clients": clients_axis_size(self.mesh), "mesh_model": model_axis_size(self.mesh),
            "train_seconds": time.perf_counter() - t0,
            "resumed_from_round": start if resume else None,
        }
        if self.ledger is not None:
            result["privacy"] = {"noise_multiplier": self.noise_multiplier, "sampling_rate": self.sampling_rate,
                                 "delta": self.delta, "unit": "user",
                                 "epsilon": self.ledger.to_json().get("epsilon")}
        return result

    def fit(self, *, resume: bool = False, overwrite: bool = False, lock_held: bool = False) -> dict[str, Any]:
        """Run (or resume) inside the run lifecycle (lock, manifest, signals)."""
        from memaudit.federated.run import BACKEND
        from memaudit.lifecycle import RunSession

        session = RunSession(self.run, self.cfg, backend=BACKEND, resume=resume, is_writer=self.is_writer,
                             hold_lock=not lock_held, overwrite=overwrite)
        with session:
            self.session = session
            result = self._train(resume)
            session.complete(result)
        return result
