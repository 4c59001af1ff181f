"""What peers tell this rank outside their data: READY, MISMATCH, ABORT, GOODBYE,
OP_FAILED, and the end of a link.

A peer that shuts down (GOODBYE) sends nothing more and takes nothing more, so every op
here that still needs it fails at once, and so does every other rank's copy of such an op
(OP_FAILED).  What it sent before through its lane (a channel of its own, read apart from
the first) is taken first: an urgent op's last message may still be there, or not yet;
the goodbye says how many the peer posted there.  A peer that vanishes without a
goodbye, or ABORTs, breaks the whole job.
"""

from __future__ import annotations

from collections.abc import Callable

from ..exceptions import PeerFailureError, TotalReduceError
from ..transport.wire import Header, Kind
from .departures import Departures
from .floating import Floating
from .job import JobState
from .ledger import CreditLedger
from .mismatch_tracker import MismatchTracker, read_view
from .optable import OpTable
from .outbox import Outbox
from .serving import JoinServer
from .starter import Starter


class PeerEvents:
    def __init__(self, job: JobState, ops: OpTable, outbox: Outbox, ledger: CreditLedger,
                 mismatches: MismatchTracker, departures: Departures, serving: JoinServer,
                 starter: Starter, floating: Floating,
                 drain_lane: Callable[[int, int], None]) -> None:
        """``drain_lane(peer, sent)``: hand over what ``peer``'s lane holds, until the
        ``sent`` messages it says it posted there have come (Transport.drain_lane)."""
        self._drain_lane = drain_lane
        self._job = job
        self._rank = job.rank
        self._ops = ops
        self._outbox = outbox
        self._ledger = ledger
        self._mismatches = mismatches
        self._departures = departures
        self._serving = serving
        self._starter = starter
        self._floating = floating

    def control(self, peer: int, header: Header, body: bytes) -> None:
        """A control message (its body read whole)."""
        kind = header.kind
        key = header.op_key
        if kind == Kind.READY:
            self.ready(peer, header)
        elif kind == Kind.MISMATCH:
            self._mismatches.heard(peer, key, read_view(body))
        elif kind == Kind.ABORT:
            lost = header.step - 1
            reason = body.decode(errors="replace")
            rank = self._rank
            job = self._job
            if lost == peer:  # its own failure: ``reason`` already says "rank N failed: ..."
                job.break_job(PeerFailureError(lost, f"rank {rank}: {reason}"), lost)
            elif lost >= 0:
                job.break_job(PeerFailureError(lost, f"rank {rank}: rank {lost} failed "
                                               f"(reported by rank {peer}): {reason}"), lost)
            else:
                job.break_job(TotalReduceError(f"rank {rank}: rank {peer} aborted the "
                                               f"job: {reason}"))
        elif kind == Kind.GOODBYE:
            self._drain_lane(peer, header.seq)
            self._departures.bye.add(peer)
            self._left(peer)
        elif kind == Kind.OP_FAILED:
            # Only a departure in order is reported this way (a crash breaks the job).
            error = PeerFailureError(header.step - 1, f"rank {self._rank}: "
                                     f"{body.decode(errors='replace')} (reported by rank "
                                     f"{peer})", orderly=True)
            ops = self._ops
            op = ops.active.get(key)
            if op is not None:
                ops.fail(op, error)
            elif key not in ops.done:
                ops.failed_early.put(key, error)

    def ready(self, peer: int, header: Header) -> None:
        """``peer`` has submitted the op: its pieces go to it without credit from now on."""
        ops = self._ops
        key = header.op_key
        op = ops.active.get(key)
        if op is None and key not in ops.done and self._starter.try_serve(header):
            op = ops.active.get(key)
        if op is not None:
            self._outbox.peer_ready(op, peer)
        elif key not in ops.done:
            self._serving.remember(header)
            self._ledger.early_ready(key, peer)

    def lost(self, peer: int, reason: str, orderly: bool) -> None:
        """The link to ``peer`` ended (MessageHandler.peer_lost)."""
        self._outbox.close(peer)
        if orderly or peer in self._departures.bye:
            self._left(peer)
            return
        if self._job.closing:
            return
        self._job.break_job(PeerFailureError(peer, f"rank {self._rank}: lost rank {peer}: "
                                             f"{reason}. Its own output should say why it "
                                             f"stopped."), peer)

    def _left(self, peer: int) -> None:
        """``peer`` shut down: every op here that still expects a message from it or owes
        it one cannot finish, and neither can any rank's copy of it that waits on ours:
        they are told."""
        self._floating.left(peer, self._rank)
        ops = self._ops
        for op in ops.live():
            if op.mismatch is not None:
                # The ranks disagree about it: that, not the departure, is the news (the
                # peer left after raising it, its view sent); housekeeping raises it once
                # every view is in or the grace period ends.
                continue
            if op.awaits_from(peer) or op.sends_owed_to(peer):
                reason = f"rank {peer} shut down while {op.spec.label} still needed it"
                ops.fail(op, PeerFailureError(peer, f"rank {self._rank}: {reason}",
                                              orderly=True))
                self._departures.tell_op_failed(op.spec.key, peer, reason)
