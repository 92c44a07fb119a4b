"""Flower's ``flwr-serverapp`` installs a run's app only after memaudit's check of it.

Flower's own SuperLink starts a ``flwr-serverapp`` process per run, and that process installs
the run's FAB (``install_from_fab``) and imports its ServerApp: anyone who reaches the
SuperLink's Control API could run code there. memaudit's SuperExec, on such a SuperLink, starts
that process through `memaudit.federated.flower.superexec.run_serverapp`, which installs this
guard first: a FAB the check refuses raises before anything of it is written or imported, and the
run ends failed. (memaudit's own SuperLink runs no ``flwr-serverapp``: its ServerApps are
threads that never install a FAB.)
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

# the module (its package exports a function of the same name, which an import statement finds)
task = importlib.import_module("flwr.superlink.runtime.run_serverapp")


def install(component: str, fab_check: Callable[[bytes], None] | None = None) -> None:
    """In a ``flwr-serverapp`` process (``component`` ``"serverapp"``, with ``fab_check``): Flower's
    ``install_from_fab`` calls ``fab_check(content)`` first, which raises to refuse the FAB.
    Idempotent; nothing without ``fab_check`` or for another component."""
    if component != "serverapp" or fab_check is None or getattr(task.install_from_fab, "__memaudit_guard__", False):
        return
    install_from_fab = task.install_from_fab

    @functools.wraps(install_from_fab)
    def install_memaudits_only(content: bytes, *args: Any, **kwargs: Any) -> Any:
        fab_check(content)
        return install_from_fab(content, *args, **kwargs)

    install_memaudits_only.__memaudit_guard__ = True  # type: ignore[attr-defined]
    task.install_from_fab = install_memaudits_only


__all__ = ["install"]
