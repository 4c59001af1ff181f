"""One turn of the engine's loop, and the way out of it.

A turn runs the commands other threads queued (submit, adopt, join, forget, abort,
shutdown), takes the reduce thread's results, lets the transport do its I/O (which calls
the outbox, the inbox and peers.py), and every ``HOUSEKEEPING`` seconds fails the ops that
are mismatched or overdue.  Whoever drives (driving.py) calls :meth:`Loop.step`.

Async calls of a repeated reduction may wait in :attr:`Loop.queued` instead
(Engine.submit_repeat): a thread that waits runs them one after another from their
Repeats (repeat.py), each to its end, while nothing else is in flight, as a thread calling
them blocking would.  Started on the general path together, ResNet-50's 161 gradients took
17-19 ms at 2 ranks where the same calls blocking took 12 (each op's pieces, records and
callbacks in the loop's hands, and bytes written into the rings long before the peer read
them).  Whatever may be out of step across ranks goes to the general path, which takes
ops in any order: calls queued while others are in flight, or behind a queued call that
stalls, or that nobody waits for (_run_queued); a call a peer already runs
(Starter.try_serve); calls that come slowly (BURST_GAP).

Shutting down: fail what is pending (as Horovod does), tell every peer GOODBYE, wait
until that is out, half-close, and wait only for each peer's transport to close its end
(which it does on reading our EOF, whatever its application is doing), never for the
peers' own shutdown().
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from ..config import Config
from ..exceptions import PeerFailureError, ShutdownError, TotalReduceError, TransportClosedError
from ..transport.base import Transport
from ..transport.wire import Header, Kind
from .applier import Applier
from .departures import Departures
from .driving import HOUSEKEEPING
from .floating import Floating
from .job import JobState
from .mismatch_tracker import MismatchTracker
from .optable import OpTable
from .outbox import Outbox
from .serving import JoinServer
from .stall import overdue
from .starter import Starter

logger = logging.getLogger(__name__)

# Calls queued within this of the one before form a burst, which stays queued for a
# thread that waits to run; one that comes later has the calls before it started on the
# general path (Engine.submit_repeat).  A burst of async calls comes 5-20 us apart, a
# grouped call's parts up to 2 ms apart now and then (the GIL elsewhere): at 500 us their
# bursts broke, and the pieces ran out of step across ranks.
BURST_GAP = 2e-3
# Once no call has been queued, and no application thread has waited (which would run
# them itself, with no hand-off between threads), for this long, the progress thread
# starts the queued calls on the general path, where each goes as soon as its peers are
# there, whatever order they come in: their caller computes meanwhile.
QUEUED_GRACE = 200e-6
# Queued calls waiting while a queued call before them has run this long (it stalls: its
# peer may be waiting for one of them) start on the general path.
STALE_QUEUED = 1e-3

# A queued call (Engine.submit_repeat): its Repeat, buffer, identity, source, future and
# when it was queued.
Queued = tuple[Any, Any, Any, Any, Any, float]


class Awaited(Protocol):
    """What a driving thread waits for: an op's future, or a small op (smallpath.py)."""

    def done(self) -> bool: ...


def _resolve_from(future: Any, done: Any) -> None:
    """Resolve ``future`` as ``done`` (the op a queued call became) was."""
    future.resolve(done.error())


class Loop:
    def __init__(self, job: JobState, config: Config, transport: Transport, ops: OpTable,
                 outbox: Outbox, applier: Applier, mismatches: MismatchTracker,
                 starter: Starter, serving: JoinServer, completions: deque[Any],
                 floating: Floating, departures: Departures | None = None) -> None:
        """``completions``: where the reduce thread leaves its results for the loop;
        ``departures``: which peers have left (a receive from any of them is refused)."""
        self._departures = departures
        self._job = job
        self._config = config
        self._transport = transport
        self._ops = ops
        self._outbox = outbox
        self._applier = applier
        self._mismatches = mismatches
        self._starter = starter
        self._serving = serving
        self._floating = floating
        self.commands: deque[tuple[str, Any, Any]] = deque()
        # Appended by any thread (deque.append is atomic), taken by the driver only.
        self.queued: deque[Queued] = deque()
        self.queued_keys: set[Any] = set()  # the queued calls' keys (added by submitters)
        self.waited = 0.0  # when a thread last stopped waiting (Driver.wait)
        # Application threads inside a call that queues (queuing_calls), and when the last
        # of them left one: the grace runs from there, not from inside the call.
        self.queuing = 0
        self.queued_until = 0.0
        self._queuing_lock = threading.Lock()
        self._running_since: float | None = None  # when the queued op running began
        self.queued_ran = 0  # queued calls that ran to their end from their Repeats
        self.queued_general = 0  # ... and that went to the general path
        # Ops that ran to their end on the urgent lane (urgent.py), to be counted ended:
        # kept apart from the commands, which a long copy stops for.
        self.ran_elsewhere: deque[Any] = deque()
        self.completions = completions
        self.closed = threading.Event()
        self.ended = False  # closed is set (a plain attribute: read on every turn)
        self.on_close: Callable[[], None] | None = None  # told once the loop has ended
        self._shutdown_deadline: float | None = None
        # Set by any thread asking to shut down (before the command runs), so that the
        # progress thread drives the way out even while a caller counts as driving.
        self.leave_asked = False
        self._writes_closed = False  # GOODBYE (or ABORT) out, our write sides half-closed
        self._await_eof = True  # whether the transport reports each peer's end
        self._next_check = time.monotonic() + HOUSEKEEPING

    # --- what the driver asks (driving.Loop) -------------------------------------------

    def wanted(self) -> bool:
        return bool(self._ops.active or self.commands or self.completions or self.queued) \
            or self._floating.watched() or self._shutdown_deadline is not None \
            or self._transport.has_backlog()

    def idle_for(self) -> float | None:
        if self.commands or self.completions:
            return None
        queued = self.queued
        if queued:  # the progress thread starts them once that has passed (_run_queued)
            if self.queuing:  # more are coming: look again a grace later
                return QUEUED_GRACE
            return max(0.0, min(self._grace_ends(), self._next_check) - time.monotonic())
        if self._writes_closed and set(self._outbox.peers) <= self._outbox.closed:
            # Every peer's end has been read: the next turn finishes the shutdown, and no
            # event would come to end a wait (every process paid a housekeeping period
            # on the way out).
            return None
        return max(0.0, min(HOUSEKEEPING, self._next_check - time.monotonic()))

    def holds(self) -> bool:
        """Whether the progress thread's next turn would only hold the queued calls for a
        thread that may come to wait for them (_run_queued): nothing else in flight.  It
        then waits out their grace without the transport, whose records of those calls,
        from a peer ahead, would end every wait at once: its turns then spun, 900-2,100 in
        one grouped submit of ResNet-50's gradients, each holding the GIL against the
        thread submitting them."""
        return bool(self.queued) and not self._ops.active and not self.commands \
            and not self.completions

    def leaving(self) -> bool:
        return self.leave_asked or self._shutdown_deadline is not None

    def pressing(self) -> bool:
        """Whether commands wait for the next turn (the transport asks between the slices
        of a long copy: a submitted op, say an urgent one, then starts sooner)."""
        return bool(self.commands)

    def step(self, timeout: float | None, until: Awaited | None = None,
             top: bool = False) -> None:
        """One turn; the caller holds the drive lock (or, unthreaded, is the only thread).
        ``timeout=None``: start what was submitted and flush, but read nothing (a submit
        returns quickly); ``until``: the driver's future (the turn that resolves it never
        blocks)."""
        if self.ended:
            return
        try:
            while self.commands:
                self._run(*self.commands.popleft())
            while self.ran_elsewhere:
                self._starter.ran_elsewhere(self.ran_elsewhere.popleft())
            while self.completions:
                self._applier.reduced(*self.completions.popleft())
            if self._shutdown_deadline is not None and \
                    self._shutdown_done(self._shutdown_deadline):
                self.finish()
                return
            if timeout is None:
                self._transport.flush()
                return
            if self.queued and self._run_queued(until, top):
                return
            busy = bool(self.commands or self.completions) or (
                until is not None and until.done())  # done: do not block in poll()
            self._transport.poll(0 if busy else timeout)
            now = time.monotonic()
            if now >= self._next_check:
                self._next_check = now + HOUSEKEEPING
                ops = self._ops
                for op, error in self._mismatches.due(now):
                    ops.fail(op, error)
                job = self._job
                for op, error in overdue(job.rank, job.size, ops.live(), now, self._config):
                    ops.fail(op, error)
        except BaseException as exc:  # a bug: fail everything loudly rather than hang
            rank = self._job.rank
            logger.exception("rank %d: progress loop crashed", rank)
            self._job.break_job(TotalReduceError(f"rank {rank}: internal error in the "
                                                 f"progress loop: {exc!r}"))
            self.finish()

    def _run_queued(self, until: Awaited | None, top: bool) -> bool:
        """In a turn of a thread that waits (``until``; ``top``: not one taken from inside
        an op it runs), run the queued calls one after another, each from its Repeat to
        its end, while nothing else is in flight; where something is, start them on the
        general path.  In one of the progress thread's, start them there once
        QUEUED_GRACE has passed.  Inside a queued call that stalls, start the rest there
        after STALE_QUEUED.  Returns whether the turn ends here, without the transport's
        poll (which would read the next calls' messages and float them: a copy more).

        A thread that waits runs every queued call, not only up to its own: a caller that
        submits many and waits for each in turn then finds the rest done (ResNet-50's 161
        gradients at 2 ranks: 12.1 ms against 14.6 stopping at the caller's call, each
        wait a hand-over between threads and back)."""
        queued = self.queued
        ops = self._ops
        now = time.monotonic()
        if not top:
            # How long the call in hand has run, not how long the rest waited (a burst
            # waits its turn, which is no stall).
            stale = now - STALE_QUEUED
            if self._running_since is None or self._running_since <= stale:
                self._start_queued(stale)
            return False
        if until is None:
            if not self.queuing and now >= self._grace_ends():
                self._start_queued(now)
                return False
            return not ops.active
        if ops.active:
            # Those in flight may wait for peers that come to them only after these: with
            # these held until those had ended (each started early by a peer's message
            # for it), bench skew took 50-57 ms against 50-52, and grouped calls (a few of
            # whose parts went ahead) 17.7 against 15.7.
            self._start_queued(now)
            return False
        ran = False
        keys = self.queued_keys
        while queued and not ops.active and not self.commands and not self.completions:
            repeat, work, key, source, future, _at = queued.popleft()
            keys.discard(key)
            self._running_since = time.monotonic()
            try:
                done = repeat.run_queued(work, key, source)
            finally:
                self._running_since = None
            if done is True:
                self.queued_ran += 1
                future.resolve(None)
            elif done is False:
                self._go_general(repeat, work, key, source, future)
            else:
                self.queued_general += 1
                done.add_done_callback(functools.partial(_resolve_from, future))
            ran = True
        return ran and not ops.active

    def _grace_ends(self) -> float:
        """When the progress thread starts the queued calls on the general path, unless a
        thread waits by then or more calls come."""
        return max(self.queued[-1][5], self.waited, self.queued_until) + QUEUED_GRACE

    def queuing_calls(self) -> Queuing:
        """``with loop.queuing_calls():`` this thread is inside one call that queues (a
        grouped allreduce's parts, an async allreduce that copies its input first); its
        own work meanwhile is no gap that ends the burst (0.2-1 ms for the last of
        ResNet-50's 8 MiB buckets, which fuses its many small arrays)."""
        return Queuing(self)

    def _start_queued(self, stale: float) -> None:
        """Start the queued calls queued at ``stale`` or before on the general path."""
        queued = self.queued
        keys = self.queued_keys
        while queued and queued[0][5] <= stale:
            repeat, work, key, source, future, _at = queued.popleft()
            keys.discard(key)
            self._go_general(repeat, work, key, source, future)

    def _go_general(self, repeat: Any, work: Any, key: Any, source: Any,
                    future: Any) -> None:
        """Start a call taken out of the queue on the general path."""
        self.queued_general += 1
        self._starter.start(repeat.spec(work, key, source), future)

    def unqueue(self, key: Any) -> bool:
        """Start the queued call ``key`` on the general path now, if one waits; returns
        whether one did (Starter.try_serve)."""
        if key not in self.queued_keys:
            return False
        for call in list(self.queued):  # a snapshot: submitters append meanwhile
            if call[2] == key:
                self.queued.remove(call)
                self.queued_keys.discard(key)
                repeat, work, _key, source, future, _at = call
                self._go_general(repeat, work, key, source, future)
                return True
        return False

    def _run(self, cmd: str, arg: Any, future: Any) -> None:
        if cmd == "submit":
            self._starter.start(arg, future)
        elif cmd == "unqueue":
            self._start_queued(arg)
        elif cmd == "adopt":
            spec, ready, told, sent, unsent, got, needs = arg
            self._transport.resume()  # a message of it may wait unread in a ring
            self._starter.adopt(spec, future, ready, told, sent, unsent, got, needs)
        elif cmd == "watch":
            self._transport.resume()  # it may have stopped reading with nothing in flight
            if self._job.broken is not None:
                arg.future.resolve(self._job.broken)
            else:
                # Peers that left before it was asked for send nothing more: each is
                # told as it leaves (Floating.left), but these left already.
                gone = self._departures.departed() if self._departures is not None else set()
                self._floating.watch(arg, gone, self._job.rank)
        elif cmd == "forget":
            self._ops.forget(arg)
        elif cmd == "join":
            self._starter.begin_join(arg)
        elif cmd == "joined":
            self._serving.joined()
        elif cmd == "abort":
            rank = self._job.rank
            self._job.break_job(PeerFailureError(rank, f"rank {rank} failed: {arg}"), rank)
        elif self._shutdown_deadline is None:
            self._shutdown_deadline = self._begin_shutdown()

    # --- the way out -------------------------------------------------------------------

    def _begin_shutdown(self) -> float:
        """Fail what is pending, then tell every peer we are leaving.  Nothing of ours is
        sent after the GOODBYE, so a peer that reads it knows which of its ops can no
        longer finish and fails them at once (peers.py)."""
        job = self._job
        job.closing = True
        self._transport.resume()
        ops = self._ops
        for op in ops.live():
            ops.fail(op, TransportClosedError(
                f"rank {job.rank}: {op.spec.label} was still pending at shutdown()"))
        self._fail_queued(None)
        self._floating.end_watches(TransportClosedError(
            f"rank {job.rank}: a receive was still pending at shutdown()"))
        if job.broken is None:  # a broken job has told its peers already (ABORT)
            outbox = self._outbox
            for peer in outbox.reachable():
                # With how many messages went through the peer's lane before it: the peer
                # may read this goodbye first (PeerEvents).
                outbox.control(peer, Header(Kind.GOODBYE,
                                            seq=self._transport.lane_sent(peer)))
        return time.monotonic() + self._config.shutdown_timeout

    def _fail_queued(self, error: BaseException | None) -> None:
        """Resolve every queued call with ``error``, or as pending at shutdown()."""
        queued = self.queued
        self.queued_keys.clear()
        while queued:
            repeat, _work, key, _source, future, _at = queued.popleft()
            future.resolve(error or TransportClosedError(
                f"rank {self._job.rank}: {repeat.label(key[1])} was still pending at "
                "shutdown()"))

    def _shutdown_done(self, deadline: float) -> bool:
        """Once our last message is out, half-close and wait only until every peer's
        transport has seen that: closing with unread bytes would reset the connection."""
        outbox = self._outbox
        if time.monotonic() >= deadline:
            left = sorted(set(outbox.peers) - outbox.closed)
            if left:
                logger.debug("rank %d: shutdown: links to %s still open after %.1f s",
                             self._job.rank, left, self._config.shutdown_timeout)
            return True
        if not self._writes_closed:
            if self._transport.pending_output() or outbox.has_control():
                return False
            self._writes_closed = True
            # A broken job leaves at once: its peers read the ABORT before our end.
            self._await_eof = self._transport.close_writes() and self._job.broken is None
        return not self._await_eof or set(outbox.peers) <= outbox.closed

    def finish(self) -> None:
        """Close: fail whatever is left, refuse what was queued, end the transport."""
        job = self._job
        job.closing = True
        ops = self._ops
        for op in ops.live():
            ops.fail(op, job.broken or TransportClosedError(
                f"rank {job.rank}: {op.spec.label} was still pending at shutdown()"))
        self._fail_queued(job.broken)
        self._floating.end_watches(job.broken or TransportClosedError(
            f"rank {job.rank}: a receive was still pending at shutdown()"))
        while self.commands:
            cmd, arg, future = self.commands.popleft()
            if cmd == "watch":
                future = arg.future
            if future is not None:
                future.resolve(ShutdownError("cannot submit after shutdown()"))
        self._transport.abort()
        self.ended = True
        self.closed.set()
        if self.on_close is not None:
            self.on_close()


class Queuing:
    """See :meth:`Loop.queuing_calls`."""

    __slots__ = ("_loop",)

    def __init__(self, loop: Loop) -> None:
        self._loop = loop

    def __enter__(self) -> None:
        loop = self._loop
        with loop._queuing_lock:
            loop.queuing += 1

    def __exit__(self, *exc: object) -> None:
        loop = self._loop
        with loop._queuing_lock:
            loop.queuing -= 1
            loop.queued_until = time.monotonic()
