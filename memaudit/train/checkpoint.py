"""Resumable training state in RUN_DIR/state/, and the Hugging Face export in RUN_DIR/model/.

    state/
      model.safetensors     the weights (exact fp32 copies)
      optimizer.pt          optimizer.state_dict() (read back with weights_only=True)
      rng.safetensors       torch CPU (and CUDA) generator states
      extra.pt              component states, e.g. the DP-SGD noise generator (weights_only)
      trainer.json          step, metrics count and other scalars

Every checkpoint is written into a temporary directory that replaces state/ in one rename
(`memaudit.io.atomic_dir`), so a kill at any moment leaves either the previous or the new
checkpoint, never a mixture. Nothing is unpickled: tensors come back from safetensors or
`torch.load(..., weights_only=True)`, scalars from JSON.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memaudit.errors import RunDirError
from memaudit.io import atomic_dir, atomic_write_json, read_json

if TYPE_CHECKING:
    import torch

    from memaudit.rundir import RunDir

STATE_SCHEMA = 1
# Everything a training run writes; removed before a fresh (--overwrite) run starts.
RUN_ARTIFACTS = ("model", "data", "state", "split.json", "canaries.json", "privacy.json",
                 "metrics.jsonl", "probes.json", "run.json")


def reset_run_artifacts(run: RunDir) -> None:
    """Remove the artifacts of a previous run in `run` (only memaudit's own names)."""
    for name in RUN_ARTIFACTS:
        p = run.path / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()


def has_state(run: RunDir) -> bool:
    return (run.state_dir / "trainer.json").is_file()


def save_state(
    run: RunDir,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scalars: dict[str, Any],
    extra: dict[str, Any] | None = None,
    files: dict[str, Any] | None = None,
) -> None:
    """Atomically replace `run.state_dir` with a checkpoint.

    Args:
        scalars: JSON-ready values (the step, counters) written to trainer.json.
        extra: component state dicts (tensors, numbers, lists) saved with torch.save and
            read back with weights_only=True.
        files: extra JSON documents, name -> object (e.g. the privacy ledger).
    """
    import torch
    from safetensors.torch import save_file, save_model

    with atomic_dir(run.state_dir) as tmp:
        save_model(model, str(tmp / "model.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        save_file(rng_state(), str(tmp / "rng.safetensors"))
        write_common(tmp, scalars=scalars, extra=extra, files=files)


def write_common(d: Path, *, scalars: dict[str, Any], extra: dict[str, Any] | None,
                 files: dict[str, Any] | None) -> None:
    """extra.pt, the JSON documents and (last) trainer.json of a checkpoint directory."""
    import torch

    torch.save(extra or {}, d / "extra.pt")
    for name, obj in (files or {}).items():
        atomic_write_json(d / name, obj)
    atomic_write_json(d / "trainer.json", {"schema": STATE_SCHEMA, **scalars})


def rng_state() -> dict[str, torch.Tensor]:
    """The torch CPU (and CUDA) generator states, as safetensors-ready tensors."""
    import torch

    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"torch_cuda_{i}"] = s
    return rng


def set_rng_state(rng: dict[str, torch.Tensor]) -> None:
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
        scalars = read_json(d / "trainer.json")
    except (FileNotFoundError, ValueError):
        raise RunDirError(f"'{d}' holds no readable checkpoint; start a new run") from None
    if scalars.get("schema") != STATE_SCHEMA:
        raise RunDirError(f"checkpoint schema {scalars.get('schema')} in '{d}' is not supported")
    return scalars


def load_state(
    run: RunDir, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore model, optimizer and RNG in place; return (scalars, extra).

    A sharded checkpoint of the parallel backend is merged into the single-process model.
    """
    import torch
    from safetensors.torch import load_file, load_model

    d = run.state_dir
    scalars = read_scalars(run)
    if scalars.get("format") == "sharded":
        from memaudit.parallel.checkpoint import load_sharded

        load_sharded(run, params=dict(model.named_parameters()), optimizer=optimizer, local=None)
        return scalars, read_extra(run)
    missing, unexpected = load_model(model, str(d / "model.safetensors"), strict=False, device=str(device))
    if missing or unexpected:
        raise RunDirError(f"checkpoint in '{d}' does not match the model ({len(missing)} missing, "
                          f"{len(unexpected)} unexpected tensors); resume with the run's own config")
    optimizer.load_state_dict(torch.load(d / "optimizer.pt", map_location=device, weights_only=True))
    set_rng_state(load_file(str(d / "rng.safetensors")))
    return scalars, read_extra(run)


def read_extra(run: RunDir) -> dict[str, Any]:
    import torch

    return torch.load(run.state_dir / "extra.pt", map_location="cpu", weights_only=True)


def read_state_file(run: RunDir, name: str) -> Any | None:
    p = run.state_dir / name
    return read_json(p) if p.is_file() else None


def save_hf_model(model: torch.nn.Module, run: RunDir, *, tokenizer_dir: Path | None) -> None:
    """`save_pretrained` (safetensors) plus the tokenizer files, atomically into RUN_DIR/model/."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # only the CLI prints
    try:
        with atomic_dir(run.model_dir) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            if tokenizer_dir is not None and tokenizer_dir.is_dir():
                for f in tokenizer_dir.iterdir():
                    if f.is_file():
                        shutil.copy2(f, tmp / f.name)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
