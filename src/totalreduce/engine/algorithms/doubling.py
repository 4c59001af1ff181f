"""Recursive doubling: the small-message allreduce and allgather.

Every rank exchanges its whole (partial) buffer with partner ``rank ^ 2^k`` at step ``k``
and reduces what it gets: ``log2 n`` message latencies instead of the ring's ``2 (n - 1)``,
at the price of sending the whole buffer ``log2 n`` times — right for small buffers, wrong
for big ones (the cut-over is ``TOTALREDUCE_SMALL_BYTES``, measured in docs/dev/perf-log.md).

With ``n`` not a power of two, the first ``2 * extra`` ranks pair up: each odd one folds
its buffer into its even neighbour (step 0), sits out the exchange, and gets the finished
result back at the end.  Both partners of an exchange add the same two partial sums, so
every rank ends with bit-identical results (addition is commutative in IEEE arithmetic).

A rank sends and then reduces into the same buffer at each step, so every reducing receive
names the send it must wait for (``Recv.after``): the engine holds an early-arriving body
until that send has left.

The allgather folds and exchanges the same way, one message a step: each carries every
block its sender holds, ``log2 n`` (+ 2 where ``n`` is not a power of two) latencies where
the ring takes ``n - 1``, for the small ones (every allgather's size exchange) whose
cost is those latencies.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from ..schedule import COPY, REDUCE, Recv, Schedule, Send, piece_count, pieces


class Fold(NamedTuple):
    """A world of ``size`` ranks run as ``p``, the power of two at most ``size``: the
    first ``2 * extra`` ranks pair up, each odd one folding into its even neighbour, and
    the ``p`` that remain (virtual ranks) exchange for ``rounds`` steps."""

    p: int
    extra: int
    rounds: int  # log2 p

    @classmethod
    def of(cls, size: int) -> Fold:
        p = 1 << (size.bit_length() - 1)
        return cls(p, size - p, p.bit_length() - 1)

    def folds_away(self, rank: int) -> bool:
        """An odd rank of a pair: it hands its part to ``rank - 1`` and waits."""
        return rank < 2 * self.extra and rank % 2 == 1

    def absorbs(self, rank: int) -> bool:
        """An even rank of a pair: it takes ``rank + 1``'s part first, returns it last."""
        return rank < 2 * self.extra and rank % 2 == 0

    def virtual(self, rank: int) -> int:
        return rank // 2 if rank < 2 * self.extra else rank - self.extra

    def real(self, v: int) -> int:
        """Virtual rank ``v``'s rank (the even one of a pair)."""
        return 2 * v if v < self.extra else v + self.extra


@lru_cache(maxsize=256)
def doubling_allreduce(rank: int, size: int, count: int, seg_elems: int) -> Schedule:
    """Pieces of ``seg_elems`` travel independently, so the exchange pipelines like the
    ring: piece ``j`` of step ``k + 1`` leaves as soon as piece ``j`` of step ``k`` is in."""
    if size == 1:
        return Schedule((), {}, ((0, count),))
    fold = Fold.of(size)
    rounds, real, absorbs = fold.rounds, fold.real, fold.absorbs(rank)
    last = rounds + 1  # the step that returns results to the folded ranks
    cut = pieces(0, count, piece_count(count, seg_elems))

    if fold.folds_away(rank):
        first = tuple(Send(rank - 1, 0, j, lo, hi) for j, (lo, hi) in enumerate(cut))
        back = {(rank - 1, last, j): Recv(lo, hi, COPY, False, ())
                for j, (lo, hi) in enumerate(cut)}
        return Schedule(first, back, ())
    virtual = fold.virtual(rank)

    def exchange(k: int, j: int) -> Send:  # k = 1 .. rounds
        lo, hi = cut[j]
        return Send(real(virtual ^ (1 << (k - 1))), k, j, lo, hi)

    recvs: dict[tuple[int, int, int], Recv] = {}
    for j, (lo, hi) in enumerate(cut):
        for k in range(1, rounds + 1):
            if k < rounds:
                then: tuple[Send, ...] = (exchange(k + 1, j),)
            else:
                then = (Send(rank + 1, last, j, lo, hi),) if absorbs else ()
            peer = exchange(k, j).peer
            recvs[(peer, k, j)] = Recv(lo, hi, REDUCE, k == rounds, then,
                                       after=((peer, k, j),))
        if absorbs:
            recvs[(rank + 1, 0, j)] = Recv(lo, hi, REDUCE, False, (exchange(1, j),))
    if absorbs:
        return Schedule((), recvs, ())
    return Schedule(tuple(exchange(1, j) for j in range(len(cut))), recvs, ())


@lru_cache(maxsize=256)
def doubling_allgather(rank: int, size: int, bounds: tuple[int, ...]) -> Schedule:
    """Block ``r`` (``bounds[r]:bounds[r + 1]``, each rank's own already in place)
    everywhere, one whole message a step: at step ``k`` a rank sends its partner every
    block it holds, those of an aligned group of ``2^(k-1)`` virtual ranks.  A folded
    (odd) rank sends its block to its even neighbour at step 0 and gets everything else
    back, in two pieces around its own, after the last exchange.

    A step's message carries what the steps before it brought, which came through other
    peers, in any order.  So each exchange's receive names our send of that step
    (``Recv.after``): what it unlocks goes only once that send has left, which the
    previous step's receive unlocked.  The regions differ (a receive never writes what
    that send reads), so the body itself may land at once."""
    if size == 1:
        return Schedule((), {}, ())
    fold = Fold.of(size)
    rounds, real, absorbs = fold.rounds, fold.real, fold.absorbs(rank)
    last = rounds + 1  # the step that returns the rest to the folded ranks

    if fold.folds_away(rank):
        first = (Send(rank - 1, 0, 0, bounds[rank], bounds[rank + 1]),)
        back = {(rank - 1, last, 0): Recv(bounds[0], bounds[rank], COPY, False, ()),
                (rank - 1, last, 1): Recv(bounds[rank + 1], bounds[size], COPY, False, ())}
        return Schedule(first, back, ())
    virtual = fold.virtual(rank)

    def exchange(k: int) -> Send:  # k = 1 .. rounds: our group of 2^(k-1) virtual ranks
        h = 1 << (k - 1)
        g = virtual // h * h
        return Send(real(virtual ^ h), k, 0, bounds[real(g)], bounds[real(g + h)])

    recvs: dict[tuple[int, int, int], Recv] = {}
    for k in range(1, rounds + 1):
        h = 1 << (k - 1)
        theirs = virtual // h * h ^ h
        if k < rounds:
            then: tuple[Send, ...] = (exchange(k + 1),)
        elif absorbs:
            then = (Send(rank + 1, last, 0, bounds[0], bounds[rank + 1]),
                    Send(rank + 1, last, 1, bounds[rank + 2], bounds[size]))
        else:
            then = ()
        peer = real(virtual ^ h)
        recvs[(peer, k, 0)] = Recv(bounds[real(theirs)], bounds[real(theirs + h)], COPY,
                                   False, then, after=((peer, k, 0),))
    if absorbs:
        recvs[(rank + 1, 0, 0)] = Recv(bounds[rank + 1], bounds[rank + 2], COPY, False,
                                       (exchange(1),))
        return Schedule((), recvs, ())
    return Schedule((exchange(1),), recvs, ())
