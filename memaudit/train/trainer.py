"""The centralized trainer: one process, PyTorch, Hugging Face Llama.

`train_centralized(cfg, run)` prepares the data, builds the preset model, trains it with
AdamW (linear warm-up, cosine decay, global-norm clipping, gradient accumulation; bf16
autocast and activation checkpointing for the large presets on GPU) or with DP-SGD when
`cfg.privacy.enabled`, writes `metrics.jsonl`, resumable checkpoints in `state/`, the
privacy ledger, and the final Hugging Face model in `model/`.

Exact resume: the batch of step t is a function of (train.seed, t) only, the learning
rate is a function of t only, and a checkpoint holds the weights, the optimizer moments,
the RNG and the DP noise-generator state; so on the CPU an interrupted-and-resumed run
ends with weights bit-identical to an uninterrupted one.

Extension point (the data x tensor-parallel backend): subclass `CentralizedTrainer` and
override the seams marked "seam" below — `select_device` (a rank's GPU), `load_data` (the
writer prepares, the others load after a barrier), `build_model` (parallelize after
building; the optimizer is built afterwards from the local shards), `local_rows` (this
data-parallel rank's share of the global batch), `compute_gradients` / `clip_gradients` /
`private_gradients` / `make_dp` (collectives; DP-SGD of the sharded model), `evaluate`,
`save_checkpoint` / `restore_checkpoint` / `export_model` (shard or gather), and set
`is_writer = False` on every rank but one.

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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from memaudit.config import Config
from memaudit.errors import MemauditError
from memaudit.lifecycle import RunSession
from memaudit.rundir import RunDir
from memaudit.train import checkpoint as ckpt
from memaudit.train.batches import EpochBatches
from memaudit.train.evaluate import holdout_loss, is_right_padded, target_mask
from memaudit.train.schedule import lr_at

if TYPE_CHECKING:
    import torch

    from memaudit.data.packing import PackedSequences

ProgressFn = Callable[[int, int, dict[str, Any]], None]
BACKEND = "parallel"


@dataclass
class Batch:
    """One step's (local) batch on the training device."""

    input_ids: torch.Tensor  # (B, L) int64
    attention_mask: torch.Tensor  # (B, L) int64, 1 = real token
    loss_mask: torch.Tensor  # (B, L) bool, True = counted target (never position 0)
    right_padded: bool  # then the model runs without an attention mask

    @property
    def num_positions(self) -> int:
        return int(self.input_ids.numel())


def train_centralized(
    cfg: Config, run: RunDir, *, resume: bool = False, progress: ProgressFn | None = None,
    **session_kw: Any,
) -> dict[str, Any]:
    """Train `cfg` into `run` (single process) and return the result summary.

    Args:
        cfg: the resolved config.
        run: the run directory; the caller has checked it with `prepare_new_run` or
            `open_for_resume`. A fresh run removes memaudit's artifacts of a previous run.
        resume: continue from `run`'s last checkpoint (or from the start if it has none).
        progress: called as progress(done_steps, total_steps, info) after every step.
        session_kw: passed to the run lifecycle (`overwrite`, `lock_held`).

    Returns:
        {"steps", "final_holdout_loss", "final_holdout_perplexity", "initial_holdout_loss",
         "final_train_loss", "train_seconds", "parameters", "epsilon" (DP only), ...}
    """
    return CentralizedTrainer(cfg, run, progress=progress).fit(resume=resume, **session_kw)


@contextlib.contextmanager
def deterministic(device: torch.device) -> Iterator[None]:
    """Deterministic kernels on the CPU (exact resume); CUDA keeps its fast kernels."""
    import torch

    if device.type != "cpu":
        yield
        return
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


class CentralizedTrainer:
    """Single-process trainer; the methods marked "seam" are what a distributed subclass overrides."""

    is_writer = True  # writes run.json, run.lock, metrics.jsonl, state/, model/, privacy.json

    def __init__(self, cfg: Config, run: RunDir, *, progress: ProgressFn | None = None) -> None:
        from memaudit.models.presets import LARGE_PRESETS

        self.cfg, self.run, self.progress = cfg, run, progress
        self.tcfg = cfg.train
        self.device = self.select_device()
        large = cfg.model.preset in LARGE_PRESETS and cfg.model.name_or_path is None
        self.autocast_dtype = self._autocast_dtype(large)
        ac = self.tcfg.activation_checkpointing
        self.activation_checkpointing = (self.device.type == "cuda" and large) if ac is None else ac
        self.private = cfg.privacy.enabled
        self.model: torch.nn.Module
        self.optimizer: torch.optim.Optimizer
        self.dp: Any = None
        self.ledger: Any = None
        self.noise_multiplier: float | None = None
        self.initial_holdout: tuple[float, float] = (math.nan, math.nan)

    # ------------------------------------------------------------------ configuration
    def select_device(self) -> torch.device:  # seam: a rank picks its own GPU
        import torch

        want = self.cfg.train.device
        if want == "cuda" and not torch.cuda.is_available():
            raise MemauditError("train.device=cuda but no CUDA device is visible; use train.device=auto")
        return torch.device("cuda" if want != "cpu" and torch.cuda.is_available() else "cpu")

    def _autocast_dtype(self, large: bool) -> torch.dtype | None:
        import torch

        d = self.tcfg.dtype
        if d == "bfloat16" or (d == "auto" and large and self.device.type == "cuda"):
            return torch.bfloat16
        return None

    def model_vocab_size(self) -> int:
        from memaudit.models.presets import model_vocab_size

        return model_vocab_size(self.cfg.model)

    # ------------------------------------------------------------------ seams: model and optimizer
    def build_model(self, vocab_size: int) -> torch.nn.Module:  # seam: parallelize_llama here
        """The seeded fp32 model on `self.device`, with activation checkpointing if asked."""
        from memaudit.models.init import initial_model

        model = initial_model(self.cfg.model, vocab_size)
        model.config.use_cache = False
        if self.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model.to(self.device).train()

    def build_optimizer(self) -> torch.optim.Optimizer:
        import torch

        t = self.tcfg
        return torch.optim.AdamW(
            self.model.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay
        )

    # ------------------------------------------------------------------ seams: batches
    def step_rows(self, step: int) -> np.ndarray:
        """Global row indices of step `step` (0-based): fixed-size, or Poisson under DP."""
        return self.sampler.indices(step)

    def local_rows(self, rows: np.ndarray) -> np.ndarray:  # seam: this data-parallel rank's share
        return rows

    def make_batch(self, rows: np.ndarray) -> Batch:
        import torch

        ids_np = self.train_set.input_ids[rows]
        am_np = self.train_set.attention_mask[rows]
        ids = torch.as_tensor(ids_np, dtype=torch.long, device=self.device)
        am = torch.as_tensor(am_np, dtype=torch.long, device=self.device)
        mask = target_mask(am)
        gf = self.tcfg.goldfish
        if gf.enabled:
            from memaudit.train.goldfish import goldfish_mask

            mask &= goldfish_mask(ids, k=gf.k, h=gf.h).to(mask.device)
        return Batch(ids, am, mask, is_right_padded(am_np))

    # ------------------------------------------------------------------ seams: one step
    def _autocast(self) -> contextlib.AbstractContextManager:
        import torch

        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def compute_gradients(self, batch: Batch) -> dict[str, float]:  # seam: collectives go here
        """Forward/backward of the token-mean loss, accumulated over micro-batches into .grad."""
        from memaudit.train.losses import causal_lm_loss

        b = batch.input_ids.shape[0]
        micro = self.tcfg.micro_batch_size or b
        total_targets = int(batch.loss_mask[:, 1:].sum())
        loss_sum = 0.0
        for s in range(0, b, micro):
            ids, lm = batch.input_ids[s : s + micro], batch.loss_mask[s : s + micro]
            n = int(lm[:, 1:].sum())
            if n == 0:
                continue
            am = None if batch.right_padded else batch.attention_mask[s : s + micro]
            with self._autocast():
                logits = self.model(input_ids=ids, attention_mask=am).logits  # (b, L, V)
            loss = causal_lm_loss(logits, ids, lm)
            if n != total_targets:  # weight by this chunk's share so the sum is the batch mean
                loss = loss * (n / total_targets)
            loss.backward()
            loss_sum += float(loss.detach())
        return {"loss": loss_sum}

    def clip_gradients(self) -> float:  # seam: the global norm spans every shard
        """Global-norm clipping to train.grad_clip; returns the norm before clipping."""
        import torch

        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        clip = self.tcfg.grad_clip if self.tcfg.grad_clip is not None else math.inf
        return float(torch.nn.utils.clip_grad_norm_(params, clip, foreach=True))

    def grad_norm(self) -> float:
        import torch

        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))) if grads else 0.0

    def private_gradients(self, rows: np.ndarray) -> dict[str, float]:
        """DP-SGD: noisy clipped mean gradient into .grad (no extra global clipping)."""
        batch = self.make_batch(rows)
        with self._autocast():
            stats = self.dp.step_gradients(batch.input_ids, batch.attention_mask, batch.loss_mask)
        return {k: float(v) for k, v in stats.items() if isinstance(v, int | float) or hasattr(v, "item")}

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
        rows = self.local_rows(self.step_rows(step))
        if self.private:
            stats = self.private_gradients(rows)
            gnorm = self.grad_norm()
            self.ledger_step()
        else:
            stats = self.compute_gradients(self.make_batch(rows))
            gnorm = self.clip_gradients()
        self.optimizer_step(lr)
        dt = time.perf_counter() - t0
        positions = len(rows) * self.train_set.seq_len
        rec = {"step": step + 1, "loss": stats.pop("loss", math.nan), "lr": lr,
               "tokens_per_s": positions / dt if dt > 0 else 0.0, "grad_norm": gnorm,
               "batch_size": len(rows)}
        rec.update(stats)
        return rec

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> tuple[float, float]:  # seam: vocabulary-parallel loss
        h = self.holdout_set
        return holdout_loss(
            self.model, h.input_ids, h.attention_mask,
            batch_size=self.tcfg.micro_batch_size or self.tcfg.batch_size,
            max_batches=self.tcfg.eval_batches, device=self.device, autocast_dtype=self.autocast_dtype,
        )

    # ------------------------------------------------------------------ privacy
    def setup_privacy(self) -> None:
        from memaudit.privacy.accounting import default_delta
        from memaudit.train.sampling import PoissonSampler

        p, n = self.cfg.privacy, len(self.train_set)
        q = self.tcfg.batch_size / n  # <= 1: dispatch.check_data refused a larger batch
        delta = p.delta if p.delta is not None else default_delta(n)
        sigma, self.calibration = p.noise_multiplier, None
        if sigma is None:
            from memaudit.privacy.calibrate import calibrate_noise

            acc = "rdp" if p.accountant == "both" else p.accountant
            sigma = calibrate_noise(p.target_epsilon, q=q, steps=self.tcfg.steps, delta=delta, accountant=acc)
            self.calibration = {"target_epsilon": p.target_epsilon, "accountant": acc,
                                "steps": self.tcfg.steps, "sampling_rate": q, "noise_multiplier": sigma}
        self.noise_multiplier, self.sampling_rate, self.delta = float(sigma), q, delta
        # privacy: one secret per run, shared by the sampler and the noise. The writer keeps it in
        # state/ before the other ranks prepare (they read it there: no collective inside prepare)
        from memaudit.privacy.randomness import DPRandomness

        # RUN_DIR/dp_secret.json: outside state/, which the lifecycle replaces only by sealed checkpoints
        self.randomness = DPRandomness.for_run(self.run.path, p, self.tcfg.seed, write=self.is_writer)
        self.sampler = PoissonSampler(n, q, self.randomness)
        self.dp = self.make_dp(clip=p.clip, noise_multiplier=float(sigma),
                               expected_batch_size=self.sampler.expected_batch_size,
                               randomness=self.randomness, population=n)
        self.ledger = self.new_ledger()

    def make_dp(self, *, clip: float, noise_multiplier: float, expected_batch_size: float,
                randomness: Any, population: int) -> Any:  # seam: DP-SGD of the parallel model
        """The DP-SGD component of `self.model`, used by `private_gradients` and checkpoints.

        It has `step_gradients(input_ids, attention_mask, loss_mask) -> stats` (the privatised
        mean gradient into `.grad`), `mechanism` (what a step adds, for the ledger),
        `state_dict()` and `load_state_dict(sd)`; `randomness` is the run's `DPRandomness`.
        """
        from memaudit.train.dpsgd import DPSGD

        return DPSGD(self.model, clip=clip, noise_multiplier=noise_multiplier,
                     expected_batch_size=expected_batch_size, randomness=randomness, population=population,
                     mode="ghost", micro_batch_size=self.tcfg.micro_batch_size)

    def new_ledger(self) -> Any:
        from memaudit.privacy.ledger import PrivacyLedger

        counts = np.bincount(self.train_set.user_index) if len(self.train_set) else np.zeros(1, int)
        return PrivacyLedger(unit="example", delta=self.delta, max_sequences_per_user=int(counts.max()),
                             calibration=self.calibration, reproducible_randomness=self.randomness.reproducible)

    def ledger_step(self) -> None:
        self.ledger.record_mechanism(self.dp.mechanism)  # the mechanism declares its own event

    def ledger_json(self) -> dict[str, Any] | None:
        return None if self.ledger is None else self.ledger.to_json()

    def write_ledger(self) -> None:
        if self.ledger is not None:
            self.session.write_ledger(self.ledger_json())

    # ------------------------------------------------------------------ seams: checkpoints
    def save_checkpoint(self, step: int) -> None:
        extra = {"dp": self.dp.state_dict()} if self.dp is not None else {}
        ledger = self.ledger_json() if self.ledger is not None and self.is_writer else None
        files = {"privacy.json": ledger} if ledger is not None else None  # accounted once, saved twice
        scalars = {"step": step, "metrics_count": step, "initial_holdout_loss": self.initial_holdout[0],
                   "initial_holdout_perplexity": self.initial_holdout[1],
                   "noise_multiplier": self.noise_multiplier}
        self.write_state(step, scalars, extra=extra, files=files)
        self.session.write_ledger(ledger)

    def write_state(self, step: int, scalars: dict[str, Any], *, extra: dict[str, Any],
                    files: dict[str, Any] | None) -> None:  # seam: sharded save
        if self.is_writer:
            with self.session.checkpoint(step) as d:
                ckpt.write_state(d, model=self.model, optimizer=self.optimizer, scalars=scalars,
                                 extra=extra, files=files)

    def read_state(self) -> tuple[dict[str, Any], dict[str, Any]]:  # seam: sharded load
        """Load state/ into the model, optimizer and RNG; return (scalars, extra)."""
        return ckpt.load_state(self.run, model=self.model, optimizer=self.optimizer, device=self.device)

    def restore_checkpoint(self) -> int:
        """Load state/ into the model, optimizer, RNG and DP state; return the step to start at."""
        scalars, extra = self.read_state()
        if self.dp is not None and "dp" in extra:
            self.dp.load_state_dict(extra["dp"])
        if self.ledger is not None:
            saved = self.session.state_file("privacy.json")
            if saved is not None:
                from memaudit.privacy.ledger import PrivacyLedger

                self.ledger = PrivacyLedger.from_json(saved)
                self.ledger.truncate_steps(int(scalars["step"]))
        self.initial_holdout = (scalars["initial_holdout_loss"], scalars["initial_holdout_perplexity"])
        return int(scalars["step"])

    def export_model(self) -> None:  # seam: gather a merged checkpoint on the writer
        if self.is_writer:
            self.session.export_hf(self.model, tokenizer=self.prepared.tokenizer(),
                                   tokenizer_dir=self.prepared.tokenizer_dir)

    # ------------------------------------------------------------------ driver
    def load_data(self) -> Any:  # seam: the writer prepares, then the others load
        """The run's PreparedData, staged and checked by the lifecycle (`dispatch.check_data`)."""
        return self.session.data()

    def prepare(self, resume: bool) -> None:
        """Data, model, optimizer, sampler (and DP) for this run."""
        vocab = self.model_vocab_size()
        self.prepared = self.load_data()  # tokenizer size and set sizes checked when it was staged
        self.train_set: PackedSequences = self.prepared.train
        self.holdout_set: PackedSequences = self.prepared.holdout
        self.model = self.build_model(vocab)
        self.optimizer = self.build_optimizer()
        self.sampler = EpochBatches(len(self.train_set), self.tcfg.batch_size, self.tcfg.seed)
        if self.private:
            self.setup_privacy()

    def _notify(self, done: int, info: dict[str, Any]) -> None:
        if self.progress is not None:
            self.progress(done, self.tcfg.steps, info)

    def _loop(self, start: int) -> dict[str, Any]:
        total = self.tcfg.steps
        last: dict[str, Any] = {}
        for step in range(start, total):
            rec = self.train_step(step)
            done = step + 1
            if done % self.tcfg.eval_every == 0 or done == total:
                rec["holdout_loss"], rec["holdout_perplexity"] = self.evaluate()
            self.session.log(rec)
            if done % self.tcfg.checkpoint_every == 0 and done < total:
                self.save_checkpoint(done)
            self._notify(done, rec)
            last = rec
        return last

    def _train(self, resume: bool) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.prepare(resume)
        start = 0
        if resume and ckpt.has_state(self.run):
            start = self.restore_checkpoint()
        else:
            self.initial_holdout = self.evaluate()
        self.session.start(start)
        self._notify(start, {"phase": "training"})
        last = self._loop(start)
        if "holdout_loss" in last:
            final = (last["holdout_loss"], last["holdout_perplexity"])
        else:  # resumed at the very end: nothing left to run
            final = self.evaluate()
        self.export_model()
        self.write_ledger()
        result = {
            "steps": self.tcfg.steps,
            "final_holdout_loss": final[0],
            "final_holdout_perplexity": final[1],
            "initial_holdout_loss": self.initial_holdout[0],
            "initial_holdout_perplexity": self.initial_holdout[1],
            # the training loss is a statistic of the private data: not in run.json under DP
            "final_train_loss": None if self.private else last.get("loss"),
            "train_sequences": len(self.train_set),
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "device": self.device.type,
            "train_seconds": time.perf_counter() - t0,
            "resumed_from_step": start if resume else None,
        }
        if self.ledger is not None:
            result["privacy"] = {"noise_multiplier": self.noise_multiplier, "sampling_rate": self.sampling_rate,
                                 "delta": self.delta, "epsilon": self.ledger_json().get("epsilon")}
        return result

    def fit(self, *, resume: bool = False, overwrite: bool = False, lock_held: bool = False) -> dict[str, Any]:
        """Run (or resume) training inside the run lifecycle (lock, manifest, signals)."""
        session = RunSession(self.run, self.cfg, backend=BACKEND, resume=resume, is_writer=self.is_writer,
                             hold_lock=not lock_held, overwrite=overwrite,
                             data_progress=lambda i, n, info: self._notify(0, {"phase": "data", **info}))
        with session, deterministic(self.device):
            self.session = session
            result = self._train(resume)
            session.complete(result)
        return result
