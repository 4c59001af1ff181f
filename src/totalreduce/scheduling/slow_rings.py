"""Whether a blocking op leaves the caller's thread while the rings copy slowly, learned
from how long each way took here.

While most of a rank's rings copy slowly (transport/copy_pace.py), a big blocking
broadcast or alltoall may go to the loop, which lends its bodies (one kernel copy on the
reader's side instead of two plain ones through the ring), rather than run on the
caller's thread, which copies them through the ring.  Which is faster depends on the
host, not on the op alone: on one 2-vCPU VM the loop took 1 MiB broadcasts in 0.19 ms
against 0.31 ms on the caller's thread, on another of the same kind, where the kernel's
copy ran at 2-7 GB/s instead of 11, it took 0.43 ms against 0.19-0.21 ms.  So each way is
timed, per kind of op and power-of-two size, and the faster one taken; now and then the
other, so that a change of the host's state is seen.  Each way's time is the least of
its last few (an op only ever takes longer than it could: a late peer, a cold start).
Once both are known the other way is tried twice in a row, the first untimed: it pays for
the change (a 16 MiB broadcast lent amid ones through the rings took 2.2-2.3 ms, against
1.1-1.2 lent one after another).  Those tries come less often while they keep finding the
other way clearly slower.

An op too big for the caller's thread runs on the loop either way, and there the choice
is whether it lends its bodies while the rings are slow or copies them through the ring
all the same (OpSpec.lend_slow): on another VM, whose kernel copied lent bodies at 4-7
GB/s, 4 MiB broadcasts took 1.39-1.88 ms lent against 0.83-1.31 ms through the ring
(alternated in one job), in the slow state as in the fast one, while 16 MiB allreduces in
the slow state took 7.2 ms lent against 9.0 ms.  Those choices are timed here too, under
keys of their own (:meth:`SlowRingChoice.key` with ``lending=True``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from ..lru import LRU

# Times kept per way and size, the least of which counts.
_KEEP = 5
# The slower way is tried again, twice in a row, every this many choices of the other (at
# 1 MiB and up, a slower try costs a few hundred microseconds): as often as one lone try
# every 16 was.
_EXPLORE = 32
# ... and where it is still the slower by _CLEARLY at its next try, twice as many, up to
# _EXPLORE_MOST: on a VM where 1 MiB alltoalls took 0.17-0.19 ms on the caller's thread
# and 0.3-0.6 on the loop, the 97th percentile of 1500 blocking ones went from 270-287 us
# with a pair of tries every 32 to 238-242 with the backoff (medians alike).
_EXPLORE_MOST = 1024
_CLEARLY = 1.5
# (kind, size class) pairs remembered: a few kinds times the sizes a job uses.
_CLASSES = 128
# Choices kept for SlowRingChoice.recent.
_RECENT = 64

_Key = tuple[str, int]
T = TypeVar("T")


class _Times:
    __slots__ = ("loop", "caller", "since", "last", "again", "every", "faster")

    def __init__(self) -> None:
        self.loop: deque[float] = deque(maxlen=_KEEP)
        self.caller: deque[float] = deque(maxlen=_KEEP)
        self.since = 0  # choices since the slower way was last tried
        self.last: bool | None = None  # the way the last op took (True: the loop)
        self.again = False  # the slower way, just tried, is taken once more
        self.every = _EXPLORE  # choices between two tries of the slower way
        self.faster: bool | None = None  # the faster way when it was last tried


class SlowRingChoice:
    """Per (kind, size class): which way ran faster while the rings were slow.  Any
    thread may ask and tell."""

    def __init__(self) -> None:
        self._classes: LRU[_Key, _Times] = LRU(_CLASSES)
        self._lock = threading.Lock()
        # The last choices made, (key, left), and how many were ever made (made_since):
        # which way an op went is otherwise visible only in how long it took.
        self.recent: deque[tuple[_Key, bool]] = deque(maxlen=_RECENT)
        self.choices = 0

    @staticmethod
    def key(kind: str, nbytes: int, lending: bool = False) -> _Key:
        """``lending``: the choice is whether the op lends on the loop (``leave``: it
        does), not whether it leaves the caller's thread."""
        return (kind + " lending" if lending else kind), nbytes.bit_length()

    def leave(self, key: _Key) -> bool:
        """Whether an op of ``key`` should go to the loop: the way with fewer times while
        either has under two (the loop first), else the faster, but the slower twice every
        _EXPLORE choices (up to _EXPLORE_MOST while it stays clearly slower)."""
        with self._lock:
            left = self._choose(key)
            self.recent.append((key, left))
            self.choices += 1
            return left

    def made_since(self, count: int) -> list[tuple[_Key, bool]]:
        """The choices made since :attr:`choices` was ``count`` (the last _RECENT of
        them), oldest first."""
        with self._lock:
            made = min(self.choices - count, len(self.recent))
            return list(self.recent)[len(self.recent) - made:] if made > 0 else []

    def _choose(self, key: _Key) -> bool:
        """:meth:`leave`'s answer (its caller holds the lock)."""
        times = self._classes.get(key)
        if times is None:
            times = _Times()
            self._classes.put(key, times)
        loop, caller = times.loop, times.caller
        if len(loop) < 2 or len(caller) < 2:
            return len(loop) <= len(caller)
        on_loop, on_caller = min(loop), min(caller)
        faster = on_loop < on_caller
        fast, slow = (on_loop, on_caller) if faster else (on_caller, on_loop)
        if times.again:
            times.again = False
            return not faster
        times.since += 1
        if times.since >= times.every:
            times.since = 0
            times.again = True
            clearly = times.faster == faster and slow >= _CLEARLY * fast
            times.every = min(2 * times.every, _EXPLORE_MOST) if clearly else _EXPLORE
            times.faster = faster
            return not faster
        return faster

    def took(self, key: _Key, left: bool, seconds: float) -> None:
        """An op of ``key`` took ``seconds``, on the loop if it ``left``: counted while
        either way has under two times, then only where the op before it went the same
        way."""
        with self._lock:
            times = self._classes.get(key)
            if times is not None:
                loop, caller = times.loop, times.caller
                if times.last == left or len(loop) < 2 or len(caller) < 2:
                    (loop if left else caller).append(seconds)
                times.last = left

    def timed(self, finish: Callable[[], T], key: _Key, left: bool = True
              ) -> Callable[[], T]:
        """``finish`` for an op of ``key`` that starts now the way ``left`` says,
        telling how long it took once it ran (its caller blocks on it from the start)."""
        start = time.perf_counter()

        def timed() -> T:
            self.took(key, left, time.perf_counter() - start)
            return finish()
        return timed

    def __len__(self) -> int:
        return len(self._classes)
