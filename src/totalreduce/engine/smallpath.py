"""The small-op path: a small op run to its end on the caller's thread, with none of the
general path's machinery when nothing else is in flight.

A lone small op is latency-bound: every object built, queued and called back on its way
(command, live op, heap entry, route, future, handle) is time on the critical path, and
the peer waits for each of them.  So when this rank runs nothing else, a blocking caller
that holds the drive lock posts the op's first message straight into the peer's ring,
reads the peer's message straight out of its own ring (the inbox hands it here, see
:meth:`.inbox.Inbox.received_view`), reduces it in place and posts what that unlocks, until
the op is over.

The messages are the general path's, header for header (the same identity, signature,
steps, READY and credit rules), so a peer may run the same op on either path and ops on
both paths interleave.  Anything the small path does not handle turns the op into an
ordinary live op with the progress made so far (:meth:`.starter.Starter.adopt`), which the
general path then finishes or fails: a message that does not fit (a mismatch), a ring
that is full, no credit, a peer that leaves, the job breaking, Ctrl-C, or no answer
within ``PROMOTE_AFTER`` (so stall warnings and op timeouts work as for any op).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Collection

from ..interrupts import deferred as ctrl_c
from ..memcopy import copy_bytes
from ..transport.base import Transport
from ..transport.wire import (
    FLAG_CREDITED,
    FLAG_READY,
    FLAG_REMOTE,
    KIND_DATA,
    LEND_REPLIES,
    Header,
    Kind,
    pack_header,
)
from .applier import Applier
from .departures import Departures
from .floating import Floating
from .job import JobState
from .ledger import CreditLedger, charge_of
from .loop import Awaited
from .mismatch_tracker import MismatchTracker
from .opstate import LentSend, LiveOp
from .optable import OpTable
from .payload import OpFuture, OpKey, OpSpec, finish_local
from .reducer import reduce_into
from .schedule import COPY, Recv, Send
from .serving import JoinServer
from .starter import Starter

# A small op with no answer after this long goes on as an ordinary op: the general path's
# housekeeping (stall warnings, op timeouts) then watches it.
PROMOTE_AFTER = 0.25

# While a small op busy-polls the rings its messages come through, a full turn of the loop
# (sockets, other peers' rings, housekeeping) this often.
_TURN_EVERY = 200e-6
# The longest that busy-poll lasts before a blocking turn of the loop, which spins on its
# own first (poller.py): a peer that takes longer is busy with more than this op.
_PEEK_SPIN = 200e-6
# ... or, where ranks outnumber cores and the busy-poll yields between looks, this long.
_YIELD_SPIN = 2e-3

PieceKey = tuple[int, int, int]  # (peer, step, piece)


class SmallOp:
    """One small op in flight on the caller's thread (see the module docstring)."""

    __slots__ = ("spec", "key0", "key1", "itemsize", "ready", "told", "sent", "gone",
                 "unsent", "applied", "seen", "waiting", "to_come", "promoted", "t_start",
                 "future", "live", "lent")

    def __init__(self, spec: OpSpec, ready: set[int]) -> None:
        self.spec = spec
        self.key0, self.key1 = spec.key
        self.itemsize = spec.work.itemsize
        self.ready = ready  # peers that have submitted it (their pieces need no credit)
        self.told: set[int] = set()  # peers told we have submitted it
        self.sent: list[Send] = []
        self.gone: set[PieceKey] = set()  # the sent ones, as (peer, step, piece)
        self.unsent: list[Send] = []  # sends the rings could not take: for the general path
        self.applied: list[tuple[PieceKey, Recv]] = []
        self.seen: set[PieceKey] = set()  # pieces applied or waiting
        # Pieces that came before a send of ours that reads the bytes they would change
        # (Recv.after): copies, kept until that send has gone.
        self.waiting: list[tuple[int, Header, Recv, bytes]] = []
        self.to_come = len(spec.schedule.recvs)
        self.promoted = False
        self.t_start = time.monotonic()
        self.future: OpFuture | None = None  # once promoted: the general path's
        self.live: LiveOp | None = None  # once promoted: the live op, unless it never ran
        # Sends whose bodies the peers copy out of ours (express.py): over only once each
        # peer has said it did.
        self.lent: list[LentSend] = []

    def done(self) -> bool:
        """The driver's ``until``: over, or handed to the general path."""
        return self.promoted or (self.to_come == 0 and (
            not self.lent or all(t.acked for t in self.lent)))


def needs(op: SmallOp) -> set[int]:
    """The peers ``op`` still needs: to hear from, or to send to."""
    out = {send.peer for send in op.unsent}
    out.update(t.send.peer for t in op.lent if not t.acked)
    seen = op.seen
    for rkey, recv in op.spec.schedule.recvs.items():
        if rkey not in seen:
            out.add(rkey[0])
            out.update(send.peer for send in recv.then)
    return out


def fits(header: Header, sig: int, dtype: int, count: int, nbytes: int) -> bool:
    """Whether a DATA header is what this rank's op expects for a piece of ``nbytes``."""
    return (header.sig == sig and header.dtype == dtype and header.count == count
            and header.nbytes == nbytes)


def apply_piece(spec: OpSpec, recv: Recv, body: memoryview) -> None:
    """Copy or reduce a piece into place (finishing its region if it is the last)."""
    work = spec.work
    if recv.mode == COPY:
        if body.nbytes:  # as bytes: a third cheaper than through np.frombuffer
            copy_bytes(work[recv.lo:recv.hi].data.cast("B"), body)
    else:
        assert spec.ufunc is not None
        # A buffer that starts undefined (OpSpec.fresh) takes each region's left operand
        # from the source: a ring reduces into every region once.
        left = None
        if spec.fresh:
            left = spec.source_part(recv.lo, recv.hi)
        reduce_into(spec.ufunc, work[recv.lo:recv.hi], body, left)
    if recv.final and spec.finalize is not None and recv.hi > recv.lo:
        spec.finalize(work[recv.lo:recv.hi])


def post_data(ledger: CreditLedger, transport: Transport, spec: OpSpec, send: Send,
              ready: set[int], told: set[int], sources: Collection[int],
              lent: LentSend | None = None) -> bool:
    """Post ``send`` straight into the peer's ring, as the outbox would have sent it: on
    credit unless the peer is ``ready``, saying READY if it is one of the ``sources`` not
    ``told`` yet (then it is); ``lent``: lend its body instead (Transport.lend_now).
    False, nothing sent or spent, if it cannot go now."""
    peer = send.peer
    lo, hi = send.lo, send.hi
    part = spec.source_part(lo, hi) if send.from_source else spec.work[lo:hi]
    body = part.data.cast("B") if hi > lo else None
    nbytes = 0 if body is None else body.nbytes
    flags = 0
    if peer not in ready:
        if not ledger.spend(peer, nbytes):
            return False
        flags = FLAG_CREDITED
    tell = peer not in told and peer in sources
    if tell:
        flags |= FLAG_READY
    credit = ledger.take_owed(peer)
    key0, key1 = spec.key
    header = pack_header(KIND_DATA, spec.dtype, flags, send.step, key0, key1, spec.sig,
                         send.piece, nbytes, spec.count, credit, spec.recipe, spec.epoch)
    if not (transport.post_now(peer, header, body) if lent is None or body is None
            else transport.lend_now(peer, header, body, lent)):
        if flags & FLAG_CREDITED:
            ledger.grant(peer, charge_of(nbytes))
        ledger.restore_owed(peer, credit)
        return False
    if tell:
        told.add(peer)
    return True


def tell_ready(ledger: CreditLedger, transport: Transport, spec: OpSpec, peer: int,
               told: set[int]) -> bool:
    """Send ``peer`` a READY for ``spec`` now (then it is ``told``); False if it cannot go."""
    return post_ready(ledger, functools.partial(transport.post_now, peer), peer, told,
                      spec.key, spec.dtype, spec.sig, spec.count, spec.recipe, spec.epoch)


def post_ready(ledger: CreditLedger,
               post_now: Callable[[bytes, memoryview | None], bool], peer: int,
               told: set[int], key: OpKey, dtype: int, sig: int, count: int, recipe: int,
               epoch: int) -> bool:
    """:func:`tell_ready` of an op given by its fields, through ``post_now(header, body)``
    (the transport's for ``peer``, or its Port's)."""
    credit = ledger.take_owed(peer)
    if not post_now(pack_header(Kind.READY, dtype, 0, 0, key[0], key[1], sig, 0, 0, count,
                                credit, recipe, epoch), None):
        ledger.restore_owed(peer, credit)
        return False
    told.add(peer)
    return True


class SmallPath:
    """Runs :class:`SmallOp`\\ s; the inbox hands it their messages while one runs."""

    def __init__(self, job: JobState, ops: OpTable, ledger: CreditLedger,
                 floating: Floating, mismatches: MismatchTracker, departures: Departures,
                 serving: JoinServer, starter: Starter, applier: Applier,
                 transport: Transport, step: Callable[[float | None, Awaited | None], None],
                 waiter: Callable[[OpFuture, float | None], bool],
                 unpark: Callable[[int], None]) -> None:
        """``step(timeout, until)``: one turn of the engine's loop (loop.py); ``waiter``:
        how a future of the engine's is waited for (Engine.wait); ``unpark(peer)``: the
        outbox's, told when a peer returns credit (Outbox.unpark)."""
        self._unpark = unpark
        self._waiter = waiter
        self._job = job
        self._applier = applier
        self._ops = ops
        self._ledger = ledger
        self._floating = floating
        self._mismatches = mismatches
        self._departures = departures
        self._serving = serving
        self._starter = starter
        self._transport = transport
        self._step = step
        self.current: SmallOp | None = None  # the op in flight, read by the inbox
        self.ran = 0  # ops that ran to their end here
        self.handed_over = 0  # ops that went on on the general path
        self.caught_up = 0  # ops begun with bodies that had floated in before them

    def eligible(self, spec: OpSpec, waits: bool = False) -> bool:
        """Whether ``spec`` can run here now: nothing else runs or waits to (the caller
        holds the drive lock and has checked the loop's queues).  ``waits``: the express
        lane runs it, which may take a schedule whose receives wait on others."""
        # This path does not hold pieces back for receives that wait on others
        # (Recv.wait, recursive halving's); the express lane takes them in order.  Bodies
        # of this very op may have floated in (a peer ahead of us sent them while we ran
        # the op before): run() applies them first.
        key = spec.key
        return ((waits or not spec.schedule.waits) and self._floating.only(key)
                and self.quiet(key))

    def quiet(self, key: OpKey) -> bool:
        """Whether nothing but op ``key`` (which is not over here) runs or waits to, all
        but floating bodies (the caller looks at those)."""
        # Asked before every small op: attributes and C-level tests only where they will
        # do, since each Python-level call here was a share of an 8-byte op's time.
        job = self._job
        ops = self._ops
        departures = self._departures
        if (ops.active or job.broken is not None or job.closing
                or self._mismatches.records.entries or departures.closed or departures.bye):
            return False
        timeline = ops.timeline
        if timeline is not None and timeline.active:
            return False
        # OpTable.known, inline (nothing is active here).
        return not (key in ops.done or key in ops.failed_early.entries)

    def run(self, spec: OpSpec) -> OpFuture | bool:
        """Run ``spec`` (eligible) to its end: True once done, False if it could not begin
        here (nothing was sent: submit it as usual), or the future of the live op it
        became (to be waited for once the drive lock is let go)."""
        ledger = self._ledger
        key = spec.key
        early = ledger.pop_early(key)
        op = SmallOp(spec, early)
        schedule = spec.schedule
        if spec.epoch < 0:
            spec.epoch = self._serving.epoch
        first = schedule.first
        if first and not self._post(op, first[0]):
            for peer in early:  # as it was: the general path starts it
                ledger.early_ready(key, peer)
            return False
        for send in first[1:]:
            if op.unsent or not self._post(op, send):
                op.unsent.append(send)
        self._serving.forget(key)
        finish_local(spec, schedule.local_final)
        stuck = bool(op.unsent)
        for peer in schedule.sources:
            if stuck:
                break
            stuck = peer not in op.told and not tell_ready(ledger, self._transport, spec,
                                                           peer, op.told)
        return self.go_on(op, stuck)

    def go_on(self, op: SmallOp, stuck: bool) -> OpFuture | bool:
        """Run ``op``, its first messages sent, to its end (as :meth:`run` returns);
        ``stuck``: one could not go, so the general path takes it at once."""
        key = op.spec.key
        if stuck:  # the general path sends what could not go (and the READYs owed)
            self._promote(op)
        else:
            self.current = op
            try:
                if key in self._floating:
                    self.caught_up += 1
                    self._take_floating(op)
                self._drive(op)
            finally:
                self.current = None
        if op.future is not None:
            self.handed_over += 1
            return op.future
        self.ran += 1
        self._ops.ran(key)
        # READYs that came while it ran were kept as early ones (it was not in the op
        # table): nothing will ever take them now.
        self._ledger.pop_early(key)
        self._serving.forget(key)
        return True

    # --- the inbox's side ----------------------------------------------------------------

    def received(self, op: SmallOp, peer: int, header: Header, body: memoryview) -> None:
        """A DATA message of ``op`` (its header's credit already granted)."""
        spec = op.spec
        if header.flags & FLAG_CREDITED:
            self._ledger.owe(peer, charge_of(header.nbytes))
        if header.flags & FLAG_READY:
            op.ready.add(peer)
        rkey = (peer, header.step, header.piece)
        recv = spec.schedule.recvs.get(rkey)
        if (recv is None or rkey in op.seen
                or not fits(header, spec.sig, spec.dtype, spec.count,
                            (recv.hi - recv.lo) * op.itemsize)):
            # Not what this rank expects: the general path's mismatch handling says so,
            # on every rank.
            self._promote(op)
            live = op.live
            if live is not None and not live.finished:
                self._applier.deliver(live, peer, header, body, False)
            return
        op.seen.add(rkey)
        if recv.after and not op.gone.issuperset(recv.after):
            op.waiting.append((peer, header, recv, bytes(body)))
            return
        self._apply(op, rkey, recv, body)
        while op.waiting and not op.promoted:
            now = [item for item in op.waiting if op.gone.issuperset(item[2].after)]
            if not now:
                break
            for item in now:
                op.waiting.remove(item)
                src, head, rec, buf = item
                self._apply(op, (src, head.step, head.piece), rec, memoryview(buf))

    def _take_aside(self, op: SmallOp, peer: int, header: Header) -> bool:
        """Take a bodiless message from ``peer`` that :meth:`peek` showed, if it is one of
        ``op``'s: its lent piece (:meth:`_take_lent`), the peer's READY for it (as the
        inbox takes one: Inbox._header_news, PeerEvents.ready), or the peer's word that it
        has copied a piece we lent it.  False, nothing taken, for anything else."""
        if header.name_key == op.key0 and header.seq == op.key1:
            if header.kind == Kind.READY:
                if header.credit:
                    self._ledger.grant(peer, header.credit)
                    self._unpark(peer)
                op.ready.add(peer)
                self._transport.take(peer, header)
                return True
            return self._take_lent(op, peer, header)
        return bool(op.lent) and header.kind in LEND_REPLIES and \
            self._transport.take_ack(peer, header)

    def _take_lent(self, op: SmallOp, peer: int, header: Header) -> bool:
        """Take a DATA message of ``op`` whose body ``peer`` lent (express.py lends an
        exchange's big pieces), if it is one this rank may place now: the kernel copies
        it straight into place.  False, nothing taken, otherwise (the loop then takes it:
        see :meth:`placeable`)."""
        recv = self.placeable(op, peer, header)
        if (recv is None or not header.flags & FLAG_REMOTE
                or not self._transport.take_lent(
                    peer, op.spec.work[recv.lo:recv.hi].data.cast("B"))):
            return False
        if header.credit:
            self._ledger.grant(peer, header.credit)
            self._unpark(peer)
        self.placed(op, peer, header, recv)
        return True

    def placeable(self, op: SmallOp, peer: int, header: Header) -> Recv | None:
        """The receive of ``op`` a DATA message from ``peer`` (``header``) whose body does
        not lie whole in a ring (lent, or in chunks) fills, if its body may be written
        straight into place now (an op that lends pieces itself; a copy, expected, not
        seen yet, its region read by no send still to go); None otherwise (the general
        path then takes the op over)."""
        if not op.lent:
            # Only an exchange that lends takes its peers' lent pieces in place.  Others
            # get them from peers on the general path (which lend the pieces of ops from
            # 1 MiB), and with every small-path op taking those in place, 4 MB alltoalls
            # at 16 ranks ran 3.49-3.59 ms against 3.08-3.11 (16 cores, alternated).
            return None
        spec = op.spec
        rkey = (peer, header.step, header.piece)
        recv = spec.schedule.recvs.get(rkey)
        if (recv is None or recv.mode != COPY or recv.hi <= recv.lo or rkey in op.seen
                or not op.gone.issuperset(recv.after)
                or not fits(header, spec.sig, spec.dtype, spec.count,
                            (recv.hi - recv.lo) * op.itemsize)):
            return None
        return recv

    def placed(self, op: SmallOp, peer: int, header: Header, recv: Recv) -> None:
        """A body :meth:`placeable` allowed is in place (its header's credit granted):
        take it as :meth:`received` takes one from a ring slot."""
        if header.flags & FLAG_CREDITED:
            self._ledger.owe(peer, charge_of(header.nbytes))
        if header.flags & FLAG_READY:
            op.ready.add(peer)
        rkey = (peer, header.step, header.piece)
        op.seen.add(rkey)
        self._apply(op, rkey, recv, None)

    def _apply(self, op: SmallOp, rkey: PieceKey, recv: Recv, body: memoryview | None
               ) -> None:
        """Copy or reduce a piece into place (None: it is there already, but for its
        finishing), then post the sends it unlocks."""
        if body is not None:
            apply_piece(op.spec, recv, body)
        elif recv.final and op.spec.finalize is not None:
            op.spec.finalize(op.spec.work[recv.lo:recv.hi])
        op.applied.append((rkey, recv))
        op.to_come -= 1
        for send in recv.then:
            if op.unsent or not self._post(op, send):
                op.unsent.append(send)
        if op.unsent:
            self._promote(op)

    # --- helpers -------------------------------------------------------------------------

    def _take_floating(self, op: SmallOp) -> None:
        """Apply the bodies of ``op`` that came before it (their credit is owed back as
        they leave the floating store, so their headers' is not owed again)."""
        floating = self._floating
        for item in floating.take(op.spec.key):
            header = item.header
            live = op.live
            if not op.promoted:
                self.received(op, item.src, header._replace(flags=header.flags & ~FLAG_CREDITED),
                              item.buf)
                floating.recycle(item.buf)
            elif live is not None and not live.finished:
                self._applier.deliver(live, item.src, header, item.buf, True)
            else:
                floating.recycle(item.buf)

    def _post(self, op: SmallOp, send: Send) -> bool:
        """Post ``send`` straight into the peer's ring, as the outbox would have sent it."""
        if not post_data(self._ledger, self._transport, op.spec, send, op.ready, op.told,
                         op.spec.schedule.sources):
            return False
        op.sent.append(send)
        op.gone.add((send.peer, send.step, send.piece))
        return True

    def _drive(self, op: SmallOp) -> None:
        """Turn the loop until ``op`` is over or must go on as an ordinary op.

        The peers' messages for ``op`` are taken straight from the transport where it can
        show them in place (:meth:`.Transport.peek`, shared-memory rings): a busy-poll on
        the rings we expect them in, at a fraction of a loop turn's cost.  Anything else
        that arrives, and a periodic look at everything (sockets, other peers), is a turn
        of the loop; so is the wait once the spin is over (it blocks in poll())."""
        step = self._step
        job = self._job
        transport = self._transport
        resume = transport.resume
        peek = transport.peek
        received = self.received
        ledger = self._ledger
        now = time.monotonic
        deadline = op.t_start + PROMOTE_AFTER
        spin = min(transport.spin_for(), _PEEK_SPIN)
        relax = os.sched_yield if transport.crowded() else None
        if relax is not None:
            spin = _YIELD_SPIN
        sources = tuple(op.spec.schedule.sources) if spin else ()
        key0, key1 = op.key0, op.key1
        spin_until = now() + spin
        next_turn = now() + _TURN_EVERY
        while not op.done():
            if (ctrl_c.pending or job.broken is not None or job.closing
                    or self._lost_peer(op)):
                self._promote(op)
                return
            for peer in sources:
                record = peek(peer)
                if record is None:
                    continue
                header, body = record
                if header.name_key != key0 or header.seq != key1 or body is None:
                    if not (body is None and self._take_aside(op, peer, header)):
                        # Not this op's, or not one to take here: the loop takes it
                        # (what can be taken here is, to spare a turn of the loop).
                        resume()  # what waited in a ring for an op is read now
                        step(0, op)
                else:  # as the inbox hands it over (Inbox.received_view)
                    if header.credit:
                        ledger.grant(peer, header.credit)
                        self._unpark(peer)
                    received(op, peer, header, body)
                    transport.take(peer, header)
                break
            else:
                if relax is not None:
                    relax()
                t = now()
                if t >= deadline:
                    self._promote(op)
                    return
                if t >= spin_until:
                    resume()
                    step(PROMOTE_AFTER, op)  # blocks in poll() until something comes
                    spin_until = now() + spin
                elif t >= next_turn:
                    resume()
                    step(0, op)
                    next_turn = t + _TURN_EVERY

    def hand_over(self) -> None:
        """The op in flight goes on on the general path now (the inbox has a body for it
        that only the general path can take)."""
        if self.current is not None:
            self._promote(self.current)

    def _lost_peer(self, op: SmallOp) -> bool:
        """Whether a peer this op still needs has shut down (one that has sent and taken
        all it had to may leave: its goodbye may even be read before the op ends)."""
        return self._departures.any() and bool(self._departures.departed() & needs(op))

    def _promote(self, op: SmallOp) -> None:
        """Hand ``op`` to the general path, with what it has sent and received so far."""
        op.promoted = True
        self.current = None
        op.future = OpFuture(self._waiter)
        # A lent send the peer has not copied yet stays due: the live op ends after it.
        owed = [t for t in op.lent if not t.acked]
        sent = op.sent if not owed else [s for s in op.sent
                                         if not any(s is t.send for t in owed)]
        op.live = live = self._starter.adopt(op.spec, op.future, op.ready, op.told,
                                             sent, op.unsent, op.applied, needs(op))
        for token in owed:
            token.op = live
        waiting, op.waiting = op.waiting, []
        if live is not None:
            for src, header, _recv, buf in waiting:
                if not live.finished:
                    self._applier.deliver(live, src, header, memoryview(buf), False)
