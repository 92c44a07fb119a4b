"""`memaudit report`."""

from __future__ import annotations

import typer

from memaudit.errors import NotImplementedYet


def register(app: typer.Typer) -> None:
    @app.command("report", help="(not yet available) report", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def _cmd() -> None:
        raise NotImplementedYet("`memaudit report` is not available in this release yet")
