"""Shared CLI helpers: console, progress bars, output formats."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

console = Console(stderr=True)  # progress and tables go to stderr unless asked for
stdout = Console()


def progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,  # the summary line follows; an error leaves only its own line
    )


def print_json(obj: Any) -> None:
    stdout.print_json(json.dumps(obj, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))
