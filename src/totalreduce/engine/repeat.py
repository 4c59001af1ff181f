"""A small blocking op made again and again, run down its chain with everything that does
not change between calls bound once.

A training loop repeats the same few small ops (a loss, a metric, a flag): the same name,
dtype, shape and reduction every step.  The express lane (express.py) runs each call from
a spec of its own, and at 2 ranks building that spec and its label, finding the chain
again, asking each part of the engine whether it is idle and calling through the
transport's dispatch took three quarters of an 8-byte allreduce's time (30 us of it,
where posting the record, waiting for the peer's and summing it took 8).  A
:class:`Repeat` is made once per template; a call gives it only its buffer and identity.

The messages are the express lane's, header for header.  Anything out of the ordinary (a
message that is not the awaited one, a peer slow to answer) builds the call's spec there
and then and hands the op to the small path at the position reached, as the express lane
does.

A send that does not fit (a full ring, no credit) waits instead, with every send after
it, in the chain's order, while this thread reads what the peer sent and tries them again
between its looks: so an op bigger than its ring runs here too, each piece copied into the
ring while the peer reads the one before (a blocking allreduce past the ring, where the
scheduler sends one: SelfGuided._direct_big).  A receive whose region a waiting send still
reads waits for that send to go.

Bodies the express lane would lend (an exchange's, of LEND_FROM or more, where the
transport lends them) are lent here too: the peer's kernel copies them out of ours, and a
call ends once every peer has said it has.  So a 2-rank allgather or alltoall of a few
MiB, whose bodies are lent, runs here from its second call, without the spec, label and
lookups the express lane makes for it each call.  A 2-rank broadcast's root lends its
body of PUSH_MIN or more and copies the back half into the peer when asked (where each
rank has a core: transport/ring_link.py), and its peer posts the chain's acknowledgement
once its own half is in; where ranks outnumber cores the root lends its pieces where
huge pages back them (ONE_WAY_HUGE), through the ring otherwise.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from threading import get_ident

import numpy as np

from ..interrupts import deferred as ctrl_c
from ..memcopy import copy_bytes
from ..transport import pages
from ..transport.base import NOT_TAKEN, TAKEN, Port, Transport
from ..transport.cma import address_of
from ..transport.ring_push import PUSH_MIN
from ..transport.wire import (
    FLAG_AGREES,
    FLAG_CREDITED,
    FLAG_READY,
    FLAG_REMOTE,
    FLAG_SPREAD,
    FLAG_WOULD_LEND,
    HEADER_SIZE,
    KIND_DATA,
    LEND_REPLIES,
    MAGIC,
    Header,
    Kind,
    pack_fields,
)
from .driving import Driver
from .express import LEND_FROM, ONE_WAY_FROM, ONE_WAY_HUGE, Chain, Express
from .floating import Floating
from .ledger import CreditLedger
from .loop import Loop
from .opstate import LentSend
from .optable import OpTable
from .payload import OpFuture, OpKey, OpSpec, copied_last, finish_regions
from .reducer import QUIET, ScratchPool, reduce_into
from .schedule import COPY, Send
from .serving import JoinServer
from .smallpath import SmallPath, post_ready

_KIND_READY = Kind.READY
_frombuffer = np.frombuffer
_now = time.perf_counter

# How long this thread looks for the peer's next message, posting what waits meanwhile,
# before the small path takes the op over (as Express.wait's spin).
_SPIN = 200e-6
# ... and longer by a second for this many bytes a call lends and copies half of (_PUSH):
# the peer copies the other half meanwhile, and its answer comes once it has.  A kernel
# copy runs at 6-12 GB/s on the hosts measured.
_PUSH_RATE = 2e9

# The fields Repeat._run compares by position (a header reordered must fail here).
assert Header._fields[3:10] == ("step", "name_key", "seq", "sig", "piece", "nbytes",
                                "count") and Header._fields[1] == "dtype"

# A send as Repeat keeps it: (port, peer, lo, hi, step, piece, bytes, to a source,
# from the call's source, the whole buffer, the Send where its body may be lent, when
# else it is lent: 0 by its size alone, _ONE_WAY only out of huge pages (ONE_WAY_HUGE),
# _PUSH by its size alone, half copied here (PUSH_MIN),
# _EXCHANGE where it would be lent out of huge pages or while the ring copies slowly
# (express.py, the exchange's rule) and the peer would lend too (Repeat._agrees), _SLOW
# a reduction's only while the ring copies slowly, as the loop's (OpSpec.lend_slow), and
# where the ranks may differ on that, only where the peer would too (OpSpec.agree_slow)).
_Send = tuple[Port, int, int, int, int, int, int, bool, bool, bool, Send | None, int]
_ONE_WAY = 1
_EXCHANGE = 2
_SLOW = 3
# A one-way send lent whole, its back half copied into the peer by this thread when the
# peer asks (transport/ring_push.py), where every rank has a core of its own.
_PUSH = 4

# What every call of a one-exchange template shares (Repeat._run_single): the send's port,
# peer, step, piece, bytes and flags; the receive's port, step, piece and bytes; whether
# it finishes the op's values (Recv.final, with a finalize).
_Single = tuple[Port, int, int, int, int, int, Port, int, int, int, bool]
# ... and of any other template of one exchange (Repeat._run_one): the send's port, peer,
# lo, hi, whether that is the whole buffer, whether it reads the source, step, piece,
# bytes and flags; the receive's port, step, piece, lo, hi, whether that is the whole
# buffer, and bytes; whether it reduces (else it copies), whether its left operand is the
# source's (OpSpec.fresh), whether it finishes the op's values (Recv.final, with a
# finalize), and whether the call finishes local regions (Schedule.local_final).
_One = tuple[Port, int, int, int, bool, bool, int, int, int, int, Port, int, int, int, int,
             bool, int, bool, bool, bool, bool]

# A reduction's lent piece is copied out of the peer and summed a slice of this size at a
# time (Repeat._take_summed), while the slice is still in the cache: 16 MB of 2 MiB
# pieces took 3.0-3.3 ms to copy whole and sum, 2.7-3.2 in 1 MiB slices, 2.2-2.3 in 512
# KiB ones, 2.1-2.5 in 256 KiB ones (one process reading its own memory, an Intel VM).
_LENT_SLICE = 512 << 10

# What a peer's last body of an exchange, or of a reduction whose ranks agree on lending
# while slow, said of its lending (Repeat._peer_lends): it lends only where we would too,
# it would not, or it lends by its own rule alone (the loop's: by size, or while slow).
_WONT = 0
_WOULD = 1
_BY_SIZE = 2


def _peer_lends(flags: int) -> int:
    """What a DATA's ``flags`` say of its sender's lending (_WONT, _WOULD, _BY_SIZE)."""
    if flags & FLAG_AGREES:
        return _WOULD if flags & FLAG_WOULD_LEND else _WONT
    return _BY_SIZE if flags & FLAG_REMOTE else _WONT


# Regions whose pages Repeat._huge remembers (a few buffers, reused call after call).
_HUGE_REGIONS = 16


class Repeat:
    """One template's calls on the express lane (see the module docstring).  Made by
    :meth:`.Engine.repeat` for a chain."""

    __slots__ = ("_describe", "_schedule", "_priority", "_lend", "_lend_slow", "_chain",
                 "_label_of", "_members", "_driver", "_loop", "_small", "_express", "_ops",
                 "_ledger", "_serving", "_floating", "_unpark", "_first", "_steps", "_sig",
                 "_code", "_count", "_recipe", "_ufunc", "_finalize", "_tell_first",
                 "_fresh", "_source_at", "_needs_source", "_done", "_dtype", "_quiet",
                 "_reduce_into", "_sends", "_transport", "_lent", "_late", "_op_bytes",
                 "_huge_regions", "_agrees", "_agree_slow", "_peer_lends", "_scratch",
                 "_single", "_one", "_spin", "_wait")

    def __init__(self, template: OpSpec, chain: Chain, label_of: Callable[[int], str],
                 members: tuple[int, ...] | None, driver: Driver, loop: Loop,
                 small: SmallPath, express: Express, ops: OpTable, ledger: CreditLedger,
                 serving: JoinServer, floating: Floating, ports: dict[int, Port],
                 unpark: Callable[[int], None], transport: Transport,
                 lends: bool = False, lends_one_way: bool = False,
                 scratch: ScratchPool | None = None) -> None:
        """``template``: a call's spec (its identity, buffers and priority unused);
        ``label_of(seq)``: the label of the call ``seq`` of it, for a spec built late;
        ``ports``: the transport's, of every peer the chain involves; ``unpark(peer)``:
        the outbox's, told when a peer returns credit; ``transport``: where bodies are
        lent, and their acknowledgements taken; ``lends``: whether calls lend the bodies
        the express lane would (through the ring, a body of 1 MiB costs less: 2 MB
        allgathers and alltoalls at 2 ranks took 0.10 ms so against 0.12 lent);
        ``lends_one_way``: whether calls lend their one-way sends' bodies (Chain.one_way):
        from PUSH_MIN whole, this thread copying the back half into the peer (where
        every rank has a core of its own), else where huge pages back them;
        ``scratch``: where a reduction's lent pieces are copied to be summed (the
        engine's pool; without it a call hands such a piece over to the small path).

        A reduction's calls lend the pieces of its exchanges where the loop would (with
        ``lends``): by size where the template's spec lends (OpSpec.lend), or while the
        ring copies slowly where it lends then (OpSpec.lend_slow), and there, where the
        ranks may differ on that (OpSpec.agree_slow), only where the peer would too; and
        take the peer's lent pieces.  So a 2-rank allreduce whose pieces are lent runs
        here too: on a VM whose rings copied slowly, 16 MB ones spent a third of their
        time on the loop between the copies and sums (200 us before the first, about 100
        between one piece's sum and the next copy, 200 waiting at the end)."""
        # The template's fields, not the spec: its buffers are a call's own, and the
        # templates that keep Repeats (up to a few MiB each) must not keep those alive.
        self._describe = template.describe
        self._schedule = template.schedule
        self._priority = template.priority
        self._lend = template.lend
        self._lend_slow = template.lend_slow
        self._chain = chain
        self._label_of = label_of
        self._members = members
        self._driver = driver
        self._loop = loop
        self._small = small
        self._express = express
        self._ops = ops
        self._done = ops.done
        self._ledger = ledger
        self._serving = serving
        self._floating = floating
        self._unpark = unpark
        self._transport = transport
        self._lent: list[LentSend] = []  # the call's lent sends (one call at a time)
        # Whether huge pages back a region (address, bytes), as the kernel said when first
        # asked (5 us a time): a training loop hands the same buffers again and again.
        self._huge_regions: dict[tuple[int, int], bool] = {}
        itemsize = template.work.itemsize
        self._op_bytes = template.work.nbytes
        # Each send as (its peer's port, peer, lo, hi, step, piece, bytes, whether the
        # peer is a source, so that its first data says READY, whether it reads the
        # call's source, whether it is the whole buffer); each step as (peer, its port,
        # step, piece, its receive, the receive's bytes, how many sends it unlocks (the
        # next ones in _sends), whether it is the whole buffer, whether those sends are
        # all bodiless, so that they go before its body is copied).  A whole buffer goes as
        # it is: at 2 ranks every piece is, and a slice of it first cost as much again as
        # the rest of making the body.
        sources = chain.sources
        count = template.count
        # The sends whose bodies may be lent, as the express lane picks them (Express._lend;
        # the transport's size rule is asked each call).
        reduces = template.ufunc is not None
        # Where ranks may differ on lending while slow (OpSpec.agree_slow), the sends stay
        # lendable even where this rank would not lend them, so that they tell the peer
        # it would not.
        agree_slow = reduces and template.agree_slow and not template.lend
        lendable = chain.lendable if lends and (template.lend or (
            reduces and (template.lend_slow or agree_slow))) else frozenset()
        one_way = chain.one_way if lends_one_way and template.ufunc is None \
            else frozenset()
        pushes = bool(one_way) and not transport.crowded()

        def sends(of: tuple[Send, ...]) -> tuple[_Send, ...]:
            out = []
            for s in of:
                nbytes = (s.hi - s.lo) * itemsize
                which = (s.peer, s.step, s.piece)
                if which in lendable and nbytes >= LEND_FROM:
                    if reduces:
                        lend, rule = s, 0 if template.lend else _SLOW
                    else:
                        lend, rule = s, _EXCHANGE if express.exchange_pages and \
                            nbytes <= transport.ring_body(s.peer) else 0
                elif which in one_way and pushes and nbytes >= PUSH_MIN:
                    lend, rule = s, _PUSH
                elif which in one_way and nbytes >= ONE_WAY_FROM:
                    lend, rule = s, _ONE_WAY
                else:
                    lend, rule = None, 0
                out.append((ports[s.peer], s.peer, s.lo, s.hi, s.step, s.piece, nbytes,
                            s.peer in sources, s.from_source, s.lo == 0 and s.hi == count,
                            lend, rule))
            return tuple(out)

        self._first = sends(chain.first)
        # How long a wait for a peer's next record lasts before a hand-over (_PUSH_RATE).
        self._spin = _SPIN + sum(send[6] for send in self._first if send[11] == _PUSH) \
            / _PUSH_RATE
        # Made once: a call of a small op must not pay for it.
        self._wait = express.wait_on if self._spin == _SPIN else \
            functools.partial(express.wait_on, spin=self._spin)
        # Every send in the chain's order (Chain.sends), where waiting ones queue: the
        # first, then each step's.  A hand-over counts the ones posted in this order.
        self._sends = sends(chain.sends)
        # Whether a send goes by the exchange's rule (_EXCHANGE), and what each peer's
        # last body said of its own (_peer_lends): a call lends such a body where both
        # ranks would, or where the peer lends by size alone (the loop's, an async call's
        # side), as it does.  One lending while the other copies through the ring was
        # slower than both ways (2-rank 4 MB alltoalls, 0.22-0.27 ms against 0.13 lent
        # and 0.17-0.19 copied), and numpy's arrays of a few MiB get huge pages for one
        # part only, which part differing from rank to rank.  So too a 2-rank reduction's
        # pieces while the rings are slow (OpSpec.agree_slow): lent one way only, one rank
        # copies into the ring, out of the peer and sums, where the other only sums.
        self._agrees = any(send[11] == _EXCHANGE for send in self._sends) or (
            agree_slow and any(send[11] == _SLOW for send in self._sends))
        self._agree_slow = agree_slow
        self._peer_lends: dict[int, int] = {}
        self._tell_first = tuple((ports[peer], peer) for peer in chain.tell_first)
        self._steps = tuple((peer, ports[peer], step, piece, recv,
                             (recv.hi - recv.lo) * itemsize, len(recv.then),
                             recv.lo == 0 and recv.hi == count,
                             bool(recv.then) and all(s.hi == s.lo for s in recv.then))
                            for peer, step, piece, recv in chain.steps)
        self._sig, self._code, self._count = template.sig, template.dtype, count
        # reduce_into's choices, made once: the dtype is the template's.  _quiet: the
        # floating-point error state to reduce under (None: integers, as they are);
        # _reduce_into: numpy keeps that state elsewhere, so reduce_into sets it.
        self._dtype = dtype = template.work.dtype
        self._quiet = QUIET if dtype.kind in "fc" else None
        self._reduce_into = dtype.kind in "fc" and QUIET is None
        self._recipe = template.recipe
        self._ufunc = template.ufunc
        self._finalize = template.finalize
        # The working buffer starts undefined, each region taken from the call's source
        # with its first (only) reduction or copied from it (OpSpec.fresh).
        self._fresh = template.fresh
        self._source_at = template.source_at  # OpSpec.source_at
        self._needs_source = template.fresh or any(s.from_source for s in chain.sends)
        # The own block copied after the receives where a call lends (payload.copied_last,
        # as the express lane does).
        self._late = template.fresh and bool(chain.steps) and \
            copied_last(template, chain.local_final)
        self._scratch = scratch if reduces else None
        self._single = self._one_exchange()
        self._one = None if self._single else self._any_exchange()

    def _one_exchange(self) -> _Single | None:
        """Where every call is one reduction's exchange (:meth:`_run_single`): the whole
        buffer sent to one peer, never lent, and that peer's whole buffer summed in, with
        nothing finished locally and nothing else sent or read, what its calls share."""
        if len(self._first) != 1 or len(self._steps) != 1 or self._tell_first \
                or self._needs_source or self._late or self._agrees \
                or self._chain.local_final or self._ufunc is None:
            return None
        port, peer, _lo, _hi, step, piece, nbytes, tell, _src, whole, lend, _rule = \
            self._first[0]
        source, in_port, in_step, in_piece, recv, in_bytes, unlocks, in_whole, _bare = \
            self._steps[0]
        if lend is not None or source != peer or not (whole and in_whole) or unlocks \
                or recv.mode == COPY:
            return None
        flags = FLAG_CREDITED | FLAG_READY if tell else FLAG_CREDITED
        return (port, peer, step, piece, nbytes, flags, in_port, in_step, in_piece,
                in_bytes, recv.final and self._finalize is not None)

    def _any_exchange(self) -> _One | None:
        """Where every call is one exchange but not :meth:`_one_exchange`'s
        (:meth:`_run_one`): a region sent to one peer, never lent, and that peer's region
        summed or copied in, with nothing else sent or read, what its calls share.  At 2
        ranks: a reducescatter, an allgather (its sizes phase and its data's), an
        alltoall, a broadcast's root."""
        # Never lent: a call copies its own block of a fresh buffer (_late's, which is
        # for calls that lend) right after its message has gone.
        if len(self._first) != 1 or len(self._steps) != 1 or self._tell_first \
                or self._agrees:
            return None
        port, peer, lo, hi, step, piece, nbytes, tell, from_source, whole, lend, _rule = \
            self._first[0]
        source, in_port, in_step, in_piece, recv, in_bytes, unlocks, in_whole, _bare = \
            self._steps[0]
        if lend is not None or source != peer or unlocks:
            return None
        reduces = recv.mode != COPY
        if reduces and self._ufunc is None:
            return None
        flags = FLAG_CREDITED | FLAG_READY if tell else FLAG_CREDITED
        finalize = self._finalize
        return (port, peer, lo, hi, whole, from_source, step, piece, nbytes, flags, in_port,
                in_step, in_piece, recv.lo, recv.hi, in_whole, in_bytes, reduces,
                reduces and self._fresh, recv.final and finalize is not None,
                (finalize is not None or self._fresh) and bool(self._chain.local_final))

    def run(self, work: np.ndarray, key: OpKey, source: np.ndarray | None = None
            ) -> OpFuture | bool:
        """The call ``key`` on ``work`` (flat, contiguous, the template's dtype and size)
        to its end, as :meth:`.Engine.run_now` returns: True once done, False if it did
        not begin (nothing sent: build its spec and go the usual way), or the future of the
        op it became on the general path.  ``source``: the call's input (OpSpec.source),
        where the template's op has one (without it such a call goes the usual way)."""
        if source is None and self._needs_source:
            return False
        # Driver.exclusive, inline: its call and the tuple through it were a share of an
        # 8-byte op's time.
        driver = self._driver
        lock = driver.lock
        if not lock.acquire(False):
            return False
        driver.owner = get_ident()
        try:
            if self._loop.ended:
                return False
            if self._single:
                return self._run_single(work, key)
            if self._one:
                return self._run_one(work, key, source)
            return self._run(work, source, key)
        finally:
            driver.owner = None
            lock.release()

    def run_queued(self, work: np.ndarray, key: OpKey, source: np.ndarray | None = None
                   ) -> OpFuture | bool:
        """:meth:`run` for a call the loop queued (Loop.queued), by the driver, which
        holds the lock: the calls queued after it do not count as work in flight."""
        if source is None and self._needs_source:
            return False
        return self._run(work, source, key, True)

    def spec(self, work: np.ndarray, key: OpKey, source: np.ndarray | None = None
             ) -> OpSpec:
        """The call's spec, as the scheduler would have built it."""
        return OpSpec(key, self._label_of(key[1]), self._sig, self._code, self._count,
                      self._describe, self._schedule, work, source, self._ufunc,
                      self._finalize, self._priority, self._recipe, -1, self._members,
                      self._fresh and source is not None, self._lend, self._lend_slow,
                      source_at=self._source_at)

    def label(self, seq: int) -> str:
        """The label of the call ``seq``, for messages."""
        return self._label_of(seq)

    def _run(self, work: np.ndarray, source: np.ndarray | None, key: OpKey,
             dequeued: bool = False) -> OpFuture | bool:
        loop = self._loop
        floating = self._floating
        # Floating.empty() and CreditLedger.pop_early(), inline: nearly always nothing
        # floats and no peer said READY first.  A blocking call does not pass the calls
        # queued before it (``dequeued``: this call is one of them).
        if (loop.commands or loop.completions or (loop.queued and not dequeued)
                or floating.bodies or floating.bytes or not self._small.quiet(key)):
            return False
        ledger = self._ledger
        early = ledger.early
        ready = (early.pop(key) or set()) if early.entries else set()
        epoch = self._serving.epoch
        told: set[int] = set()
        post = self._post
        sends = self._sends
        lent = self._lent
        lent.clear()
        posted = 0
        queued = len(self._first)  # sends unlocked so far: sends[posted:queued] wait
        for send in self._first:
            if not post(work, source, send, key, epoch, ready, told):
                break
            posted += 1
        if not posted and queued:  # as it was: the general path starts it
            for peer in ready:
                ledger.early_ready(key, peer)
            return False
        if self._serving.early_headers.entries:  # JoinServer.forget's test, first
            self._serving.forget(key)
        finalize = self._finalize
        fresh = self._fresh
        at = self._source_at
        late = self._late and bool(lent)
        if (finalize is not None or fresh) and not late:
            self._finish_local(work, source)
        key0, key1 = key
        sig, code, count = self._sig, self._code, self._count
        for port, peer in self._tell_first:  # sources waited for before data goes to them
            if peer not in told and not post_ready(ledger, port.post_now, peer, told, key,
                                                   code, sig, count, self._recipe, epoch):
                return self._hand_over(work, source, key, epoch, ready, told, 0, posted,
                                       True, late)
        wait = self._wait
        for done, (peer, port, step, piece, recv, nbytes, then, whole, bare) in enumerate(
                self._steps):
            # Header[3:10] and [1]: what a DATA message of this step must say, compared
            # as one slice where the express lane makes nine comparisons of fields.
            expected = (step, key0, key1, sig, piece, nbytes, count)
            record = port.peek()
            while True:
                if record is None:
                    if posted < queued:
                        record, posted = self._wait_posting(port, work, source, key, epoch,
                                                            ready, told, posted, queued)
                    else:
                        record = wait(port.peek)
                    if record is None:
                        break
                if record[1] is not None:
                    break
                header = record[0]
                if not (header.kind == _KIND_READY and header.name_key == key0
                        and header.seq == key1):
                    if lent and header.kind in LEND_REPLIES and \
                            self._transport.take_ack(peer, header):
                        # The peer has copied (part of) a body we lent it.
                        record = port.peek()
                        continue
                    break
                # The peer's READY for this op, ahead of its data (Express.run).
                if header.credit:
                    ledger.grant(peer, header.credit)
                    self._unpark(peer)
                ready.add(peer)
                port.take(header)
                record = port.peek()
            if record is None:
                return self._hand_over(work, source, key, epoch, ready, told, done, posted,
                                       posted < queued, late)
            header, body = record
            if header[3:10] != expected or header[1] != code or (
                    body is None and not (header.flags & FLAG_REMOTE and nbytes and (
                        recv.mode == COPY or self._scratch is not None))):
                # Not the message this step waits for: the small path looks at it again.
                return self._hand_over(work, source, key, epoch, ready, told, done, posted,
                                       posted < queued, late)
            lo, hi = recv.lo, recv.hi
            if posted < queued:
                # A waiting send may still read this region: it goes first.
                gone = self._post_reading(work, source, key, epoch, ready, told, posted,
                                          queued, lo, hi)
                if gone < 0:
                    return self._hand_over(work, source, key, epoch, ready, told, done,
                                           -1 - gone, True, late)
                posted = gone
            if bare and body is not None and posted == queued:
                # What this step unlocks carries no body (a chain broadcast's
                # acknowledgement, algorithms/chain.py, which needs only this header
                # checked): it goes before the copy, so the root waiting for it stops
                # waiting a piece's copy sooner.  Not for a lent body, whose copy may
                # fail and hand the op over as if this step had sent nothing.
                queued += then
                while posted < queued and post(work, source, sends[posted], key, epoch,
                                               ready, told):
                    posted += 1
                then = 0
            part = work if whole else work[lo:hi]
            # A reduction's left operand: a fresh buffer's region takes it from the
            # source (the chains that start one reduce into each region once: apply_piece).
            left = part if recv.mode == COPY or source is None or not fresh \
                else source[lo - at:hi - at]
            pending = TAKEN
            if body is None and header.flags & FLAG_SPREAD and recv.mode == COPY:
                # Lent by an idle peer, which copies the back half into us (a broadcast's
                # root): our front copied and the body acknowledged, bodiless sends this
                # step unlocks go before the wait for the peer's half (below), as after a
                # ring's body: the root waiting for them stops waiting sooner.
                pending = self._transport.take_lent_front(peer, part.data.cast("B"))
                if pending == NOT_TAKEN:
                    return self._hand_over(work, source, key, epoch, ready, told, done,
                                           posted, posted < queued, late)
                if pending != TAKEN and (not bare or finalize is not None):
                    if not self._transport.wait_pushed(peer, pending):
                        return self._hand_over(work, source, key, epoch, ready, told, done,
                                               posted, posted < queued, late)
                    pending = TAKEN
            # Lent to us: our kernel copies it out of the peer (and frees its record),
            # straight into place, or a slice at a time, each summed in as it lands.
            elif body is None and not (
                    self._transport.take_lent(peer, part.data.cast("B")) if recv.mode == COPY
                    else self._take_summed(peer, part, left, nbytes)):
                return self._hand_over(work, source, key, epoch, ready, told, done, posted,
                                       posted < queued, late)
            credit = header.credit
            flags = header.flags
            if self._agrees:
                self._peer_lends[peer] = _peer_lends(flags)
            ledger.settle(peer, credit, flags, nbytes)
            if credit:
                self._unpark(peer)
            if flags & FLAG_READY:
                ready.add(peer)
            if recv.mode == COPY:
                if nbytes and body is not None:  # (else lent: copied in place above)
                    copy_bytes(part.data.cast("B"), body)
            elif nbytes and body is not None:  # (else lent: summed in as it landed)
                self._sum_in(part, body, left, hi - lo)
            if recv.final and finalize is not None and hi > lo:
                finalize(part)
            if body is not None:
                port.take(header)
            queued += then
            while posted < queued and post(work, source, sends[posted], key, epoch, ready,
                                           told):
                posted += 1
            if pending != TAKEN and not self._transport.wait_pushed(peer, pending):
                return self._hand_over(work, source, key, epoch, ready, told, done + 1,
                                       posted, posted < queued, late)
        if posted < queued:
            gone = self._post_until(queued, work, source, key, epoch, ready, told, posted)
            if gone < 0:
                return self._hand_over(work, source, key, epoch, ready, told,
                                       len(self._steps), -1 - gone, True, late)
        if late:
            self._finish_local(work, source)
        for token in lent:  # each peer says it has copied what we lent it
            if not self._express.acked(token, self._spin):
                return self._hand_over(work, source, key, epoch, ready, told,
                                       len(self._steps), posted, False)
        self._express.repeats += 1
        # The loop never turned meanwhile, so no READY of this op was kept as an early one.
        self._done.add(key)  # OpTable.ran, inline
        return True

    def _run_single(self, work: np.ndarray, key: OpKey) -> OpFuture | bool:
        """:meth:`_run` for a template of one exchange (:meth:`_one_exchange`): a 2-rank
        allreduce up to SMALL_BYTES, a barrier.  The same messages, with _run's loops,
        sets and per-send choices left out: in three sittings of `bench latency`, an
        8-byte allreduce took 7.8-8.1 us this way against 8.8-10.5 through _run, a
        barrier 7.1-7.5 against 7.9-8.6.  Anything else than the peer's awaited message
        hands the op over as _run does (a READY ahead of it too, which _run takes
        itself: the peer's call then went the general way, where time is not this
        short)."""
        loop = self._loop
        floating = self._floating
        ledger = self._ledger
        serving = self._serving
        if (loop.commands or loop.completions or loop.queued or floating.bodies
                or floating.bytes or ledger.early.entries or serving.early_headers.entries
                or not self._small.quiet(key)):
            return self._run(work, None, key)
        single = self._single
        assert single is not None
        port, peer, step, piece, nbytes, flags, port_in, step_in, piece_in, nbytes_in, \
            finalizes = single
        credit = ledger.terms(peer, nbytes)
        if credit < 0:
            return False
        epoch = serving.epoch
        key0, key1 = key
        sig, code, count = self._sig, self._code, self._count
        packed = pack_fields(MAGIC, KIND_DATA, code, flags, self._recipe, step, key0, key1,
                             sig, piece, epoch & 0xFFFFFFFF, nbytes, count, credit)
        if not port.post_now(packed, work.data.cast("B") if nbytes else None):
            ledger.grant(peer, nbytes if nbytes > HEADER_SIZE else HEADER_SIZE)
            ledger.restore_owed(peer, credit)
            return False
        record = port_in.peek() or self._express.wait_on(port_in.peek)
        if record is None or record[1] is None \
                or record[0][3:10] != (step_in, key0, key1, sig, piece_in, nbytes_in, count) \
                or record[0][1] != code:
            told = {peer} if flags & FLAG_READY else set()
            return self._hand_over(work, None, key, epoch, set(), told, 0, 1, False)
        header, body = record
        assert body is not None
        credit = header.credit
        ledger.settle(peer, credit, header.flags, nbytes_in)
        if credit:
            self._unpark(peer)
        if nbytes_in:
            ufunc = self._ufunc
            assert ufunc is not None
            if self._reduce_into:
                reduce_into(ufunc, work, body, work)
            else:
                quiet = self._quiet
                if quiet is None:
                    ufunc(work, _frombuffer(body, self._dtype, count), out=work)
                else:
                    token = quiet[0].set(quiet[1])
                    try:
                        ufunc(work, _frombuffer(body, self._dtype, count), out=work)
                    finally:
                        quiet[0].reset(token)
            if finalizes:
                assert self._finalize is not None
                self._finalize(work)
        port_in.take(header)
        self._express.repeats += 1
        self._done.add(key)
        return True

    def _run_one(self, work: np.ndarray, key: OpKey, source: np.ndarray | None
                 ) -> OpFuture | bool:
        """:meth:`_run_single` for the other templates of one exchange
        (:meth:`_any_exchange`), whose regions, source and copies that one leaves out (an
        8-byte allreduce took 0.4 us longer through this): the two phases of an 8-byte
        allgather of rows took 32 us this way against 41 through _run, a 1 KB
        reducescatter 10.0 against 12.2.  A READY of the op ahead of the peer's message is
        taken as _run takes one (a broadcast's root gets one before the acknowledgement);
        anything else hands the op over as _run does."""
        loop = self._loop
        floating = self._floating
        ledger = self._ledger
        serving = self._serving
        if (loop.commands or loop.completions or loop.queued or floating.bodies
                or floating.bytes or ledger.early.entries or serving.early_headers.entries
                or not self._small.quiet(key)):
            return self._run(work, source, key)
        one = self._one
        assert one is not None
        port, peer, lo, hi, whole, from_source, step, piece, nbytes, flags, port_in, \
            step_in, piece_in, lo_in, hi_in, whole_in, nbytes_in, reduces, left_source, \
            finalizes, local = one
        credit = ledger.terms(peer, nbytes)
        if credit < 0:
            return False
        epoch = serving.epoch
        key0, key1 = key
        sig, code, count = self._sig, self._code, self._count
        if not nbytes:
            body = None
        elif from_source:
            assert source is not None
            at = self._source_at
            body = source[lo - at:hi - at].data.cast("B")
        else:
            body = (work if whole else work[lo:hi]).data.cast("B")
        packed = pack_fields(MAGIC, KIND_DATA, code, flags, self._recipe, step, key0, key1,
                             sig, piece, epoch & 0xFFFFFFFF, nbytes, count, credit)
        if not port.post_now(packed, body):
            ledger.grant(peer, nbytes if nbytes > HEADER_SIZE else HEADER_SIZE)
            ledger.restore_owed(peer, credit)
            return False
        if local:
            self._finish_local(work, source)
        record = port_in.peek() or self._express.wait_on(port_in.peek)
        ready: set[int] = set()
        if record is not None and record[1] is None:
            header = record[0]
            if header.kind == _KIND_READY and header.name_key == key0 and header.seq == key1:
                if header.credit:
                    ledger.grant(peer, header.credit)
                    self._unpark(peer)
                ready.add(peer)
                port_in.take(header)
                record = port_in.peek() or self._express.wait_on(port_in.peek)
        if record is None or record[1] is None \
                or record[0][3:10] != (step_in, key0, key1, sig, piece_in, nbytes_in, count) \
                or record[0][1] != code:
            told = {peer} if flags & FLAG_READY else set()
            return self._hand_over(work, source, key, epoch, ready, told, 0, 1, False)
        header, got = record
        assert got is not None
        credit = header.credit
        ledger.settle(peer, credit, header.flags, nbytes_in)
        if credit:
            self._unpark(peer)
        if nbytes_in:
            part = work if whole_in else work[lo_in:hi_in]
            if reduces:
                left = part
                if left_source:
                    assert source is not None
                    at = self._source_at
                    left = source[lo_in - at:hi_in - at]
                self._sum_in(part, got, left, hi_in - lo_in)
            else:
                copy_bytes(part.data.cast("B"), got)
            if finalizes:
                assert self._finalize is not None
                self._finalize(part)
        port_in.take(header)
        self._express.repeats += 1
        self._done.add(key)
        return True

    def _sum_in(self, part: np.ndarray, body: memoryview, left: np.ndarray, count: int
                ) -> None:
        """``part`` = ``left`` op the ``count`` values in ``body``: reduce_into, with its
        checks made once for the template (_run_single keeps its own copy inline: a call
        more cost the 8-byte allreduce's path about 0.1 us)."""
        ufunc = self._ufunc
        assert ufunc is not None
        if self._reduce_into:
            reduce_into(ufunc, part, body, left)
            return
        quiet = self._quiet
        if quiet is None:
            ufunc(left, _frombuffer(body, self._dtype, count), out=part)
            return
        token = quiet[0].set(quiet[1])
        try:
            ufunc(left, _frombuffer(body, self._dtype, count), out=part)
        finally:
            quiet[0].reset(token)

    def _take_summed(self, peer: int, part: np.ndarray, left: np.ndarray, nbytes: int
                     ) -> bool:
        """Take the peer's lent piece of ``nbytes`` for ``part`` (Transport.take_lent_each),
        summing each slice into ``part`` as it lands (``left``: the left operand, ``part``
        or a fresh buffer's region of the source); False, nothing summed, where it cannot
        be taken here.  Only a reduction's Repeat, which keeps ``_scratch``, gets here
        (_run hands a lent piece over otherwise)."""
        scratch, ufunc = self._scratch, self._ufunc
        assert scratch is not None and ufunc is not None
        size = self._dtype.itemsize

        def each(view: memoryview, offset: int) -> None:
            lo = offset // size
            hi = lo + view.nbytes // size
            reduce_into(ufunc, part[lo:hi], view, left[lo:hi])

        spare = scratch.get(min(nbytes, _LENT_SLICE))
        try:
            return self._transport.take_lent_each(peer, spare, nbytes, each)
        finally:
            scratch.put(spare)

    def _finish_local(self, work: np.ndarray, source: np.ndarray | None) -> None:
        """payload.finish_local for the call's buffers."""
        assert source is not None or not self._fresh
        finish_regions(work, source if self._fresh else None, self._source_at,
                       self._finalize, self._chain.local_final)

    def _wait_posting(self, port: Port, work: np.ndarray, source: np.ndarray | None,
                      key: OpKey, epoch: int, ready: set[int], told: set[int], posted: int,
                      queued: int) -> tuple[tuple[Header, memoryview | None] | None, int]:
        """The next record from ``port`` within the spin (None if none came), trying the
        waiting sends ``_sends[posted:queued]`` again between looks: the peer may wait for
        them, and reads our ring, making room, while it does.  The spin starts again
        whenever one goes.  Returns the record and how many sends are posted now."""
        post = self._post
        sends = self._sends
        peek = port.peek
        deadline = _now() + _SPIN
        while not ctrl_c.pending:
            gone = posted
            while posted < queued and post(work, source, sends[posted], key, epoch, ready,
                                           told):
                posted += 1
            if posted > gone:
                deadline = _now() + _SPIN
            record = peek()
            if record is not None:
                return record, posted
            if _now() >= deadline:
                break
        return None, posted

    def _post_reading(self, work: np.ndarray, source: np.ndarray | None, key: OpKey,
                      epoch: int, ready: set[int], told: set[int], posted: int, queued: int,
                      lo: int, hi: int) -> int:
        """Post the waiting sends up to the last one that reads ``work[lo:hi]`` (a
        receive is about to write there), as :meth:`_post_until` returns."""
        end = posted
        for i in range(posted, queued):
            send = self._sends[i]
            if not send[8] and send[2] < hi and lo < send[3]:  # from work, overlapping
                end = i + 1
        return self._post_until(end, work, source, key, epoch, ready, told, posted)

    def _post_until(self, end: int, work: np.ndarray, source: np.ndarray | None,
                    key: OpKey, epoch: int, ready: set[int], told: set[int], posted: int
                    ) -> int:
        """Post the waiting sends ``_sends[posted:end]`` within the spin, which starts
        again whenever one goes (a peer copying a big op's pieces out makes room at its
        own pace): ``end``, or ``-1 - posted`` where one could not go."""
        post = self._post
        sends = self._sends
        deadline = _now() + _SPIN
        while posted < end:
            if post(work, source, sends[posted], key, epoch, ready, told):
                posted += 1
                deadline = _now() + _SPIN
            elif _now() >= deadline or ctrl_c.pending:
                return -1 - posted
        return posted

    def _post(self, work: np.ndarray, source: np.ndarray | None, send: _Send,
              key: OpKey, epoch: int, ready: set[int], told: set[int]) -> bool:
        """:func:`.smallpath.post_data` for this template's send."""
        port, peer, lo, hi, step, piece, nbytes, to_source, from_source, whole, lend, \
            pages_rule = send
        ledger = self._ledger
        flags = 0 if peer in ready else FLAG_CREDITED
        credit = ledger.terms(peer, nbytes if flags else -1)
        if credit < 0:
            return False
        tell = to_source and peer not in told
        if tell:
            flags |= FLAG_READY
        if from_source:  # OpSpec.source_part
            assert source is not None
            at = self._source_at
            body = None if not nbytes else source[lo - at:hi - at].data.cast("B")
        else:
            body = None if not nbytes else (work if whole else work[lo:hi]).data.cast("B")
        lends = False
        if lend is not None and body is not None and pages_rule == _SLOW:
            if not self._agree_slow:
                lends = self._transport.lends(peer)
            else:
                flags |= FLAG_AGREES
                if self._lend_slow and self._transport.lends(peer):
                    flags |= FLAG_WOULD_LEND
                    lends = self._peer_lends.get(peer, _WONT) != _WONT
        elif lend is not None and body is not None and \
                self._transport.lends_body(peer, self._op_bytes, nbytes):
            if pages_rule != _EXCHANGE:
                lends = not pages_rule or pages_rule == _PUSH or self._huge(body)
            else:
                flags |= FLAG_AGREES
                peer_lends = self._peer_lends.get(peer, _WONT)
                if not self._transport.ring_beats_lending(peer) or self._huge(body):
                    flags |= FLAG_WOULD_LEND
                    lends = peer_lends != _WONT
                else:
                    lends = peer_lends == _BY_SIZE
        # pack_header, its fields in wire order without the call between.
        header = pack_fields(MAGIC, KIND_DATA, self._code, flags, self._recipe, step, key[0],
                       key[1], self._sig, piece, epoch & 0xFFFFFFFF, nbytes, self._count,
                       credit)
        token = None
        if lends:
            assert lend is not None and body is not None
            token = LentSend(lend)
            gone = self._transport.lend_now(peer, header, body, token,
                                            spread=pages_rule == _PUSH)
        else:
            gone = port.post_now(header, body)
        if not gone:
            if flags & FLAG_CREDITED:
                ledger.grant(peer, nbytes if nbytes > HEADER_SIZE else HEADER_SIZE)
            ledger.restore_owed(peer, credit)
            return False
        if tell:
            told.add(peer)
        if token is not None:
            self._lent.append(token)
            self._express.repeats_lent += 1
        return True

    def _huge(self, body: memoryview) -> bool:
        """Whether huge pages back at least ONE_WAY_HUGE of ``body``'s bytes (the bar of
        one-way sends and of exchanges alike)."""
        region = (address_of(body), body.nbytes)
        huge = self._huge_regions.get(region)
        if huge is None:
            share = pages.huge_share(*region)
            huge = share is not None and share >= ONE_WAY_HUGE
            if len(self._huge_regions) >= _HUGE_REGIONS:
                self._huge_regions.clear()
            self._huge_regions[region] = huge
        return huge

    def _hand_over(self, work: np.ndarray, source: np.ndarray | None, key: OpKey,
                   epoch: int, ready: set[int], told: set[int], done: int, posted: int,
                   stuck: bool, local: bool = False) -> OpFuture | bool:
        """``local``: as Express.hand_over's."""
        self._express.repeats_handed_over += 1
        spec = self.spec(work, key, source)
        spec.epoch = epoch
        return self._express.hand_over(spec, self._chain, ready, told, done, posted, stuck,
                                       list(self._lent), local)
