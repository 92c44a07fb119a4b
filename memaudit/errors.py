"""Error types that the CLI turns into one line and exit code 2.

Every message names the offending value and the fix. Messages never contain
canary secrets or raw training text.
"""

from __future__ import annotations

import re

# Python's own conversion errors quote the value they could not convert, which may be a piece
# of a corpus (`invalid literal for int() with base 10: 'my ssn is ...'`): never shown.
_QUOTES_A_VALUE = re.compile(r"(invalid literal for \w+\(\)(?: with base \d+)?|could not convert "
                             r"string to \w+|could not convert \w+ to \w+)\b.*", re.DOTALL)
VALUE_NOT_SHOWN = ("a value in the input is not of the type expected (the value is not shown: it may "
                   "be private data); re-run with --debug to see where, and fix that field")


def without_values(line: str) -> str:
    """`line`, or where it is one of Python's conversion errors quoting a value, a line without it.

    >>> without_values("invalid literal for int() with base 10: 'my pin'").startswith("a value")
    True
    """
    m = _QUOTES_A_VALUE.search(line)
    return line if m is None else line[:m.start()] + VALUE_NOT_SHOWN


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
