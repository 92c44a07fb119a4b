"""`memaudit probe`."""

from __future__ import annotations

import typer

from memaudit.errors import NotImplementedYet


def register(app: typer.Typer) -> None:
    @app.command("probe", help="(not yet available) probe", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def _cmd() -> None:
        raise NotImplementedYet("`memaudit probe` is not available in this release yet")
