"""Waiting for work: socket events, shared-memory rings, and how long to spin first.

A blocked ``select()`` costs a scheduler wake-up (tens of us on a loaded host) on every hop
of a small op's critical path, so the poller spins briefly before it sleeps; with
shared-memory peers it naps at most ``_RING_SLEEP`` (in case a doorbell is lost), after
telling each peer's writer that it sleeps, so the writer rings the doorbell.

Two threads may wait at once: the one inside ``poll()`` (slot 0) and one inside the
transport's ``wait()`` (slot 1, which does no I/O); each announces its sleep in its own
slot of the ring, so a writer wakes whichever sleeps.
"""

from __future__ import annotations

import contextlib
import os
import select
import selectors
import socket
import time
from typing import Any

from .ring_link import RingLink

_SPIN = 50e-6  # busy-poll this long before a blocking select
# poll() spins this long when every local rank can have a core of its own (shared-memory
# peers reply within tens of us, a sleep plus doorbell costs ~50 us).
_SPIN_OWN_CORE = 2e-3
# ... and this long, yielding the core between looks, when ranks outnumber cores.
_YIELD_SPIN = 1e-3
_SPIN_SOCKET_EVERY = 16  # while spinning on rings, look at the sockets this seldom
# ... or, when every peer is on a ring, this long apart: a Ctrl-C, a peer's end or another
# thread's submit then waits at most this long to be seen by a spinning thread.
_SOCKET_PERIOD = 200e-6
_RING_SLEEP = 0.02  # the longest nap with shared-memory peers
# epoll takes its timeout in whole milliseconds, rounded up: a 200 us nap (a queued call's
# grace, engine/loop.py) slept 1.08 ms, a 1.5 ms one 2.1 ms.  Naps shorter than this wait
# on the epoll descriptor through select(), which takes microseconds (200 us: 0.27 ms).
_FINE_NAP = 0.01
# select() cannot watch a descriptor from this number on.
_FD_SETSIZE = 1024

POLL_SLOT = 0
WAIT_SLOT = 1


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def local_spin(crowded: bool) -> float:
    """How long a thread waiting for a peer on this host spins before it blocks: long
    where every rank of the host has a core of its own, shorter, yielding the core
    between looks, where ``crowded`` (the host's ranks outnumber its cores)."""
    return _YIELD_SPIN if crowded else _SPIN_OWN_CORE


# A thread that drives a busy loop gives its core away this often (GiveWay).  Before every
# look at MPI it made 16-64 MB allgathers and allreduces over the MPI transport 10-30 %
# slower in one run; this often they stayed within the noise in four.
GIVE_WAY_EVERY = 100e-6


class GiveWay:
    """Now and then, the thread that drives the loop gives its core away (sched_yield),
    where each of this host's ranks has a core of its own (``on``).

    A loop busy with a big op's transfers never blocks, so a thread of ours woken
    meanwhile (the application's, with an urgent op: engine/urgent.py) waited for the
    scheduler's next look, up to milliseconds, before it ran: at 2 ranks a 1 KB urgent
    allreduce 2 ms into a 64 MB one took 0.14-0.52 ms over the MPI transport, tails of
    0.9-1.3 ms, against 0.091-0.095 ms, at most 0.18, with this (bench preempt,
    alternated three times; over sockets 0.25-0.30 against 0.16-0.23 ms, tails of 0.6-3.1
    against 0.4-0.7).  The rings' readers give way between the slices of a lent copy
    (ring_link.py).  Where ranks outnumber cores the core would go to another rank."""

    __slots__ = ("on", "_next")

    def __init__(self, on: bool) -> None:
        self.on = on
        self._next = 0.0

    def now_and_then(self, now: float) -> None:
        """Yield if GIVE_WAY_EVERY has passed since the last time (``now``: monotonic)."""
        if self.on and now >= self._next:
            os.sched_yield()
            self._next = now + GIVE_WAY_EVERY


class Poller:
    def __init__(self, rings: list[RingLink], rings_only: bool = False,
                 local: int | None = None) -> None:
        """``rings``: the ring links (the caller's list, kept up to date in place);
        ``rings_only``: every peer is reached through one; ``local``: the ranks of this
        host, this one included (by default one per ring and this one)."""
        self.rings = rings
        self.rings_only = rings_only and bool(rings)
        # Ranks share cores, whether they talk through rings or sockets: a waiting turn
        # gives the core away between looks (the peer may be waiting for it) rather than
        # sleeping, which costs a wake-up each time.  At 4 ranks on 2 cores over sockets,
        # 1-64 MB allreduces and gathers ran 1.2-1.5x slower with busy 50 us spins.
        self.crowded = (len(rings) + 1 if local is None else local) > cores()
        # Whether every rank of this host can have a core of its own, with rings to read.
        self.own_core = bool(rings) and not self.crowded
        self.spin = local_spin(self.crowded) if self.own_core or self.crowded else _SPIN
        self.give_way = GiveWay(not self.crowded)
        self.selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.selector.register(self._wake_r, selectors.EVENT_READ, None)
        fileno = getattr(self.selector, "fileno", None)
        fd = fileno() if fileno is not None else -1
        self._fine_fd = fd if 0 <= fd < _FD_SETSIZE else -1
        # wake(), per slot: a thread spinning in select() sees it at its next look, where
        # the wake-up byte would wait for its next look at the sockets (_SOCKET_PERIOD);
        # the byte (a system call each side) goes only to a thread that sleeps.
        self._poked = [False, False]
        self._asleep = [False, False]
        self._socket_turns = 0  # turns since select() last looked at the sockets
        self._next_look = 0.0  # when rings_only: when to look at the sockets again

    def wake(self) -> None:
        """Have a thread in :meth:`select` return soon.  The poke is raised before the
        sleepers are looked at, and a sleeper announces itself before it looks at its
        poke, so one of the two sees the other (the GIL orders them)."""
        poked = self._poked
        poked[POLL_SLOT] = poked[WAIT_SLOT] = True
        asleep = self._asleep
        if asleep[POLL_SLOT] or asleep[WAIT_SLOT]:
            with contextlib.suppress(OSError):
                self._wake_w.send(b"\0")

    def woken(self) -> None:
        """The wake socket was readable: empty it."""
        with contextlib.suppress(OSError):
            self._wake_r.recv(4096)

    def rings_ready(self) -> bool:
        """Whether a ring has a record for us (or a lent body copied in part) or has freed
        room for a message that found it full."""
        for link in self.rings:  # a plain loop: this runs on every spin turn
            ring = link.ring_in
            if ring is not None and ((ring.ready() and (not link.deferred
                                                        or link.asked_to_push()))
                                     or link.lent_in is not None):
                return True
            lane = link.lane_in
            if lane is not None and lane.head() != link.lane_seen:
                return True  # news in the lane (RingLink.read_lane)
            if link.blocked is not None and link.room_freed():
                return True
        return False

    def select(self, timeout: float | None, slot: int = POLL_SLOT,
               pending: set[int] | None = None) -> list[tuple[Any, int]]:
        """Socket events, after spinning briefly and before sleeping; returns early when a
        ring has a record (the caller drains the rings whatever this returns).  A spin
        also ends once ``pending`` (the caller's links with output waiting) fills."""
        rings = self.rings
        poked = self._poked
        if poked[slot]:
            poked[slot] = False
            # Still a look at the sockets when one is due: wakes that come faster than
            # that (an application submitting op after op) must not starve them.
            return self._look_at_sockets() if not rings or self._sockets_due() else []
        if rings and not self._sockets_due() and self.rings_ready():
            # Records are waiting: take them first and look at the sockets (doorbells, EOF,
            # a remote peer's bytes) on a later turn, though never too seldom.
            return []
        events = self._look_at_sockets()
        if events or timeout == 0 or self.rings_ready():
            return events
        # The thread in wait() spins briefly only: the application may want the GIL.
        spin = self.spin if slot == POLL_SLOT else _SPIN
        if timeout is not None and timeout < spin:
            spin = timeout
        spin_until = time.monotonic() + spin
        relax = os.sched_yield if slot == POLL_SLOT and self.crowded else None
        while time.monotonic() < spin_until and not pending:
            if self.rings_ready():
                return events
            if poked[slot]:
                poked[slot] = False
                return events
            if relax is not None:
                relax()
            if not rings or self._sockets_due():
                events = self._look_at_sockets()
                if events:
                    return events
        stuck: list[RingLink] = []
        if rings:
            timeout = _RING_SLEEP if timeout is None else min(timeout, _RING_SLEEP)
            for link in rings:
                link.set_sleeping(slot, True)
            stuck = [link for link in rings if link.ask_for_room(True)]
        self._asleep[slot] = True
        try:
            if not poked[slot] and not (rings and self.rings_ready()):
                events = self._nap(timeout)
        finally:
            self._asleep[slot] = False
            poked[slot] = False  # the caller looks at what the poke was for next
            for link in rings:
                link.set_sleeping(slot, False)
            for link in stuck:
                link.ask_for_room(False)
        return events

    def _nap(self, timeout: float | None) -> list[tuple[Any, int]]:
        """Block in the selector for up to ``timeout`` seconds, to the microsecond."""
        if timeout is not None and 0 < timeout < _FINE_NAP and self._fine_fd >= 0:
            ready, _, _ = select.select([self._fine_fd], [], [], timeout)
            return self.selector.select(0) if ready else []
        return self.selector.select(timeout)

    def _sockets_due(self) -> bool:
        """Whether a turn that could take ring records instead should look at the sockets:
        when every peer is on a ring, they carry only doorbells, wake-ups and ends, and a
        look costs a system call (microseconds, on a small op's critical path), so once a
        period; else once in so many turns, for the socket peers' data."""
        if self.rings_only:
            return time.monotonic() >= self._next_look
        self._socket_turns += 1
        return self._socket_turns >= _SPIN_SOCKET_EVERY

    def _look_at_sockets(self) -> list[tuple[Any, int]]:
        self._socket_turns = 0
        self._next_look = time.monotonic() + _SOCKET_PERIOD
        return self.selector.select(0)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.selector.close()
        for s in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                s.close()
