"""The centralized backend's JAX engine (`train.engine: jax`), a backend of the one driver.

`JaxTrainer` (run by `memaudit.run.centralized_jax.train_centralized_jax(cfg, run)`) trains the
federated side's Flax Llama where the torch engine
trains the Hugging Face one, from the same seeded weights (`memaudit.models.init`, converted by
`memaudit.models.convert.hf_to_flax`), on the same batches (`EpochBatches`; under DP the same
samplers and privacy plans, `memaudit.train.user_dp`), with the same loss, learning-rate
schedule, AdamW and global-norm clipping (`memaudit.train.jax_engine`), and DP-SGD by
jax-privacy (`memaudit.train.jax_dp`): example level, or user level by ELS or ULS. Full
fine-tuning or LoRA (`memaudit.models.flax_lora.LoraModel`: the adapters are the trained
parameters), Goldfish loss. The parameters, the optimizer state and each batch live on a
(data, model) device mesh (`train.mesh_model`).

The loop, evaluation schedule, checkpoints, ledger, export and result are the driver's
(`memaudit.run.driver.fit`): the run directory, metrics (DP statistics in sensitive_metrics.jsonl),
ledger and Hugging Face export are the torch engine's; run.json's result says `engine: jax`.
A checkpoint is `state/state.msgpack` (parameters and optimizer state, flax serialisation,
read back into a template, never unpickled) and trainer.json; the batch, learning rate and DP
noise of step t are functions of (train.seed or the run's DP secret, t) alone, so on the CPU a
resumed run ends bit-identical to an uninterrupted one.

References:
    Abadi et al., CCS 2016 (DP-SGD); Charles et al., SaTML 2025 (ELS, ULS); Hu et al., ICLR
    2022 (LoRA); Hans et al., NeurIPS 2024 (Goldfish).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization
from jax.sharding import NamedSharding, PartitionSpec

from memaudit.backends import CENTRALIZED, Session, StepOutcome
from memaudit.checkpoints import checkpoint_present
from memaudit.config import Config
from memaudit.errors import RunDirError
from memaudit.io import atomic_write_bytes, atomic_write_json
from memaudit.models.convert import hf_to_flax, to_hf_model
from memaudit.models.flax_llama import FlaxLlama
from memaudit.models.flax_lora import LoraModel, count, initial_lora, torch_lora_model
from memaudit.models.init import flax_config, hf_config, initial_state_dict, model_vocab_size
from memaudit.models.lora import merged_copy, save_adapter, trained_label
from memaudit.privacy.plan import PrivacyPlan
from memaudit.privacy.randomness import dp_randomness
from memaudit.rundir import RunDir
from memaudit.train import checkpoint as ckpt
from memaudit.train import jax_dp, user_dp
from memaudit.train import jax_engine as eng
from memaudit.train.batches import EpochBatches
from memaudit.train.sampling import cap_per_user
from memaudit.train.schedule import lr_at

ProgressFn = Callable[[int, int, dict[str, Any]], None]
ENGINE = "jax"
STATE_FILE = "state.msgpack"


class JaxTrainer:
    """The jax engine of the centralized backend (`memaudit.run.driver.Backend`)."""

    name = CENTRALIZED
    counter = "step"

    def __init__(self, cfg: Config, run: RunDir, *, progress: ProgressFn | None = None,
                 devices: Any = None) -> None:
        self.cfg, self.run, self.tcfg = cfg, run, cfg.train
        self.is_writer = jax.process_index() == 0
        self.progress = progress if self.is_writer else None
        self.private = cfg.privacy.enabled
        self.devices = devices
        self.plan: PrivacyPlan | None = None
        self.group_size = 1  # rows per clipped unit: a ULS user's capped sequences
        self.kept_rows: np.ndarray | None = None
        self.frozen = 0
        self.clipping = jax_dp.jax_clipping(cfg)  # DP-SGD's clipped sum: ghost or vmap

    @property
    def total(self) -> int:
        return self.tcfg.steps

    @property
    def eval_every(self) -> int:
        return self.tcfg.eval_every

    @property
    def checkpoint_every(self) -> int:
        return self.tcfg.checkpoint_every

    # ------------------------------------------------------------------ set-up
    def running(self, session: Session, resume: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def prepare(self, session: Session) -> None:
        """Data, mesh, model, optimizer, sampler, the DP plan and the compiled steps."""
        self.session = session
        self.prepared = session.data()  # staged and checked by the lifecycle (checks.check_data)
        self.train_set, self.holdout_set = self.prepared.train, self.prepared.holdout
        self.mesh = eng.build_mesh(self.tcfg.mesh_model, self.devices)
        self.dtype = eng.compute_dtype(self.tcfg.dtype, self.mesh.devices.flat[0].platform)
        self._build_model(model_vocab_size(self.cfg.model))
        self.tx = eng.adamw(tuple(self.tcfg.betas), self.tcfg.weight_decay)
        self.param_sh = eng.tree_shardings(self.params0, self.mesh)
        self.params = eng.place(self.params0, self.param_sh)
        opt_state = self.tx.init(self.params)
        self.opt_sh = eng.tree_shardings(opt_state, self.mesh)
        self.opt_state = eng.place(opt_state, self.opt_sh)
        self.sampler: Any = EpochBatches(len(self.train_set), self.tcfg.batch_size, self.tcfg.seed)
        if self.private:
            self._setup_privacy()
        self._compile()

    def _build_model(self, vocab: int) -> None:
        """The Flax Llama in the compute dtype and the seeded start (adapters under LoRA)."""
        model = FlaxLlama(dataclasses.replace(flax_config(self.cfg.model, vocab), dtype=self.dtype))
        self.vocab = vocab
        lora = self.cfg.model.lora
        if lora is None:
            self.params0 = hf_to_flax(initial_state_dict(self.cfg.model, vocab))
            self.model: Any = model
            return
        base, self.params0 = initial_lora(self.cfg.model, vocab)
        self.frozen = int(sum(v.numel() for v in base.values()))
        base_tree = hf_to_flax(base)
        base_dev = eng.place(base_tree, eng.tree_shardings(base_tree, self.mesh))
        self.model = LoraModel(model, base_dev, lora.alpha / lora.rank, dropout=lora.dropout)

    @property
    def dropout(self) -> bool:
        lora = self.cfg.model.lora
        return lora is not None and lora.dropout > 0

    def _setup_privacy(self) -> None:
        """σ, sampler and plan of the config's DP (the torch engine's, `memaudit.train.user_dp`),
        from the run's one secret (`memaudit.privacy.randomness.dp_randomness`)."""
        p = self.cfg.privacy
        self.randomness = dp_randomness(self.run, self.cfg, is_writer=self.is_writer)
        self.kept_rows = self._contribution_rows()
        if p.unit == "user":
            setup = user_dp.uls_setup if p.user_sampling == "uls" else user_dp.els_setup
            sigma, self.sampler, self.plan, self.group_size = setup(
                self.cfg, self.train_set, self.kept_rows, self.randomness)
        else:
            sigma, self.sampler, self.plan, _ = user_dp.example_setup(
                self.cfg, self.train_set, self.kept_rows, self.randomness,
                max_sequences_per_document=getattr(self.prepared, "max_sequences_per_document", None))
        self.noise_multiplier = float(sigma)
        self.expected = float(self.sampler.expected_batch_size)
        self.clipping = jax_dp.jax_clipping(self.cfg, group=self.group_size > 1, platform=jax.default_backend())

    def _contribution_rows(self) -> np.ndarray:
        """The rows DP samples from: every row, or at most k per user (as the torch engine)."""
        n, k = len(self.train_set), self.cfg.privacy.max_examples_per_user
        if k is None:
            return np.arange(n, dtype=np.int64)
        return cap_per_user(self.train_set.user_index, k, self.tcfg.seed)

    def privacy_plan(self) -> PrivacyPlan | None:
        return self.plan

    def _compile(self) -> None:
        """The jitted step (plain or DP-SGD) and evaluation, laid out on the mesh."""
        forward = eng.make_forward(self.model)
        rep = NamedSharding(self.mesh, PartitionSpec())
        out = (self.param_sh, self.opt_sh, rep)
        donate = (0, 1) if self.mesh.devices.flat[0].platform != "cpu" else ()
        micro = self.tcfg.micro_batch_size
        data = eng.data_axis_size(self.mesh)
        self._multiple = data  # a step's rows (or users): a multiple of the data axis ...
        if self.private:
            p = self.cfg.privacy
            units = None if micro is None else max(1, micro // self.group_size)
            if units is not None:  # ... and of jax-privacy's micro-batch
                self._multiple = math.lcm(data, units)
            step = jax_dp.private_step(forward, self.tx, clip=p.clip, noise_multiplier=self.noise_multiplier,
                                       expected=self.expected, group=self.group_size > 1, dropout=self.dropout,
                                       microbatch=units, clipping=self.clipping, model=self.model)
        else:
            chunks = 1 if micro is None else -(-self.tcfg.batch_size // micro)
            clip = self.tcfg.grad_clip if self.tcfg.grad_clip is not None else math.inf
            step = eng.plain_step(forward, self.tx, grad_clip=clip, chunks=chunks)
        self._step = jax.jit(step, out_shardings=out, donate_argnums=donate)
        self._eval = jax.jit(eng.holdout_sums(forward), out_shardings=rep)
        self._row_sh = eng.batch_sharding(self.mesh)

    # ------------------------------------------------------------------ steps
    def _batch(self, rows: np.ndarray) -> tuple[Any, Any, Any, int, int]:
        """Step rows -> (ids, am, lmask) on the mesh, padded with rows that have no target; under
        ULS shaped (users, k, L). Returns also (real rows, clipped units)."""
        pad = rows < 0
        real = int((~pad).sum())
        take = np.where(pad, 0, rows)
        ids = self.train_set.input_ids[take].astype(np.int32)
        am = self.train_set.attention_mask[take].astype(np.int32)
        lm = eng.loss_mask(ids, am, self.tcfg.goldfish)
        lm[pad] = False
        g, m = self.group_size, self._multiple
        units = len(rows) // g
        # a Poisson step: a power of two (few compiled programs); a fixed-size one: as it is
        cap = eng.capacity(units, m) if self.private else -(-units // m) * m
        length = ids.shape[1]
        shape = (cap, g, length) if g > 1 else (cap, length)

        def padded(x: np.ndarray, dtype: Any) -> Any:
            out = np.zeros((cap * g, length), dtype)
            out[:len(rows)] = x
            return jax.device_put(out.reshape(shape), self._row_sh)

        return padded(ids, np.int32), padded(am, np.int32), padded(lm, bool), real, units

    def _rng(self, step: int) -> Any:
        """Adapter dropout's key of step `step` (from train.seed), None without dropout."""
        return jax.random.fold_in(jax.random.key(self.tcfg.seed), step) if self.dropout else None

    def train_step(self, step: int) -> dict[str, Any]:
        """One optimizer update (0-based `step`); returns its metrics line (the torch engine's keys)."""
        t0 = time.perf_counter()
        lr = lr_at(step, lr=self.tcfg.lr, warmup_steps=self.tcfg.warmup_steps,
                   total_steps=self.tcfg.steps, min_lr_ratio=self.tcfg.min_lr_ratio)
        rows = self.sampler.indices(step)
        ids, am, lm, real, units = self._batch(rows)
        lr_dev = jnp.float32(lr)
        if self.private:
            key = jnp.asarray(self.randomness.jax_key_data(jax_dp.NOISE_PURPOSE, step))
            self.params, self.opt_state, st = self._step(self.params, self.opt_state, ids, am, lm, lr_dev,
                                                         key, self._rng(step))
            st = jax.device_get(st)
            stats = jax_dp.step_metrics(st, rows=real, units=units if self.group_size > 1 else real,
                                        noise_std=self._noise_std(), group=self.group_size > 1)
        else:
            self.params, self.opt_state, st = self._step(self.params, self.opt_state, ids, am, lm, lr_dev,
                                                         self._rng(step))
            st = jax.device_get(st)
            stats = {"loss": float(st["loss"])}
        dt = time.perf_counter() - t0
        rec = {"step": step + 1, "loss": stats.pop("loss"), "lr": lr,
               "tokens_per_s": real * self.train_set.seq_len / dt if dt > 0 else 0.0,
               "grad_norm": float(st["grad_norm"]), "batch_size": len(rows)}
        rec.update(stats)
        return rec

    def _noise_std(self) -> float:
        """σC / E[|S|]: the noise's standard deviation in the averaged gradient."""
        if self.noise_multiplier == 0:
            return 0.0
        return self.noise_multiplier * self.cfg.privacy.clip / self.expected

    def step(self, i: int) -> StepOutcome:
        """The driver's step: one update; under DP every step releases a noisy gradient."""
        return StepOutcome(self.train_step(i), released=self.private)

    def evaluate(self) -> tuple[float, float]:
        """(token-mean holdout loss, perplexity) over the first eval_batches batches, as the torch engine."""
        h = self.holdout_set
        b = self.tcfg.micro_batch_size or self.tcfg.batch_size
        n = min(len(h), b * self.tcfg.eval_batches)
        rows = -(-b // eng.data_axis_size(self.mesh)) * eng.data_axis_size(self.mesh)
        total, count_ = 0.0, 0.0
        for s in range(0, n, b):
            k = min(b, n - s)
            ids = np.zeros((rows, h.seq_len), np.int32)
            am = np.zeros((rows, h.seq_len), np.int32)
            ids[:k], am[:k] = h.input_ids[s:s + k], h.attention_mask[s:s + k]
            ls, c = self._eval(self.params, jax.device_put(ids, self._row_sh), jax.device_put(am, self._row_sh))
            total, count_ = total + float(ls), count_ + float(c)
        if count_ == 0:
            return math.nan, math.nan
        loss = total / count_
        return loss, math.exp(min(loss, 700.0))

    # ------------------------------------------------------------------ checkpoints
    def has_checkpoint(self) -> bool:
        return checkpoint_present(self.run.state_dir)

    def save(self, session: Session, done: int, scalars: dict[str, Any], files: dict[str, Any]) -> None:
        """Parameters and optimizer state (msgpack) and the scalars, after `done` steps."""
        host = jax.device_get({"params": self.params, "opt_state": self.opt_state})
        if not self.is_writer:
            return
        with session.checkpoint(done) as d:
            atomic_write_bytes(d / STATE_FILE, serialization.to_bytes(host))
            for name, obj in (files or {}).items():
                atomic_write_json(d / name, obj)
            atomic_write_json(d / "trainer.json", {"schema": ckpt.STATE_SCHEMA, **scalars, "engine": ENGINE,
                                                   "noise_multiplier": getattr(self, "noise_multiplier", None)})

    def load(self, session: Session) -> dict[str, Any]:
        """state/ into the parameters and optimizer state; a torch engine's checkpoint is refused."""
        scalars = ckpt.read_scalars(self.run)
        path = self.run.state_dir / STATE_FILE
        if scalars.get("engine") != ENGINE or not path.is_file():
            raise RunDirError(f"the checkpoint in '{self.run.state_dir}' was written by the torch engine; "
                              "resume it with train.engine=torch or start a new run")
        template = jax.device_get({"params": self.params, "opt_state": self.opt_state})
        with ckpt.checkpoint_file(path):
            host = serialization.from_bytes(template, path.read_bytes())
        self.params = eng.place(host["params"], self.param_sh)
        self.opt_state = eng.place(host["opt_state"], self.opt_sh)
        return scalars

    # ------------------------------------------------------------------ the driver's hooks
    def begin(self) -> None:
        """Nothing to synchronise: every batch is a function of (seed or secret, step)."""

    def export(self, session: Session) -> None:
        """The Hugging Face model into model/ (and under LoRA the merged model and adapter/),
        written by the torch side's code as the federated backend's export."""
        params = jax.device_get(self.params)
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
        """One process: nothing to wait for."""

    def train_sequences(self) -> int:
        return len(self.train_set)

    def parameters(self) -> int:
        return count(self.params0) + self.frozen

    def details(self) -> dict[str, Any]:
        trained = count(self.params0)
        out = {"engine": ENGINE, "device": jax.default_backend(), "devices": int(self.mesh.devices.size),
               "mesh_data": eng.data_axis_size(self.mesh), "mesh_model": int(self.mesh.shape[eng.MeshAxis.MODEL]),
               "compute_dtype": jnp.dtype(self.dtype).name, "trained": trained_label(self.cfg.model.lora),
               "trained_parameters": trained, "frozen_parameters": self.frozen}
        if self.private:
            out["clipping"] = self.clipping
        p = self.cfg.privacy
        if self.private and (p.unit == "user" or p.max_examples_per_user is not None):
            out["contribution_bound"] = {"unit": p.unit, "max_examples_per_user": p.max_examples_per_user,
                                         "user_sampling": p.user_sampling if p.unit == "user" else None,
                                         "sequences_sampled_from": len(self.kept_rows)}
        return out
