"""Applying an arrived piece to its op: a copy into place or a reduction (inline, or on the
reduce thread for big pieces), then what that unlocks (the sends that waited for it, the
op's end).

The receiving side of an op's state is this part's: which pieces arrived, which wait for a
send of ours to leave or another piece to be applied first (``held``), which were applied
(``done_recvs``, kept only for schedules whose receives wait on others), and how many are
still to come from each peer.
"""

from __future__ import annotations

import time
from typing import Any

from ..exceptions import TotalReduceError
from ..memcopy import copy_bytes
from ..transport.wire import Header
from .mismatch_tracker import MismatchTracker
from .opstate import LiveOp
from .optable import OpTable
from .outbox import Outbox
from .payload import finish_local
from .reducer import ReduceThread, ScratchPool, reduce_into
from .schedule import COPY, Recv

PieceKey = tuple[int, int, int]  # (peer, step, piece)


class Applier:
    def __init__(self, rank: int, ops: OpTable, outbox: Outbox, mismatches: MismatchTracker,
                 scratch: ScratchPool, reducer: ReduceThread | None, reduce_min: int) -> None:
        self._rank = rank
        self._ops = ops
        self._outbox = outbox
        self._mismatches = mismatches
        self._scratch = scratch
        self._reducer = reducer
        self._reduce_min = reduce_min  # pieces at least this big go to the reduce thread

    def deliver(self, op: LiveOp, peer: int, header: Header, body: memoryview,
                pooled: bool) -> None:
        """Apply one arrived piece of ``op`` by copy or reduction.  ``pooled``: ``body``
        is a scratch buffer this call now owns; else it is only valid during the call."""
        recv = self._mismatches.check(op, peer, header)
        if recv is None:  # dropped: a mismatch is under way
            if pooled:
                self._scratch.put(body)
            return
        rkey = (peer, header.step, header.piece)
        if recv.mode == COPY:
            if body.nbytes:
                copy_bytes(op.region(recv.lo, recv.hi), body)
            if pooled:
                self._scratch.put(body)
            self.applied(op, rkey, recv)
        else:
            self.reduce(op, rkey, recv, body, pooled)

    def adopt(self, op: LiveOp, got: list[tuple[PieceKey, Recv]]) -> None:
        """Pieces the small path applied to ``op`` before it became live (their sends
        went, or are queued by the outbox)."""
        for rkey, _recv in got:
            op.got.add(rkey)
            if op.spec.schedule.waits:
                op.done_recvs.add(rkey)
            op.recvs_left -= 1
            op.pending_from[rkey[0]] -= 1
        if got and not op.t_first:
            op.t_first = time.monotonic()

    def applied(self, op: LiveOp, rkey: PieceKey, recv: Recv) -> None:
        """A COPY piece is in place (it arrived straight into the op's array); what it
        unlocks goes once the sends it names (``Recv.after``) have left."""
        op.got.add(rkey)
        if recv.after and not op.left.issuperset(recv.after):
            op.held.append((rkey, recv, None, False))
            return
        self._after_recv(op, rkey, recv)

    def reduce(self, op: LiveOp, rkey: PieceKey, recv: Recv, buf: memoryview,
               pooled: bool) -> None:
        """Reduce a REDUCE piece into place, now or once the send it would overwrite has
        left."""
        op.got.add(rkey)
        if (recv.after and not op.left.issuperset(recv.after)) or \
                (recv.wait and not op.done_recvs.issuperset(recv.wait)):
            # This body would overwrite bytes that a send of ours has yet to read, or what
            # it unlocks must carry a piece that has yet to come.
            if not pooled:
                copy = self._scratch.get(buf.nbytes)  # a ring slot is only ours during
                copy[:] = buf                          # this call
                buf, pooled = copy, True
            op.held.append((rkey, recv, buf, pooled))
            return
        spec = op.spec
        assert spec.ufunc is not None
        dest = spec.work[recv.lo:recv.hi]
        left = None
        if spec.fresh:
            left = spec.source_part(recv.lo, recv.hi)
        token = (op, rkey, recv, buf if pooled else None)
        if self._reducer is not None and dest.nbytes >= self._reduce_min:
            self._reducer.submit(spec.ufunc, dest, buf, token, left)
            return
        reduce_into(spec.ufunc, dest, buf, left)
        self.reduced(token, None)

    def reduced(self, token: Any, error: BaseException | None) -> None:
        """A reduction finished (inline, or on the reduce thread)."""
        op, rkey, recv, pooled = token
        if pooled is not None:
            self._scratch.put(pooled)
        if op.finished:
            return
        if error is not None:
            self._ops.fail(op, TotalReduceError(
                f"rank {self._rank}: reduction failed in {op.spec.label}: {error!r}"))
            return
        self._after_recv(op, rkey, recv)

    def send_left(self, op: LiveOp) -> None:
        """A send of ``op`` left: the pieces that waited for it may be reduced now, and the
        op may be over."""
        self._release(op)
        self._ops.complete(op)

    def _release(self, op: LiveOp) -> None:
        if op.held:
            held, op.held = op.held, []
            for rkey, recv, buf, pooled in held:
                if buf is None:  # a COPY piece in place already
                    self.applied(op, rkey, recv)
                else:
                    self.reduce(op, rkey, recv, buf, pooled)

    def _after_recv(self, op: LiveOp, rkey: PieceKey, recv: Recv) -> None:
        if not op.t_first:
            op.t_first = time.monotonic()
        spec = op.spec
        if recv.final and spec.finalize is not None and recv.hi > recv.lo:
            spec.finalize(spec.work[recv.lo:recv.hi])
        op.recvs_left -= 1
        op.pending_from[rkey[0]] -= 1
        if op.local_due and not op.recvs_left:  # left for last (Starter.start)
            op.local_due = False
            finish_local(spec, spec.schedule.local_final)
        outbox = self._outbox
        for send in recv.then:
            outbox.queue(op, send)
        if spec.schedule.waits:
            op.done_recvs.add(rkey)
            self._release(op)
        self._ops.complete(op)
