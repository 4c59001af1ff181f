"""Recursive halving then doubling (Rabenseifner): the mid-size allreduce at 4+ ranks.

A reduce-scatter by recursive halving, then an allgather by recursive doubling.  At step
``k`` of the first half a rank sends its partner ``rank ^ p / 2^k`` the half of its
current range that the partner keeps and reduces the half it keeps, so after ``log2 p``
steps it holds one finished block; the allgather passes finished blocks back the other
way, doubling what each rank holds per step.  Every rank sends ``2 (p - 1) / p`` of the
buffer, as in the ring, in ``2 log2 p`` message latencies instead of the ring's
``2 (p - 1)``; recursive doubling takes ``log2 p`` latencies but sends and reduces the
whole buffer at every step.  So this fills the range between the two at more than two
ranks (at 2 ranks it is the ring).

Ranges halve by the high bits of a rank's (virtual) number first, so a rank's range is a
contiguous run of blocks at every step and each step's share goes out in few messages.
The buffer is cut into ``p`` blocks of ``m`` units each (``m`` a power of two, a unit at
most a segment), and messages are aligned runs of a power-of-two number of units, so each
message of a step lies inside one message of the step before: the receive of that one
unlocks it.  A reducing receive waits (``Recv.wait``) for the receive of the previous
step that covered its region, so what it unlocks carries every earlier contribution.  In
the allgather every block travels as its own messages, since a send there mixes blocks
finished at different steps.

With ``n`` not a power of two the first ``2 * extra`` ranks fold in pairs, as for
recursive doubling (doubling.py).  Every finished block is reduced by one rank and copied
everywhere else, so all ranks end bit-identical.
"""

from __future__ import annotations

from collections import defaultdict
from functools import lru_cache

from ..schedule import COPY, REDUCE, Recv, Schedule, Send, even_bounds, piece_count, pieces


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


@lru_cache(maxsize=256)
def halving_allreduce(rank: int, size: int, count: int, seg_elems: int) -> Schedule:
    if size == 1:
        return Schedule((), {}, ((0, count),))
    p = 1 << (size.bit_length() - 1)
    extra = size - p
    rounds = p.bit_length() - 1
    last = 2 * rounds + 1  # the step that returns results to the folded ranks
    blocks = even_bounds(count, p)
    m = _pow2_at_least(piece_count(max(blocks[b + 1] - blocks[b] for b in range(p)),
                                   seg_elems))
    # Unit u = b * m + q is piece q of block b: ub[u]:ub[u + 1] in the buffer.
    ub = [0]
    for b in range(p):
        for lo, hi in pieces(blocks[b], blocks[b + 1], m):
            assert lo == ub[-1]
            ub.append(hi)
    unit = max(1, max(ub[u + 1] - ub[u] for u in range(p * m)))
    # Units per message at most: a power of two, so that messages nest across steps.
    group = 1 << max(0, (max(1, seg_elems // unit)).bit_length() - 1)
    per_block = min(group, m)  # units per allgather message (never spans blocks)

    def chunks(u0: int, u1: int, g: int) -> list[tuple[int, int]]:
        return [(u, min(u1, u + g)) for u in range(u0, u1, g)]

    if rank < 2 * extra and rank % 2 == 1:  # folds into rank - 1 and waits
        first = tuple(Send(rank - 1, 0, u0, ub[u0], ub[u1])
                      for u0, u1 in chunks(0, p * m, group))
        back = {(rank - 1, last, u0): Recv(ub[u0], ub[u1], COPY, False, ())
                for u0, u1 in chunks(0, p * m, per_block)}
        return Schedule(first, back, ())

    v = rank // 2 if rank < 2 * extra else rank - extra
    folded = rank < 2 * extra  # absorbs rank + 1's buffer first, returns the result last

    def real(w: int) -> int:
        return 2 * w if w < extra else w + extra

    def halves(k: int) -> tuple[int, tuple[int, int], tuple[int, int], int]:
        """Reduce-scatter step ``k``: the partner, the unit ranges kept and given, and the
        units per message."""
        h = p >> k
        base = (v // (2 * h)) * 2 * h
        lower = (base * m, (base + h) * m)
        upper = ((base + h) * m, (base + 2 * h) * m)
        keep, give = (upper, lower) if v & h else (lower, upper)
        return real(v ^ h), keep, give, min(group, h * m)

    recvs: dict[tuple[int, int, int], Recv] = {}
    # The sends each receive unlocks, by the receive's key.
    unlocks: defaultdict[tuple[int, int, int], list[Send]] = defaultdict(list)
    opening: list[Send] = []
    # The previous step's receives, as (peer, step, units per message).
    prev: tuple[int, int, int] | None = (rank + 1, 0, group) if folded else None

    def owner(key_step: tuple[int, int, int], u0: int) -> tuple[int, int, int]:
        """The receive of ``key_step``'s step whose message holds the unit run at ``u0``."""
        peer, step, g = key_step
        return (peer, step, (u0 // g) * g)

    for k in range(1, rounds + 1):
        peer, keep, give, g = halves(k)
        for u0, u1 in chunks(*give, g):
            send = Send(peer, k, u0, ub[u0], ub[u1])
            if prev is None:
                opening.append(send)
            else:
                unlocks[owner(prev, u0)].append(send)
        prev = (peer, k, g)
    assert prev is not None

    def available(u0: int) -> tuple[int, int, int]:
        """The receive after which the allgather unit run at ``u0`` is here and final."""
        b = u0 // m
        if b == v:
            return owner(prev, u0)
        t = (b ^ v).bit_length()  # the allgather step that brings block b
        return (real(v ^ (1 << (t - 1))), rounds + t, u0)

    for t in range(1, rounds + 1):
        h = 1 << (t - 1)
        mine = (v // h) * h
        peer = real(v ^ h)
        for u0, u1 in chunks(mine * m, (mine + h) * m, per_block):
            unlocks[available(u0)].append(Send(peer, rounds + t, u0, ub[u0], ub[u1]))
    if folded:
        for u0, u1 in chunks(0, p * m, per_block):
            unlocks[available(u0)].append(Send(rank + 1, last, u0, ub[u0], ub[u1]))

    # The receives, now that every one's unlocked sends are known.
    before: tuple[int, int, int] | None = (rank + 1, 0, group) if folded else None
    if folded:
        for u0, u1 in chunks(0, p * m, group):
            key = (rank + 1, 0, u0)
            recvs[key] = Recv(ub[u0], ub[u1], REDUCE, False, tuple(unlocks[key]))
    for k in range(1, rounds + 1):
        peer, keep, _give, g = halves(k)
        for u0, u1 in chunks(*keep, g):
            key = (peer, k, u0)
            wait = (owner(before, u0),) if before is not None else ()
            recvs[key] = Recv(ub[u0], ub[u1], REDUCE, k == rounds, tuple(unlocks[key]),
                              wait=wait)
        before = (peer, k, g)
    for t in range(1, rounds + 1):
        h = 1 << (t - 1)
        theirs = ((v // h) * h) ^ h
        peer = real(v ^ h)
        for u0, u1 in chunks(theirs * m, (theirs + h) * m, per_block):
            key = (peer, rounds + t, u0)
            recvs[key] = Recv(ub[u0], ub[u1], COPY, False, tuple(unlocks[key]))
    return Schedule(tuple(opening), recvs, ())
