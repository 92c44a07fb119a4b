"""The training backends' names, the old name that existing configs and run directories hold, and
what a backend and the training driver hand each other: the `Session` through which a backend
writes the run directory, and what one step returns (`StepOutcome`).

`centralized` is the torch backend (one process, or the data x tensor-parallel grid that
`memaudit.parallel` runs); `federated` is the JAX one. Configs, sweep files and run.json written
before the rename say `parallel` for `centralized`: every reader maps it with `backend_name`, so
such a config still loads and such a run still resumes and reports.

>>> backend_name("parallel"), backend_name("federated")
('centralized', 'federated')
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

CENTRALIZED = "centralized"
FEDERATED = "federated"
BACKENDS = (CENTRALIZED, FEDERATED)
# the centralized backend's name before it was renamed
ALIASES = {"parallel": CENTRALIZED}


def backend_name(name: Any) -> Any:
    """`name` with an old alias replaced by the backend's name (anything else unchanged)."""
    return ALIASES.get(name, name) if isinstance(name, str) else name


def report_rank(name: str) -> int:
    """Where a backend's rows come in a report's sorted tables: federated first, then
    centralized (the old names' alphabetical order, kept so that a report reads as before)."""
    return (FEDERATED, CENTRALIZED).index(name) if name in BACKENDS else len(BACKENDS)


def config_with_backend_name(config: Any) -> Any:
    """A run config as stored in run.json, with an old backend alias replaced (for comparisons)."""
    if isinstance(config, dict) and config.get("backend") in ALIASES:
        return {**config, "backend": backend_name(config["backend"])}
    return config


@dataclass(frozen=True)
class StepOutcome:
    """One step's or round's metrics line, and whether its DP mechanism released anything
    (an aborted secure-aggregation round released and applied nothing: no ledger event).
    `privacy_metrics` is what the mechanism's event depends on (e.g. the adaptive clip)."""

    record: dict[str, Any]
    released: bool = True
    privacy_metrics: dict[str, Any] | None = None


class Session(Protocol):
    """What a backend does to the run directory, through the session the training driver hands it
    (`memaudit.run.lifecycle.RunSession` is the one implementation; the backends below the run
    wing name only this)."""

    def data(self) -> Any:
        """The prepared data: staged and checked at open, or the resumed run's."""
    def checkpoint(self, step: int) -> AbstractContextManager[Path]:
        """A temporary folder for the checkpoint of `step`, sealed and swapped into state/."""
    def begin_checkpoint(self, step: int) -> Path:
        """`checkpoint`'s folder for a write spread over processes (then `commit_checkpoint`)."""
    def commit_checkpoint(self, step: int) -> None:
        """Seal and swap in the folder of `begin_checkpoint`."""
    def export_hf(self, model: Any, *, tokenizer: Any, tokenizer_dir: Path | None) -> None:
        """The Hugging Face checkpoint into model/ (with the tokenizer)."""
