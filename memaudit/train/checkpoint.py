"""Resumable training state of the torch backend in RUN_DIR/state/.

    state/
      model.safetensors     the weights (exact fp32 copies)
      optimizer.pt          optimizer.state_dict() (read back with weights_only=True)
      rng.safetensors       torch CPU (and CUDA) generator states
      extra.pt              component states, e.g. the DP-SGD noise generator (weights_only)
      trainer.json          step, metrics count and other scalars

A checkpoint is written into a temporary directory that the run lifecycle seals with its
commit marker and swaps in for state/ (`memaudit.run.lifecycle`), so a kill at any moment leaves
a complete checkpoint that the next start recovers, never a mixture. Nothing is unpickled: tensors come back from safetensors or
`torch.load(..., weights_only=True)`, scalars from JSON.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memaudit.checkpoints import checkpoint_present
from memaudit.errors import MemauditError, RunDirError
from memaudit.io import atomic_write_json, read_json

if TYPE_CHECKING:
    import torch

    from memaudit.rundir import RunDir

STATE_SCHEMA = 1


def has_state(run: RunDir) -> bool:
    return checkpoint_present(run.state_dir)


def write_state(
    d: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scalars: dict[str, Any],
    extra: dict[str, Any] | None = None,
    files: dict[str, Any] | None = None,
) -> None:
    """Write a single-process checkpoint into the directory `d` (the lifecycle seals it and
    swaps it in for `state/`).

    Args:
        scalars: JSON-ready values (the step, counters) written to trainer.json.
        extra: component state dicts (tensors, numbers, lists) saved with torch.save and
            read back with weights_only=True.
        files: extra JSON documents, name -> object (e.g. the privacy ledger).
    """
    # lazy: torch (~2 s) only when called; this module imports without it
    import torch
    from safetensors.torch import save_file, save_model

    save_model(model, str(d / "model.safetensors"))
    torch.save(optimizer.state_dict(), d / "optimizer.pt")
    save_file(rng_state(), str(d / "rng.safetensors"))
    write_common(d, scalars=scalars, extra=extra, files=files)


def write_common(d: Path, *, scalars: dict[str, Any], extra: dict[str, Any] | None,
                 files: dict[str, Any] | None) -> None:
    """extra.pt, the JSON documents and (last) trainer.json of a checkpoint directory."""
    # lazy: torch (~2 s) only when called; this module imports without it
    import torch

    torch.save(extra or {}, d / "extra.pt")
    for name, obj in (files or {}).items():
        atomic_write_json(d / name, obj)
    atomic_write_json(d / "trainer.json", {"schema": STATE_SCHEMA, **scalars})


def rng_state() -> dict[str, torch.Tensor]:
    """The torch CPU (and CUDA) generator states, as safetensors-ready tensors."""
    # lazy: torch (~2 s) only when called; this module imports without it
    import torch

    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"torch_cuda_{i}"] = s
    return rng


def set_rng_state(rng: dict[str, torch.Tensor]) -> None:
    # lazy: torch (~2 s) only when called; this module imports without it
    import torch

    torch.set_rng_state(rng["torch_cpu"])
    if torch.cuda.is_available():
        states = [rng[k] for k in sorted(k for k in rng if k.startswith("torch_cuda_"))]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)


def read_scalars(run: RunDir) -> dict[str, Any]:
    """trainer.json of `run`'s checkpoint, checked for a supported schema."""
    d = run.state_dir
    try:
        scalars = read_json(d / "trainer.json", what="checkpoint")
    except (FileNotFoundError, MemauditError, NotADirectoryError):
        raise RunDirError(f"'{d}' holds no readable checkpoint; start a new run") from None
    if not isinstance(scalars, dict) or scalars.get("schema") != STATE_SCHEMA:
        schema = scalars.get("schema") if isinstance(scalars, dict) else None
        raise RunDirError(f"checkpoint schema {schema} in '{d}' is not supported; start a new run")
    return scalars


def load_state(
    run: RunDir, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore model, optimizer and RNG in place from a single-process checkpoint; return
    (scalars, extra). A grid's sharded checkpoint is read by `memaudit.parallel.checkpoint.load_any`.
    """
    # lazy: torch (~2 s) only when called; this module imports without it
    from safetensors.torch import load_file, load_model

    d = run.state_dir
    scalars = read_scalars(run)
    with checkpoint_file(d / "model.safetensors"):
        missing, unexpected = load_model(model, str(d / "model.safetensors"), strict=False, device=str(device))
    if missing or unexpected:
        raise RunDirError(f"checkpoint in '{d}' does not match the model ({len(missing)} missing, "
                          f"{len(unexpected)} unexpected tensors); resume with the run's own config")
    optimizer.load_state_dict(torch_load(d / "optimizer.pt", map_location=device))
    with checkpoint_file(d / "rng.safetensors"):
        set_rng_state(load_file(str(d / "rng.safetensors")))
    return scalars, read_extra(run)


@contextlib.contextmanager
def checkpoint_file(path: Path):
    """Reading one checkpoint file: a missing, truncated or garbage file is one line naming it."""
    try:
        yield
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        raise RunDirError(f"checkpoint file '{path}' is missing; the checkpoint is incomplete, "
                          "start a new run") from None
    except Exception as e:
        if isinstance(e, MemauditError):
            raise
        raise RunDirError(f"checkpoint file '{path}' is damaged or not memaudit's "
                          f"({type(e).__name__}); it is not loaded, start a new run") from None


def torch_load(path: Path, *, map_location: Any = "cpu") -> Any:
    """`torch.load(weights_only=True)`; a file holding anything but tensors and plain data
    (a pickled object, which could run code) is refused in one line, never unpickled."""
    # lazy: torch (~2 s) only when called; this module imports without it
    import torch

    with checkpoint_file(path):
        return torch.load(path, map_location=map_location, weights_only=True)


def read_extra(run: RunDir) -> dict[str, Any]:
    return torch_load(run.state_dir / "extra.pt")
