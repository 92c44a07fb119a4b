"""The one training driver: `fit(session, backend)` for every backend.

The loop over steps (centralized) or rounds (federated), the holdout evaluation, the
checkpoints, the privacy ledger, interruption and the result are written once, here. A backend
(`memaudit.train.trainer.Trainer`: torch over a `Layout`; `memaudit.federated.trainer.
FederatedTrainer`: JAX over an in-process or a Flower runtime) provides what differs: set-up,
one step, evaluation, its checkpoint format, the export and its privacy mechanism.

The ledger is set up and restored here alone: the backend states its `PrivacyPlan` (unit, δ,
noise multiplier, the mechanism that declares its own `DpEvent`), every step or round that
released something records that mechanism's event, each checkpoint carries the ledger as of
its step, and a resume reads that copy back. The DP secret is the run lifecycle's
(`memaudit.privacy.randomness.dp_randomness`).

    with RunSession(run, cfg, backend=backend.name, resume=resume, ...) as session:
        result = fit(session, backend, resume=resume)   # a TrainResult

References:
    torchtitan's `Trainer` (one loop, model parallelism applied from outside) and optax's
    (init, update) pairs, the shapes this follows (`../shared/STYLE.md`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from memaudit.backends import StepOutcome
from memaudit.io import writing
from memaudit.privacy.ledger import PrivacyLedger
from memaudit.privacy.plan import PrivacyPlan, new_ledger
from memaudit.run.lifecycle import RunSession

ProgressFn = Callable[[int, int, dict[str, Any]], None]


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """What a training run ends with; `to_json()` is run.json's `result`.

    `resumed_from` is the step (or round) training resumed at, None for a run that was not
    resumed; `details` holds what only one backend has (device, torch threads; clients, mesh).
    """

    backend: str
    counter: str
    steps: int
    final_holdout_loss: float
    final_holdout_perplexity: float
    initial_holdout_loss: float
    initial_holdout_perplexity: float
    final_train_loss: float | None
    train_sequences: int
    parameters: int
    train_seconds: float
    resumed_from: int | None
    privacy: dict[str, Any] | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "steps": self.steps,
            "final_holdout_loss": self.final_holdout_loss,
            "final_holdout_perplexity": self.final_holdout_perplexity,
            "initial_holdout_loss": self.initial_holdout_loss,
            "initial_holdout_perplexity": self.initial_holdout_perplexity,
            "final_train_loss": self.final_train_loss,
            "train_sequences": self.train_sequences,
            "parameters": self.parameters,
            "train_seconds": self.train_seconds,
            "resumed_from_step": self.resumed_from,
        }
        if self.counter == "round":
            out.update(rounds=self.steps, resumed_from_round=self.resumed_from)
        out.update(self.details)
        if self.privacy is not None:
            out["privacy"] = dict(self.privacy)
        return out


class Backend(Protocol):
    """What `fit` asks of a backend. Nothing here writes to the run directory except through
    the `RunSession` it is handed."""

    name: ClassVar[str]  # recorded in run.json; a resume must match
    counter: ClassVar[str]  # "step" or "round": the metrics key, and what `total` counts
    is_writer: bool  # this process writes the run directory
    private: bool  # DP training

    @property
    def total(self) -> int: ...
    @property
    def eval_every(self) -> int: ...
    @property
    def checkpoint_every(self) -> int: ...

    def running(self, session: RunSession, resume: bool) -> AbstractContextManager[Any]:
        """The context the whole run executes in (deterministic kernels, thread counts)."""
    def prepare(self, session: RunSession) -> None:
        """Data, model, optimizer, sampler and the DP mechanism (`privacy_plan`)."""
    def privacy_plan(self) -> PrivacyPlan | None:
        """The DP plan after `prepare`; None without DP."""
    def has_checkpoint(self) -> bool: ...
    def load(self, session: RunSession) -> dict[str, Any]:
        """state/ into the model and optimizer; returns the checkpoint's scalars."""
    def save(self, session: RunSession, done: int, scalars: dict[str, Any], files: dict[str, Any]) -> None:
        """The checkpoint after `done` steps, sealed and swapped in through `session`."""
    def begin(self) -> None:
        """Called once before the first step (after a resume's `load`)."""
    def step(self, i: int) -> StepOutcome:
        """One optimizer step or federated round (0-based `i`)."""
    def evaluate(self) -> tuple[float, float]:
        """Holdout (loss, perplexity) of the current model."""
    def export(self, session: RunSession) -> None:
        """The Hugging Face checkpoint into model/ (a collective on a grid)."""
    def finish(self) -> None:
        """Called on every process after the export and the ledger (e.g. a barrier)."""
    def details(self) -> dict[str, Any]:
        """The result's backend-only fields."""
    def train_sequences(self) -> int: ...
    def parameters(self) -> int: ...


@dataclass
class _Run:
    """The driver's own state over one run."""

    ledger: PrivacyLedger | None = None
    initial: tuple[float, float] = (math.nan, math.nan)
    start: int = 0
    epsilon: float | None = None  # ε so far, for the progress display under DP


def _restore(session: RunSession, backend: Backend, run: _Run) -> None:
    """A resume: the backend's checkpoint, then the ledger as of that checkpoint."""
    scalars = backend.load(session)
    run.start = int(scalars[backend.counter])
    run.initial = (scalars["initial_holdout_loss"], scalars["initial_holdout_perplexity"])
    saved = session.state_file("privacy.json")
    if run.ledger is not None and saved is not None:
        ledger = PrivacyLedger.from_json(saved)
        # the checkpoint's copy is its step's: cut anything recorded past it (a copy written
        # without the count predates it and is the checkpoint's as it is)
        ledger.truncate_steps(int(scalars.get("ledger_steps", ledger.steps)))
        if ledger.max_sequences_per_document is None:  # a copy written before memaudit counted m
            ledger.max_sequences_per_document = run.ledger.max_sequences_per_document
        run.ledger = ledger


def _checkpoint(session: RunSession, backend: Backend, run: _Run, done: int) -> None:
    # the per-document epsilon (a mixture PLD) waits for the run's last write
    ledger = run.ledger.to_json(with_document=False) if run.ledger is not None and backend.is_writer else None
    scalars = {backend.counter: done, "metrics_count": done, "initial_holdout_loss": run.initial[0],
               "initial_holdout_perplexity": run.initial[1]}
    if run.ledger is not None:
        scalars["ledger_steps"] = run.ledger.steps
    # the ledger is saved twice: in the sealed checkpoint (restored with it) and as privacy.json
    with writing(session.run.state_dir):  # a full disk: one line naming the checkpoint it writes
        backend.save(session, done, scalars, {"privacy.json": ledger} if ledger is not None else {})
    session.write_ledger(ledger)


def _progress_info(backend: Backend, run: _Run, rec: dict[str, Any], done: int) -> dict[str, Any]:
    """What the progress display is given after a step: the step's record without DP; under DP
    only ε so far (recomputed from the ledger at each evaluation and at the end), never the loss
    or another unprivatised statistic of the private data (those go to sensitive_metrics.jsonl)."""
    if not backend.private:
        return rec
    if run.ledger is not None and (done % backend.eval_every == 0 or done == backend.total
                                   or run.epsilon is None):
        run.epsilon = _epsilon_so_far(run.ledger)
    return {"phase": "training", "epsilon": run.epsilon}


def _epsilon_so_far(ledger: PrivacyLedger) -> float | None:
    """ε at the ledger's δ by RDP, or by PLD where RDP cannot interpret an event."""
    for accountant in ("rdp", "pld"):
        try:
            return ledger.epsilon(accountant)
        except (ValueError, NotImplementedError, TypeError):
            continue
    return None


def _loop(session: RunSession, backend: Backend, run: _Run, plan: PrivacyPlan | None,
          notify: Callable[[int, dict[str, Any]], None]) -> dict[str, Any]:
    total, last = backend.total, {}
    for i in range(run.start, total):
        out = backend.step(i)
        if run.ledger is not None and out.released:
            run.ledger.record_mechanism(plan.mechanism, out.privacy_metrics)  # its own event
        rec, done = out.record, i + 1
        if done % backend.eval_every == 0 or done == total:
            rec["holdout_loss"], rec["holdout_perplexity"] = backend.evaluate()
        session.log(rec)
        if done % backend.checkpoint_every == 0 and done < total:
            _checkpoint(session, backend, run, done)
        notify(done, _progress_info(backend, run, rec, done))
        last = rec
    return last


def fit(session: RunSession, backend: Backend, *, resume: bool = False,
        progress: ProgressFn | None = None) -> TrainResult:
    """Train (or resume) `backend` inside an open `session`; returns the result, which the
    caller passes to `session.complete`.

    Args:
        session: the run's lifecycle, entered (lock, manifest, data staged or checked).
        backend: the backend, not yet prepared.
        resume: continue from state/ when it holds a checkpoint (else from step 0).
        progress: called as progress(done, total, info) on the writer (data, start, each step).
    """

    def notify(done: int, info: dict[str, Any]) -> None:
        if progress is not None and backend.is_writer:
            progress(done, backend.total, info)

    t0 = time.perf_counter()
    with backend.running(session, resume):
        backend.prepare(session)
        plan = backend.privacy_plan()
        run = _Run(ledger=new_ledger(plan) if plan is not None else None)
        if resume and backend.has_checkpoint():
            _restore(session, backend, run)
        else:
            run.initial = backend.evaluate()
        session.start(run.start)
        backend.begin()
        notify(run.start, {"phase": "training"})
        last = _loop(session, backend, run, plan, notify)
        # resumed at the very end: nothing left to run, so evaluate what was restored
        final = ((last["holdout_loss"], last["holdout_perplexity"]) if "holdout_loss" in last
                 else backend.evaluate())
        backend.export(session)
        ledger = run.ledger.to_json() if run.ledger is not None else None
        if ledger is not None:
            session.write_ledger(ledger)
        backend.finish()
        privacy = None
        if plan is not None and ledger is not None:
            privacy = {"noise_multiplier": plan.noise_multiplier, "sampling_rate": plan.sampling_rate,
                       "delta": plan.delta, "unit": plan.unit, "epsilon": ledger.get("epsilon"),
                       "document": ledger.get("document")}
        return TrainResult(
            backend=backend.name, counter=backend.counter, steps=backend.total,
            final_holdout_loss=final[0], final_holdout_perplexity=final[1],
            initial_holdout_loss=run.initial[0], initial_holdout_perplexity=run.initial[1],
            # the training loss is a statistic of the private data: not in run.json under DP
            final_train_loss=None if backend.private else last.get("loss"),
            train_sequences=backend.train_sequences(), parameters=backend.parameters(),
            train_seconds=time.perf_counter() - t0, resumed_from=run.start if resume else None,
            privacy=privacy, details=backend.details())


def run_backend(backend: Backend, cfg: Any, run_dir: Any, *, resume: bool = False, overwrite: bool = False,
                lock_held: bool = False, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Open the run's lifecycle and `fit` the backend in it; returns run.json's result."""
    session = RunSession(run_dir, cfg, backend=backend.name, resume=resume, is_writer=backend.is_writer,
                         hold_lock=not lock_held, overwrite=overwrite,
                         data_progress=(lambda i, n, info: progress(0, backend.total, {"phase": "data", **info}))
                         if progress is not None and backend.is_writer else None)
    with session:
        result = fit(session, backend, resume=resume, progress=progress).to_json()
        session.complete(result)
    return result


def run_trainer(backend: Any, *, resume: bool = False, overwrite: bool = False,
                lock_held: bool = False) -> dict[str, Any]:
    """`run_backend` for a trainer that holds its config, run directory and progress callback
    (`cfg`, `run`, `progress`: every memaudit backend does); returns run.json's result.

    Args:
        backend: the trainer (`train.trainer.Trainer`, `train.jax_trainer.JaxTrainer`,
            `federated.trainer.FederatedTrainer`), not yet prepared.
        resume: continue from state/ when it holds a checkpoint.
        overwrite: replace a previous memaudit run in the directory.
        lock_held: the caller holds the run's lock (a grid's launcher, a Flower submitter).
    """
    return run_backend(backend, backend.cfg, backend.run, resume=resume, overwrite=overwrite,
                       lock_held=lock_held, progress=backend.progress)
