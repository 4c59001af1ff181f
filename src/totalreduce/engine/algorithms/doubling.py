"""Recursive doubling: the small-message allreduce.

Every rank exchanges its whole (partial) buffer with partner ``rank ^ 2^k`` at step ``k``
and reduces what it gets: ``log2 n`` message latencies instead of the ring's ``2 (n - 1)``,
at the price of sending the whole buffer ``log2 n`` times — right for small buffers, wrong
for big ones (the cut-over is ``TOTALREDUCE_SMALL_BYTES``, measured in docs/BENCHMARKS.md).

With ``n`` not a power of two, the first ``2 * extra`` ranks pair up: each odd one folds
its buffer into its even neighbour (step 0), sits out the exchange, and gets the finished
result back at the end.  Both partners of an exchange add the same two partial sums, so
every rank ends with bit-identical results (addition is commutative in IEEE arithmetic).

A rank sends and then reduces into the same buffer at each step, so every reducing receive
names the send it must wait for (``Recv.after``): the engine holds an early-arriving body
until that send has left.
"""

from __future__ import annotations

from functools import lru_cache

from ..schedule import COPY, REDUCE, Recv, Schedule, Send


@lru_cache(maxsize=256)
def doubling_allreduce(rank: int, size: int, count: int) -> Schedule:
    if size == 1:
        return Schedule((), {}, ((0, count),))
    p = 1 << (size.bit_length() - 1)
    extra = size - p
    rounds = p.bit_length() - 1
    last = rounds + 1  # the step that returns results to the folded ranks

    if rank < 2 * extra and rank % 2 == 1:  # folds into rank - 1 and waits
        fold = Send(rank - 1, 0, 0, 0, count)
        recvs = {(rank - 1, last, 0): Recv(0, count, COPY, False, ())}
        return Schedule((fold,), recvs, ())

    virtual = rank // 2 if rank < 2 * extra else rank - extra

    def real(v: int) -> int:
        return 2 * v if v < extra else v + extra

    def exchange(k: int) -> Send:  # k = 1 .. rounds
        return Send(real(virtual ^ (1 << (k - 1))), k, 0, 0, count)

    recvs: dict[tuple[int, int, int], Recv] = {}
    for k in range(1, rounds + 1):
        if k < rounds:
            then: tuple[Send, ...] = (exchange(k + 1),)
        else:
            then = (Send(rank + 1, last, 0, 0, count),) if rank < 2 * extra else ()
        sent = exchange(k)
        recvs[(sent.peer, k, 0)] = Recv(0, count, REDUCE, k == rounds, then,
                                        after=((sent.peer, k, 0),))
    if rank < 2 * extra:  # even: absorb the odd neighbour first
        recvs[(rank + 1, 0, 0)] = Recv(0, count, REDUCE, False, (exchange(1),))
        return Schedule((), recvs, ())
    return Schedule((exchange(1),), recvs, ())
