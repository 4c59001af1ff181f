"""The progress engine: one thread that runs the "big loop" of the Total Reduce design.

Ops arrive from any thread through :meth:`Engine.submit` and start at once: there is no
negotiation.  The loop then

* hands the transport the most urgent ready message for each peer when it can take one
  (a per-peer heap keyed by op priority: a small urgent op overtakes a big one between
  pieces — that is the preemption),
* routes every arriving body by its self-guided header: straight into the destination
  array when the op is known here, else into a *floating* buffer that is applied when the
  local rank submits the op,
* reduces (inline, or on the reduce thread for big pieces), which unlocks the next sends,
* and watches for stalls, timeouts, mismatches and lost peers.

Flow control (why floating memory is bounded): a rank may send a message for an op its
peer has not announced only against *credit*, ``TOTALREDUCE_FLOATING_CAP / (n - 1)`` bytes
per directed pair.  Credit comes back when the receiver consumes such a message.  When a
rank submits an op it sends READY to each peer it still expects data from; from then on
that op's messages need no credit.  So a rank racing ahead parks its messages in its own
memory (they are views of its own arrays, no copy) once the lagging peer's floating budget
is used, and an op a rank is waiting for can always proceed: no deadlock, no data loss, and
floating memory on any rank never exceeds the cap.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..config import Config
from ..exceptions import (
    PeerFailureError,
    ShutdownError,
    TotalReduceError,
    TransportClosedError,
)
from ..interrupts import deferred as ctrl_c
from ..lru import LRU
from ..threads import start_daemon
from ..transport.base import Outgoing, Transport
from ..transport.wire import (
    DTYPES,
    FLAG_CREDITED,
    FLAG_LENDABLE,
    FLAG_READY,
    HEADER_SIZE,
    Header,
    Kind,
    pack_header,
)
from .driving import Driving, Waiting
from .mismatch import MismatchRecord, decode_view, encode_view
from .opstate import DoneSet, FloatingBody, LiveOp, QueuedMsg, Route
from .payload import OpFuture, OpKey, OpSpec
from .reducer import ReduceThread, ScratchPool, reduce_into
from .schedule import COPY, Recv, Send
from .stall import overdue

logger = logging.getLogger(__name__)

_HOUSEKEEPING = 0.25
_EARLY_READY_ENTRIES = 1 << 16
_MISMATCH_ENTRIES = 4096


class Engine:
    """Runs ops over a transport.  Thread-safe: :meth:`submit` and :meth:`shutdown` may be
    called from any thread; everything else happens on the progress thread."""

    def __init__(self, transport: Transport, config: Config) -> None:
        self.rank = transport.rank
        self.size = transport.size
        self._transport = transport
        self._config = config
        self._budget = config.floating_cap // max(1, self.size - 1)
        self._commands: deque[tuple[str, Any, Any]] = deque()
        self._completions: deque[Any] = deque()
        self._active: dict[OpKey, LiveOp] = {}
        self._done = DoneSet()
        self._floating: dict[OpKey, list[FloatingBody]] = {}
        self.floating_bytes = 0
        self.floating_peak = 0
        self.ready_sent = 0  # READY control messages (most ride on DATA instead)
        # READYs for ops not submitted here yet.  Bounded: dropping the stalest costs
        # only credit (the sender then sends against credit), never correctness.
        self._early_ready: LRU[OpKey, set[int]] = LRU(_EARLY_READY_ENTRIES)
        # Views of mismatched ops, kept until the op fails here (or, for ops this rank
        # never submits, until they are the stalest of _MISMATCH_ENTRIES).
        self._mismatches: LRU[OpKey, MismatchRecord] = LRU(_MISMATCH_ENTRIES)
        # Ops a peer failed before we submitted them (OP_FAILED), with the error to raise.
        self._failed_early: LRU[OpKey, PeerFailureError] = LRU(_MISMATCH_ENTRIES)
        # join(): ``_epoch`` counts this rank's completed join rounds and stamps every op
        # it submits.  From its first join on, ``_server`` builds this rank's part of an op
        # it never submitted from the op's first header (None: it cannot take part), for
        # ops stamped below ``_serve_below``: begun before this rank's current (or last)
        # round ended.  Later ones are this rank's to submit.  The READYs of ops not
        # submitted yet are kept for it, headers and all.
        self._epoch = 0
        self._serve_below = 0
        self._server: Callable[[Header], OpSpec | None] | None = None
        self._early_headers: LRU[OpKey, Header] = LRU(_EARLY_READY_ENTRIES)
        peers = [p for p in range(self.size) if p != self.rank]
        self._heaps: dict[int, list[tuple[int, int, QueuedMsg]]] = {p: [] for p in peers}
        self._parked: dict[int, dict[OpKey, list[QueuedMsg]]] = {p: {} for p in peers}
        self._control: dict[int, deque[tuple[Header, bytes | None]]] = {
            p: deque() for p in peers}
        self._credit = dict.fromkeys(peers, self._budget)
        self._owed = dict.fromkeys(peers, 0)
        self._routes: dict[int, Route] = {}
        self._gone: set[int] = set()
        self._bye: set[int] = set()
        self._tiebreak = itertools.count()
        self._scratch = ScratchPool(config.scratch_bytes)
        self._discard = bytearray(1 << 16)
        self._broken: TotalReduceError | None = None
        self._closing = False
        self._closed = threading.Event()
        self._shutdown_deadline: float | None = None
        self._writes_closed = False  # GOODBYE (or ABORT) out, our write sides half-closed
        self._await_eof = True  # whether the transport reports each peer's end
        self._next_check = time.monotonic() + _HOUSEKEEPING
        # Whoever holds the drive lock runs the loop (driving.py): a waiting thread that
        # drives saves two hand-offs per op (GIL switch + wake-up), most of a small op's time.
        self._drive = threading.Lock()
        self._owner: int | None = None  # thread ident holding _drive (to refuse re-entry)
        self._idle = threading.Condition()  # the progress thread sleeps here while callers drive
        self._drivers = 0
        self._driving = Driving(self)
        self._waiting = Waiting(self)
        self._reducer = ReduceThread(self._completions.append, transport.wake) \
            if config.reduce_thread_bytes >= 0 else None
        transport.start(self)
        self._thread = start_daemon(self._run, "totalreduce-progress")

    # --- public, any thread -----------------------------------------------------------

    def submit(self, spec: OpSpec, blocking: bool = False) -> OpFuture:
        """Start an op.  The future resolves with None or the op's error.

        ``blocking=True`` promises that this thread waits on the future next, so it will
        drive the op itself and the progress thread is left asleep.
        """
        future = OpFuture(self.wait)
        if self._closing or self._closed.is_set():
            future.resolve(ShutdownError("cannot submit after shutdown()"))
            return future
        self._commands.append(("submit", spec, future))
        if self._drive.acquire(blocking=False):
            # Start it here and now: no hand-off to the progress thread.
            if blocking:
                self._drive_to_end(future)
            else:
                with self._driving:
                    if not self._closed.is_set():
                        self._step(None)
        else:
            self._transport.wake()  # whoever holds the lock picks the command up
        if not blocking:
            self._nudge()
        if ctrl_c.pending:
            ctrl_c.raise_if_pending()
        return future

    def interrupt(self) -> None:
        """SIGINT arrived while the main thread was inside the engine: rather than let
        KeyboardInterrupt tear through a half-handled message, it is raised at the next
        point where the engine's state is whole (between two turns of the loop, or on
        the way out; see interrupts.py).  Called from the signal handler."""
        ctrl_c.pending = True
        self._transport.wake()

    def _drive_to_end(self, future: OpFuture) -> None:
        """With ``_drive`` held: start what was submitted and run the loop until ``future``
        is done.  A blocking caller waits next anyway, and keeping the loop saves the trip
        back out through the caller's wait(), which lies on the path of the rank that
        arrives last: two ranks left a barrier 12 us apart (median) instead of 20."""
        with self._waiting, self._driving:
            if not self._closed.is_set():
                self._step(None)  # start and send; then look for replies
            while not future.done() and not self._closed.is_set():
                if ctrl_c.pending:
                    ctrl_c.raise_if_pending()
                self._step(_HOUSEKEEPING, future)
        if ctrl_c.pending:
            ctrl_c.raise_if_pending()

    def abort(self, reason: str) -> None:
        """This rank is failing (an uncaught exception): tell every peer at once, so they
        raise PeerFailureError naming us instead of waiting for our data (any thread).
        A shutdown() should follow; it then only flushes the news and closes."""
        self._commands.append(("abort", reason, None))
        self._transport.wake()
        self._nudge()

    def begin_join(self, server: Callable[[Header], OpSpec | None]) -> None:
        """From now on, run every op that a peer began before this rank's join round ends
        and that this rank has not submitted, with the spec ``server`` builds from its
        header; an op it returns None for fails on the peers with a MismatchError.  Ops
        already waiting here are served at once.  Takes effect before any later submit
        (any thread)."""
        self._commands.append(("join", server, None))
        self._transport.wake()
        self._nudge()

    def end_join(self) -> None:
        """This rank's join round is over: ops it submits from now on belong to the next
        (any thread; takes effect before any later submit)."""
        self._commands.append(("joined", None, None))

    def forget_name(self, name_key: int) -> None:
        """The scheduler no longer counts calls of this name: its next op is call 0 again,
        so which of its calls finished here must be forgotten too (any thread)."""
        self._commands.append(("forget", name_key, None))

    def _nudge(self) -> None:
        """Have the progress thread drive, unless a caller does."""
        if not self._drivers and self._wanted():
            with self._idle:
                self._idle.notify()
            if self._transport.has_backlog():
                self._transport.wake()  # a wait() begun earlier must re-arm its timer

    def _wanted(self) -> bool:
        """Whether the progress thread has work (read without the lock: a stale answer
        costs at most one housekeeping tick)."""
        return bool(self._active or self._commands or self._completions) \
            or self._shutdown_deadline is not None or self._transport.has_backlog()

    def shutdown(self, timeout: float | None = None) -> None:
        """Say goodbye to every peer, wait for theirs (up to ``shutdown_timeout``), close."""
        if not self._closed.is_set():
            self._commands.append(("shutdown", None, None))
            self._transport.wake()
            self._nudge()
            self._thread.join(timeout if timeout is not None
                              else self._config.shutdown_timeout + 10.0)
        if self._reducer is not None:
            self._reducer.stop()

    @property
    def broken(self) -> TotalReduceError | None:
        return self._broken

    def stats(self) -> dict[str, int]:
        return {"floating_bytes": self.floating_bytes, "floating_peak": self.floating_peak,
                "ready_sent": self.ready_sent,
                "floating_cap": self._config.floating_cap, "active_ops": len(self._active),
                "scratch_idle_bytes": self._scratch.idle_bytes,
                "done_names": self._done.names(), "early_ready": len(self._early_ready),
                "mismatch_records": len(self._mismatches)}

    # --- the loop --------------------------------------------------------------------

    def wait(self, future: OpFuture, timeout: float | None) -> bool:
        """Wait for ``future`` (any future resolved by this engine's loop) by running the
        loop on this thread (see ``_drive``).  Returns False on timeout."""
        if self._owner == threading.get_ident():
            raise TotalReduceError(
                f"rank {self.rank}: an op was waited on from inside the engine loop (a "
                "completion callback); that would deadlock. Wait from another thread.")
        deadline = None if timeout is None else time.monotonic() + timeout
        woke = False
        with self._waiting:
            while not future.done():
                if ctrl_c.pending:
                    ctrl_c.raise_if_pending()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                if self._closed.is_set():
                    return future.wait_event(left)
                slice_ = _HOUSEKEEPING if left is None else min(left, _HOUSEKEEPING)
                if not self._drive.acquire(timeout=min(slice_, 1e-3)):
                    if not woke:
                        woke = True
                        self._transport.wake()  # a holder blocked in poll() lets go sooner
                    continue
                with self._driving:
                    while not future.done() and not self._closed.is_set():
                        if ctrl_c.pending:
                            ctrl_c.raise_if_pending()
                        left = None if deadline is None else deadline - time.monotonic()
                        if left is not None and left <= 0:
                            return False
                        self._step(_HOUSEKEEPING if left is None else min(left, _HOUSEKEEPING),
                                   future)
            if ctrl_c.pending:  # the op may have ended meanwhile; Ctrl-C still wins
                ctrl_c.raise_if_pending()
            return True

    def _run(self) -> None:
        """The progress thread: drives whenever work is in flight and no caller drives.

        With nothing in flight it only ticks (a non-blocking turn every housekeeping
        period), so a thread running blocking collectives back to back is never raced for
        the lock; bytes peers send meanwhile wait in the kernel or the shared ring.
        """
        can_wait = self._transport.can_wait()
        while not self._closed.is_set():
            with self._idle:
                while not self._closed.is_set() and (self._drivers or not self._wanted()):
                    if not self._idle.wait(_HOUSEKEEPING):
                        break
                tick = bool(self._drivers) or not self._wanted()
            if self._closed.is_set():
                return
            if tick and self._drivers:
                continue
            if not tick and can_wait and not (self._commands or self._completions):
                # Wait for I/O without the lock, so a caller can take over at any moment.
                self._transport.wait(max(0.0, min(_HOUSEKEEPING,
                                                  self._next_check - time.monotonic())))
            self._drive.acquire()
            with self._driving:
                if self._drivers and self._shutdown_deadline is None:
                    continue
                if not self._closed.is_set():
                    self._step(0 if can_wait or tick else _HOUSEKEEPING)

    def _step(self, timeout: float | None, until: OpFuture | None = None) -> None:
        """One turn of the loop; the caller holds ``_drive``.  ``timeout=None``: start
        what was submitted and flush, but read nothing (a submit returns quickly).  A
        driver passes its future as ``until``, so the turn that resolves it never blocks."""
        try:
            while self._commands:
                cmd, spec, future = self._commands.popleft()
                if cmd == "submit":
                    self._start(spec, future)
                elif cmd == "forget":
                    self._done.forget(spec)
                elif cmd == "join":
                    self._start_serving(spec)
                elif cmd == "joined":
                    self._epoch += 1
                elif cmd == "abort":
                    self._break(PeerFailureError(self.rank, f"rank {self.rank} failed: {spec}"),
                                self.rank)
                elif self._shutdown_deadline is None:
                    self._shutdown_deadline = self._begin_shutdown()
            while self._completions:
                self._reduced(*self._completions.popleft())
            if self._shutdown_deadline is not None and \
                    self._shutdown_done(self._shutdown_deadline):
                self._finish()
                return
            if timeout is None:
                self._transport.flush()
                return
            busy = bool(self._commands or self._completions) or (
                until is not None and until.done())  # done: do not block in poll()
            self._transport.poll(0 if busy else timeout)
            now = time.monotonic()
            if now >= self._next_check:
                self._next_check = now + _HOUSEKEEPING
                self._housekeeping(now)
        except BaseException as exc:  # a bug: fail everything loudly rather than hang
            logger.exception("rank %d: progress loop crashed", self.rank)
            self._break(TotalReduceError(f"rank {self.rank}: internal error in the progress "
                                         f"loop: {exc!r}"))
            self._finish()

    def _finish(self) -> None:
        self._closing = True
        for op in list(self._active.values()):
            self._fail(op, self._broken or TransportClosedError(
                f"rank {self.rank}: {op.spec.label} was still pending at shutdown()"))
        while self._commands:
            _cmd, _spec, future = self._commands.popleft()
            if future is not None:
                future.resolve(ShutdownError("cannot submit after shutdown()"))
        self._transport.abort()
        self._closed.set()
        with self._idle:
            self._idle.notify_all()

    def _begin_shutdown(self) -> float:
        """Fail what is pending (as Horovod does), then tell every peer we are leaving.

        Nothing of ours is sent after the GOODBYE, so a peer that reads it knows which of
        its ops can no longer finish and fails them at once (``_peer_left``)."""
        self._closing = True
        self._transport.resume()
        for op in list(self._active.values()):
            self._fail(op, TransportClosedError(
                f"rank {self.rank}: {op.spec.label} was still pending at shutdown()"))
        if self._broken is None:  # a broken job has told its peers already (ABORT)
            for peer in self._heaps:
                if peer not in self._gone:
                    self._control[peer].append((Header(Kind.GOODBYE), None))
                    self._transport.want_send(peer)
        return time.monotonic() + self._config.shutdown_timeout

    def _shutdown_done(self, deadline: float) -> bool:
        """Once our last message is out, half-close and wait only until every peer's
        transport has seen that (it closes its end at once, whatever its application is
        doing): closing with unread bytes would reset the connection.  We never wait
        for the peers' own shutdown()."""
        if time.monotonic() >= deadline:
            left = sorted(set(self._heaps) - self._gone)
            if left:
                logger.debug("rank %d: shutdown: links to %s still open after %.1f s",
                             self.rank, left, self._config.shutdown_timeout)
            return True
        if not self._writes_closed:
            if self._transport.pending_output() or any(
                    self._control[p] for p in self._control if p not in self._gone):
                return False
            self._writes_closed = True
            # A broken job leaves at once: its peers read the ABORT before our end.
            self._await_eof = self._transport.close_writes() and self._broken is None
        return not self._await_eof or set(self._heaps) <= self._gone

    def _housekeeping(self, now: float) -> None:
        for key, record in self._mismatches.items():
            op = self._active.get(key)
            if op is not None and op.mismatch is record and (
                    record.complete() or now >= record.deadline):
                self._fail(op, record.error(self.rank, op.spec.describe.get("name", "")))
        for op, error in overdue(self.rank, list(self._active.values()), now, self._config):
            self._fail(op, error)

    # --- starting and finishing ops --------------------------------------------------

    def _start(self, spec: OpSpec, future: OpFuture) -> None:
        if self._broken is not None:
            future.resolve(self._broken)
            return
        key = spec.key
        if key in self._active or key in self._done:
            future.resolve(TotalReduceError(
                f"rank {self.rank}: {spec.label} was submitted twice (internal error)"))
            return
        if spec.epoch < 0:
            spec.epoch = self._epoch
        op = LiveOp(spec, future)
        departed = self._gone | self._bye
        gone = sorted((set(op.pending_from) | spec.schedule.first_peers) & departed) \
            if departed else None
        if gone:
            self._done.add(key)
            reason = f"{spec.label} needs rank {gone[0]}, which has shut down"
            future.resolve(PeerFailureError(gone[0], f"rank {self.rank}: {reason}"))
            self._tell_op_failed(key, gone[0], reason)
            return
        early = self._failed_early.pop(key)
        if early is not None:
            self._done.add(key)
            future.resolve(early)
            return
        self._active[key] = op
        self._transport.resume()
        op.ready_peers = self._early_ready.pop(key) or set()
        self._early_headers.pop(key)
        for lo, hi in spec.schedule.local_final:
            if spec.finalize is not None and hi > lo:
                spec.finalize(spec.work[lo:hi])
        for item in self._floating.pop(key, ()):
            self.floating_bytes -= item.charge
            self._settle_credit(item.src, item.header, item.charge)
            if not op.finished:
                self._apply_floating(op, item)
        if op.finished:
            return
        if op.mismatch is not None:
            return  # found while applying floating pieces; housekeeping raises after grace
        record = self._mismatches.get(key)
        if record is not None:
            # Peers told us before we submitted; give the rest a grace period to answer.
            record.deadline = max(record.deadline,
                                  time.monotonic() + self._config.mismatch_grace)
            self._join_mismatch(op, record, fail_now=False)
            return
        # A peer we send to right away learns that we are ready from that DATA message
        # (FLAG_READY): one message fewer per op and peer.  The others get a READY now.
        first_to = spec.schedule.first_peers
        for peer, left in op.pending_from.items():
            if left <= 0:
                continue
            if peer in first_to:
                op.announce.add(peer)
            else:
                self._announce(op, peer)
        for send in spec.schedule.first:
            self._queue(op, send)
        self._check_done(op)

    def _announce(self, op: LiveOp, peer: int) -> None:
        key = op.spec.key
        self.ready_sent += 1
        spec = op.spec
        self._control[peer].append((Header(Kind.READY, spec.dtype, name_key=key[0],
                                           seq=key[1], sig=spec.sig, count=spec.count,
                                           recipe=spec.recipe, epoch=spec.epoch), None))
        self._transport.want_send(peer)

    def _queue(self, op: LiveOp, send: Send) -> None:
        heapq.heappush(self._heaps[send.peer],
                       (-op.spec.priority, next(self._tiebreak), QueuedMsg(op, send)))
        self._transport.want_send(send.peer)

    def _check_done(self, op: LiveOp) -> None:
        if op.recvs_left == 0 and op.sends_left == 0 and not op.finished:
            op.finished = True
            del self._active[op.spec.key]
            self._done.add(op.spec.key)
            op.future.resolve(None)

    def _fail(self, op: LiveOp, error: BaseException) -> None:
        if op.finished:
            return
        op.finished = True
        key = op.spec.key
        self._active.pop(key, None)
        self._done.add(key)
        self._mismatches.pop(key)
        for parked in self._parked.values():
            parked.pop(key, None)
        op.future.resolve(error)

    def _break(self, error: TotalReduceError, lost: int | None = None) -> None:
        if self._broken is not None:
            return
        self._broken = error
        self._transport.resume()
        if lost != self.rank:
            logger.error("%s", error)
        body = str(error).encode()[:4096]
        for peer in self._heaps:
            if peer not in self._gone and peer != lost:
                self._heaps[peer].clear()
                self._parked[peer].clear()
                self._control[peer].append(
                    (Header(Kind.ABORT, step=0 if lost is None else lost + 1,
                            nbytes=len(body)), body))
                self._transport.want_send(peer)
        for op in list(self._active.values()):
            self._fail(op, error)
        for items in self._floating.values():
            for item in items:
                self.floating_bytes -= item.charge
        self._floating.clear()

    # --- sending (called by the transport) ------------------------------------------

    def next_outgoing(self, peer: int) -> Outgoing | None:
        control = self._control[peer]
        if control:
            note, text = control.popleft()
            note = note._replace(credit=self._take_owed(peer))
            return Outgoing(note.pack(), memoryview(text) if text else None, None)
        heap = self._heaps[peer]
        while heap:
            _prio, _tie, msg = heapq.heappop(heap)
            op = msg.op
            if op.finished:
                continue
            send = msg.send
            body = op.region(send.lo, send.hi, send.from_source)
            flags = 0
            if peer not in op.ready_peers:
                charge = max(body.nbytes, HEADER_SIZE)
                if self._credit[peer] < charge:
                    self._parked[peer].setdefault(op.spec.key, []).append(msg)
                    if peer in op.announce:
                        # Our DATA waits for the peer's READY: ours must not wait on it.
                        op.announce.discard(peer)
                        self._announce(op, peer)
                    continue
                self._credit[peer] -= charge
                flags = FLAG_CREDITED
            if peer in op.announce:
                op.announce.discard(peer)
                flags |= FLAG_READY
            spec = op.spec
            if 0 < self._config.cma_bytes <= spec.work.nbytes:
                flags |= FLAG_LENDABLE
            key = spec.key
            header = pack_header(Kind.DATA, spec.dtype, flags, send.step, key[0], key[1],
                                 spec.sig, send.piece, body.nbytes, spec.count,
                                 self._take_owed(peer), spec.recipe, spec.epoch)
            return Outgoing(header, body, msg)
        if self._owed[peer] >= max(1, self._budget // 4):
            return Outgoing(Header(Kind.CREDIT, credit=self._take_owed(peer)).pack(), None,
                            None)
        return None

    def _take_owed(self, peer: int) -> int:
        owed = self._owed[peer]
        self._owed[peer] = 0
        return owed

    def sent(self, peer: int, token: object) -> None:
        if isinstance(token, QueuedMsg) and not token.op.finished:
            op = token.op
            op.sends_left -= 1
            send = token.send
            op.left.add((send.peer, send.step, send.piece))
            if op.held:
                held, op.held = op.held, []
                for item in held:
                    self._reduce(op, *item)
            self._check_done(op)

    def _unpark(self, peer: int, key: OpKey | None = None) -> None:
        parked = self._parked[peer]
        if key is not None:
            msgs = parked.pop(key, ())
        else:
            msgs = [m for lst in parked.values() for m in lst]
            parked.clear()
        for msg in msgs:
            heapq.heappush(self._heaps[peer],
                           (-msg.op.spec.priority, next(self._tiebreak), msg))
        if msgs:
            self._transport.want_send(peer)

    # --- receiving (called by the transport) ----------------------------------------

    def body_buffer(self, peer: int, header: Header) -> memoryview:
        n = header.nbytes
        if header.kind != Kind.DATA:
            if n > (64 << 10):
                # Control bodies are small JSON/text; anything bigger is not ours to keep.
                self._routes[peer] = Route("discard")
                return self._discard_view(n)
            control = bytearray(n)
            self._routes[peer] = Route("control", buf=control)
            return memoryview(control)
        charge = max(n, HEADER_SIZE) if header.flags & FLAG_CREDITED else 0
        key = header.op_key
        op = self._active.get(key)
        if op is not None:
            recv = self._check_message(op, peer, header)
            if recv is None:
                self._routes[peer] = Route("discard", charge=charge)
                return self._discard_view(n)
            if recv.mode == COPY:
                self._routes[peer] = Route("direct", op, recv, charge=charge)
                return op.region(recv.lo, recv.hi)
            buf = self._scratch.get(n)
            self._routes[peer] = Route("reduce", op, recv, buf, charge)
            return buf
        if key in self._done or self._broken is not None:
            self._routes[peer] = Route("discard", charge=charge)
            return self._discard_view(n)
        if header.epoch < self._serve_below and self._server is not None:
            self._serve(peer, header)
            return self.body_buffer(peer, header)  # now active, or refused (done)
        buf = self._scratch.get(n)  # pooled: a fresh 1 MiB bytearray costs page faults
        self._routes[peer] = Route("float", buf=buf, charge=charge)
        self.floating_bytes += charge
        self.floating_peak = max(self.floating_peak, self.floating_bytes)
        return buf

    def _discard_view(self, n: int) -> memoryview:
        if len(self._discard) < n:
            self._discard = bytearray(n)
        return memoryview(self._discard)[:n]

    def _check_message(self, op: LiveOp, peer: int, header: Header) -> Recv | None:
        """The schedule entry this message fills, or None (after starting a mismatch)."""
        if op.mismatch is not None:
            return None
        spec = op.spec
        problem = None
        if header.sig != spec.sig or header.dtype != spec.dtype or header.count != spec.count:
            problem = "header"
        else:
            rkey = (peer, header.step, header.piece)
            recv = spec.schedule.recvs.get(rkey)
            if (recv is not None and rkey not in op.got
                    and header.nbytes == (recv.hi - recv.lo) * op.itemsize):
                return recv
            problem = "layout"
        seen: dict[str, Any] = {"count": header.count}
        dtype = DTYPES.get(header.dtype)
        if dtype is not None:
            seen["dtype"] = str(dtype)
        if problem == "layout":
            seen["detail"] = (f"sent step {header.step} piece {header.piece} of "
                              f"{header.nbytes} bytes, which rank {self.rank} does not expect")
        record = self._record(spec.key, spec.label)
        record.add(peer, seen, partial=True)
        self._join_mismatch(op, record, fail_now=False)
        return None

    def _record(self, key: OpKey, label: str) -> MismatchRecord:
        """The mismatch record of op ``key``, begun now if this is the first word of it."""
        record = self._mismatches.get(key)
        if record is None:
            record = MismatchRecord(label, self.size,
                                    time.monotonic() + self._config.mismatch_grace)
            self._mismatches.put(key, record)
        return record

    def _join_mismatch(self, op: LiveOp, record: MismatchRecord, fail_now: bool) -> None:
        op.mismatch = record
        record.label = op.spec.label
        record.add(self.rank, {k: v for k, v in op.spec.describe.items() if k != "name"})
        if not record.announced:
            record.announced = True
            self._send_view(op.spec.key, op.spec.describe)
        if fail_now or record.complete():
            self._fail(op, record.error(self.rank, op.spec.describe.get("name", "")))

    def _send_view(self, key: OpKey, view: dict[str, Any]) -> None:
        """Tell every live peer this rank's view of op ``key`` (a MISMATCH)."""
        body = encode_view(view)
        for peer in self._heaps:
            if peer not in self._gone:
                self._control[peer].append(
                    (Header(Kind.MISMATCH, name_key=key[0], seq=key[1], nbytes=len(body)),
                     body))
                self._transport.want_send(peer)

    def _header_news(self, peer: int, header: Header) -> None:
        """What any header may carry besides its body: credit, and the sender's READY."""
        if header.credit:
            self._credit[peer] += header.credit
            self._unpark(peer)
        if header.flags & FLAG_READY:
            self._peer_ready(peer, header)

    def received(self, peer: int, header: Header, body: memoryview) -> None:
        self._header_news(peer, header)
        route = self._routes.pop(peer)
        what = route.what
        if what in ("direct", "reduce"):
            self._settle_credit(peer, header, route.charge)
            op = route.op
            assert op is not None and route.recv is not None
            rkey = (peer, header.step, header.piece)
            if op.finished:  # failed while the body was arriving
                if what == "reduce":
                    self._scratch.put(route.buf)
            elif what == "direct":
                self._apply(op, rkey, route.recv)
            else:
                self._reduce(op, rkey, route.recv, route.buf, True)
        elif what == "float":
            item = FloatingBody(peer, header, route.buf, route.charge)
            key = header.op_key
            op = self._active.get(key)
            if op is None and key not in self._done:
                self._floating.setdefault(key, []).append(item)
                return
            # The op was submitted (or even failed) while this body was still arriving.
            self.floating_bytes -= item.charge
            self._settle_credit(peer, header, item.charge)
            if op is not None and not op.finished:
                self._apply_floating(op, item)
        elif what == "discard":
            self._settle_credit(peer, header, route.charge)
        else:
            self._control_message(peer, header, bytes(route.buf))

    def can_defer(self, peer: int, header: Header) -> bool:
        # Only with no op in flight here: then nothing behind this message (another op's
        # data, credit, READY) can be what this rank waits for, and the next submit
        # resumes reading.
        return not self._active and not self._closing and self._broken is None \
            and header.op_key not in self._done

    def received_view(self, peer: int, header: Header, body: memoryview) -> None:
        if header.kind == Kind.DATA and self._reducer is None:
            op = self._active.get((header.name_key, header.seq))
            if op is not None:
                # The usual case, without a Route: a piece of an op we run, used straight
                # out of the sender's slot (one pass over the bytes, no copy).
                self._header_news(peer, header)
                recv = self._check_message(op, peer, header)
                if header.flags & FLAG_CREDITED:
                    self._settle_credit(peer, header, max(header.nbytes, HEADER_SIZE))
                if recv is None:
                    return  # dropped: a mismatch is under way
                rkey = (peer, header.step, header.piece)
                if recv.mode == COPY:
                    if body.nbytes:
                        op.region(recv.lo, recv.hi)[:] = body
                    self._apply(op, rkey, recv)
                else:
                    self._reduce(op, rkey, recv, body, False)
                return
        dest = self.body_buffer(peer, header)  # floating, or for the reduce thread: a copy
        if body.nbytes:
            dest[:] = body
        self.received(peer, header, dest)

    def _settle_credit(self, peer: int, header: Header, charge: int) -> None:
        if charge:
            self._owed[peer] += charge
            if self._owed[peer] >= max(1, self._budget // 4):
                self._transport.want_send(peer)

    def _apply_floating(self, op: LiveOp, item: FloatingBody) -> None:
        recv = self._check_message(op, item.src, item.header)
        if recv is None:
            return
        rkey = (item.src, item.header.step, item.header.piece)
        if recv.mode == COPY:
            op.region(recv.lo, recv.hi)[:] = item.buf
            self._scratch.put(item.buf)
            self._apply(op, rkey, recv)
        else:
            self._reduce(op, rkey, recv, item.buf, True)

    def _reduce(self, op: LiveOp, rkey: tuple[int, int, int], recv: Recv, buf: memoryview,
                pooled: bool) -> None:
        op.got.add(rkey)
        if recv.after and not op.left.issuperset(recv.after):
            # This body would overwrite bytes that a send of ours has yet to read.
            if not pooled:
                copy = self._scratch.get(buf.nbytes)  # a ring slot is only ours during
                copy[:] = buf                          # this call
                buf, pooled = copy, True
            op.held.append((rkey, recv, buf, pooled))
            return
        spec = op.spec
        assert spec.ufunc is not None
        dest = spec.work[recv.lo:recv.hi]
        token = (op, rkey, recv, buf if pooled else None)
        threshold = self._config.reduce_thread_bytes
        if self._reducer is not None and dest.nbytes >= threshold:
            self._reducer.submit(spec.ufunc, dest, buf, token)
            return
        reduce_into(spec.ufunc, dest, buf)
        self._reduced(token, None)

    def _reduced(self, token: Any, error: BaseException | None) -> None:
        op, rkey, recv, pooled = token
        if pooled is not None:
            self._scratch.put(pooled)
        if op.finished:
            return
        if error is not None:
            self._fail(op, TotalReduceError(f"rank {self.rank}: reduction failed in "
                                            f"{op.spec.label}: {error!r}"))
            return
        self._after_recv(op, rkey, recv)

    def _apply(self, op: LiveOp, rkey: tuple[int, int, int], recv: Recv) -> None:
        op.got.add(rkey)
        self._after_recv(op, rkey, recv)

    def _after_recv(self, op: LiveOp, rkey: tuple[int, int, int], recv: Recv) -> None:
        spec = op.spec
        if recv.final and spec.finalize is not None and recv.hi > recv.lo:
            spec.finalize(spec.work[recv.lo:recv.hi])
        op.recvs_left -= 1
        op.pending_from[rkey[0]] -= 1
        for send in recv.then:
            self._queue(op, send)
        self._check_done(op)

    def _control_message(self, peer: int, header: Header, body: bytes) -> None:
        kind = header.kind
        key = header.op_key
        if kind == Kind.READY:
            self._peer_ready(peer, header)
        elif kind == Kind.MISMATCH:
            view = decode_view(body) or {"detail": "unreadable description"}
            op = self._active.get(key)
            if op is None and key in self._done:
                return
            record = self._record(key, op.spec.label if op is not None else f"op {key}")
            record.add(peer, view)
            if op is not None:
                self._join_mismatch(op, record, fail_now=False)
        elif kind == Kind.ABORT:
            lost = header.step - 1
            reason = body.decode(errors="replace")
            if lost == peer:  # its own failure: ``reason`` already says "rank N failed: ..."
                self._break(PeerFailureError(lost, f"rank {self.rank}: {reason}"), lost)
            elif lost >= 0:
                self._break(PeerFailureError(lost, f"rank {self.rank}: rank {lost} failed "
                                             f"(reported by rank {peer}): {reason}"), lost)
            else:
                self._break(TotalReduceError(f"rank {self.rank}: rank {peer} aborted the "
                                             f"job: {reason}"))
        elif kind == Kind.GOODBYE:
            self._bye.add(peer)
            self._peer_left(peer)
        elif kind == Kind.OP_FAILED:
            lost = header.step - 1
            error = PeerFailureError(lost, f"rank {self.rank}: "
                                     f"{body.decode(errors='replace')} (reported by rank "
                                     f"{peer})")
            op = self._active.get(key)
            if op is not None:
                self._fail(op, error)
            elif key not in self._done:
                self._failed_early.put(key, error)

    def _peer_ready(self, peer: int, header: Header) -> None:
        key = header.op_key
        op = self._active.get(key)
        if op is None and key not in self._done and header.epoch < self._serve_below \
                and self._server is not None:
            self._serve(peer, header)
            op = self._active.get(key)
        if op is not None:
            op.ready_peers.add(peer)
            self._unpark(peer, key)
        elif key not in self._done:
            if header.recipe:
                self._early_headers.put(key, header)
            ready = self._early_ready.get(key)
            if ready is None:
                ready = set()
                self._early_ready.put(key, ready)
            ready.add(peer)

    # --- serving ops this rank never submitted (join) ----------------------------------

    def _start_serving(self, server: Callable[[Header], OpSpec | None]) -> None:
        self._server = server
        self._serve_below = self._epoch + 1
        waiting = [(items[0].src, items[0].header) for items in self._floating.values()
                   if items]
        waiting += [(min(self._early_ready.get(k) or {0}), h)
                    for k, h in self._early_headers.items()]
        for peer, header in waiting:
            key = header.op_key
            if key not in self._active and key not in self._done \
                    and header.epoch < self._serve_below:
                self._serve(peer, header)

    def _serve(self, peer: int, header: Header) -> None:
        """Start this rank's part of an op only peers submitted, or refuse it."""
        assert self._server is not None
        key = header.op_key
        self._early_headers.pop(key)
        spec = self._server(header)
        if spec is not None:
            self._start(spec, OpFuture())
            return
        # Nothing here can take part: fail it on the peers now rather than let them wait.
        self._done.add(key)
        self._early_ready.pop(key)
        for item in self._floating.pop(key, ()):
            self.floating_bytes -= item.charge
            self._settle_credit(item.src, item.header, item.charge)
            self._scratch.put(item.buf)
        self._send_view(key, {"kind": "none: this rank has called join(), and only "
                              "allreduce (and barrier) run while a rank has joined"})

    def _peer_left(self, peer: int) -> None:
        """``peer`` shut down: it sends nothing more and takes nothing more, so every op
        here that still expects a message from it or owes it one cannot finish, and
        neither can any rank's copy of it that waits on ours: they are told."""
        for op in list(self._active.values()):
            if op.mismatch is not None:
                # The ranks disagree about it: that, not the departure, is the news (the
                # peer left after raising it, its view sent); housekeeping raises it once
                # every view is in or the grace period ends.
                continue
            if op.awaits_from(peer) or op.sends_owed_to(peer):
                reason = f"rank {peer} shut down while {op.spec.label} still needed it"
                self._fail(op, PeerFailureError(peer, f"rank {self.rank}: {reason}"))
                self._tell_op_failed(op.spec.key, peer, reason)

    def _tell_op_failed(self, key: OpKey, lost: int, reason: str) -> None:
        body = reason.encode()[:4096]
        for other in self._heaps:
            if other not in self._gone and other not in self._bye:
                self._control[other].append((Header(
                    Kind.OP_FAILED, step=lost + 1, name_key=key[0], seq=key[1],
                    nbytes=len(body)), body))
                self._transport.want_send(other)

    def peer_lost(self, peer: int, reason: str, orderly: bool) -> None:
        self._gone.add(peer)
        self._heaps[peer].clear()
        self._parked[peer].clear()
        self._control[peer].clear()
        self._routes.pop(peer, None)
        if orderly or peer in self._bye:
            self._peer_left(peer)
            return
        if self._closing:
            return
        self._break(PeerFailureError(peer, f"rank {self.rank}: lost rank {peer}: {reason}. "
                                     f"Its own output should say why it stopped."), peer)
