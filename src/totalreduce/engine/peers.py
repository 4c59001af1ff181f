"""What peers tell this rank outside their data: READY, MISMATCH, ABORT, GOODBYE,
OP_FAILED, and the end of a link.

A peer that shuts down (GOODBYE) sends nothing more and takes nothing more, so every op
here that still needs it fails at once, and so does every other rank's copy of such an op
(OP_FAILED).  A peer that vanishes without a goodbye, or ABORTs, breaks the whole job.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..exceptions import PeerFailureError, TotalReduceError
from ..transport.wire import Header, Kind
from .mismatch_tracker import read_view
from .payload import OpKey

if TYPE_CHECKING:
    from .engine import Engine


class PeerEvents:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._rank = engine.rank
        self.gone = engine.outbox.closed  # links that ended
        self.bye: set[int] = set()  # peers that said GOODBYE

    def departed(self) -> set[int]:
        return self.gone | self.bye

    def control(self, peer: int, header: Header, body: bytes) -> None:
        """A control message (its body read whole)."""
        engine = self._engine
        kind = header.kind
        key = header.op_key
        if kind == Kind.READY:
            self.ready(peer, header)
        elif kind == Kind.MISMATCH:
            engine.mismatches.heard(peer, key, read_view(body))
        elif kind == Kind.ABORT:
            lost = header.step - 1
            reason = body.decode(errors="replace")
            rank = self._rank
            if lost == peer:  # its own failure: ``reason`` already says "rank N failed: ..."
                engine.break_job(PeerFailureError(lost, f"rank {rank}: {reason}"), lost)
            elif lost >= 0:
                engine.break_job(PeerFailureError(lost, f"rank {rank}: rank {lost} failed "
                                                  f"(reported by rank {peer}): {reason}"), lost)
            else:
                engine.break_job(TotalReduceError(f"rank {rank}: rank {peer} aborted the "
                                                  f"job: {reason}"))
        elif kind == Kind.GOODBYE:
            self.bye.add(peer)
            self._left(peer)
        elif kind == Kind.OP_FAILED:
            # Only a departure in order is reported this way (a crash breaks the job).
            error = PeerFailureError(header.step - 1, f"rank {self._rank}: "
                                     f"{body.decode(errors='replace')} (reported by rank "
                                     f"{peer})", orderly=True)
            op = engine.ops.active.get(key)
            if op is not None:
                engine.fail(op, error)
            elif key not in engine.ops.done:
                engine.ops.failed_early.put(key, error)

    def ready(self, peer: int, header: Header) -> None:
        """``peer`` has submitted the op: its pieces go to it without credit from now on."""
        engine = self._engine
        key = header.op_key
        op = engine.ops.active.get(key)
        if op is None and key not in engine.ops.done and engine.serving.serves(header):
            engine.serving.serve(header)
            op = engine.ops.active.get(key)
        if op is not None:
            op.ready_peers.add(peer)
            engine.outbox.unpark(peer, key)
        elif key not in engine.ops.done:
            engine.serving.remember(header)
            engine.ledger.early_ready(key, peer)

    def tell_op_failed(self, key: OpKey, lost: int, reason: str) -> None:
        body = reason.encode()[:4096]
        self._engine.outbox.tell_all(
            Header(Kind.OP_FAILED, step=lost + 1, name_key=key[0], seq=key[1],
                   nbytes=len(body)), body, skip=self.bye)

    def lost(self, peer: int, reason: str, orderly: bool) -> None:
        """The link to ``peer`` ended (MessageHandler.peer_lost)."""
        engine = self._engine
        engine.outbox.close(peer)
        engine.inbox.lost(peer)
        if orderly or peer in self.bye:
            self._left(peer)
            return
        if engine.closing:
            return
        engine.break_job(PeerFailureError(peer, f"rank {self._rank}: lost rank {peer}: "
                                          f"{reason}. Its own output should say why it "
                                          f"stopped."), peer)

    def _left(self, peer: int) -> None:
        """``peer`` shut down: every op here that still expects a message from it or owes
        it one cannot finish, and neither can any rank's copy of it that waits on ours:
        they are told."""
        engine = self._engine
        for op in engine.ops.live():
            if op.mismatch is not None:
                # The ranks disagree about it: that, not the departure, is the news (the
                # peer left after raising it, its view sent); housekeeping raises it once
                # every view is in or the grace period ends.
                continue
            if op.awaits_from(peer) or op.sends_owed_to(peer):
                reason = f"rank {peer} shut down while {op.spec.label} still needed it"
                engine.fail(op, PeerFailureError(peer, f"rank {self._rank}: {reason}",
                                                 orderly=True))
                self.tell_op_failed(op.spec.key, peer, reason)
