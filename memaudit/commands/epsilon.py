"""`memaudit epsilon`."""

from __future__ import annotations

import typer

from memaudit.errors import NotImplementedYet


def register(app: typer.Typer) -> None:
    @app.command("epsilon", help="(not yet available) epsilon", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def _cmd() -> None:
        raise NotImplementedYet("`memaudit epsilon` is not available in this release yet")
