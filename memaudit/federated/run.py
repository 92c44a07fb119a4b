"""Run-directory plumbing of the federated trainer: manifest, resumable state, HF export.

Mirrors the centralized trainer's conventions (`memaudit.train.trainer` / `checkpoint`):
run.json carries status and timings, metrics.jsonl one line per round, and state/ is replaced
atomically (`memaudit.io.atomic_dir`) so a kill leaves the previous or the new checkpoint:

    state/
      server.msgpack   server params + server optimizer state + aggregator state + round
                       (`flax.serialization.to_bytes`; read back into a template, never unpickled)
      trainer.json     round, metrics count, the base PRNG key, initial holdout loss
      privacy.json     the DP ledger at this round (DP runs only)
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from memaudit.config import Config, dump_config
from memaudit.errors import RunDirError
from memaudit.io import atomic_dir, atomic_write_bytes, atomic_write_json, read_json
from memaudit.rundir import RunDir, new_manifest

if TYPE_CHECKING:
    from pathlib import Path

BACKEND = "federated"
STATE_SCHEMA = 1


def open_manifest(run: RunDir, cfg: Config, *, resume: bool) -> None:
    """A fresh run: clear old artifacts and write run.json; a resume: mark it running again."""
    from memaudit.train import checkpoint as ckpt

    if resume:
        m = run.read_manifest()
        if m.get("backend") != BACKEND:
            raise RunDirError(f"run '{run.path}' was trained with backend '{m.get('backend')}'; "
                              "resume it with that backend or start a new run")
        timings = dict(m.get("timings", {}))
        timings["resumed"] = [*timings.get("resumed", []), time.time()]
        run.update_manifest(status="running", timings=timings, error=None)
        return
    ckpt.reset_run_artifacts(run)
    seeds = {"train": cfg.train.seed, "model_init": cfg.model.init_seed, "data": cfg.data.seed,
             "synth": cfg.data.synth.seed, "privacy_reproducible": cfg.privacy.reproducible_randomness}
    m = new_manifest(config=dump_config(cfg), backend=BACKEND, seeds=seeds, data_fingerprint=None)
    m["timings"]["started"] = time.time()
    run.write_manifest(m)


def close_manifest(run: RunDir, status: str, **fields: Any) -> None:
    m = run.read_manifest()
    timings = dict(m.get("timings", {}))
    timings["finished"] = time.time()
    run.update_manifest(status=status, timings=timings, **fields)


def has_state(run: RunDir) -> bool:
    return (run.state_dir / "trainer.json").is_file() and (run.state_dir / "server.msgpack").is_file()


def save_state(run: RunDir, host_state: Any, scalars: dict[str, Any],
               files: dict[str, Any] | None = None) -> None:
    """Atomically replace state/ with `host_state` (a pytree of numpy arrays) and scalars."""
    from flax import serialization

    with atomic_dir(run.state_dir) as tmp:
        atomic_write_bytes(tmp / "server.msgpack", serialization.to_bytes(host_state))
        for name, obj in (files or {}).items():
            atomic_write_json(tmp / name, obj)
        atomic_write_json(tmp / "trainer.json", {"schema": STATE_SCHEMA, **scalars})


def load_state(run: RunDir, template: Any) -> tuple[Any, dict[str, Any]]:
    """Read state/ back into the structure of `template`; returns (state, scalars)."""
    from flax import serialization

    d = run.state_dir
    try:
        scalars = read_json(d / "trainer.json")
        data = (d / "server.msgpack").read_bytes()
    except (FileNotFoundError, ValueError):
        raise RunDirError(f"'{d}' holds no readable federated checkpoint; start a new run") from None
    if scalars.get("schema") != STATE_SCHEMA:
        raise RunDirError(f"checkpoint schema {scalars.get('schema')} in '{d}' is not supported")
    try:
        state = serialization.from_bytes(template, data)
    except (ValueError, KeyError, TypeError) as e:
        raise RunDirError(f"checkpoint in '{d}' does not match this model or algorithm "
                          f"({type(e).__name__}); resume with the run's own config") from None
    return state, scalars


def export_model(run: RunDir, params: Any, *, preset: str, vocab_size: int, tokenizer: Any,
                 tokenizer_dir: Path | None) -> None:
    """The Hugging Face checkpoint + tokenizer into RUN_DIR/model/ (atomically)."""
    from memaudit.models.convert import to_hf_model
    from memaudit.train import checkpoint as ckpt

    model = to_hf_model(params, preset=preset, vocab_size=vocab_size)
    for attr in ("eos_token_id", "pad_token_id", "bos_token_id"):
        v = getattr(tokenizer, attr, None)
        if v is not None:
            setattr(model.config, attr, v)
            if getattr(model, "generation_config", None) is not None:
                setattr(model.generation_config, attr, v)
    ckpt.save_hf_model(model, run, tokenizer_dir=tokenizer_dir)
