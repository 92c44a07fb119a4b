"""`memaudit train CONFIG [--out RUN_DIR] [--set key=value ...] [--backend ...] [--resume RUN_DIR]`."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import typer

from memaudit.backends import BACKENDS, backend_name
from memaudit.commands._common import console, progress
from memaudit.errors import ConfigError, MemauditError

HELP = ("Train a model into a run directory (centralized PyTorch or federated JAX), or resume an "
        "interrupted run with --resume.")


def register(app: typer.Typer) -> None:
    @app.command("train", help=HELP)
    def _cmd(
        config: Annotated[Path | None, typer.Argument(help="YAML config, e.g. configs/tiny.yaml.")] = None,
        out: Annotated[Path | None, typer.Option(
            "--out", help="Run directory to write (default: output_dir of the config, else runs/<config name>).")] = None,
        set_: Annotated[list[str] | None, typer.Option(
            "--set", help="Override a config key, e.g. --set train.lr=3e-4 (repeatable).")] = None,
        backend: Annotated[str | None, typer.Option(
            "--backend", help="centralized (PyTorch, one or many processes) or federated (JAX).")] = None,
        resume: Annotated[Path | None, typer.Option(
            "--resume", help="Continue the interrupted run in this directory from its last checkpoint.")] = None,
        overwrite: Annotated[bool, typer.Option(
            "--overwrite", help="Replace a run that already exists in the output directory.")] = False,
    ) -> None:
        overrides = list(set_ or [])
        if backend is not None:
            if backend_name(backend) not in BACKENDS:  # `parallel`: the old name, still accepted
                raise ConfigError(f"--backend '{backend}' is not known; use centralized or federated")
            overrides.append(f"backend={backend_name(backend)}")
        if resume is not None:
            if out is not None or overwrite:
                raise MemauditError("--resume continues the run in place; drop --out/--overwrite")
            cfg, run = _open_resume(resume, config, overrides)
        else:
            if config is None:
                raise ConfigError("pass a CONFIG file (e.g. configs/tiny.yaml) or --resume RUN_DIR")
            cfg, run = _open_new(config, out, overrides, overwrite)
        result = _run_with_progress(cfg, run, resume=resume is not None, overwrite=overwrite)
        typer.echo(summary_line(cfg, run.path, result))


def _open_new(config: Path, out: Path | None, overrides: list[str], overwrite: bool):
    # lazy: `memaudit --help` does not import the config (pydantic, ~0.3 s)
    from memaudit.config import load_config
    from memaudit.rundir import prepare_new_run

    cfg = load_config(config, overrides)
    target = out or (Path(cfg.output_dir) if cfg.output_dir else Path("runs") / config.stem)
    return cfg, prepare_new_run(target, overwrite=overwrite)


def _open_resume(path: Path, config: Path | None, overrides: list[str]):
    """The run's own config; a CONFIG or --set given with --resume must agree with it."""
    # lazy: `memaudit --help` does not import the config (pydantic, ~0.3 s)
    from memaudit.config import config_from_dict, dump_config, load_config, with_overrides
    from memaudit.rundir import open_for_resume

    run = open_for_resume(path)
    manifest = run.read_manifest()
    stored = manifest.get("config")
    if not isinstance(stored, dict):
        raise MemauditError(f"'{run.manifest_path}' holds no config; start a new run instead")
    cfg = config_from_dict(stored, source=str(run.manifest_path))
    if config is not None or overrides:
        given = load_config(config, overrides) if config is not None else with_overrides(
            cfg, dict(_split(o) for o in overrides))
        # the grid may change (e.g. fewer nodes): checkpoints load into any grid
        key = _first_difference(dump_config(given), dump_config(cfg), skip={"output_dir", "parallel"})
        if key is not None:
            raise ConfigError(f"'{key}' differs from the config of run '{run.path}'; resume uses "
                              "the run's own config (only parallel.* may change), so drop "
                              "CONFIG/--set or start a new run")
        if given.parallel != cfg.parallel:
            if cfg.backend == "federated":
                raise ConfigError("parallel.* does not apply to the federated backend; drop it from --set")
            cfg = cfg.model_copy(update={"parallel": given.parallel})
    status = run.status()
    if status == "complete":
        raise MemauditError(f"run '{run.path}' is already complete; nothing to resume "
                            "(start a new run with --out)")
    return cfg, run


def _split(item: str) -> tuple[str, Any]:
    # lazy: `memaudit --help` does not import the config (pydantic, ~0.3 s)
    from memaudit.config import parse_override

    return parse_override(item)


def _first_difference(a: Any, b: Any, *, skip: set[str], prefix: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k in skip:
                continue
            d = _first_difference(a.get(k), b.get(k), skip=set(), prefix=f"{prefix}{k}.")
            if d is not None:
                return d
        return None
    return None if a == b else prefix.rstrip(".")


def _run_with_progress(cfg, run, *, resume: bool, overwrite: bool = False) -> dict[str, Any]:
    bar = progress()
    task = bar.add_task("train", total=None, info="", visible=False)

    def on_progress(done: int, total: int, info: dict[str, Any]) -> None:
        if info.get("warning"):
            console.print(f"warning: {info['warning']}")
        phase = info.get("phase")
        desc = "data" if phase == "data" else "train"
        bar.update(task, completed=done, total=total, description=desc,
                   info=_info_text(info, private=cfg.privacy.enabled), visible=True)

    try:
        with bar:
            # lazy: `memaudit --help` does not import numpy (~0.4 s)
            from memaudit.run.dispatch import dispatch

            return dispatch(cfg, run, resume=resume, progress=on_progress, overwrite=overwrite)
    except KeyboardInterrupt:
        console.print(f"interrupted; continue with: memaudit train --resume {run.path}")
        raise


def _info_text(info: dict[str, Any], *, private: bool = False) -> str:
    """The progress line's text: loss, holdout loss and lr; under DP (`private`) only ε so far
    (the bar shows the step and the time): the training loss is a statistic of the private
    data that DP does not privatise, so it goes to sensitive_metrics.jsonl only."""
    keys = (("epsilon", "epsilon"),) if private else (("loss", "loss"), ("holdout_loss", "holdout"), ("lr", "lr"))
    parts = []
    for key, label in keys:
        v = info.get(key)
        if isinstance(v, float) and math.isfinite(v):
            parts.append(f"{label} {v:.3g}")
    return " ".join(parts)


def summary_line(cfg, path: Path, result: dict[str, Any]) -> str:
    """One line: what was trained, the holdout loss before -> after, where it is. No text, no secrets."""
    units = "rounds" if cfg.backend == "federated" else "steps"
    steps = result.get("steps", result.get("rounds"))
    init, final = result.get("initial_holdout_loss"), result.get("final_holdout_loss")
    ppl = result.get("final_holdout_perplexity")
    loss = f"holdout loss {init:.3f} -> {final:.3f}" if _num(init) and _num(final) else (
        f"holdout loss {final:.3f}" if _num(final) else "holdout loss n/a")
    if _num(ppl):
        loss += f" (perplexity {ppl:.1f})"
    eps = ""
    priv = result.get("privacy") or {}
    stated = _stated_epsilon(priv)
    if stated is not None:
        value, how = stated
        per = " per user" if priv.get("unit") == "user" else " per sequence"
        eps = f", epsilon {value:.2f}{per}{_document_text(priv.get('document'))} ({how}; delta {priv.get('delta'):.0e})"
    secs = result.get("train_seconds")
    took = f" in {secs:.0f}s" if _num(secs) else ""
    model = cfg.model.preset or f"from {cfg.model.init_from}"
    return (f"trained {model} ({cfg.backend}) for {steps} {units}{took}: {loss}{eps}; "
            f"run: {path}")


def _stated_epsilon(priv: dict[str, Any]) -> tuple[float, str] | None:
    """(ε, which accountant and why) from the ledger: the accountant that set σ when it was
    calibrated to a target (its ε is the one the run was calibrated to), else the tightest."""
    eps_by = priv.get("epsilon") if isinstance(priv.get("epsilon"), dict) else {}
    known = {acc: v for acc, v in eps_by.items() if _num(v)}
    if not known:
        return None
    cal = priv.get("calibration") if isinstance(priv.get("calibration"), dict) else {}
    acc = cal.get("accountant")
    if acc in known:
        target = cal.get("target_epsilon")
        return known[acc], f"{acc.upper()}, the accountant that set sigma" + (
            f" for target {target:g}" if _num(target) else "")
    acc = min(known, key=known.__getitem__)
    return known[acc], acc.upper()


def _document_text(doc: Any) -> str:
    """", 27.8 per document of up to 4 sequences" (example-level runs; the ledger's figure)."""
    if not isinstance(doc, dict):
        return ""
    known = [v for v in (doc.get("epsilon") or {}).values() if _num(v)]
    m = doc.get("max_sequences_per_document")
    if not known:
        return ", per document unknown" if m is None else ""
    return f", {min(known):.2f} per document of up to {m} sequence{'s' if m != 1 else ''}"


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and math.isfinite(v)
