"""Whether copying bodies through a shared-memory ring costs more, right now, than lending
them (cma.py).

A ring copy is cheap while the writer's and the reader's cores share a cache: the reader
finds the lines the writer just wrote.  Where they do not (cores of another CCX or
socket, or a VM whose vCPUs the host has moved apart), every line of the ring crosses
between the caches twice, and the writer's copy also waits for the reader's stale copies
to be invalidated.  On a 2-vCPU VM, a 512 KiB body took 14 us to copy into the ring and
15 us out in one placement, and 100-210 us in and 50-55 us out in the other, for minutes at a
time; the kernel's copy of the same body lent took 48 us in both.  MPICH lends such bodies
(it uses ``process_vm_readv`` too), so it did not slow down when the ring did.

So the writer times its big copies into the ring, and while they are slow its link lends
bodies it would otherwise copy.  Lending leaves nothing to time: now and then the ring is
tried again, for a lap and the copies after it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

# Copies into the ring at least this big are timed: smaller ones are too short to tell a
# shared cache from a distant one through the timer's and the interpreter's noise.
PACE_MIN = 256 << 10
# The ring is taken for slow when this many copies in a row are: in the slow placement
# every copy is, while in the fast one a copy the scheduler cut in two, or one from a
# source no cache held, is now and then (1 % of 512 KiB copies at 2 ranks).  With the
# median of three, two such in three copies lent for PROBE_EVERY where the ring was fast:
# 1 MiB alltoalls left the caller's thread for a third of a run, at 0.15-0.23 ms each
# against 0.09-0.13 ms.  One fast copy makes it fast again at once: cores that share no
# cache cannot copy fast.
_WINDOW = 3
# While lending because the ring was slow, the ring is tried again this often.  A try
# copies a lap of the ring before its copies are judged (see CopyPace.cold): in the slow
# state that costs about 2 ms.
PROBE_EVERY = 0.25
# A body out of small pages that the ring holds whole is lent only while the ring's
# copies run slower than twice the kernel's copy of a lent body (far_rate): through the
# ring each of the two ranks of an exchange copies it twice (in, then the peer's out),
# lent the kernel copies it once, pinning each small page.  The ring's pace is the median
# of this many copies: its copies into a ring whose reader shares no cache with the
# writer spread from 8 to 40 GB/s (2 MiB bodies, 2 ranks), against 22-48 where one cache
# serves both, and the two ranks, each timing its own ring, must mostly agree (a call
# where one lends and the other copies costs more than either way).
_PLACEMENT_WINDOW = 15


class CopyPace:
    """The recent speed of one ring's big copies, and what to do with the next body."""

    __slots__ = ("_rates", "_recent", "_median", "_clock", "_last", "_lap", "cold", "far",
                 "far_rate")

    def __init__(self, far_rate: float = 0.0, lap: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._rates: deque[float] = deque(maxlen=_WINDOW)
        self._recent: deque[float] = deque(maxlen=_PLACEMENT_WINDOW)  # beats_lending
        self._median = 0.0  # of _recent, kept here: a call lending or not asks each time
        self._clock = clock
        self._last = 0.0  # when the last copy was timed
        # Bytes still to copy before copies are judged: a lap of the ring (``lap``) at
        # first and whenever the ring is tried again after lending.  Lines no cache holds
        # copy at memory's speed whatever the placement (7-10 GB/s here, against 15-37
        # once the ring is warm and the cores share a cache), so a verdict drawn from
        # them would lend on and on where the ring is fast.
        self._lap = lap
        self.cold = lap
        self.far = False  # the last _WINDOW copies were each slower than far_rate
        # Bytes per second (TOTALREDUCE_SLOW_RING_GBPS; 0: never far; by default the
        # speed of the kernel's copy of a lent body here, cma.read_rate).  The placements
        # above gave 37 and 4-5 GB/s, and a copy into private memory 22-35 GB/s; a lent
        # body was read at about 11 GB/s, so below that the ring's two copies cost more
        # than the kernel's one.  Another VM read lent bodies at 4-7 GB/s: a fixed 10
        # GB/s lent there where the ring was the faster by 2x.
        self.far_rate = far_rate

    def timed(self, nbytes: int, seconds: float) -> None:
        """One copy of ``nbytes`` into the ring took ``seconds``."""
        self._last = self._clock()
        if self.cold > 0:
            self.cold -= nbytes
            return
        rates = self._rates
        rate = nbytes / max(seconds, 1e-9)
        recent = self._recent
        recent.append(rate)
        self._median = sorted(recent)[len(recent) // 2]
        if self.far and rate >= self.far_rate:
            rates.clear()
            self.far = False
        rates.append(rate)
        if len(rates) == _WINDOW:
            self.far = max(rates) < self.far_rate

    def lend(self) -> bool:
        """Whether bodies should be lent rather than copied: the ring is slow, and not
        due to be tried again (then it is taken for fast until its copies say)."""
        if not self.far:
            return False
        if self._clock() - self._last < PROBE_EVERY:
            return True
        self.far = False
        self._rates.clear()
        self.cold = self._lap
        return False

    def beats_lending(self) -> bool:
        """Whether a body out of small pages that the ring holds whole goes faster
        through it than lent (_PLACEMENT_WINDOW); also where far_rate is 0, and where no
        copy was timed for PROBE_EVERY (the ring is tried, and its copies timed)."""
        if not self._recent or not self.far_rate or \
                self._clock() - self._last >= PROBE_EVERY:
            return True
        return self._median >= 2 * self.far_rate
