"""The express lane: a small op whose schedule is a chain, run straight down it.

In a chain every receive unlocks only later steps' sends, so its receives can be waited
for one after the other: recursive doubling (the small allreduce; barrier is a one-byte
one), the ring allgather (the size phase of allgather and alltoall), a pairwise exchange
at 2 ranks, a small broadcast.  The small path (smallpath.py) runs any schedule, and pays
for it on every message: sets of what was sent, seen and applied, lists kept for a
possible hand-over, a lookup of each arriving piece.  For a chain, all of that is one
position: how many receives are done.  So this lane keeps only the position, looks for the
next message in the one ring it must come through (past that peer's READY for the op,
which comes first where we send to the peer only later), and on anything else (a message
that is not that one, a full ring, no credit, a peer slow to answer) builds the small
path's record of the op from the position and lets the small path go on from there: the
same messages, none sent twice.

The messages are the small path's, header for header, so peers may run the same op on
either lane.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

from ..interrupts import deferred as ctrl_c
from ..lru import LRU
from ..transport.base import Transport
from ..transport.wire import (
    FLAG_CREDITED,
    FLAG_READY,
    FLAG_REMOTE,
    LEND_REPLIES,
    Header,
    Kind,
)
from .ledger import CreditLedger, charge_of
from .opstate import LentSend
from .optable import OpTable
from .payload import OpFuture, OpSpec, copied_last, finish_local
from .reducer import reduce_into
from .schedule import COPY, Recv, Schedule, Send
from .serving import JoinServer
from .smallpath import SmallOp, SmallPath, apply_piece, post_data, tell_ready

# How long the lane waits for a step's message before the small path takes over (which
# also turns the loop: sockets, other peers, housekeeping).
_SPIN = 200e-6

# Chains by the schedule they came from (kept, so its id is not reused while the entry
# lives): a job's small ops use a few schedules.
_CHAINS = 256

# The smallest body this lane lends (where the loop would lend it too: CMA_BYTES).  Both
# ranks of a 2-rank exchange copying at once, the kernel's copy of 2 MiB out of the
# peer took 260-290 us here, against 420-440 for the ring's two copies (in, out), and 4 MB
# alltoalls ran about a third faster lent; at 512 KiB the two ways cost the same (80-110
# against 105 us) and 1 MB allgathers lent were slower in some runs.
LEND_FROM = 1 << 20

# A one-way send (a broadcast root's piece, which no piece comes back for in its step) is
# lent from a Repeat only where at least this share of its bytes huge pages back
# (transport/pages.py): the ring's two copies overlap, and out of small pages the reader's
# kernel copy, which pins them one by one, is no faster (Chain.lendable), but out of huge
# ones it copies at memory's speed.
ONE_WAY_HUGE = 0.9
# ... and only from this size.  At 2 ranks, blocks of calls alternated in one job (three
# jobs), 4 MiB broadcasts (pieces of 1 MiB) took 0.146-0.148 ms lent against 0.163-0.172
# through the ring out of huge pages, and 0.218-0.254 against 0.262-0.274 out of numpy's
# arrays (whose middle 2 MiB huge pages back); 2 MiB ones (three pieces of 683 KiB) were
# level, and 1 MiB ones (two of 512 KiB) no faster in jobs of their own.
ONE_WAY_FROM = 640 << 10

# The exchange's rule: an exchange's body that the ring holds whole (Chain.lendable) is
# lent only where huge pages back ONE_WAY_HUGE of its bytes, or where the ring copies
# slowly (CopyPace.beats_lending: its cores share no cache), and only where the peer
# would lend its own too, or lends by size alone (Repeat._agrees; the express lane,
# which cannot know the peer's pages, lends it only while the ring copies slowly). The
# reader's kernel pins the lender's pages one by one: out of small ones a 2 MiB body
# took 180-210 us to copy, out of huge ones 85-100, where the ring's two copies (in,
# out, both ranks at once) took 120-130 in all. A rank that sends through the ring while
# its peer lends copies in, then out of the peer. At 2 ranks, the cores sharing a cache,
# 3 MB alltoalls and allgathers, whose 1.5 MiB halves small pages back, took 0.125 ms
# through the ring against 0.180 lent (MPI 0.146); 4 MB alltoalls 0.134 lent where huge
# pages backed both ranks' halves, 0.18-0.20 through the ring, 0.23 lent where one half
# was small-paged, and 0.22-0.27 where one rank lent and the other did not.


class Chain:
    """A schedule as one line: ``first`` sends, then the messages to wait for, each as
    (peer, step, piece, receive), whose receive's ``then`` sends follow it."""

    __slots__ = ("first", "steps", "sources", "sends", "local_final", "tell_first",
                 "lendable", "one_way", "waits")

    def __init__(self, schedule: Schedule, steps: list[tuple[int, int, int, Recv]]) -> None:
        self.first = schedule.first
        self.steps = tuple(steps)
        self.sources = tuple(sorted(schedule.sources))
        self.local_final = schedule.local_final
        # Receives that wait on others (Recv.wait): the lane applies them in order, the
        # small path would not, so a hand-over goes straight to the general path.
        self.waits = schedule.waits
        # Every send, in the order the lane posts them.
        self.sends: tuple[Send, ...] = (*schedule.first,
                                        *(s for *_k, recv in steps for s in recv.then))
        # The sources told READY before the first wait: those waited for before any data
        # of ours goes to them.  The others learn it from our first data (FLAG_READY),
        # which leaves before we wait for theirs, so a READY of its own would only cost a
        # message each way (three per op at 16 ranks for recursive doubling).
        posted = {s.peer for s in schedule.first}
        tell: list[int] = []
        for peer, *_k, recv in steps:
            if peer not in posted and peer not in tell:
                tell.append(peer)
            posted.update(s.peer for s in recv.then)
        self.tell_first = tuple(tell)
        # Sends that may be lent (the peer's kernel copies the body out of ours): those of
        # an exchange, where the peer sends us a piece in the same step, so both ranks
        # copy at once, each one copy instead of the ring's two (a one-way send, as a
        # broadcast's, is faster through the ring, where the two copies overlap); and
        # never one whose bytes a later receive of the op changes (Recv.after), as the
        # peer may read them after that receive.
        exchanged = {(peer, step) for peer, step, *_k in steps}
        guarded = {key for *_k, recv in steps for key in recv.after}
        self.lendable = frozenset((s.peer, s.step, s.piece) for s in self.sends
                                  if (s.peer, s.step) in exchanged
                                  and (s.peer, s.step, s.piece) not in guarded)
        # The others that may be lent out of huge pages (ONE_WAY_HUGE).
        self.one_way = frozenset((s.peer, s.step, s.piece) for s in self.sends
                                 if (s.peer, s.step) not in exchanged
                                 and (s.peer, s.step, s.piece) not in guarded)


def chain_of(schedule: Schedule, waits: bool = False) -> Chain | None:
    """``schedule`` as a :class:`Chain`, or None if it is not one.

    The receives are waited for by step, then piece, then source.  A body must never be
    reduced before the sends that read its region (``after``) have been posted: each of
    them must come earlier in that order, or the schedule is no chain.  With ``waits``,
    receives may wait on others (``Recv.wait``, recursive halving's) where those come
    earlier in that order; without it such a schedule is no chain.  The order itself
    is about speed only: a message of a step depends on earlier steps' (or, as a broadcast's
    acknowledgement, on the same step's from the rank before), so a receive's sends must be
    of its step or later; a wait on a message that cannot come yet would end in a
    hand-over to the small path after the spin, never in a hang."""
    if schedule.waits and not waits:
        return None
    steps = sorted(((src, step, piece, recv) for (src, step, piece), recv
                    in schedule.recvs.items()), key=lambda item: (item[1], item[2], item[0]))
    posted = {(s.peer, s.step, s.piece) for s in schedule.first}
    applied: set[tuple[int, int, int]] = set()
    for src, step, piece, recv in steps:
        if (not posted.issuperset(recv.after) or any(s.step < step for s in recv.then)
                or not applied.issuperset(recv.wait)):
            return None
        posted.update((s.peer, s.step, s.piece) for s in recv.then)
        applied.add((src, step, piece))
    return Chain(schedule, steps)


class Express:
    def __init__(self, small: SmallPath, ops: OpTable, ledger: CreditLedger,
                 serving: JoinServer, transport: Transport,
                 unpark: Callable[[int], None], exchange_pages: bool = False) -> None:
        """``unpark(peer)``: the outbox's, told when a peer returns credit;
        ``exchange_pages``: an exchange's body the ring holds whole is lent only by the
        exchange's rule (the comment before Chain; TOTALREDUCE_CMA_BYTES auto), else by
        size alone."""
        self.exchange_pages = exchange_pages
        self._small = small
        self._unpark = unpark
        self._ops = ops
        self._ledger = ledger
        self._serving = serving
        self._transport = transport
        self._chains: LRU[int, tuple[Schedule, Chain | None]] = LRU(_CHAINS)
        self.ran = 0  # ops that ran to their end on this lane
        self.repeats = 0  # ops a Repeat ran to their end on this lane (repeat.py)
        self.repeats_handed_over = 0  # ops a Repeat began (counted in handed_over too)
        self.repeats_lent = 0  # bodies Repeats lent
        self.handed_over = 0  # ops the small path went on with

    def chain(self, schedule: Schedule) -> Chain | None:
        """The chain ``schedule`` is, if this lane can run it here: every peer it involves
        reached through a ring this process reads in place (Transport.peek)."""
        hit = self._chains.get(id(schedule))
        if hit is not None and hit[0] is schedule:
            return hit[1]
        chain = chain_of(schedule, waits=True)
        if chain is not None:
            transport = self._transport
            peers = set(chain.sources) | {s.peer for s in chain.sends}
            if transport.spin_for() <= 0 or not all(map(transport.peeks, peers)):
                chain = None
        self._chains.put(id(schedule), (schedule, chain))
        return chain

    def run(self, spec: OpSpec, chain: Chain) -> OpFuture | bool:
        """Run ``spec`` (eligible for the small path, none of its bodies floating here) to
        its end: as :meth:`.SmallPath.run`."""
        ledger = self._ledger
        transport = self._transport
        key = spec.key
        key0, key1 = key
        ready = ledger.pop_early(key)
        if spec.epoch < 0:
            spec.epoch = self._serving.epoch
        told: set[int] = set()
        sources = chain.sources
        posted = 0
        work = spec.work
        itemsize = work.itemsize
        # Copies (a reduction would sum a lent piece after copying it: no gain) of an op
        # big enough that the loop would lend its pieces (TOTALREDUCE_CMA_BYTES).  Not an
        # allreduce's allgather phase either, though its peer copies those pieces: lent
        # straight after the sum that wrote them, 3 MB allreduces at 2 ranks took
        # 0.77-0.82 ms against 0.49-0.65 through the ring (alternated three times).
        lendable = chain.lendable if (chain.lendable and spec.lend
                                      and spec.ufunc is None) else None
        lent: list[LentSend] = []
        for send in chain.first:
            token = None if lendable is None else self._lend(spec, send, lendable)
            if not post_data(ledger, transport, spec, send, ready, told, sources, token):
                if not posted:  # as it was: the general path starts it
                    for peer in ready:
                        ledger.early_ready(key, peer)
                    return False
                return self.hand_over(spec, chain, ready, told, 0, posted, True, lent,
                                      local=True)
            if token is not None:
                lent.append(token)
            posted += 1
        self._serving.forget(key)
        # A gathering op's own block after its receives where it is small enough
        # (payload.copied_last), as on the loop; a hand-over before then copies it
        # (``local``).
        late = spec.fresh and bool(chain.steps) and copied_last(spec, chain.local_final)
        if (spec.finalize is not None or spec.fresh) and not late:
            finish_local(spec, chain.local_final)
        for peer in chain.tell_first:
            if peer not in told and not tell_ready(ledger, transport, spec, peer, told):
                return self.hand_over(spec, chain, ready, told, 0, posted, True, lent, late)
        peek = transport.peek
        take = transport.take
        sig, dtype, count = spec.sig, spec.dtype, spec.count
        ufunc = spec.ufunc
        # A REDUCE piece with nothing to finalize (or to take from the source) is reduced
        # here, the rest by apply_piece: on this path every call saved is a share of the
        # op's whole cost.
        plain = spec.finalize is None and not spec.fresh
        unpark = self._unpark
        for done, (peer, step, piece, recv) in enumerate(chain.steps):
            record = peek(peer) or self.wait(peer)
            while record is not None and record[1] is None:
                header = record[0]
                if header.kind == Kind.READY and header.name_key == key0 \
                        and header.seq == key1:
                    # The peer's READY for this op, ahead of its data (a peer we send to
                    # only later): as the inbox takes it (Inbox._header_news,
                    # PeerEvents.ready).
                    self._credit(peer, header)
                    ready.add(peer)
                    take(peer, header)
                elif not (lent and header.kind in LEND_REPLIES
                          and transport.take_ack(peer, header)):
                    break  # else: the peer has copied (part of) a body we lent it
                record = peek(peer) or self.wait(peer)
            if record is None:
                return self.hand_over(spec, chain, ready, told, done, posted, False, lent,
                                      late)
            header, body = record
            lo, hi = recv.lo, recv.hi
            if (header.name_key != key0 or header.seq != key1
                    or header.step != step or header.piece != piece or header.sig != sig
                    or header.dtype != dtype or header.count != count
                    or header.nbytes != (hi - lo) * itemsize  # smallpath.fits, inline
                    or (body is None and not (header.flags & FLAG_REMOTE
                                              and recv.mode == COPY and hi > lo))):
                # Not the message this step waits for: the small path looks at it again.
                return self.hand_over(spec, chain, ready, told, done, posted, False, lent,
                                      late)
            if body is None:
                # Lent to us: our kernel copies it out of the peer, straight into place.
                if not transport.take_lent(peer, work[lo:hi].data.cast("B")):
                    return self.hand_over(spec, chain, ready, told, done, posted, False,
                                           lent, late)
                if recv.final and spec.finalize is not None:
                    spec.finalize(work[lo:hi])
            flags = header.flags
            credit = header.credit
            if credit:  # _credit, inline
                ledger.grant(peer, credit)
                unpark(peer)
            if flags & FLAG_CREDITED:
                ledger.owe(peer, charge_of(header.nbytes))
            if flags & FLAG_READY:
                ready.add(peer)
            if body is not None:
                if plain and recv.mode != COPY:
                    assert ufunc is not None
                    reduce_into(ufunc, work[lo:hi], body)
                else:
                    apply_piece(spec, recv, body)
                take(peer, header)
            for send in recv.then:
                token = None if lendable is None else self._lend(spec, send, lendable)
                if not post_data(ledger, transport, spec, send, ready, told, sources, token):
                    return self.hand_over(spec, chain, ready, told, done + 1, posted, True,
                                           lent, late)
                if token is not None:
                    lent.append(token)
                posted += 1
        if late:
            finish_local(spec, chain.local_final)
        for token in lent:  # each peer says it has copied what we lent it
            if not self.acked(token):
                return self.hand_over(spec, chain, ready, told, len(chain.steps),
                                       posted, False, lent)
        self.ran += 1
        # The loop never turned meanwhile, so no READY of this op was kept as an early one
        # (the small path, which turns it, forgets those here).
        self._ops.ran(key)
        return True

    def _lend(self, spec: OpSpec, send: Send, lendable: frozenset[tuple[int, int, int]]
              ) -> LentSend | None:
        """A token to lend ``send``'s body with, if it is to be lent."""
        n = (send.hi - send.lo) * spec.work.itemsize
        peer = send.peer
        transport = self._transport
        if ((peer, send.step, send.piece) not in lendable or n < LEND_FROM
                or not transport.lends_body(peer, spec.work.nbytes, n)):
            return None
        if self.exchange_pages and n <= transport.ring_body(peer) and \
                transport.ring_beats_lending(peer):
            # Through the ring, whatever backs the pages: that the peer's would be huge
            # too, only a Repeat learns (its calls lend where both ranks' would).
            return None
        return LentSend(send)

    def acked(self, token: LentSend, spin: float = _SPIN) -> bool:
        """Wait until the peer says it has copied the body ``token`` lent it (the records
        it sends before that are replies too, to other bodies); False where none came
        within ``spin`` seconds, or another record stands first."""
        transport = self._transport
        peer = token.send.peer
        while not token.acked:
            record = transport.peek(peer) or \
                self.wait_on(functools.partial(transport.peek, peer), spin)
            if (record is None or record[1] is not None
                    or record[0].kind not in LEND_REPLIES
                    or not transport.take_ack(peer, record[0])):
                return False
        return True

    def _credit(self, peer: int, header: Header) -> None:
        """The credit ``peer`` returned on ``header``, as the inbox takes it."""
        if header.credit:
            self._ledger.grant(peer, header.credit)
            self._unpark(peer)

    def wait(self, peer: int) -> tuple[Header, memoryview | None] | None:
        """The next record from ``peer``, or None if none came within the spin."""
        return self.wait_on(functools.partial(self._transport.peek, peer))

    def wait_on(self, peek: Callable[[], tuple[Header, memoryview | None] | None],
                spin: float = _SPIN) -> tuple[Header, memoryview | None] | None:
        """:meth:`wait`, looking with ``peek()`` (a peer's Port.peek, say), for up to
        ``spin`` seconds."""
        relax = os.sched_yield if self._transport.crowded() else None
        now = time.perf_counter
        deadline = now() + spin
        while not ctrl_c.pending:
            if relax is not None:
                relax()
            record = peek()
            if record is not None:
                return record
            if now() >= deadline:
                break
        return None

    def hand_over(self, spec: OpSpec, chain: Chain, ready: set[int], told: set[int],
                   done: int, posted: int, stuck: bool, lent: list[LentSend],
                   local: bool = False) -> OpFuture | bool:
        """The small path goes on with the op: ``done`` steps applied, ``posted`` sends
        gone (``lent``: those lent); ``stuck``: the next send could not go (the general
        path sends it); ``local``: before the local regions were finished, which the
        general path never does once an op has begun (Starter.adopt): they are now."""
        if local:
            finish_local(spec, chain.local_final)
        self.handed_over += 1
        return self._small.go_on(progress(spec, chain, ready, told, done, posted, lent),
                                 stuck or chain.waits)


def progress(spec: OpSpec, chain: Chain, ready: set[int], told: set[int], done: int,
             posted: int, lent: list[LentSend]) -> SmallOp:
    """The small path's record of a chain run this far: ``done`` steps applied, ``posted``
    sends gone (``lent``: those lent), ``told`` peers told READY, ``ready`` peers that
    said it."""
    op = SmallOp(spec, ready)
    op.told = told
    op.lent = lent
    applied = chain.steps[:done]
    unlocked = len(chain.first) + sum(len(recv.then) for *_k, recv in applied)
    op.sent = list(chain.sends[:posted])
    op.gone = {(s.peer, s.step, s.piece) for s in op.sent}
    op.unsent = list(chain.sends[posted:unlocked])
    op.applied = [((p, s, j), recv) for p, s, j, recv in applied]
    op.seen = {rkey for rkey, _recv in op.applied}
    op.to_come = len(chain.steps) - done
    return op

