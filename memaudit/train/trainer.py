"""The centralized trainer: PyTorch, Hugging Face Llama, in one process or on the 4D grid.

`Trainer` (run by `memaudit.run.centralized.train_centralized(cfg, run)`) prepares the data,
builds the preset model, trains it with
AdamW (linear warm-up, cosine decay, global-norm clipping, gradient accumulation; bf16
autocast and activation checkpointing for the large presets on GPU) or with DP-SGD when
`cfg.privacy.enabled`, writes `metrics.jsonl`, resumable checkpoints in `state/`, the
privacy ledger, and the final Hugging Face model in `model/`.

Exact resume: the batch of step t is a function of (train.seed, t) only, the learning
rate is a function of t only, and a checkpoint holds the weights, the optimizer moments,
the RNG, the DP noise-generator state and the number of torch CPU threads (which decides how
the CPU kernels split their float reductions; a resume runs on the checkpoint's count); so on
the CPU an interrupted-and-resumed run ends with weights bit-identical to an uninterrupted one.

The loop, evaluation schedule, checkpoints, ledger and result are the one training driver's
(`memaudit.run.driver.fit`); `Trainer` is the torch backend it drives. One `Trainer` runs every
layout by composition: it takes a `Layout`
(`memaudit.train.layout`) that says where the model lives, `SerialLayout` for one process or
`memaudit.parallel.layout.TensorParallelLayout` for the data x (x, y, z) grid (one per rank,
started by `memaudit.run.launch`). The layout builds or parallelises the seeded model,
shards each chunk of the global batch, syncs gradients, computes the global gradient norm,
evaluates, writes and reads its checkpoint format and exports the merged model; DP-SGD is the
one `memaudit.train.dpsgd.DPSGD` with the layout's per-example clipping.

References:
    Loshchilov & Hutter, "Decoupled Weight Decay Regularization" (AdamW), ICLR 2019.
    Chen et al., "Training Deep Nets with Sublinear Memory Cost" (activation checkpointing), 2016.
    Abadi et al., "Deep Learning with Differential Privacy" (DP-SGD), CCS 2016.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from memaudit.backends import CENTRALIZED, Session, StepOutcome
from memaudit.config import Config
from memaudit.models.init import initial_model, model_vocab_size
from memaudit.models.keyed_dropout import dropout_rows, dropout_step
from memaudit.models.lora import (
    apply_lora,
    merged_copy,
    parameter_counts,
    save_adapter,
    trained_label,
)
from memaudit.models.presets import LARGE_PRESETS
from memaudit.privacy.plan import PrivacyPlan
from memaudit.privacy.randomness import dp_randomness
from memaudit.rundir import RunDir
from memaudit.train import checkpoint as ckpt
from memaudit.train import user_dp
from memaudit.train.batches import EpochBatches
from memaudit.train.dpsgd import DPSGD
from memaudit.train.evaluate import is_right_padded, target_mask
from memaudit.train.goldfish import goldfish_mask
from memaudit.train.host_memory import kept_freed_memory
from memaudit.train.layout import Batch, Layout, SerialLayout, autocast, make_optimizer
from memaudit.train.sampling import cap_per_user
from memaudit.train.schedule import lr_at

if TYPE_CHECKING:
    from memaudit.data.packing import PackedSequences

ProgressFn = Callable[[int, int, dict[str, Any]], None]
BACKEND = CENTRALIZED  # the backend's name in run.json


@contextlib.contextmanager
def deterministic(device: torch.device) -> Iterator[None]:
    """Deterministic kernels on the CPU (exact resume); CUDA keeps its fast kernels."""
    if device.type != "cpu":
        yield
        return
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


@contextlib.contextmanager
def cpu_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op CPU threads set to `n` for the block (None: left as they are)."""
    before = torch.get_num_threads()
    if n is not None and n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


class Trainer:
    """The centralized backend of the training driver (`memaudit.run.driver.Backend`): one step,
    evaluation, checkpoint format and DP-SGD over a `Layout`.

    Everything that depends on where the model lives (one process, or the data x (x, y, z)
    grid) is asked of `layout`; nothing here is meant to be overridden.
    """

    name = BACKEND
    counter = "step"

    def __init__(self, cfg: Config, run: RunDir, layout: Layout | None = None, *,
                 progress: ProgressFn | None = None) -> None:
        self.layout: Layout = layout if layout is not None else SerialLayout(cfg)
        self.cfg, self.run = cfg, run
        self.progress = progress if self.layout.is_writer else None  # only the writer reports
        self.tcfg = cfg.train
        self.device = self.layout.device
        large = cfg.model.preset in LARGE_PRESETS and cfg.model.name_or_path is None
        self.autocast_dtype = self._autocast_dtype(large)
        ac = self.tcfg.activation_checkpointing
        self.activation_checkpointing = (self.device.type == "cuda" and large) if ac is None else ac
        self.private = cfg.privacy.enabled
        self.model: torch.nn.Module
        self.optimizer: torch.optim.Optimizer
        self.dp: Any = None
        self.prepared: Any = None  # the prepared data (`init`); None: sequences given directly
        self.plan: PrivacyPlan | None = None
        self.noise_multiplier: float | None = None
        self.group_size = 1  # rows per clipped unit: a ULS user's capped sequences
        self.kept_rows: np.ndarray | None = None

    @property
    def is_writer(self) -> bool:
        return self.layout.is_writer

    @property
    def total(self) -> int:
        return self.tcfg.steps

    @property
    def eval_every(self) -> int:
        return self.tcfg.eval_every

    @property
    def checkpoint_every(self) -> int:
        return self.tcfg.checkpoint_every

    # ------------------------------------------------------------------ configuration
    def _autocast_dtype(self, large: bool) -> torch.dtype | None:
        d = self.tcfg.dtype
        if d == "bfloat16" or (d == "auto" and large and self.device.type == "cuda"):
            return torch.bfloat16
        return None

    def model_vocab_size(self) -> int:
        return model_vocab_size(self.cfg.model)

    # ------------------------------------------------------------------ model and optimizer
    def build_model(self, vocab_size: int) -> torch.nn.Module:
        """The seeded fp32 model on the layout's device (activation checkpointing if asked),
        laid out by the layout."""
        model = initial_model(self.cfg.model, vocab_size)
        model.config.use_cache = False
        if self.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        lora = self.cfg.model.lora
        if lora is not None:  # frozen base, seeded adapters (peft); the layout splits both
            if self.activation_checkpointing:
                model.enable_input_require_grads()
            model = apply_lora(model, lora, seed=self.cfg.model.init_seed)
        return self.layout.parallelize(model.to(self.device).train())

    def build_optimizer(self) -> torch.optim.Optimizer:
        """AdamW over the model's trainable (local) parameters, built after the layout sharded
        them; under LoRA the frozen base has no optimizer state."""
        return make_optimizer([p for p in self.model.parameters() if p.requires_grad], self.tcfg)

    # ------------------------------------------------------------------ batches
    def step_rows(self, step: int) -> np.ndarray:
        """Global row indices of step `step` (0-based): fixed-size, or Poisson under DP."""
        return self.sampler.indices(step)

    def make_batch(self, rows: np.ndarray) -> Batch:
        """The global batch of `rows` on the device (every process of a grid holds all of it)."""
        pad = rows < 0  # ULS: a user's group padded with rows that have no target
        rows = np.where(pad, 0, rows) if pad.any() else rows
        ids_np = self.train_set.input_ids[rows]
        am_np = self.train_set.attention_mask[rows]
        ids = torch.as_tensor(ids_np, dtype=torch.long, device=self.device)
        am = torch.as_tensor(am_np, dtype=torch.long, device=self.device)
        mask = target_mask(am)
        gf = self.tcfg.goldfish
        if gf.enabled:
            mask &= goldfish_mask(ids, k=gf.k, h=gf.h).to(mask.device)
        if pad.any():
            mask[torch.as_tensor(pad, device=mask.device)] = False
        return Batch(ids, am, mask, is_right_padded(am_np))

    # ------------------------------------------------------------------ one step
    def compute_gradients(self, batch: Batch) -> dict[str, float]:
        """Forward/backward of the token-mean loss, accumulated over micro-batches of
        `train.micro_batch_size` global rows into .grad; the layout syncs once at the end."""
        b = batch.input_ids.shape[0]
        micro = self.tcfg.micro_batch_size or max(b, 1)
        total_targets = int(batch.loss_mask[:, 1:].sum())  # global: every process holds the batch
        loss_sum = 0.0
        for s in range(0, b, micro):
            part = batch.rows(slice(s, s + micro))
            n = int(part.loss_mask[:, 1:].sum())
            if n == 0:
                continue
            first = self.layout.first_local_row(int(part.input_ids.shape[0]), s)
            with dropout_rows(self.model, first):  # backward too: a recomputed forward drops alike
                loss, logged = self.layout.chunk_loss(self.model, part, self.autocast_dtype)
                if n != total_targets:  # weight by this chunk's share so the sum is the batch mean
                    loss, logged = loss * (n / total_targets), logged * (n / total_targets)
                loss.backward()
            loss_sum += float(logged)
        self.layout.finish_gradients(self.model)
        return {"loss": loss_sum}

    def clip_gradients(self) -> float:
        """Global-norm clipping to train.grad_clip; returns the norm before clipping."""
        clip = self.tcfg.grad_clip if self.tcfg.grad_clip is not None else math.inf
        return self.layout.clip_grad_norm_(self.model, clip)

    def grad_norm(self) -> float:
        return self.layout.grad_norm(self.model)

    def private_gradients(self, step: int, rows: np.ndarray) -> dict[str, float]:
        """DP-SGD: noisy clipped mean gradient into .grad (no extra global clipping)."""
        b = self.make_batch(rows)
        with autocast(self.device, self.autocast_dtype):
            stats = self.dp.step_gradients(b.input_ids, b.attention_mask, b.loss_mask, step=step,
                                           right_padded=b.right_padded, group_size=self.group_size)
        return {k: float(v) for k, v in stats.items()}

    def optimizer_step(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def train_step(self, step: int) -> dict[str, Any]:
        """One optimizer update (0-based `step`); returns its metrics line."""
        t0 = time.perf_counter()
        lr = lr_at(step, lr=self.tcfg.lr, warmup_steps=self.tcfg.warmup_steps,
                   total_steps=self.tcfg.steps, min_lr_ratio=self.tcfg.min_lr_ratio)
        rows = self.step_rows(step)
        with dropout_step(self.model, seed=self.tcfg.seed, step=step):  # adapter dropout's masks
            if self.private:
                stats = self.private_gradients(step, rows)
                gnorm = self.grad_norm()
            else:
                stats = self.compute_gradients(self.make_batch(rows))
                gnorm = self.clip_gradients()
        self.optimizer_step(lr)
        dt = time.perf_counter() - t0
        positions = int((rows >= 0).sum()) * self.train_set.seq_len
        rec = {"step": step + 1, "loss": stats.pop("loss", math.nan), "lr": lr,
               "tokens_per_s": positions / dt if dt > 0 else 0.0, "grad_norm": gnorm,
               "batch_size": len(rows)}
        rec.update(stats)
        return rec

    def step(self, i: int) -> StepOutcome:
        """The driver's step: one update; under DP every step releases a noisy gradient."""
        return StepOutcome(self.train_step(i), released=self.private)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> tuple[float, float]:
        return self.layout.evaluate(self.model, self.holdout_set,
                                    batch_size=self.tcfg.micro_batch_size or self.tcfg.batch_size,
                                    max_batches=self.tcfg.eval_batches, autocast_dtype=self.autocast_dtype)

    # ------------------------------------------------------------------ privacy
    def setup_privacy(self) -> None:
        """DP-SGD: σ (calibrated to the target ε if given), the run's secret randomness shared by
        the sampler and the noise, and the plan the driver's ledger records. Under
        `privacy.max_examples_per_user` k only k sequences of each user are sampled from; under
        `privacy.unit=user` the plan is user-level (ELS or ULS, `memaudit.train.user_dp`)."""
        p = self.cfg.privacy
        # one secret per run, shared by the sampler and the noise; the writer keeps it before the
        # other ranks prepare (they read it: no collective inside prepare)
        self.randomness = dp_randomness(self.run, self.cfg, is_writer=self.is_writer)
        self.kept_rows = self._contribution_rows()
        if p.unit == "user":
            setup = user_dp.uls_setup if p.user_sampling == "uls" else user_dp.els_setup
            sigma, self.sampler, self.plan, self.group_size = setup(
                self.cfg, self.train_set, self.kept_rows, self.randomness)
            self.noise_multiplier = float(sigma)
            self.dp = DPSGD(self.model, clip=p.clip, noise_multiplier=float(sigma),
                            expected_batch_size=self.sampler.expected_batch_size, randomness=self.randomness,
                            population=self.plan.mechanism.population, micro_batch_size=self.tcfg.micro_batch_size,
                            clipping=self.layout.dp_clipping(self.model, "ghost"))
            return
        sigma, self.sampler, self.plan, _ = user_dp.example_setup(
            self.cfg, self.train_set, self.kept_rows, self.randomness,
            max_sequences_per_document=getattr(self.prepared, "max_sequences_per_document", None))
        self.noise_multiplier = sigma
        # one DP-SGD for every layout; the per-example norms, clipped sum and noise are the layout's
        self.dp = DPSGD(self.model, clip=p.clip, noise_multiplier=sigma,
                        expected_batch_size=self.sampler.expected_batch_size, randomness=self.randomness,
                        population=len(self.kept_rows), micro_batch_size=self.tcfg.micro_batch_size,
                        clipping=self.layout.dp_clipping(self.model, "ghost"))

    def _contribution_rows(self) -> np.ndarray:
        """The rows DP samples from: every row, or at most k per user (warned when k caps nothing)."""
        n, k = len(self.train_set), self.cfg.privacy.max_examples_per_user
        if k is None:
            return np.arange(n, dtype=np.int64)
        most = int(np.bincount(self.train_set.user_index).max()) if n else 0
        if k > most and self.progress is not None:
            self.progress(0, self.total, {"phase": "data", "warning": (
                f"privacy.max_examples_per_user={k} exceeds the most sequences any user has ({most}); "
                "no user is capped")})
        return cap_per_user(self.train_set.user_index, k, self.tcfg.seed)

    def privacy_plan(self) -> PrivacyPlan | None:
        return self.plan

    # ------------------------------------------------------------------ checkpoints
    def has_checkpoint(self) -> bool:
        return ckpt.has_state(self.run)

    def save(self, session: Session, done: int, scalars: dict[str, Any], files: dict[str, Any]) -> None:
        """The layout's checkpoint of `done` steps: weights, optimizer, RNG, the DP-SGD state,
        and the thread count the CPU kernels split their reductions by (exact resume)."""
        extra = {"dp": self.dp.state_dict()} if self.dp is not None else {}
        scalars = {**scalars, "noise_multiplier": self.noise_multiplier, "torch_threads": torch.get_num_threads()}
        self.layout.write_state(session, done, self.model, self.optimizer, scalars=scalars, extra=extra,
                                files=files or None)

    def read_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load state/ (in whatever layout it was written) into the model, optimizer and RNG."""
        return self.layout.read_state(self.run, self.model, self.optimizer)

    def load(self, session: Session) -> dict[str, Any]:
        """state/ into the model, optimizer, RNG and DP-SGD state; returns its scalars."""
        scalars, extra = self.read_state()
        if self.dp is not None and "dp" in extra:
            self.dp.load_state_dict(extra["dp"])
        return scalars

    def export(self, session: Session) -> None:
        """The merged Hugging Face model into model/ (the writer writes; a collective on a grid);
        under LoRA also the PEFT adapter folder into adapter/ (`memaudit.models.lora`)."""
        if self.cfg.model.lora is None:
            self.layout.export_model(session, self.model, self.prepared)
            return
        whole = self.layout.lora_model(self.model)  # a grid assembles its shards on the writer
        if whole is None:
            return
        session.export_hf(merged_copy(whole), tokenizer=self.prepared.tokenizer(),
                          tokenizer_dir=self.prepared.tokenizer_dir)
        save_adapter(whole, self.run.path, base=self.cfg.model.init_from)

    # ------------------------------------------------------------------ the driver's hooks
    @contextlib.contextmanager
    def running(self, session: Session, resume: bool) -> Iterator[None]:
        """Deterministic CPU kernels, on the checkpoint's thread count when resuming, and on the
        CPU the memory each step frees kept for the next (`kept_freed_memory`)."""
        with (deterministic(self.device), cpu_threads(self._checkpoint_threads() if resume else None),
              kept_freed_memory(self.device)):
            yield

    def prepare(self, session: Session) -> None:
        """Data, model, optimizer, sampler (and DP) for this run; the writer's first."""
        self.session = session
        with self.layout.writer_first():
            self._prepare()

    def _prepare(self) -> None:
        vocab = self.model_vocab_size()
        # staged by the lifecycle; tokenizer size and set sizes checked then (`checks.check_data`)
        self.prepared = self.session.data()
        self.train_set: PackedSequences = self.prepared.train
        self.holdout_set: PackedSequences = self.prepared.holdout
        self.model = self.build_model(vocab)
        self.optimizer = self.build_optimizer()
        self.sampler = EpochBatches(len(self.train_set), self.tcfg.batch_size, self.tcfg.seed)
        if self.private:
            self.setup_privacy()

    def begin(self) -> None:
        """Nothing to synchronise: every rank computes the same batches from (seed, step)."""

    def finish(self) -> None:
        """The export was the collective that ends a grid's run."""

    def train_sequences(self) -> int:
        return len(self.train_set)

    def parameters(self) -> int:
        return self.layout.num_parameters(self.model)

    def details(self) -> dict[str, Any]:
        # full: the logical model; LoRA: the logical adapters and base (a grid's shards count whole)
        counts = (parameter_counts(self.model) if self.cfg.model.lora is not None
                  else {"trained_parameters": self.parameters(), "frozen_parameters": 0})
        out = {"engine": "torch", "device": self.device.type, "torch_threads": torch.get_num_threads(),
               "trained": trained_label(self.cfg.model.lora), **counts}
        p = self.cfg.privacy
        if self.private and (p.unit == "user" or p.max_examples_per_user is not None):
            out["contribution_bound"] = {"unit": p.unit, "max_examples_per_user": p.max_examples_per_user,
                                         "user_sampling": p.user_sampling if p.unit == "user" else None,
                                         "sequences_sampled_from": len(self.kept_rows)}
        return out

    def _checkpoint_threads(self) -> int | None:
        """The torch CPU thread count the checkpoint was written on (None: no checkpoint, or one
        from before memaudit recorded it); read after the session has recovered state/."""
        if not ckpt.has_state(self.run):
            return None
        n = ckpt.read_scalars(self.run).get("torch_threads")
        return n if isinstance(n, int) and n > 0 else None


CentralizedTrainer = Trainer  # the name benchmarks and the randomness tests construct (one process)
