"""Pipelined chain broadcast: root -> root+1 -> ... -> root-1, piece by piece.

Each rank forwards piece ``j`` as soon as it has it, so a large broadcast costs about one
buffer transfer plus ``n - 2`` pieces, whatever the world size.  Small broadcasts on many
ranks would prefer a tree; the world sizes we run today do not (see issue #3).
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
    forward = pos < size - 1
    if pos == 0:
        return Schedule(tuple(Send(nxt, 0, j, lo, hi) for j, (lo, hi) in enumerate(cut)), {},
                        ())
    recvs = {
        (prev, pos - 1, j): Recv(lo, hi, COPY, False,
                                 (Send(nxt, pos, j, lo, hi),) if forward else ())
        for j, (lo, hi) in enumerate(cut)
    }
    return Schedule((), recvs, ())
