"""Starting an op here: a submitted one, or one a joined rank serves.

Starting checks that the op can run at all (the job is whole, no peer it needs has left,
no peer failed it already), applies the pieces that floated in before it, joins a
mismatch peers already reported, and hands the op to the outbox, which sends its first
pieces and READYs.
"""

from __future__ import annotations

from collections.abc import Callable

from ..exceptions import PeerFailureError, TotalReduceError, TransportClosedError
from ..transport.wire import Header
from .applier import Applier, PieceKey
from .departures import Departures
from .floating import Floating
from .job import JobState
from .ledger import CreditLedger
from .mismatch_tracker import MismatchTracker
from .opstate import LiveOp
from .optable import OpTable
from .outbox import Outbox
from .payload import OpFuture, OpKey, OpSpec, copied_last, finish_local
from .reducer import ScratchPool
from .schedule import Recv, Send
from .serving import JoinServer, Server


def _never(key: OpKey) -> bool:
    return False


class Starter:
    def __init__(self, job: JobState, ops: OpTable, ledger: CreditLedger, outbox: Outbox,
                 floating: Floating, applier: Applier, mismatches: MismatchTracker,
                 departures: Departures, serving: JoinServer, scratch: ScratchPool,
                 resume: Callable[[], None]) -> None:
        """``resume()``: the transport reads again (it may stop while nothing runs)."""
        self._job = job
        self._ops = ops
        self._ledger = ledger
        self._outbox = outbox
        self._floating = floating
        self._applier = applier
        self._mismatches = mismatches
        self._departures = departures
        self._serving = serving
        self._scratch = scratch
        self._resume = resume
        # Starts the queued call of a key on the general path, if one waits (Loop.unqueue).
        self.unqueue: Callable[[OpKey], bool] = _never

    def start(self, spec: OpSpec, future: OpFuture) -> None:
        op = self._open(spec, future, set())
        if op is None:
            return
        if op.recvs_left and copied_last(spec, spec.schedule.local_final):
            op.local_due = True  # the Applier copies it after the last receive
        else:
            finish_local(spec, spec.schedule.local_final)
        if self._catch_up(op):
            return
        self._outbox.begin(op)
        self._ops.complete(op)

    def adopt(self, spec: OpSpec, future: OpFuture, ready: set[int], told: set[int],
              sent: list[Send], unsent: list[Send], got: list[tuple[PieceKey, Recv]],
              needs: set[int]) -> LiveOp | None:
        """Go on with an op the small path (smallpath.py) began: ``told`` peers know it
        was submitted here, ``sent`` messages have left, ``unsent`` ones are due, ``got``
        pieces are applied, and ``needs`` are the peers it still needs.  Returns the live
        op (None: it failed at once)."""
        if self._job.closing:
            self._ops.refuse(spec.key)
            future.resolve(TransportClosedError(
                f"rank {self._job.rank}: {spec.label} was still pending at shutdown()"))
            return None
        departed = self._departures.departed() & needs
        if departed:  # some may be needed no more: what they sent floated in meanwhile
            needs = needs - departed | self._needs(spec, departed, got, unsent)
        op = self._open(spec, future, ready, needs)
        if op is None:
            return None
        self._applier.adopt(op, got)
        self._outbox.adopt(op, told, sent, unsent)
        if self._catch_up(op):
            return op
        self._ops.complete(op)
        return op

    def ran_elsewhere(self, key: OpKey) -> None:
        """Op ``key`` ran to its end off the loop (the urgent lane): count it ended, and
        drop what was kept for it (a READY that came early)."""
        self._ops.ran(key)
        self._ledger.pop_early(key)
        self._serving.forget(key)

    def _open(self, spec: OpSpec, future: OpFuture, ready: set[int],
              needs: set[int] | None = None) -> LiveOp | None:
        """The op, now live here; None (its future resolved) if it cannot run.  ``needs``:
        the peers it needs (None: every peer of its schedule)."""
        job = self._job
        if job.broken is not None:
            future.resolve(job.broken)
            return None
        ops = self._ops
        key = spec.key
        if ops.known(key):
            future.resolve(TotalReduceError(
                f"rank {job.rank}: {spec.label} was submitted twice (internal error)"))
            return None
        serving = self._serving
        if spec.epoch < 0:
            spec.epoch = serving.epoch
        departed = self._departures.departed()
        if departed:
            if needs is None:
                needs = self._needs(spec, departed)
            gone = sorted(needs & departed)
            if gone:
                ops.refuse(key)
                reason = f"{spec.label} needs rank {gone[0]}, which has shut down"
                future.resolve(PeerFailureError(gone[0], f"rank {job.rank}: {reason}",
                                                orderly=True))
                self._departures.tell_op_failed(key, gone[0], reason)
                return None
        early = ops.failed_early.pop(key)
        if early is not None:
            ops.refuse(key)
            future.resolve(early)
            return None
        floating = self._floating
        op = LiveOp(spec, future, self._ledger.pop_early(key) | ready,
                    floating.first_arrival(key))
        ops.open(op)
        self._resume()
        serving.forget(key)
        return op

    def _needs(self, spec: OpSpec, departed: set[int],
               got: list[tuple[PieceKey, Recv]] | None = None,
               unsent: list[Send] | None = None) -> set[int]:
        """Which of the ``departed`` peers this op, starting now, still needs: one it must
        still send to, or one whose messages for it not applied yet have not all floated
        in.  A peer that left in order sent everything it ever will first, so an op whose
        messages from it are all here can still finish (the sizes phase of an allgather
        may be what read them, and the goodbye behind them, before the data phase
        started; or they came through the first channel while an op begun off the loop
        waited on the lane).  ``got``, ``unsent``: for such an op, the pieces it applied
        and the sends now due (None: it starts afresh, every send of its schedule due)."""
        schedule = spec.schedule
        applied = {rkey for rkey, _recv in got or ()}
        owed = {send.peer for send in (schedule.first if unsent is None else unsent)}
        for rkey, recv in schedule.recvs.items():
            if rkey not in applied:
                owed.update(send.peer for send in recv.then)
        floating = self._floating
        return {peer for peer in departed
                if peer in owed
                or sum(1 for rkey in schedule.recvs if rkey[0] == peer and rkey not in applied)
                > floating.count_from(spec.key, peer)}

    def _catch_up(self, op: LiveOp) -> bool:
        """Apply the pieces that floated in before ``op`` and join a mismatch peers
        reported already; True if that settled its fate (a mismatch under way)."""
        key = op.spec.key
        floating = self._floating
        if key in floating:
            for item in floating.take(key):
                if op.finished:
                    self._scratch.put(item.buf)
                else:
                    self._applier.deliver(op, item.src, item.header, item.buf, True)
            if op.finished or op.mismatch is not None:
                return True  # a mismatch found in floating pieces: housekeeping raises later
        return bool(len(self._mismatches)) and self._mismatches.started(op)

    # --- after join() ------------------------------------------------------------------

    def begin_join(self, server: Server) -> None:
        """Serve from now on, beginning with the ops already waiting here."""
        waiting = self._serving.begin(server)
        waiting += [header for _peer, header in self._floating.waiting()]
        for header in waiting:
            if not self._ops.known(header.op_key):
                self.try_serve(header)

    def serves(self, header: Header) -> bool:
        """Whether the op of ``header``, not submitted here, is this rank's to serve."""
        return self._serving.serves(header)

    def try_serve(self, header: Header) -> bool:
        """If the op of ``header`` (not submitted here) waits in the loop's queue, or is
        this rank's to serve, start it (its part of it) now, or refuse it; returns whether
        it was.  A peer's message shows the peer runs the op now: a queued call waiting
        for another to end first may be what that peer waits for."""
        if self.unqueue(header.op_key):
            return True
        if not self._serving.serves(header):
            return False
        key = header.op_key
        spec = self._serving.spec_for(header)
        if spec is not None:
            self.start(spec, OpFuture())
            return True
        # Nothing here can take part: fail it on the peers now rather than let them wait.
        self._ops.refuse(key)
        self._ledger.pop_early(key)
        self._floating.drop(key)
        self._mismatches.tell_view(key, {
            "kind": "none: this rank has called join(), and only allreduce (and barrier) "
                    "run while a rank has joined"})
        return True
