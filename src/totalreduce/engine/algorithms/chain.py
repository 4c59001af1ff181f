"""Pipelined chain broadcast: root -> root+1 -> ... -> root-1, piece by piece, then an
empty acknowledgement once around the chain.

Each rank forwards piece ``j`` as soon as it has it, so a large broadcast costs about one
buffer transfer plus ``n - 2`` pieces, whatever the world size.  Small broadcasts on many
ranks would prefer a tree; the world sizes we run today do not.

Why the acknowledgement: without it the root finishes having heard from nobody, so a rank
that disagrees about the op (another root, or an allreduce under the same name) would go
unnoticed there and the root would return while others raise.  The last rank sends an
empty message to the root once it holds piece 0, and the root passes it on to rank
``root + 1``, ..., ``root - 2``.  Every rank then finishes only after every other rank's
header (which carries the op's signature, root included) was checked somewhere along the
way, so a disagreement fails the op on every rank and none returns data.  It costs one
empty hop per rank: nothing for large broadcasts, about twice the latency of a tiny one.
"""

from __future__ import annotations

from functools import lru_cache

from ..schedule import COPY, Recv, Schedule, Send, piece_count, pieces


@lru_cache(maxsize=256)
def chain_broadcast(rank: int, size: int, root: int, count: int, seg_elems: int) -> Schedule:
    if size == 1:
        return Schedule((), {}, ())
    pos = (rank - root) % size
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    cut = pieces(0, count, piece_count(count, seg_elems))
    last = size - 1
    ack_step = size  # data steps are 0 .. size - 2
    ack = Send(nxt, ack_step, 0, 0, 0)
    recvs: dict[tuple[int, int, int], Recv] = {}
    if pos == 0:
        first = tuple(Send(nxt, 0, j, lo, hi) for j, (lo, hi) in enumerate(cut))
        recvs[(prev, ack_step, 0)] = Recv(0, 0, COPY, False, (ack,) if size > 2 else ())
        return Schedule(first, recvs, ())
    for j, (lo, hi) in enumerate(cut):
        then: tuple[Send, ...] = ()
        if pos < last:
            then = (Send(nxt, pos, j, lo, hi),)
        elif j == 0:
            then = (ack,)
        recvs[(prev, pos - 1, j)] = Recv(lo, hi, COPY, False, then)
    if pos < last:
        recvs[(prev, ack_step, 0)] = Recv(0, 0, COPY, False, (ack,) if pos < last - 1 else ())
    return Schedule((), recvs, ())
