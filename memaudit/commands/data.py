"""`memaudit data ...`."""

from __future__ import annotations

import typer

from memaudit.errors import NotImplementedYet

app = typer.Typer(help="(not yet available) data", no_args_is_help=True)


@app.command("todo", help="(not yet available)")
def _todo() -> None:
    raise NotImplementedYet("`memaudit data` is not available in this release yet")
