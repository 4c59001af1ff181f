"""Who runs the engine's loop: the guards around its drive lock and its driver count.

Whoever holds the drive lock runs the loop: the progress thread, or an application thread
waiting for its op.  Both guards are classes rather than generator-based context managers:
each is entered once or twice per op, and the generator form cost ~2 us a time.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import Engine


class Driving:
    """``with engine._driving:`` marks this thread as the loop's driver and releases the
    drive lock (already acquired) on the way out."""

    __slots__ = ("_engine",)

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def __enter__(self) -> None:
        self._engine._owner = threading.get_ident()

    def __exit__(self, *exc: object) -> None:
        engine = self._engine
        engine._owner = None
        engine._drive.release()


class Waiting:
    """``with engine._waiting:`` counts this thread among the callers that drive the loop
    themselves, so the progress thread stays asleep; on the way out it is woken if work
    is left."""

    __slots__ = ("_engine",)

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def __enter__(self) -> None:
        engine = self._engine
        with engine._idle:
            engine._drivers += 1

    def __exit__(self, *exc: object) -> None:
        engine = self._engine
        with engine._idle:
            engine._drivers -= 1
        engine._nudge()
