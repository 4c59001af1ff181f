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
from typing import Any

from ..config import Config
from ..exceptions import PeerFailureError, ShutdownError, TotalReduceError
from ..interrupts import deferred as ctrl_c
from ..timeline import Timeline
from ..transport.base import Transport
from ..transport.wire import Header, Kind
from .driving import CallerWaits, Driver
from .handler import Handler
from .inbox import Inbox
from .ledger import CreditLedger
from .loop import Loop
from .mismatch_tracker import MismatchTracker
from .opstate import LiveOp
from .optable import OpTable
from .outbox import Outbox
from .payload import OpFuture, OpSpec
from .peers import PeerEvents
from .reducer import ReduceThread
from .serving import JoinServer, Server

logger = logging.getLogger(__name__)


class Engine:
    """Runs ops over a transport.  Thread-safe: :meth:`submit`, :meth:`wait` and
    :meth:`shutdown` may be called from any thread; everything else runs on whichever
    thread drives the loop."""

    def __init__(self, transport: Transport, config: Config, *, threaded: bool = True,
                 timeline: Timeline | None = None) -> None:
        """``threaded=False``: no progress thread and no reduce thread; the loop runs only
        when a caller drives it (``wait``, or ``engine.loop.step``): one-process tests.
        ``timeline``: where to trace each op (self-guided mode)."""
        self.rank = transport.rank
        self.size = transport.size
        self.transport = transport
        self._config = config
        self.broken: TotalReduceError | None = None
        self.closing = False
        self.loop = Loop(self, config)
        self._commands = self.loop.commands
        peers = [p for p in range(self.size) if p != self.rank]
        self.ops = OpTable(timeline)
        self.ledger = CreditLedger(peers, config.floating_cap // max(1, self.size - 1))
        self.outbox = Outbox(peers, self.ledger, transport)
        reducer = ReduceThread(self.loop.completions.append, transport.wake) \
            if threaded and config.reduce_thread_bytes >= 0 else None
        self._reducer = reducer
        self.inbox = Inbox(self, config, self.ledger, reducer)
        self.mismatches = MismatchTracker(self, config)
        self.peers = PeerEvents(self)
        self.serving = JoinServer(self)
        self._closed = self.loop.closed
        self._driver = Driver(self.rank, transport, self.loop, self._closed)
        self.loop.on_close = self._driver.closed
        transport.start(Handler(self))
        if threaded:
            self._driver.start()

    # --- public, any thread -----------------------------------------------------------

    def submit(self, spec: OpSpec) -> OpFuture:
        """Start an op (on this thread, unless another drives the loop now).  The future
        resolves with None or the op's error."""
        future = OpFuture(self.wait)
        if self.closing or self._closed.is_set():
            future.resolve(ShutdownError("cannot submit after shutdown()"))
            return future
        self._commands.append(("submit", spec, future))
        self._driver.kick(future)
        self._driver.nudge()  # the progress thread takes over, unless a caller waits
        if ctrl_c.pending:
            ctrl_c.raise_if_pending()
        return future

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
            self._command("shutdown", None)
            self._driver.join(timeout if timeout is not None
                              else self._config.shutdown_timeout + 10.0)
        if self._reducer is not None:
            self._reducer.stop()

    def stats(self) -> dict[str, int]:
        inbox = self.inbox
        return {"floating_bytes": inbox.floating_bytes, "floating_peak": inbox.floating_peak,
                "ready_sent": self.outbox.ready_sent, "parks": self.outbox.parks,
                "floating_cap": self._config.floating_cap, "active_ops": len(self.ops.active),
                "scratch_idle_bytes": inbox.scratch.idle_bytes,
                "done_names": self.ops.done.names(), "early_ready": self.ledger.early_count(),
                "mismatch_records": len(self.mismatches)}

    def _command(self, what: str, arg: Any) -> None:
        self._commands.append((what, arg, None))
        self.transport.wake()
        self._driver.nudge()

    # --- starting and ending ops -------------------------------------------------------

    def start(self, spec: OpSpec, future: OpFuture) -> None:
        if self.broken is not None:
            future.resolve(self.broken)
            return
        ops = self.ops
        key = spec.key
        if ops.known(key):
            future.resolve(TotalReduceError(
                f"rank {self.rank}: {spec.label} was submitted twice (internal error)"))
            return
        if spec.epoch < 0:
            spec.epoch = self.serving.epoch
        op = LiveOp(spec, future)
        departed = self.peers.departed()
        gone = sorted((set(op.pending_from) | spec.schedule.first_peers) & departed) \
            if departed else None
        if gone:
            ops.done.add(key)
            reason = f"{spec.label} needs rank {gone[0]}, which has shut down"
            future.resolve(PeerFailureError(gone[0], f"rank {self.rank}: {reason}",
                                            orderly=True))
            self.peers.tell_op_failed(key, gone[0], reason)
            return
        early = ops.failed_early.pop(key)
        if early is not None:
            ops.done.add(key)
            future.resolve(early)
            return
        ops.active[key] = op
        self.transport.resume()
        op.ready_peers = self.ledger.pop_early(key)
        self.serving.forget(key)
        for lo, hi in spec.schedule.local_final:
            if spec.finalize is not None and hi > lo:
                spec.finalize(spec.work[lo:hi])
        inbox = self.inbox
        if key in inbox.floating:
            op.t_floated = min(item.t for item in inbox.floating[key])
            for item in inbox.take_floating(key):
                if op.finished:
                    inbox.scratch.put(item.buf)
                else:
                    inbox.deliver(op, item.src, item.header, item.buf, True)
            if op.finished or op.mismatch is not None:
                return  # a mismatch found in floating pieces: housekeeping raises later
        if len(self.mismatches) and self.mismatches.started(op):
            return
        # A peer we send to right away learns that we are ready from that DATA message
        # (FLAG_READY): one message fewer per op and peer.  The others get a READY now.
        first_to = spec.schedule.first_peers
        outbox = self.outbox
        for peer, left in op.pending_from.items():
            if left <= 0:
                continue
            if peer in first_to:
                op.announce.add(peer)
            else:
                outbox.announce(op, peer)
        for send in spec.schedule.first:
            outbox.queue(op, send)
        ops.complete(op)

    def fail(self, op: LiveOp, error: BaseException) -> None:
        if self.ops.end(op, error):
            key = op.spec.key
            self.mismatches.forget(key)
            self.outbox.drop_op(key)

    def break_job(self, error: TotalReduceError, lost: int | None = None) -> None:
        """The job cannot go on: fail every op, and tell every peer (an ABORT naming the
        rank that was lost, if any)."""
        if self.broken is not None:
            return
        self.broken = error
        self.transport.resume()
        if lost != self.rank:
            logger.error("%s", error)
        body = str(error).encode()[:4096]
        outbox = self.outbox
        abort = Header(Kind.ABORT, step=0 if lost is None else lost + 1, nbytes=len(body))
        for peer in outbox.peers:
            if peer not in outbox.closed and peer != lost:
                outbox.drop_data(peer)
                outbox.control(peer, abort, body)
        for op in self.ops.live():
            self.fail(op, error)
        self.inbox.clear_floating()
