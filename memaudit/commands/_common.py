"""Shared CLI helpers: console, progress bars, output formats."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

console = Console(stderr=True)  # progress and tables go to stderr unless asked for
stdout = Console()


class LazyProgress(Progress):
    """A progress display that appears at its first update: a command that fails before it
    reports anything prints its one error line and nothing else (no blank line)."""

    _shown = False

    def start(self) -> None:  # `with bar:` no longer shows it by itself
        pass

    def stop(self) -> None:
        if self._shown:
            super().stop()

    def update(self, *args: Any, **kwargs: Any) -> None:
        if not self._shown and kwargs.get("visible", True):
            self._shown = True
            super().start()
        super().update(*args, **kwargs)

    def advance(self, *args: Any, **kwargs: Any) -> None:
        if not self._shown:
            self._shown = True
            super().start()
        super().advance(*args, **kwargs)


def progress() -> Progress:
    return LazyProgress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,  # the summary line follows; an error leaves only its own line
        disable=not console.is_terminal,  # a log file or a pipe gets the result lines only
    )


def print_json(obj: Any) -> None:
    stdout.print_json(json.dumps(obj, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))
