"""Who runs the engine's loop: the progress thread, or an application thread waiting for
its own op.

Whoever holds the drive lock runs the loop.  A waiting thread that drives saves two
hand-offs per op (a GIL switch and a wake-up), most of a small op's time; the progress
thread drives only when work is in flight and no caller does.  The guards are classes
rather than generator-based context managers: each is entered once or twice per op, and
the generator form cost ~2 us a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from ..exceptions import TotalReduceError
from ..interrupts import deferred as ctrl_c
from ..threads import start_daemon
from ..transport.base import Transport
from .payload import OpFuture

_get_ident = threading.get_ident

T = TypeVar("T")
A = TypeVar("A")

HOUSEKEEPING = 0.25  # the longest a turn blocks, and the period of the engine's checks


class Loop(Protocol):
    """What the driver drives (the engine)."""

    def step(self, timeout: float | None, until: OpFuture | None = None,
             top: bool = False) -> None:
        """One turn.  ``timeout=None``: start what was submitted and flush, but read
        nothing; ``until``: the future the driving thread waits for (the turn that
        resolves it never blocks); ``top``: a turn of the driver's own, not one taken
        from inside an op it runs (which may then run queued ops: Loop.queued)."""

    def wanted(self) -> bool:
        """Whether the progress thread has work (may be read without the lock)."""

    def idle_for(self) -> float | None:
        """How long the progress thread may wait for I/O without the lock before the
        loop's next check; None: it has queued work and must not wait."""

    def holds(self) -> bool:
        """Whether the wait is only a grace for queued calls, which the transport's news
        cannot shorten (the progress thread then waits away from it)."""

    ended: bool  # the loop has closed for good
    waited: float  # set when a thread stops waiting (the loop's queued calls' grace)

    def leaving(self) -> bool:
        """Whether the engine is shutting down (the progress thread then drives even
        while callers do, until the loop ends)."""


class Driver:
    """Runs the loop's turns on whichever thread needs them; ``closed`` is set once the
    loop has ended."""

    def __init__(self, rank: int, transport: Transport, loop: Loop,
                 closed: threading.Event) -> None:
        self._rank = rank
        self._transport = transport
        self._loop = loop
        self._step = loop.step
        self._wanted = loop.wanted
        self._closed = closed
        # Public for the engine's repeats (repeat.py), which take the lock as
        # :meth:`exclusive` does without the call between: a small op comes through there
        # every call.
        self.lock = threading.Lock()
        self.owner: int | None = None  # thread holding the lock (to refuse re-entry)
        # The progress thread sleeps here while callers drive.
        self._idle_lock = threading.Lock()
        self._idle = threading.Condition(self._idle_lock)
        self._drivers = 0  # threads waiting for their op, driving it themselves
        self._driving = _Driving(self)
        self.waiting = Waiting(self)
        self._local = threading.local()  # .waits: depth of caller_waits() on this thread
        self._caller_waits = CallerWaits(self)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = start_daemon(self._run, "totalreduce-progress")

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    # --- entry points ------------------------------------------------------------------

    def kick(self, future: OpFuture) -> None:
        """Start what was just submitted (``future``'s op) on this thread if nobody drives;
        else the driver picks it up.  Inside :meth:`caller_waits`, keep driving until
        ``future`` is done: the caller waits for it next anyway, and keeping the loop saves
        the trip back out and in again through wait(), which lies on the path of the rank
        that arrives last (a 4-byte allreduce at 2 ranks: 42 us instead of 50)."""
        if not self.lock.acquire(False):
            self._transport.wake()  # whoever holds the lock picks the command up
            return
        if not getattr(self._local, "waits", 0):
            with self._driving:
                if not self._loop.ended:
                    self._step(None)
            return
        with self._driving:
            if not self._loop.ended:
                self._step(None)  # start and send; then look for replies
            while not future.done() and not self._loop.ended:
                if ctrl_c.pending:
                    ctrl_c.raise_if_pending()
                self._step(HOUSEKEEPING, future, True)

    def waits_here(self) -> bool:
        return getattr(self._local, "waits", 0) > 0

    def exclusive(self, fn: Callable[[A], T], arg: A) -> T | bool:
        """``fn(arg)`` as the loop's driver, if no other thread drives now and the loop has
        not ended; False otherwise."""
        lock = self.lock
        if not lock.acquire(False):  # positional: a keyword doubles the call's cost
            return False
        # As ``with self._driving``, spelled out: a small op comes through here every
        # call, and the context manager's two method calls were a measurable share.
        self.owner = _get_ident()
        try:
            if self._loop.ended:
                return False
            return fn(arg)
        finally:
            self.owner = None
            lock.release()

    def caller_waits(self) -> CallerWaits:
        """``with driver.caller_waits():`` this thread waits for each op it submits inside,
        and drives the loop meanwhile (see :meth:`kick`)."""
        return self._caller_waits

    def aside(self) -> Aside:
        """``with driver.aside():`` this thread, though inside :meth:`caller_waits`, does
        not drive for a while (it runs an op past the loop, engine/urgent.py): the
        progress thread drives what is in flight meanwhile."""
        return Aside(self)

    def wait(self, future: OpFuture, timeout: float | None) -> bool:
        """Wait for ``future`` (any future resolved by the loop) by driving the loop on this
        thread whenever nobody else does.  Returns False on timeout."""
        if self.owner == threading.get_ident():
            raise TotalReduceError(
                f"rank {self._rank}: an op was waited on from inside the engine loop (a "
                "completion callback); that would deadlock. Wait from another thread.")
        deadline = None if timeout is None else time.monotonic() + timeout
        woke = False
        with self.waiting:
            while not future.done():
                if ctrl_c.pending:
                    ctrl_c.raise_if_pending()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                if self._closed.is_set():
                    return future.wait_event(left)
                slice_ = HOUSEKEEPING if left is None else min(left, HOUSEKEEPING)
                if not self.lock.acquire(timeout=min(slice_, 1e-3)):
                    if not woke:
                        woke = True
                        self._transport.wake()  # a holder blocked in poll() lets go sooner
                    continue
                with self._driving:
                    while not future.done() and not self._loop.ended:
                        if ctrl_c.pending:
                            ctrl_c.raise_if_pending()
                        left = None if deadline is None else deadline - time.monotonic()
                        if left is not None and left <= 0:
                            return False
                        self._step(HOUSEKEEPING if left is None else min(left, HOUSEKEEPING),
                                   future, True)
            # Before the progress thread is woken on the way out: a caller that waits for
            # its calls one after another is back in a moment (Loop.QUEUED_GRACE).
            self._loop.waited = time.monotonic()
            if ctrl_c.pending:  # the op may have ended meanwhile; Ctrl-C still wins
                ctrl_c.raise_if_pending()
            return True

    def waiting_callers(self) -> int:
        """How many application threads wait for an op now, driving (read without the
        lock: a hint)."""
        return self._drivers

    def nudge(self) -> None:
        """Have the progress thread drive, unless a caller does."""
        if not self._drivers and self._wanted():
            with self._idle:
                self._idle.notify()
            if self._transport.has_backlog():
                self._transport.wake()  # a wait() begun earlier must re-arm its timer

    def closed(self) -> None:
        """The loop has ended: let the progress thread go."""
        with self._idle:
            self._idle.notify_all()

    # --- the progress thread -------------------------------------------------------------

    def _run(self) -> None:
        """Drive whenever work is in flight and no caller drives.

        With nothing in flight it only ticks (a non-blocking turn every housekeeping
        period), so a thread running blocking collectives back to back is never raced for
        the lock; bytes peers send meanwhile wait in the kernel or the shared ring.
        """
        transport = self._transport
        can_wait = transport.can_wait()
        while not self._closed.is_set():
            with self._idle:
                while not self._closed.is_set() and (self._drivers or not self._wanted()):
                    if not self._idle.wait(HOUSEKEEPING):
                        break
                tick = bool(self._drivers) or not self._wanted()
            if self._closed.is_set():
                return
            if tick and self._drivers and not self._loop.leaving():
                # A caller drives; but one that asked to shut down from inside its wait
                # (recovery drops its world there) drives no more.
                continue
            if not tick and can_wait:
                idle = self._loop.idle_for()
                if idle is not None:
                    if self._loop.holds():
                        # Out of the transport's reach: a peer's records for the calls
                        # held would end each of its waits at once.
                        with self._idle:
                            self._idle.wait(idle)
                    else:
                        # Wait for I/O without the lock, so a caller can take over at any
                        # moment.
                        transport.wait(idle)
            self.lock.acquire()
            with self._driving:
                if self._drivers and not self._loop.leaving():
                    continue
                if not self._closed.is_set():
                    self._step(0 if can_wait or tick else HOUSEKEEPING, None, True)


class _Driving:
    """``with driver._driving:`` marks this thread as the loop's driver and releases the
    lock (already acquired) on the way out."""

    __slots__ = ("_driver",)

    def __init__(self, driver: Driver) -> None:
        self._driver = driver

    def __enter__(self) -> None:
        self._driver.owner = threading.get_ident()

    def __exit__(self, *exc: object) -> None:
        driver = self._driver
        driver.owner = None
        driver.lock.release()


class Waiting:
    """``with driver.waiting:`` counts this thread among the callers that drive the loop
    themselves, so the progress thread stays asleep; on the way out it is woken if work
    is left."""

    __slots__ = ("_driver",)

    def __init__(self, driver: Driver) -> None:
        self._driver = driver

    def __enter__(self) -> None:
        driver = self._driver
        with driver._idle_lock:  # the condition's own lock, without its Python layer
            driver._drivers += 1

    def __exit__(self, *exc: object) -> None:
        driver = self._driver
        with driver._idle_lock:
            driver._drivers -= 1
        driver.nudge()


class Aside:
    """See :meth:`Driver.aside`."""

    __slots__ = ("_driver", "_counted")

    def __init__(self, driver: Driver) -> None:
        self._driver = driver
        self._counted = False

    def __enter__(self) -> None:
        driver = self._driver
        self._counted = getattr(driver._local, "waits", 0) > 0
        if self._counted:
            with driver._idle_lock:
                driver._drivers -= 1
            driver.nudge()

    def __exit__(self, *exc: object) -> None:
        if self._counted:
            driver = self._driver
            with driver._idle_lock:
                driver._drivers += 1


class CallerWaits(Waiting):
    """See :meth:`Driver.caller_waits`: a driver (the progress thread stays asleep) whose
    thread drives each op it submits to the end."""

    __slots__ = ()

    def __enter__(self) -> None:
        super().__enter__()
        local = self._driver._local
        local.waits = getattr(local, "waits", 0) + 1

    def __exit__(self, *exc: object) -> None:
        self._driver._local.waits -= 1
        super().__exit__(*exc)
