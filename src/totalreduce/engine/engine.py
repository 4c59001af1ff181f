"""The progress engine: the "big loop" of the Total Reduce design, wired from its parts.

Ops arrive from any thread through :meth:`Engine.submit` and start at once: there is no
negotiation.  The loop then

* hands the transport the most urgent ready message for each peer when it can take one
  (outbox.py: a per-peer heap keyed by op priority, so a small urgent op overtakes a big
  one between pieces: that is the preemption),
* routes every arriving body by its self-guided header (inbox.py): straight into the
  destination array when the op is known here, else into a *floating* buffer that is
  applied when the local rank submits the op,
* reduces (inline, or on the reduce thread for big pieces), which unlocks the next sends,
* and watches for stalls, timeouts, mismatches (mismatch_tracker.py) and lost peers
  (peers.py).

Flow control (why floating memory is bounded, ledger.py): a rank may send a message for an
op its peer has not announced only against *credit*, ``TOTALREDUCE_FLOATING_CAP / (n - 1)``
bytes per directed pair, which comes back once the receiver consumes the message.  When a
rank submits an op it sends READY to each peer it still expects data from; from then on
that op's messages need no credit.  So a rank racing ahead parks its messages in its own
memory (views of its own arrays, no copy) once the lagging peer's floating budget is used,
and an op a rank is waiting for can always proceed: no deadlock, no data loss, and floating
memory on any rank never exceeds the cap.

One turn of the loop and the way out are loop.py's; who runs the loop is driving.py's
business; ops a joined rank serves, serving.py's.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable
from typing import Any

from ..config import Config
from ..exceptions import ShutdownError
from ..interrupts import deferred as ctrl_c
from ..timeline import Timeline
from ..transport import pages
from ..transport.base import Port, Transport
from ..transport.ring_push import PUSH_MIN
from ..transport.wire import Header
from .applier import Applier
from .departures import Departures
from .driving import CallerWaits, Driver
from .express import Express
from .floating import Floating, Watch
from .handler import Handler
from .inbox import Inbox
from .job import JobState
from .ledger import CreditLedger
from .loop import BURST_GAP, Loop, Queuing
from .mismatch_tracker import MismatchTracker
from .optable import OpTable
from .outbox import Outbox
from .payload import OpFuture, OpKey, OpSpec
from .peers import PeerEvents
from .reducer import ReduceThread, ScratchPool
from .repeat import Repeat
from .serving import JoinServer, Server
from .smallpath import SmallPath
from .starter import Starter
from .urgent import Adopt, UrgentLane

logger = logging.getLogger(__name__)


class Engine:
    """Runs ops over a transport.  Thread-safe: :meth:`submit`, :meth:`wait` and
    :meth:`shutdown` may be called from any thread; everything else runs on whichever
    thread drives the loop.

    The engine only wires its parts (each gets the collaborators it uses, nothing more)
    and offers the scheduler's entry points; every decision is one part's."""

    def __init__(self, transport: Transport, config: Config, *, threaded: bool = True,
                 timeline: Timeline | None = None) -> None:
        """``threaded=False``: no progress thread and no reduce thread; the loop runs only
        when a caller drives it (``wait``, or ``engine.loop.step``): one-process tests.
        ``timeline``: where to trace each op (self-guided mode)."""
        self.rank = rank = transport.rank
        self.size = size = transport.size
        self.transport = transport
        self.hosts = transport.hosts  # each rank's host, for algorithms that mind it
        self._config = config
        peers = [p for p in range(size) if p != rank]
        ledger = CreditLedger(peers, config.floating_cap // max(1, size - 1),
                              transport.want_send)
        outbox = Outbox(peers, ledger, transport)
        ops = OpTable(timeline)
        ops.on_fail(outbox.drop_op)
        scratch = ScratchPool(config.scratch_bytes)
        floating = Floating(ledger, scratch)
        self.job = job = JobState(rank, size, outbox, ops, floating, transport.resume)
        mismatches = MismatchTracker(rank, size, ops, outbox, config.mismatch_grace)
        ops.on_fail(mismatches.forget)
        departures = Departures(outbox)
        completions: deque[Any] = deque()  # the reduce thread's results, for the loop
        reducer = ReduceThread(completions.append, transport.wake) \
            if threaded and config.reduce_thread_bytes >= 0 else None
        self._reducer = reducer
        applier = Applier(rank, ops, outbox, mismatches, scratch, reducer,
                          config.reduce_thread_bytes)
        serving = JoinServer()
        starter = Starter(job, ops, ledger, outbox, floating, applier, mismatches, departures,
                          serving, scratch, transport.resume)
        # The handler (made below, attached before any message can come) takes what a
        # departing peer's lane still holds.
        peer_events = PeerEvents(job, ops, outbox, ledger, mismatches, departures, serving,
                                 starter, floating,
                                 lambda peer, sent: transport.drain_lane(peer, handler, sent))
        inbox = Inbox(job, ops, ledger, outbox, mismatches, floating, applier, starter,
                      peer_events, scratch, use_in_place=reducer is None)
        self.loop = loop = Loop(job, config, transport, ops, outbox, applier, mismatches,
                                starter, serving, completions, floating, departures)
        self._commands = loop.commands
        starter.unqueue = loop.unqueue
        self._closed = loop.closed
        self._driver = Driver(rank, transport, loop, self._closed)
        loop.on_close = self._driver.closed
        self._small = small = SmallPath(job, ops, ledger, floating, mismatches, departures,
                                        serving, starter, applier, transport, loop.step,
                                        self.wait, outbox.unpark)
        inbox.small = small
        self._express = Express(small, ops, ledger, serving, transport, outbox.unpark,
                                exchange_pages=config.cma_bytes < 0)
        self._serving = serving
        self._urgent = UrgentLane(job, ops, floating, mismatches, departures, serving,
                                  transport, self._adopt, loop.ran_elsewhere)
        inbox.urgent = self._urgent.running
        # What stats() reports on.
        self._ops, self._ledger, self._outbox = ops, ledger, outbox
        self._floating, self._scratch, self._mismatches = floating, scratch, mismatches
        handler = Handler(outbox, inbox, applier, peer_events, loop.pressing)
        transport.start(handler)
        if threaded:
            self._driver.start()

    # --- public, any thread -----------------------------------------------------------

    def submit(self, spec: OpSpec) -> OpFuture:
        """Start an op (on this thread, unless another drives the loop now).  The future
        resolves with None or the op's error."""
        future = OpFuture(self.wait)
        if self.job.closing or self._closed.is_set():
            future.resolve(ShutdownError("cannot submit after shutdown()"))
            return future
        self._commands.append(("submit", spec, future))
        self._driver.kick(future)
        self._driver.nudge()  # the progress thread takes over, unless a caller waits
        if ctrl_c.pending:
            ctrl_c.raise_if_pending()
        return future

    def submit_repeat(self, repeat: Repeat, work: Any, key: OpKey,
                      source: Any = None) -> OpFuture:
        """Queue an async call of ``repeat`` (buffer ``work``, identity ``key``): the loop's
        driver runs it from the Repeat, to its end, once nothing else is in flight (see
        loop.py), and on the general path where it cannot.  The future resolves as
        :meth:`submit`'s does."""
        future = OpFuture(self.wait)
        if self.job.closing or self._closed.is_set():
            future.resolve(ShutdownError("cannot submit after shutdown()"))
            return future
        if key in self._floating or key in self._ledger.early.entries:
            # A peer runs it already, and may wait for it before it comes to the calls
            # that would run first here: the general path takes it now.
            return self.submit(repeat.spec(work, key, source))
        loop = self.loop
        queued = loop.queued
        now = time.monotonic()
        # Not a burst: the calls before it start on the general path (loop.py).  Inside a
        # call that queues several, the gaps are that call's own work.
        slow = bool(queued) and not loop.queuing and now - queued[-1][5] > BURST_GAP
        # The rest of a burst: the progress thread, woken for its first call, looks
        # again once the grace has passed (waking it for each cost the burst's submits
        # the GIL, and their gaps then ended bursts).
        quiet = bool(queued) and not slow and not self._driver.waiting_callers()
        loop.queued_keys.add(key)
        if slow:
            self._commands.append(("unqueue", now, None))
        queued.append((repeat, work, key, source, future, now))
        if slow:
            self._driver.kick(future)
        elif not quiet:
            self.transport.wake()  # a driver blocked in poll() looks again
        if not quiet:
            self._driver.nudge()
        if ctrl_c.pending:
            ctrl_c.raise_if_pending()
        return future

    def run_now(self, spec: OpSpec) -> OpFuture | bool:
        """Run a small op to its end on this thread (smallpath.py), if nothing else is in
        flight here and no other thread drives: True once it is done, False if it did not
        begin (submit it), or the future of an op that went on on the general path (wait
        for it).  Raises the op's error."""
        # Past whatever the loop is busy with (urgent.py).
        chain = self._urgent.chain(spec) if spec.priority > 0 else None
        if chain is not None:
            with self._driver.aside():
                ran = self._urgent.run(spec, chain)
            if ran is not False:
                return ran
        ran = self._driver.exclusive(self._run_small, spec)
        if ran is True and self.transport.has_backlog():
            # Credit it owes a peer, say: the progress thread sends it, as it would have
            # been woken to if the caller had waited through caller_waits().
            self._driver.nudge()
        return ran

    def repeat(self, spec: OpSpec, label_of: Callable[[int], str], lends: bool = False,
               lends_one_way: bool = False) -> Repeat | None:
        """What runs calls like ``spec`` (a small blocking op's) on this thread with
        everything they share bound once (repeat.py), while the engine is idle, if they
        can run that way here: their schedule a chain through rings this process reads.
        ``label_of(seq)``: the label of the call
        ``seq``.  Its calls keep ``spec``'s priority where they go on
        on the general path; while the engine is idle no other op is there to pass.
        ``lends``: its calls lend the bodies the express lane would (else none);
        ``lends_one_way``: and their one-way sends' (Repeat: whole, half copied into the
        peer, or where huge pages back them)."""
        chain = self._express.chain(spec.schedule)
        if chain is None:
            return None
        ports: dict[int, Port] = {}
        for peer in {*chain.sources, *(s.peer for s in chain.sends)}:
            port = self.transport.port(peer)
            if port is None:
                return None
            ports[peer] = port
        return Repeat(spec, chain, label_of, spec.ranks, self._driver, self.loop,
                      self._small, self._express, self._ops, self._ledger, self._serving,
                      self._floating, ports, self._outbox.unpark, self.transport, lends,
                      lends_one_way, self._scratch)

    def _adopt(self, state: Adopt) -> OpFuture:
        """The loop goes on with an op the urgent lane began (Starter.adopt)."""
        future = OpFuture(self.wait)
        if self.job.closing or self._closed.is_set():
            future.resolve(ShutdownError(f"{state[0].label}: cannot go on after shutdown()"))
            return future
        self._commands.append(("adopt", state, future))
        self._driver.kick(future)
        self._driver.nudge()
        return future

    def _run_small(self, spec: OpSpec) -> OpFuture | bool:
        loop = self.loop
        small = self._small
        chain = self._express.chain(spec.schedule)
        if chain is not None and spec.key in self._floating:
            chain = None  # the small path takes in what floated here first
        if (loop.commands or loop.completions or loop.queued
                or not small.eligible(spec, chain is not None)):
            return False
        if chain is not None:
            return self._express.run(spec, chain)
        return small.run(spec)

    def watch(self, match: Callable[[int, Header], bool], sources: Iterable[int],
              label: str) -> OpFuture:
        """A future resolved once a body that no submitted op here expects, from one of
        ``sources``, is accepted by ``match(sender, header)`` (run on the loop's thread,
        once per such body until it accepts one; bodies floating already are asked first,
        the earliest first).  It fails if every source shuts down or the job breaks.  A
        receive from any source learns this way which op to submit."""
        future = OpFuture(self.wait)
        if self.job.closing or self._closed.is_set():
            future.resolve(ShutdownError(f"{label}: cannot receive after shutdown()"))
            return future
        self._commands.append(("watch", Watch(match, set(sources), future, label), None))
        self._driver.kick(future)
        self._driver.nudge()
        return future

    def ring_room(self, peers: Iterable[int]) -> int:
        """Bytes the ring to each of ``peers`` holds at once; 0 if one is not reached
        through a ring."""
        return min((self.transport.ring_room(p) for p in peers), default=0)

    def crowded(self) -> bool:
        """Whether this host's ranks outnumber its cores (Transport.crowded)."""
        return self.transport.crowded()

    def huge_share(self, buf: Any) -> float | None:
        """The share of a contiguous array's bytes that huge pages back (None: the kernel
        cannot say), which decides what lending them costs (transport/pages.py)."""
        return pages.huge_share(buf.ctypes.data, buf.nbytes)

    def lends(self, peers: Collection[int]) -> bool:
        """Whether big bodies to most of ``peers`` would be lent now, for rings that have
        been slow lately (transport/copy_pace.py): only the loop lends.  Most, not any:
        each ring is timed on its own, and at 16 ranks on 16 cores one of the fifteen was
        nearly always taken for slow, which sent every 1 MiB broadcast to the loop (2.0-2.2
        ms, against 0.86-1.07 ms on the caller's thread)."""
        transport = self.transport
        return 2 * sum(map(transport.lends, peers)) > len(peers)

    def lends_first(self, spec: OpSpec) -> bool:
        """Whether every one of ``spec``'s first sends would be lent, by the size rule
        the loop's and the express lane's sends follow (Transport.lends_body)."""
        transport = self.transport
        work = spec.work
        first = spec.schedule.first
        return spec.lend and bool(first) and all(
            transport.lends_body(s.peer, work.nbytes, (s.hi - s.lo) * work.itemsize)
            for s in first)

    def spreads(self, peers: Collection[int], nbytes: int) -> bool:
        """Whether ``peers`` would copy a body of ``nbytes`` this rank lends them, while it
        sits idle, half each, this rank the other halves (transport/ring_push.py): such a
        body is lent to each, is big enough, and every rank of the host has a core of its
        own."""
        transport = self.transport
        return nbytes >= PUSH_MIN and bool(peers) and not transport.crowded() and all(
            transport.lends_body(p, nbytes, nbytes) for p in peers)

    def idle(self) -> bool:
        """Whether nothing is in flight here: no op submitted, running or waiting (read
        without the lock: a hint that another thread may change at once)."""
        return not self.loop.wanted()

    def waits_here(self) -> bool:
        """Whether this thread is inside :meth:`caller_waits` (it blocks on what it
        submits, so a small op may run to its end on it)."""
        return self._driver.waits_here()

    def queuing_calls(self) -> Queuing:
        """``with engine.queuing_calls():`` one call of this thread's queues several
        parts: the progress thread holds the queued calls until it has returned."""
        return self.loop.queuing_calls()

    def caller_waits(self) -> CallerWaits:
        """``with engine.caller_waits():`` this thread waits for each op it submits inside,
        driving the loop itself until the op is done, so the progress thread is left
        asleep (a blocking call: no hand-off between threads on its path)."""
        return self._driver.caller_waits()

    def wait(self, future: OpFuture, timeout: float | None) -> bool:
        """Wait for ``future`` (any future resolved by this engine's loop), driving the
        loop on this thread.  Returns False on timeout."""
        return self._driver.wait(future, timeout)

    def interrupt(self) -> None:
        """SIGINT arrived while the main thread was inside the engine: rather than let
        KeyboardInterrupt tear through a half-handled message, it is raised at the next
        point where the engine's state is whole (between two turns of the loop, or on
        the way out; see interrupts.py).  Called from the signal handler."""
        ctrl_c.pending = True
        self.transport.wake()

    def abort(self, reason: str) -> None:
        """This rank is failing (an uncaught exception): tell every peer at once, so they
        raise PeerFailureError naming us instead of waiting for our data (any thread).
        A shutdown() should follow; it then only flushes the news and closes."""
        self._command("abort", reason)

    def begin_join(self, server: Server) -> None:
        """From now on, run every op that a peer began before this rank's join round ends
        and that this rank has not submitted, with the spec ``server`` builds from its
        header; an op it returns None for fails on the peers with a MismatchError.  Ops
        already waiting here are served at once.  Takes effect before any later submit
        (any thread)."""
        self._command("join", server)

    def end_join(self) -> None:
        """This rank's join round is over: ops it submits from now on belong to the next
        (any thread; takes effect before any later submit)."""
        self._commands.append(("joined", None, None))

    def forget_name(self, name_key: int) -> None:
        """The scheduler no longer counts calls of this name: its next op is call 0 again,
        so which of its calls finished here must be forgotten too (any thread)."""
        self._commands.append(("forget", name_key, None))

    def shutdown(self, timeout: float | None = None) -> None:
        """Say goodbye to every peer, wait for theirs (up to ``shutdown_timeout``), close."""
        if not self._closed.is_set():
            self.loop.leave_asked = True
            self._command("shutdown", None)
            self._driver.join(timeout if timeout is not None
                              else self._config.shutdown_timeout + 10.0)
        if self._reducer is not None:
            self._reducer.stop()

    @property
    def broken(self) -> BaseException | None:
        """The failure that ended the job here, if one has."""
        return self.job.broken

    def stats(self) -> dict[str, int]:
        return {"floating_bytes": self._floating.bytes, "floating_peak": self._floating.peak,
                "floated_bytes": self._floating.floated,
                "ready_sent": self._outbox.ready_sent, "parks": self._outbox.parks,
                "floating_cap": self._config.floating_cap,
                "active_ops": len(self._ops.active),
                "scratch_idle_bytes": self._scratch.idle_bytes,
                "done_names": self._ops.done.names(),
                "early_ready": self._ledger.early_count(),
                "mismatch_records": len(self._mismatches),
                "direct_ops": self._small.ran + self._express.ran + self._express.repeats,
                "express_ops": self._express.ran + self._express.repeats,
                "express_repeats": self._express.repeats,
                "express_repeats_handed_over": self._express.repeats_handed_over,
                "express_repeats_lent": self._express.repeats_lent,
                "express_handed_over": self._express.handed_over,
                "direct_handed_over": self._small.handed_over,
                "direct_caught_up": self._small.caught_up,
                "queued_ran": self.loop.queued_ran,
                "queued_general": self.loop.queued_general,
                "urgent_ops": self._urgent.ran,
                "urgent_handed_over": self._urgent.handed_over}

    def _command(self, what: str, arg: Any) -> None:
        self._commands.append((what, arg, None))
        self.transport.wake()
        self._driver.nudge()
