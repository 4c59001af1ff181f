"""Which size of op runs where: on the caller's thread (the small path) or on the loop,
and whether its pieces are lent (transport/cma.py) or copied through the rings.  The
self-guided scheduler routes each op by these; the numbers are measurements, kept with
the rules they set."""

from __future__ import annotations

from ..config import RING_SMALL_ROOM


def direct_ring_bytes(direct: int, ring_room: int, size: int) -> int:
    """The largest blocking allreduce, allgather, alltoall or broadcast the caller's thread
    runs itself where DIRECT_BYTES is auto (``direct`` for the other ops).

    Past DIRECT_BYTES the general path wins for ops that only move data: it lends their
    bodies, one kernel copy instead of two through a ring (but for 2-rank gathers, whose
    lent pieces the caller's thread drives faster still: LENT_GATHER_BYTES). An
    allreduce reads each peer's data once to reduce it, out of the ring as cheaply as
    out of a lent copy, so the caller's thread keeps it while what it sends one peer, 2
    (size - 1) / size of it, fits in the ring beside the room kept for small records
    (past that it would wait on the reader for room). At 2 ranks on the shared-memory
    rings, 3-4 MiB allreduces took 0.21-0.38 ms this way against 0.46-0.84 ms on the
    general path; 6-8 MiB ones, past the ring, were no faster. An allgather sends one
    peer (size - 1) / size of it, which fits too: at 2 ranks 3 MiB allgathers took
    0.23-0.24 ms this way against 0.32-0.40 ms lent (4 MiB ones 0.31-0.33 against
    0.34-0.35). An alltoall sends each peer 1 / size of it: at 2 ranks 3 MiB alltoalls
    took 0.24 ms this way against 0.34-0.35 ms lent. The last two stay only while the
    rings copy fast (see LENT_WHEN_SLOW). A broadcast sends its next peer all of it, and
    gains on the caller's thread only in pieces of half a segment
    (algorithms/select.py): at 2 ranks 3 MiB ones took 0.39-0.49 ms this way against
    0.46-1.17 ms on the loop, 4 MiB ones 0.50-0.78 against 0.55-1.54 ms."""
    room = ring_room - RING_SMALL_ROOM
    if direct <= 0 or room <= 0 or size < 2:
        return direct
    return max(direct, room * size // (2 * (size - 1)))


def direct_broadcast_bytes(direct_ring: int, ring_room: int, size: int) -> int:
    """The largest blocking broadcast the caller's thread runs itself where DIRECT_BYTES
    is auto: while the whole buffer, which a chain sends its next peer, fits in the ring
    beside the room kept for small records, from 3 to 7 ranks (where broadcasts are
    chains; ``direct_ring`` elsewhere, the allreduce's bound, direct_ring_bytes).  On 2
    cores (one job per tree, alternated three times, 3 rounds each): at 4 ranks 3 MiB
    broadcasts took 0.82-1.05 ms this way against 1.46-1.88 on the loop, 4 MiB ones
    0.99-1.23 against 1.49-1.57; at 3 ranks 4 MiB ones 0.56-0.64 against 0.74-0.81."""
    room = ring_room - RING_SMALL_ROOM
    if direct_ring <= 0 or not 2 < size < 8:
        return direct_ring
    return max(direct_ring, room)


# At 2 ranks a blocking allgather or alltoall up to this size runs on the caller's thread
# past the ring's bound (direct_ring_bytes) where what it sends its peer would be lent:
# the express lane lends it as the loop does (from its second call, its Repeat: repeat.py),
# and then copies its own block while the peer reads, without the loop's turns between
# the steps (the op, its lend, the peer's read, the acknowledgement: 100-200 us at 16
# MB).  One job per way, alternated three times (the slowest rank's median): allgathers
# of 6 MB took 0.25-0.26 ms against 0.27-0.33 on the loop, 8 MB 0.33-0.35 against
# 0.36-0.42, 12 MB 0.66-0.68 against 0.73-0.82, 16 MB 1.11-1.21 against 1.17-1.45;
# alltoalls of 6 MB 0.32-0.39 against 0.37-0.47, 8 MB 0.45-0.52 against 0.48-0.64, 16 MB
# 1.22-1.39 against 1.32-1.60.  The lane alone was level with the loop from 24 MB; its
# Repeat took 24 MB alltoalls in 2.10-2.20 ms against 2.30-2.37 on the loop in three
# alternations of four (level in the fourth), allgathers in 1.90-1.99 against 2.00-2.25
# (three of four).  At 32-64 MB the loop's way (its reads in slices) was as fast or
# faster.
LENT_GATHER_BYTES = 24 << 20

# Blocking allreduces past the ring and up to this size run from their Repeat on the
# caller's thread at 2 ranks on shared-memory rings, where each rank has a core of its
# own (SelfGuided._big_allreduce).  While Repeats lent nothing the loop was as fast or
# faster past 24 MiB, where it lends: where an AMD VM's cores shared no cache, 28 MB
# allreduces took 4.2-4.5 ms from the Repeat against 3.3-4.3 on the loop and 32 MB
# 5.1-5.6 against 4.3-4.8; 64 and 128 MB were level where they shared one.  A Repeat
# now lends where the loop would and sums each slice of a lent piece as it lands: on an
# Intel VM whose rings copied slowly, 32 MB took 7.4-7.6 ms this way against 8.8-8.9 on
# the loop, 64 MB 15.4-15.8 against 18.0-18.3, 128 MB 33.3-33.9 against 37.8-38.0 (the
# old and the new bound alternated twice).
REPEAT_ALLREDUCE_BYTES = 256 << 20

# Async allreduces up to this size wait in the loop's queue for a thread that waits to
# run them from their Repeats (SelfGuided._queued), where that was measured.
QUEUED_ALLREDUCE_BYTES = 24 << 20

# A blocking broadcast or alltoall at least this big may leave the caller's thread while
# most of its peers' rings copy slowly (transport/copy_pace.py; Engine.lends), for the
# loop to lend its pieces, where that has been the faster way here (slow_rings.py): on
# one VM in that state 1 MiB broadcasts took 0.19-0.27 ms against 0.29-0.30 ms through
# the ring, 4 MiB ones 0.38-0.49 against 1.7-1.8 ms, 1 MiB alltoalls 0.20-0.21 against
# 0.30-0.32 ms; on another, whose kernel copied lent bodies at a third of the speed,
# 1 MiB broadcasts took 0.57-0.68 ms lent against 0.11-0.17 ms through the ring, and
# alltoalls 0.49-0.58 against 0.20-0.29 ms.  The other ops stay (but allgathers past
# DIRECT_BYTES, which only the ring's bound lets the caller's thread run): on the
# general path 1 MiB allgathers took 0.42-0.46 ms against 0.25-0.31 ms on the caller's
# thread, reducescatters 0.42 against 0.19-0.25 ms, and allreduces 0.78-2.7 ms against
# 0.47-1.8 ms at 1-4 MiB.
LENT_WHEN_SLOW = 512 << 10

# Reductions below this size do not lend their pieces where every rank has a core of its
# own and CMA_BYTES is auto (from CROWDED_REDUCE_LEND_BYTES, rings that copy slowly still
# lend those out of huge pages, copy_pace.py).  A
# lent piece is one kernel copy on the receiver's core, which then sums it in a second
# pass; through the ring the sender's core copies it in while the receiver's sums it
# straight out of the ring.  For a copied piece (a gather's) the kernel's one copy is the
# cheaper.  Alternated runs at 2 ranks (`--set CMA_BYTES=1048576` against `33554432`):
# allreduce 8 MB 1.01-1.15 -> 0.82-0.87 ms, 16 MB 2.34-2.58 -> 1.95-2.06, reducescatter
# 4 MB 0.34-0.43 -> 0.25-0.26, 8 MB 0.84-0.97 -> 0.58-0.64, 16 MB 1.90-2.09 -> 1.45-1.53,
# 64 and 256 MB level; allgathers of 8-16 MB lost 20-40% without lending, so gathers keep
# it.  Where a host's ranks outnumber its cores, see CROWDED_REDUCE_LEND_BYTES.
REDUCE_LEND_BYTES = 32 << 20

# ... and this size where the host's ranks outnumber its cores.  There the sender's copy
# into the ring takes a core a peer wanted, and from 8 MB lending wins: at 4 ranks on 2
# cores 8 MB allreduces took 4.1-4.2 ms lent against 4.8-5.2 through the ring; but at 3
# ranks 4 MB ones took 2.9-4.3 ms lent against 1.8-3.2, at 4 ranks as long either way
# (one job each, alternated two or three times; the slowest rank's time).
#
# Below it a reduction is not lent even while the rings copy slowly: a ring's copies of
# buffers that no cache holds run at memory's speed (9-20 GB/s here), below the kernel's
# copy of a warm lent body, so CopyPace takes the ring for slow where it is not (on the
# loop, where an async op's source is most often cold), and lent, the reader sums in a
# second pass.  Async allreduces submitted all at once, lending on and off alternated in
# blocks of three in one job (24 MB in all, medians, ms): where the VM's two cores shared a
# cache, 1 MB ones took 7.5 lent against 4.0 through the ring, 2 MB 7.5 against 3.9, 4 MB
# 4.7 against 3.2; where they did not (four jobs), 0.5 MB 9.7-10.5 against 5.9-6.1, 1 MB
# 8.1-9.0 against 5.5-6.1, 2 MB 7.6-8.1 against 5.2-6.0, 4 MB 5.8-6.3 against 4.1-4.6.
# 8 and 16 MB were level either way (64 MB in all), 4 MB ones 10.5-10.7 lent against
# 11.5-11.6 there.  At 4 ranks on 2 cores: 1 MB 27.3 lent against 19.4, 2 MB 17.6 against
# 13.7, 0.5 and 4 MB level.
CROWDED_REDUCE_LEND_BYTES = 8 << 20

# ... and only from a buffer at least this share of which huge pages back, where the
# kernel can say (transport/pages.py): a lent piece costs its reader a pin of each of the
# lender's pages, which small pages make dearer than the ring's two copies.  At 2 ranks
# (one job per way, alternated twice), allreduces of small-paged buffers (torch's, by
# default) took 6.5 ms lent against 3.7-3.9 through the ring at 32 MB, 12.1-12.5 against
# 7.5-7.7 at 64 MB and 46.5-46.9 against 30.8-32.9 at 256 MB, while numpy's arrays, huge
# but for their ends, took 3.5-3.6 lent against 3.6-3.7 (32 MB) and 29.4-29.7 against
# 30.3-30.8 (256 MB); at 4 ranks on 2 cores 16 MB ones took 10.1-11.2 ms lent against
# 7.9-10.3 small-paged, 6.1-7.5 against 7.9-8.0 huge-paged.
HUGE_LEND_SHARE = 0.75
