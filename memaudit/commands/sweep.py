"""`memaudit sweep`."""

from __future__ import annotations

import typer

from memaudit.errors import NotImplementedYet


def register(app: typer.Typer) -> None:
    @app.command("sweep", help="(not yet available) sweep", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def _cmd() -> None:
        raise NotImplementedYet("`memaudit sweep` is not available in this release yet")
