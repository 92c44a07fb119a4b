"""One run lifecycle for every backend: lock, signals, manifest, data, metrics, ledger,
checkpoints, export.

The training driver (`memaudit.run.driver.fit`) goes through a `RunSession` for everything it does
to the run directory; the backends keep only their step or round logic:

    with RunSession(run, cfg, backend="federated", resume=False, is_writer=True) as s:
        prepared = s.data()                        # staged and checked at open, or the resume's
        s.start(step)                              # training starts at `step`: metrics.jsonl
                                                   # (and sensitive_metrics.jsonl) truncated there
        for step in range(start, total):
            ...
            s.log(record)                          # metrics.jsonl (+ sensitive_metrics.jsonl)
            with s.checkpoint(step) as tmp: ...    # sealed, then swapped in
        s.export_hf(model, tokenizer=..., tokenizer_dir=...)
        s.write_ledger(ledger_json)
        s.complete(result)

Crash safety is the checkpoint-directory protocol of `memaudit.checkpoints` (sealed
checkpoints, swapped in by renames, the newest complete one recovered at start).

Overwrite. `--overwrite` replaces a memaudit run only after the new config was validated:
the old run's artifacts are moved aside into one hidden folder, the new manifest is
written, and only then is the old one deleted; a failure before that puts it back.

The DP run's secret (`RUN_DIR/dp_secret.json`, outside `state/`, which is replaced only by
sealed checkpoints) is opened by `memaudit.privacy.randomness.dp_randomness`, for every backend.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

from memaudit.backends import backend_name
from memaudit.checkpoints import (
    checkpoint_candidates,
    clean_temporaries,
    recover_checkpoint,
    remove,
    seal,
    swap_in,
)
from memaudit.config import Config, dump_config
from memaudit.data import load_prepared, prepare_data
from memaudit.data.prepare import config_hash
from memaudit.errors import DataError, MemauditError, RunDirError, without_values
from memaudit.io import (
    append_jsonl,
    atomic_dir,
    atomic_write_json,
    private_tree,
    read_json,
    truncate_jsonl,
    writing,
)
from memaudit.models.hf_export import save_pretrained_quietly, set_special_tokens
from memaudit.models.init import base_model_record, model_vocab_size
from memaudit.run.checks import check_data
from memaudit.rundir import RUN_ARTIFACTS, RunDir, new_manifest, require_memaudit_manifest

SENSITIVE_METRICS = "sensitive_metrics.jsonl"
# Per-step values that are computed from the private data and not privatised: under DP they
# go to sensitive_metrics.jsonl (documented as sensitive, like data/), never to metrics.jsonl.
SENSITIVE_KEYS = frozenset({
    "loss", "batch_size", "cohort", "survivors", "dropped", "secagg_aborted", "clip_fraction",
    "clipped", "grad_norm", "update_norm", "raw_norm", "tokens_per_s", "round_seconds",
    "step_seconds", "count_fraction", "participants", "sequences",
    # the realized cohort's size, data and norms, and what is a function of them
    "aggregated_clients", "total_weight", "examples", "delta_norm", "within_clip",
    "dropped_users", "dropped_nodes", "rejected_nodes", "nodes_compiling", "secagg_bits", "secagg_degree", "secagg_bytes_up",
    "secagg_bytes_down", "secagg_bytes_masked", "secagg_words", "ddp_gamma", "ddp_dim", "ddp_l2", "ddp_l1", "ddp_local_std",
    "ddp_effective_noise", "ddp_noise_std", "ddp_below_plan",
})


class TrainingInterrupted(KeyboardInterrupt):
    """SIGTERM during training: handled like Ctrl-C (status "interrupted")."""


def one_line_error(exc: BaseException) -> str:
    """The error run.json records: one line, never a data value quoted by Python."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {without_values(text[0]) if text else ''}"[:300]


def _resend_sigterm() -> None:
    time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into `TrainingInterrupted` in the main thread for the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise TrainingInterrupted("terminated by SIGTERM")

    hook = sys.unraisablehook

    def unraisable(u: Any) -> None:
        """A SIGTERM that landed where Python cannot raise (a weakref callback, a finaliser)
        would be printed with its traceback and lost: send it again, quietly, from a thread
        (started without waiting for it, 1 ms later), so that it lands after this hook has
        returned, where Python can raise it."""
        if isinstance(u.exc_value, TrainingInterrupted):
            _thread.start_new_thread(_resend_sigterm, ())
            return
        hook(u)

    previous = signal.signal(signal.SIGTERM, handler)
    sys.unraisablehook = unraisable
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        sys.unraisablehook = hook


# ----------------------------------------------------------------------------- session
class RunSession:
    """The lifecycle of one training run in `run`, shared by every backend.

    Args:
        run: the run directory, checked by `prepare_new_run` / `open_for_resume`.
        cfg: the resolved, validated config.
        backend: "centralized" or "federated" (recorded in run.json; a resume must match).
        resume: continue the run in place.
        is_writer: this process writes the run directory (rank 0 / JAX process 0).
        hold_lock: take run.lock here (False when a launcher process already holds it).
        overwrite: the caller asked to replace an existing run.
        private: the run is DP; per-step statistics of the private data then go to
            sensitive_metrics.jsonl.
    """

    def __init__(self, run: RunDir, cfg: Config, *, backend: str, resume: bool, is_writer: bool = True,
                 hold_lock: bool = True, overwrite: bool = False, private: bool | None = None,
                 data_progress: Any = None) -> None:
        self.run, self.cfg, self.backend, self.resume = run, cfg, backend, resume
        self.is_writer, self.hold_lock, self.overwrite = is_writer, hold_lock, overwrite
        self.private = cfg.privacy.enabled if private is None else private
        self.data_progress = data_progress
        self._stack = contextlib.ExitStack()
        self._lock: Any = None

    # ---- enter / exit
    def __enter__(self) -> Self:
        stack = self._stack
        try:
            if self.is_writer and self.hold_lock:
                self._lock = stack.enter_context(self.run.locked())
            stack.enter_context(sigterm_as_interrupt())
            if self.is_writer:
                self._open()
        except BaseException:
            stack.close()
            raise
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        try:
            if exc is not None and self.is_writer and self.run.is_run():
                with contextlib.suppress(MemauditError, OSError):
                    if isinstance(exc, KeyboardInterrupt):
                        self._close("interrupted")
                    else:
                        self._close("failed", error=one_line_error(exc))
        finally:
            self._stack.close()

    def _open(self) -> None:
        os.chmod(self.run.path, 0o700)  # the run holds sensitive files: its owner's only
        if self.resume:
            m = self.run.read_manifest()
            if backend_name(m.get("backend")) != self.backend:  # `parallel`: an older run's name
                raise RunDirError(f"run '{self.run.path}' was trained with backend "
                                  f"'{m.get('backend')}'; resume it with that backend or start a new run")
            self._resume_data = self._check_resume_data()  # before anything is written
            clean_temporaries(self.run)
            recover_checkpoint(self.run)
            timings = dict(m.get("timings") or {})
            timings["resumed"] = [*timings.get("resumed", []), time.time()]
            # the config may differ in parallel.* only (a resume on another grid)
            self.run.update_manifest(status="running", timings=timings, error=None,
                                     config=dump_config(self.cfg))
            return
        staged = self._stage_data()  # the new run's data, valid, before the old run is touched
        aside = self._move_old_run_aside()
        self._adopt_staged(staged)
        try:
            t, p = self.cfg.train, self.cfg.privacy
            seeds = {"train": t.seed, "model_init": self.cfg.model.init_seed, "data": self.cfg.data.seed,
                     "synth": self.cfg.data.synth.seed,
                     "privacy_randomness": _privacy_randomness(p)}
            m = new_manifest(config=dump_config(self.cfg), backend=self.backend, seeds=seeds,
                             data_fingerprint=None)
            m["timings"]["started"] = time.time()
            if self.cfg.model.init_from is not None:  # the starting checkpoint: path + weights' sha256

                m["base_model"] = base_model_record(self.cfg.model.init_from)
            self.run.write_manifest(m)
        except BaseException:
            if aside is not None:
                _restore_aside(self.run, aside)
            raise
        if aside is not None:
            remove(aside)

    def _stage_data(self) -> Path:
        """Prepare (or reuse) the new run's data in a hidden staging folder and check it with
        `checks.check_data`; nothing of the run directory changes if this fails."""
        stage = RunDir(self.run.path / f".memaudit-staging-{os.getpid()}")
        remove(stage.path)
        stage.path.mkdir(parents=True, mode=0o700)
        try:
            for name in ("data", "split.json", "canaries.json"):  # reused when the config matches
                src = self.run.path / name
                if not self.overwrite and src.exists() and not self.run.is_run():
                    (shutil.copytree if src.is_dir() else shutil.copy2)(src, stage.path / name)
            vocab = model_vocab_size(self.cfg.model)
            prepared = prepare_data(self.cfg.data, stage, vocab_size=vocab, progress=self.data_progress,
                                    base_model=self.cfg.model.init_from)
            check_data(self.cfg, prepared, vocab)
        except BaseException:
            remove(stage.path)
            raise
        return stage.path

    def _adopt_staged(self, stage: Path) -> None:
        for name in ("data", "split.json", "canaries.json"):
            target = self.run.path / name
            if target.exists():
                remove(target)
            private_tree(stage / name)  # the corpus as trained and the canaries' secrets
            os.replace(stage / name, target)
        remove(stage)

    def _move_old_run_aside(self) -> Path | None:
        """--overwrite of a run: its artifacts into one hidden folder (deleted once the new
        manifest is written). Without --overwrite there is nothing to move (checked before)."""
        if not self.run.is_run():
            return None  # a new folder (the CLI refuses one holding anything): nothing to replace
        if not self.overwrite:
            raise RunDirError(f"output '{self.run.path}' already holds a memaudit run; pass "
                              "--overwrite to replace it, or choose another --out")
        require_memaudit_manifest(self.run)  # checked again under the lock
        present = [n for n in RUN_ARTIFACTS if (self.run.path / n).exists()]
        aside = self.run.path / f".memaudit-replaced-{os.getpid()}-{time.time_ns()}"
        aside.mkdir()
        for name in ("run.json", *[n for n in present if n != "run.json"]):
            if (self.run.path / name).exists():
                os.replace(self.run.path / name, aside / name)
        clean_temporaries(self.run)
        for p in checkpoint_candidates(self.run):
            remove(p)
        return aside

    def _close(self, status: str, **fields: Any) -> None:
        m = self.run.read_manifest()
        timings = dict(m.get("timings") or {})
        timings["finished"] = time.time()
        self.run.update_manifest(status=status, timings=timings, **fields)

    def complete(self, result: dict[str, Any]) -> None:
        if self.is_writer:
            self._close("complete", result=result, error=None)

    # ---- data
    def data(self) -> Any:
        """The run's prepared data: prepared and checked when the session opened (a new run:
        before an old run was replaced), or loaded and checked (a resume).

        A resume never rewrites the data: if the config or the input files changed since the
        run started, it is refused with nothing written. Non-writers load what the writer
        prepared (the caller puts a barrier in between).
        """
        if not self.is_writer:
            return load_prepared(self.run)
        prepared = self._resume_data if self.resume else load_prepared(self.run)  # staged at start
        self.run.update_manifest(data_fingerprint=prepared.fingerprint)
        return prepared

    def _check_resume_data(self) -> Any:
        """The run's prepared data, checked against the config and run.json; a resume never
        rewrites it, so a change since the run started is refused with nothing written."""
        try:
            prepared = load_prepared(self.run)
        except DataError as e:
            raise RunDirError(f"cannot resume '{self.run.path}': {e}") from None
        want = self.run.read_manifest().get("data_fingerprint")
        if (prepared.meta.get("config_hash") != config_hash(self.cfg.data, model_vocab_size(self.cfg.model),
                                                            base_model=self.cfg.model.init_from)
                or (want is not None and want != prepared.fingerprint)):
            raise RunDirError(f"the data of '{self.run.path}' (config or input files) changed "
                              "since the run started; start a new run instead of --resume")
        return prepared

    # ---- metrics
    def start(self, step: int) -> None:
        """Training starts (again) at `step`: drop metrics lines past it."""
        if self.is_writer:
            truncate_jsonl(self.run.metrics_path, step)
            sens = self.run.path / SENSITIVE_METRICS
            if sens.exists():
                truncate_jsonl(sens, step)

    def log(self, record: dict[str, Any]) -> None:
        """One step's or round's metrics line. Under DP the unprivatised statistics of the
        private data (SENSITIVE_KEYS) go to sensitive_metrics.jsonl instead."""
        if self._lock is not None:
            self._lock.check()
        if not self.is_writer:
            return
        if not self.private:
            append_jsonl(self.run.metrics_path, record)
            return
        key = "round" if "round" in record else "step"
        public = {k: v for k, v in record.items() if k not in SENSITIVE_KEYS}
        sensitive = {key: record.get(key), **{k: v for k, v in record.items() if k in SENSITIVE_KEYS}}
        append_jsonl(self.run.metrics_path, public)
        append_jsonl(self.run.path / SENSITIVE_METRICS, sensitive, mode=0o600)

    # ---- checkpoints
    def checkpoint_tmp(self, step: int) -> Path:
        """Where the checkpoint of `step` is written before it is sealed (the same path on
        every rank of a grid, so all of them can write their pieces into it)."""
        return self.run.path / f".state.{int(step)}.tmp"

    def begin_checkpoint(self, step: int) -> Path:
        """Writer: a fresh, empty temporary directory for the checkpoint of `step`."""
        tmp = self.checkpoint_tmp(step)
        if self.is_writer:
            remove(tmp)
            tmp.mkdir(parents=True, mode=0o700)
        return tmp

    def commit_checkpoint(self, step: int) -> None:
        """Writer: seal the checkpoint of `step` (its commit marker last) and swap it in."""
        if self.is_writer:
            tmp = self.checkpoint_tmp(step)
            private_tree(tmp)  # optimizer moments and RNG state of a private run: 0600 / 0700
            seal(tmp, step=step)
            swap_in(tmp, self.run.state_dir)

    @contextlib.contextmanager
    def checkpoint(self, step: int) -> Iterator[Path]:
        """Single writer: write the checkpoint of `step` into the yielded directory; it is
        sealed and swapped in at the end of the block, removed if the block fails."""
        tmp = self.begin_checkpoint(step)
        try:
            yield tmp
            self.commit_checkpoint(step)
        except BaseException:
            remove(tmp)
            raise

    def state_file(self, name: str) -> Any | None:
        p = self.run.state_dir / name
        return read_json(p, what="checkpoint file") if p.is_file() else None

    # ---- ledger and export
    def write_ledger(self, ledger_json: dict[str, Any] | None) -> None:
        if ledger_json is not None and self.is_writer:
            atomic_write_json(self.run.privacy_path, ledger_json)

    def export_hf(self, model: Any, *, tokenizer: Any, tokenizer_dir: Path | None) -> None:
        """The Hugging Face checkpoint + tokenizer, atomically into RUN_DIR/model/."""
        if not self.is_writer:
            return

        set_special_tokens(model, tokenizer)
        with atomic_dir(self.run.model_dir) as tmp, writing(self.run.model_dir):
            save_pretrained_quietly(model, tmp)
            if tokenizer_dir is not None and tokenizer_dir.is_dir():
                for f in tokenizer_dir.iterdir():
                    if f.is_file():
                        shutil.copy2(f, tmp / f.name)


def _privacy_randomness(p: Any) -> str:
    if getattr(p, "reproducible_randomness", False):
        return "reproducible (derived from train.seed)"
    return "secret (OS entropy)" if p.enabled else "n/a"


def _restore_aside(run: RunDir, aside: Path) -> None:
    for p in aside.iterdir():
        target = run.path / p.name
        if not target.exists():
            os.replace(p, target)
    remove(aside)
