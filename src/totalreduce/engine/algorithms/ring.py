"""Ring algorithms: scatter-reduce, allgather, and allreduce as the two back to back.

Rank ``r`` sends only to ``r + 1`` and receives only from ``r - 1``.  Each block is cut
into the same number of pieces; piece ``j`` of step ``s + 1`` is unlocked by receiving
piece ``j`` of step ``s``, which is what pipelines the ring.  Bandwidth-optimal: every rank
sends ``2 (n - 1) / n`` of the buffer for an allreduce.
"""

from __future__ import annotations

from functools import lru_cache

from ..schedule import COPY, REDUCE, Recv, Schedule, Send, even_bounds, piece_count, pieces


def _ring(rank: int, size: int, bounds: tuple[int, ...], seg_elems: int,
          reduce_steps: int, gather_steps: int, shift: int, fresh: bool = False) -> Schedule:
    """Scatter-reduce for ``reduce_steps`` steps, then allgather for ``gather_steps``.

    ``fresh``: the first sends read the op's source (OpSpec.fresh: the working buffer
    starts undefined); every block a rank reduces into it reduces once, so each reduction
    can take its left operand from the source too.

    At reduce step ``s`` rank ``r`` sends block ``r - s + shift`` and reduces block
    ``r - s - 1 + shift`` into its buffer; after ``n - 1`` steps it owns the reduced block
    ``r + 1 + shift``.  The allgather steps then pass finished blocks around.
    """
    n = size
    right, left = (rank + 1) % n, (rank - 1) % n
    m = piece_count(max(bounds[i + 1] - bounds[i] for i in range(n)), seg_elems)
    cut = [pieces(bounds[b], bounds[b + 1], m) for b in range(n)]
    steps = reduce_steps + gather_steps

    def send_block(s: int) -> int:
        if s < reduce_steps:
            return (rank - s + shift) % n
        return (rank + 1 + shift - (s - reduce_steps)) % n

    def recv_block(s: int) -> int:
        if s < reduce_steps:
            return (rank - s - 1 + shift) % n
        return (rank + shift - (s - reduce_steps)) % n

    def send(s: int, j: int) -> Send:
        lo, hi = cut[send_block(s)][j]
        return Send(right, s, j, lo, hi)

    recvs: dict[tuple[int, int, int], Recv] = {}
    for s in range(steps):
        for j in range(m):
            lo, hi = cut[recv_block(s)][j]
            then = (send(s + 1, j),) if s + 1 < steps else ()
            recvs[(left, s, j)] = Recv(lo, hi, REDUCE if s < reduce_steps else COPY,
                                       s == reduce_steps - 1, then)
    first = tuple(send(0, j) for j in range(m)) if steps else ()
    if fresh:
        first = tuple(Send(x.peer, x.step, x.piece, x.lo, x.hi, True) for x in first)
    return Schedule(first, recvs, ())


@lru_cache(maxsize=256)
def ring_allreduce(rank: int, size: int, count: int, seg_elems: int,
                   fresh: bool = False) -> Schedule:
    if size == 1:
        return Schedule((), {}, ((0, count),))
    bounds = tuple(even_bounds(count, size))
    return _ring(rank, size, bounds, seg_elems, size - 1, size - 1, 0, fresh)


@lru_cache(maxsize=256)
def ring_reducescatter(rank: int, size: int, bounds: tuple[int, ...],
                       seg_elems: int, fresh: bool = False) -> Schedule:
    """Leaves the reduced block ``rank`` (``bounds[rank]:bounds[rank + 1]``) on each rank."""
    if size == 1:
        return Schedule((), {}, ((bounds[0], bounds[1]),))
    return _ring(rank, size, bounds, seg_elems, size - 1, 0, -1, fresh)


@lru_cache(maxsize=256)
def ring_allgatherv(rank: int, size: int, bounds: tuple[int, ...], seg_elems: int,
                    own: bool = False) -> Schedule:
    """Block ``i`` of the buffer is rank ``i``'s contribution, already in place locally;
    or, with ``own``, in the op's source (OpSpec.source_at: the block's place), which the
    first sends read and the op copies into place itself (Schedule.local_final,
    OpSpec.fresh).  Then the block need not be copied before the first sends leave: a
    peer reading a lent one copies it while this rank copies the peer's."""
    local = ((bounds[rank], bounds[rank + 1]),) if own else ()
    if size == 1:
        return Schedule((), {}, local)
    # An allgather is the gather half of an allreduce whose owned block is our own.
    ring = _ring(rank, size, bounds, seg_elems, 0, size - 1, -1, own)
    return Schedule(ring.first, ring.recvs, local)
