"""The urgent lane: a small blocking op of raised priority, run on the caller's thread
while another thread drives the loop (a big op's copies, say).

Priorities order what the loop sends and reads, but an urgent op run by the loop still
waits for the loop: for the progress thread to finish the copy slice or reduction in
hand, to take the op up, and, at the peer, to find its message behind the big op's
records in the ring, which is read in order.  On a two-core host that was 0.3-0.4 ms for
a 1 KB allreduce during a 64 MB one, against 20 us alone.  So each pair of ranks on a host
has a second, small ring each way, a *lane* (the transport's), which only these ops use:
the caller's thread posts its messages into the peer's lane and reads the peer's out of
its own, reducing them in place, with no drive lock, no credit and no turn of the loop
on the way.  The lane's size bounds what it holds, as credit bounds the rings.

The messages are the general path's, header for header, so a peer that runs the op on
the loop (it submitted it asynchronously, say) handles one from the lane as any other:
the loop reads the messages in its lanes whose ops it runs (Inbox.lane_claims).  Anything
this thread does not handle makes the loop take the op over with the progress made so far
(Starter.adopt, as the small path's ops): a message of the op that came through the ring
(the peer runs it on the loop), one that does not fit (a mismatch, which the loop then
reports), a full lane, a peer that leaves, the job breaking, Ctrl-C, or no answer within
``_WAIT``.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable

from ..interrupts import deferred as ctrl_c
from ..lru import LRU
from ..transport.base import Transport
from ..transport.wire import FLAG_READY, Kind, pack_header
from .departures import Departures
from .express import Chain, chain_of, progress
from .floating import Floating
from .job import JobState
from .mismatch_tracker import MismatchTracker
from .optable import OpTable
from .payload import OpFuture, OpKey, OpSpec, finish_local
from .schedule import Recv, Schedule, Send
from .serving import JoinServer
from .smallpath import apply_piece, fits, needs

# How long a step busy-polls the lane for the peer's message: it holds this process's
# GIL meanwhile, which the thread that drives the loop (the big op's copies) may want.
_SPIN = 200e-6
# ... then looks between naps, which let that thread run, until this long has passed;
# then the loop takes the op over: a peer that takes longer has not called the op yet, and
# the loop, which blocks instead of polling, is the place to wait for it.
_WAIT = 2e-3
_NAP = 50e-6

# Chains by the schedule they came from, as the express lane keeps them.
_CHAINS = 256

Adopt = tuple[OpSpec, set[int], set[int], list[Send], list[Send],
              list[tuple[tuple[int, int, int], Recv]], set[int]]


class UrgentLane:
    def __init__(self, job: JobState, ops: OpTable, floating: Floating,
                 mismatches: MismatchTracker, departures: Departures, serving: JoinServer,
                 transport: Transport, adopt: Callable[[Adopt], OpFuture],
                 finished: deque[OpKey]) -> None:
        """``adopt(state)``: has the loop take an op over (Engine._adopt), returning the
        future of the live op it becomes; ``finished``: where the ops that ran to their
        end here go, for the loop to count ended (Loop.ran_elsewhere)."""
        self._job = job
        self._ops = ops
        self._floating = floating
        self._mismatches = mismatches
        self._departures = departures
        self._serving = serving
        self._transport = transport
        self._adopt = adopt
        self._chains: LRU[int, tuple[Schedule, Chain | None, int]] = LRU(_CHAINS)
        # The ops running here now, each with whether a message of it came through a ring
        # (set by the inbox, on the loop's thread): then the peer runs it on the loop.
        self.running: dict[OpKey, bool] = {}
        self._finished = finished
        self.ran = 0
        self.handed_over = 0

    def chain(self, spec: OpSpec) -> Chain | None:
        """The chain ``spec``'s schedule is, if this lane can run it now: it receives (so
        a peer's thread has at most one op's first messages in a lane before it waits for
        ours, which bounds what a lane holds or the loop floats from it without credit);
        every peer it involves has a lane that takes its bodies; and nothing here calls
        for the loop (a broken or closing job, a peer gone, a mismatch being reported, a
        timeline, bodies of the op that came before it)."""
        schedule = spec.schedule
        hit = self._chains.get(id(schedule))
        if hit is None or hit[0] is not schedule:
            # Reductions into a fresh buffer (OpSpec.fresh) are left to the loop; a fresh
            # copy, an alltoall's own block, is a local region (finish_local in run()).
            chain = None if spec.fresh and spec.ufunc is not None else chain_of(schedule)
            if chain is not None and not chain.steps:
                chain = None
            longest = 0
            if chain is not None:
                longest = max((s.hi - s.lo for s in chain.sends), default=0)
            hit = (schedule, chain, longest)
            self._chains.put(id(schedule), hit)
        _schedule, chain, longest = hit
        if chain is None:
            return None
        job = self._job
        if (job.broken is not None or job.closing or self._ops.tracing()
                or self._departures.any() or len(self._mismatches)
                or spec.key in self._floating):
            return None
        room = longest * spec.work.itemsize
        transport = self._transport
        for peer in (*chain.sources, *(s.peer for s in chain.sends)):
            if transport.lane_room(peer) < room:
                return None
        return chain

    def run(self, spec: OpSpec, chain: Chain) -> OpFuture | bool:
        """Run ``spec`` (its :meth:`chain`) to its end on this thread: True once done,
        False if nothing was sent (run it the usual way), or the future of the live op
        the loop took it over as (wait for it)."""
        key = spec.key
        if spec.epoch < 0:
            spec.epoch = self._serving.epoch
        running = self.running
        running[key] = False
        try:
            told: set[int] = set()
            ready: set[int] = set()
            sources = chain.sources
            posted = 0
            for send in chain.first:
                if not self._post(spec, send, told, sources):
                    if not posted:
                        return False
                    # The loop goes on past where the local regions are finished.
                    finish_local(spec, chain.local_final)
                    return self._hand_over(spec, chain, ready, told, 0, posted)
                posted += 1
            finish_local(spec, chain.local_final)
            for i, (peer, step, piece, recv) in enumerate(chain.steps):
                if not self._receive(spec, peer, step, piece, recv, ready):
                    return self._hand_over(spec, chain, ready, told, i, posted)
                for send in recv.then:
                    if not self._post(spec, send, told, sources):
                        return self._hand_over(spec, chain, ready, told, i + 1, posted)
                    posted += 1
        finally:
            running.pop(key, None)
        self.ran += 1
        self._finished.append(key)
        return True

    def _post(self, spec: OpSpec, send: Send, told: set[int],
              sources: tuple[int, ...]) -> bool:
        """Post ``send`` into the peer's lane: no credit (the lane's size bounds it), and
        READY to a peer we expect data from, as the loop's first message would say."""
        peer = send.peer
        lo, hi = send.lo, send.hi
        part = spec.source_part(lo, hi) if send.from_source else spec.work[lo:hi]
        body = part.data.cast("B") if hi > lo else None
        tell = peer not in told and peer in sources
        key0, key1 = spec.key
        header = pack_header(Kind.DATA, spec.dtype, FLAG_READY if tell else 0, send.step,
                             key0, key1, spec.sig, send.piece,
                             0 if body is None else body.nbytes, spec.count, 0,
                             spec.recipe, spec.epoch)
        if not self._transport.lane_post(peer, header, body):
            return False
        if tell:
            told.add(peer)
        return True

    def _receive(self, spec: OpSpec, peer: int, step: int, piece: int, recv: Recv,
                 ready: set[int]) -> bool:
        """Wait for the message of (``peer``, ``step``, ``piece``) in the peer's lane and
        apply it; False if the loop must take the op over (see the module docstring)."""
        transport = self._transport
        lock = transport.lane_lock(peer)
        peek = transport.lane_peek
        key0, key1 = spec.key
        nbytes = (recv.hi - recv.lo) * spec.work.itemsize
        running = self.running
        key = spec.key
        job = self._job
        relax = os.sched_yield if transport.crowded() else None
        now = time.perf_counter
        start = now()
        nap_from, deadline = start + _SPIN, start + _WAIT
        while True:
            with lock:
                record = peek(peer)
                if record is not None:
                    header, body = record
                    if header.name_key == key0 and header.seq == key1:
                        if (header.step != step or header.piece != piece
                                or not fits(header, spec.sig, spec.dtype, spec.count,
                                            nbytes)):
                            return False  # left for the loop, which says what differs
                        if header.flags & FLAG_READY:
                            ready.add(peer)
                        apply_piece(spec, recv, body)
                        transport.lane_take(peer, header)
                        return True
                    # Another op's (another thread's, or one the loop will claim once it
                    # runs it): ours is behind it.
            if (running[key] or ctrl_c.pending or job.broken is not None or job.closing
                    or self._departures.any() or key in self._floating):
                return False
            t = now()
            if t >= nap_from:
                if t >= deadline:
                    return False
                transport.lane_wait(peer, _NAP)
            elif relax is not None:
                relax()

    def _hand_over(self, spec: OpSpec, chain: Chain, ready: set[int], told: set[int],
                   done: int, posted: int) -> OpFuture:
        """The loop goes on with the op: ``done`` steps applied, ``posted`` sends gone."""
        self.handed_over += 1
        # No longer this thread's: the loop must take its messages from the lane (the
        # thread may drive the loop itself next, inside Engine._adopt).
        self.running.pop(spec.key, None)
        op = progress(spec, chain, ready, told, done, posted, [])  # the lane never lends
        return self._adopt((spec, ready, told, op.sent, op.unsent, op.applied, needs(op)))
