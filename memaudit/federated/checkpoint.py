"""The federated backend's checkpoint format.

The run lifecycle (`memaudit.run.lifecycle.RunSession`) owns the run directory (lock, manifest,
metrics, the sealed checkpoint swap, the ledger, the export); this module only says what a
federated checkpoint holds:

    state/
      server.msgpack   server params + server optimizer state + aggregator state + round
                       (`flax.serialization.to_bytes`; read back into a template, never unpickled)
      trainer.json     round, metrics count, the base PRNG key, initial holdout loss
      privacy.json     the DP ledger at this round (DP runs only)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from memaudit.checkpoints import checkpoint_present
from memaudit.errors import MemauditError, RunDirError
from memaudit.io import atomic_write_bytes, atomic_write_json, read_json

if TYPE_CHECKING:
    from memaudit.rundir import RunDir

STATE_SCHEMA = 1


def has_state(run: RunDir) -> bool:
    return checkpoint_present(run.state_dir) and (run.state_dir / "server.msgpack").is_file()


def write_state(d: Path, host_state: Any, scalars: dict[str, Any],
                files: dict[str, Any] | None = None) -> None:
    """Write `host_state` (a pytree of numpy arrays) and scalars into the directory `d`."""
    # lazy: flax (~2.5 s) only when called; this module imports without it
    from flax import serialization

    atomic_write_bytes(d / "server.msgpack", serialization.to_bytes(host_state))
    for name, obj in (files or {}).items():
        atomic_write_json(d / name, obj)
    atomic_write_json(d / "trainer.json", {"schema": STATE_SCHEMA, **scalars})


def load_state(run: RunDir, template: Any) -> tuple[Any, dict[str, Any]]:
    """Read state/ back into the structure of `template`; returns (state, scalars)."""
    # lazy: flax (~2.5 s) only when called; this module imports without it
    from flax import serialization

    d = run.state_dir
    try:
        scalars = read_json(d / "trainer.json", what="checkpoint")
        data = (d / "server.msgpack").read_bytes()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, MemauditError):
        raise RunDirError(f"'{d}' holds no readable federated checkpoint; start a new run") from None
    if not isinstance(scalars, dict) or scalars.get("schema") != STATE_SCHEMA:
        raise RunDirError(f"the checkpoint in '{d}' has an unsupported schema; start a new run")
    try:
        state = serialization.from_bytes(template, data)
    except Exception as e:  # noqa: BLE001 - msgpack raises many types on a damaged file
        raise RunDirError(f"checkpoint in '{d}' does not match this model or algorithm, or is "
                          f"damaged ({type(e).__name__}); resume with the run's own config") from None
    return state, scalars
