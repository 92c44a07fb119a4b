"""Error types that the CLI turns into one line and exit code 2.

Every message names the offending value and the fix. Messages never contain
canary secrets or raw training text.
"""

from __future__ import annotations


class MemauditError(Exception):
    """Bad user input or an unusable environment; shown as one line, exit code 2."""


class ConfigError(MemauditError, ValueError):
    """A config file or override is invalid."""


class DataError(MemauditError, ValueError):
    """A corpus or prepared data directory cannot be used."""


class RunDirError(MemauditError):
    """A run directory is missing, locked by a live process, or already complete."""


class NotImplementedYet(MemauditError):
    """A command group that a later release fills in."""
