"""A time box on one invocation: stop cleanly at a checkpoint before a wall-clock limit.

An accelerator lent in commands of a few minutes runs a long sweep in pieces. `memaudit sweep
--stop-after SECONDS` opens a box that ends SECONDS from now (`time_box`); the end is an absolute
UNIX time in the environment (`MEMAUDIT_STOP_AT`), so the sweep's worker processes see it too.
Every one-process training run asks `after_checkpoint` once a checkpoint is sealed: when a
stretch as long as the one that just ended would not finish inside the box, it raises `TimeUp`
there. The run closes "interrupted" with that checkpoint, and the next invocation resumes from
it: the same steps from the same state and random streams, so the pieces end where one
uninterrupted run ends (for DP runs with `privacy.reproducible_randomness`; noise drawn from OS
entropy, the default, makes no two runs agree, pieces or not). A sweep does not start a point, or a point's probes, once the box has
ended (`should_stop`), unless this process has done no work in the box yet (`note_work`): every
invocation moves the sweep on by at least one stretch, however short its box, so that repeating
the same command always ends it.

>>> with time_box(3600.0):
...     expired(), should_stop(), remaining() > 3500
(False, False, True)
>>> stop_at() is None
True
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator

ENV = "MEMAUDIT_STOP_AT"
_worked = False  # this process sealed a checkpoint, finished a run or probed one inside the box


class TimeUp(KeyboardInterrupt):
    """The time box ends before the next checkpoint would: handled as an interrupt (the run is
    left "interrupted" with its last checkpoint, to be resumed by the next invocation)."""


def stop_at() -> float | None:
    """The box's end (UNIX seconds), or None when no box is open."""
    value = os.environ.get(ENV)
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        return None  # set by memaudit only; a stray value opens no box


def remaining() -> float:
    """Seconds left in the box (inf without one)."""
    end = stop_at()
    return math.inf if end is None else end - time.time()


def expired() -> bool:
    """Whether the box has ended."""
    return remaining() <= 0


def note_work() -> None:
    """This process has moved the sweep on (a run finished, a point probed): from now on a
    boundary past the box's end stops it."""
    global _worked
    _worked = True


def should_stop() -> bool:
    """Whether to stop at a boundary (before a point, its probes or a reference run): the box
    has ended and this process has already done some work in it."""
    return _worked and expired()


def after_checkpoint(stretch_seconds: float) -> None:
    """Raise `TimeUp` when another stretch of `stretch_seconds` (the time the one just sealed
    took) would end past the box; call it right after a checkpoint is sealed."""
    note_work()
    left = remaining()
    if left < max(stretch_seconds, 0.0):
        raise TimeUp(f"time box: {max(left, 0.0):.0f} s left, the last stretch took {stretch_seconds:.0f} s")


def check_seconds(seconds: float) -> float:
    """A --stop-after value: a finite number of seconds > 0 (ValueError naming the fix)."""
    if not (isinstance(seconds, int | float) and math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"--stop-after {seconds} is not a positive number of seconds; give e.g. "
                         "--stop-after 420 (a margin below the command's limit)")
    return float(seconds)


@contextlib.contextmanager
def time_box(seconds: float | None) -> Iterator[float | None]:
    """Open a box of `seconds` from now for the block (None: no box); yields its end."""
    if seconds is None:
        yield None
        return
    global _worked
    end = time.time() + check_seconds(seconds)
    before = os.environ.get(ENV)
    os.environ[ENV] = repr(end)
    _worked = False
    try:
        yield end
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
