"""Direct pairwise exchange for alltoall(v): every rank sends each peer its block.

With the small world sizes of one host this is both the simplest and the fastest: all
``n - 1`` sends start at once and each byte crosses the network once.  Blocks are cut into
pieces so a big alltoall still yields to urgent ops between pieces.
"""

from __future__ import annotations

from functools import lru_cache

from ..schedule import COPY, Recv, Schedule, Send, piece_count, pieces


@lru_cache(maxsize=256)
def pairwise_alltoallv(rank: int, size: int, send_bounds: tuple[int, ...],
                       recv_bounds: tuple[int, ...], seg_elems: int,
                       own: bool = False) -> Schedule:
    """``send_bounds[p]:send_bounds[p+1]`` of the source goes to rank ``p``; what rank
    ``p`` sends lands at ``recv_bounds[p]:recv_bounds[p+1]`` of the working buffer.  The
    caller copies the rank's own block locally, unless ``own``: then the op copies it from
    its source (Schedule.local_final, OpSpec.fresh) once its first messages are out (a
    small one once its receives are in: payload.copied_last), while the peers copy
    theirs; the block must lie at the same place in both."""
    first: list[Send] = []
    recvs: dict[tuple[int, int, int], Recv] = {}
    for offset in range(1, size):
        # Staggered order: rank r talks to r+1 first, so no peer is everyone's first.
        peer = (rank + offset) % size
        lo, hi = send_bounds[peer], send_bounds[peer + 1]
        for j, (a, b) in enumerate(pieces(lo, hi, piece_count(hi - lo, seg_elems))):
            first.append(Send(peer, 0, j, a, b, from_source=True))
        src = (rank - offset) % size
        lo, hi = recv_bounds[src], recv_bounds[src + 1]
        for j, (a, b) in enumerate(pieces(lo, hi, piece_count(hi - lo, seg_elems))):
            recvs[(src, 0, j)] = Recv(a, b, COPY, False, ())
    local: tuple[tuple[int, int], ...] = ()
    if own:
        lo, hi = send_bounds[rank], send_bounds[rank + 1]
        if (lo, hi) != (recv_bounds[rank], recv_bounds[rank + 1]):
            raise ValueError("own block at different places in the source and the buffer")
        local = ((lo, hi),)
    return Schedule(tuple(first), recvs, local)
