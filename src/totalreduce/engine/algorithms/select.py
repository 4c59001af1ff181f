"""Which algorithm runs a collective, and with which segment size: the scheduler above
says what an op is (kind, sizes, root), this says how.

Across hosts (``TOTALREDUCE_HIERARCHICAL``; see hierarchical.py), allreduces the ring
would take run hierarchically instead: auto does so where every host has the same number
of ranks, two or more, since each host then sends the buffer across the network once
instead of once per rank pair that straddles hosts; on also takes the small ones.

Allreduce picks recursive doubling (fewest hops), recursive halving then doubling (at 8+
ranks, see :func:`auto_halving_bytes`) or the ring by size (``TOTALREDUCE_SMALL_BYTES``;
auto: doubling up to 1 MiB, halving or the ring above).  Reduce-scatter, allgather and
broadcast take recursive halving, recursive doubling and a scatter then allgather in
power-of-two worlds where those won (:meth:`Algorithms._log_steps`), else the ring and
the chain; small allgathers (up to SMALL_BYTES, from 4 ranks, any world) recursive
doubling with one message a step.  At 2 ranks
doubling moves the same bytes as the ring, but each rank reduces the whole buffer and a
piece that arrives before our own send of it has left must be copied aside; the ring
reduces half and never waits on itself.  Up to 2 MiB at 2 ranks the ring's second hop
costs more than that: doubling was 15-20% faster at 2 MB, even at 3-4 MB and slower from
6 MB (docs/dev/perf-log.md).  The choice is part of the op's signature (the scheduler
puts ``algorithm`` in its description), so ranks configured differently get a
MismatchError, not a hang.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np

from ...lru import LRU
from ...transport.ring_push import PUSH_MIN
from ...transport.wire import (
    RECIPE_DOUBLING_ALLREDUCE,
    RECIPE_HALVING_ALLREDUCE,
    RECIPE_HIERARCHICAL_ALLREDUCE,
    RECIPE_RING_ALLREDUCE,
)
from ..schedule import Schedule, remap
from .chain import chain_broadcast
from .doubling import doubling_allgather, doubling_allreduce
from .halving import (
    doubling_allgatherv,
    halving_allreduce,
    halving_reducescatter,
    scatter_allgather_broadcast,
)
from .hierarchical import hierarchical_allreduce, host_groups
from .pairwise import pairwise_alltoallv
from .ring import ring_allgatherv, ring_allreduce, ring_reducescatter

logger = logging.getLogger("totalreduce")

# Broadcasts up to small_bytes go in pieces of at most this size: a receiver copies one
# piece out while the root copies the next in, where a whole-buffer piece makes the two
# copies run one after the other (2 ranks, 1 MiB: 164 -> 129 us; 2 MiB: 315 -> 231 us).
# Bigger ones of up to two segments (which the caller's thread runs while they fit in
# the ring) go in pieces of half a segment, for the same overlap: 4 MiB at 2 ranks, on
# the caller's thread, took 0.39-0.67 ms against 0.63-0.81 ms in two whole segments
# on the loop (8 rounds alternated in one job), and in two segments on the caller's
# thread about as long as on the loop.  Past two segments they keep the segment size:
# per-piece overhead would outweigh it (4 MiB in 512 KiB pieces on the loop: 389 -> 429
# us).
_SMALL_BROADCAST_PIECE = 512 << 10

# Where a pair's big bodies are lent (transport/cma.py: the receiver's kernel copies them
# out of the sender's memory, in slices that let urgent messages pass), a piece buys no
# overlap: nothing pipelines through a ring, and at 2 ranks nothing is forwarded.  What
# a piece still costs is a turn of the loop on each side (the lend, its acknowledgement,
# the receive's bookkeeping: 50-70 us at 2 ranks).  So broadcasts, allgathers and
# alltoalls past two segments go in pieces of up to this size there: at 2 ranks (old and
# new alternated in one sitting, medians of 4) 16 MiB allgathers took 1.9 ms against 2.3
# in 2 MiB pieces, 64 MiB ones 13.0 against 14.3, 256 MiB alltoalls 41.7 against 45.8.
# A broadcast's root lends such a piece whole and, idle otherwise, copies its back half
# into the peer meanwhile (transport/ring_push.py), so that from PUSH_MIN on
# a broadcast goes in such pieces: each costs a request and its answer.  Where it copies
# through the ring instead (its core is not its own) it does in chunks (shmring.py), as
# fast as in pieces.
LENT_PIECE_BYTES = 32 << 20


def auto_halving_bytes(size: int) -> int:
    """TOTALREDUCE_HALVING_BYTES=-1, for allreduce: up to where recursive halving runs
    instead of the ring.  On 16 cores, one rank per core: at 4 ranks it never won (a tie
    at 4 MB, the ring 15% faster at 16 MB); at 8 and 12 ranks it ran 4 MB 2-3x faster
    than the ring and 16 MB at par, 64 MB 5-10% slower; at 16 ranks it was faster from
    4 MB (6x) to 64 MB (15%).  Below SMALL_BYTES recursive doubling beat it at every rank
    count."""
    if size < 8:
        return 0
    return size << 20 if size < 16 else 1 << 62


class AllreducePlan(NamedTuple):
    schedule: Schedule
    algorithm: str  # "ring", "doubling", "halving" or "hierarchical"
    recipe: int  # wire.Header.recipe without the op: how a joined rank rebuilds it
    fresh: bool = False  # built for an op whose buffer starts undefined (OpSpec.fresh)


class Algorithms:
    """Schedules for one rank of a ``size``-rank job."""

    def __init__(self, rank: int, size: int, segment_bytes: int, small_bytes: int,
                 hosts: tuple[int, ...] | None = None, hierarchical: str = "auto",
                 members: tuple[int, ...] | None = None, halving_bytes: int = -1,
                 lent_pieces: bool = False) -> None:
        """``hosts``: each rank's host (Transport.hosts); ``hierarchical``: auto, on (1)
        or off (0), as TOTALREDUCE_HIERARCHICAL.  ``members``: the job's ranks of a
        process set, which this instance's ``rank`` and ``size`` then count within
        (``hosts`` too); its schedules name the job's ranks.  ``lent_pieces``: the
        ranks' big bodies are lent to each other (every rank must be told the same):
        at 2 ranks, big broadcasts, allgathers and alltoalls go in pieces of
        LENT_PIECE_BYTES."""
        self.rank = rank
        self.size = size
        self._members = members
        # Remapped schedules, by the cached schedule they came from (kept, so that its
        # id is not reused while the entry lives).
        self._mapped: LRU[int, tuple[Schedule, Schedule]] = LRU(256)
        self._segment_bytes = segment_bytes
        self._lent_piece = LENT_PIECE_BYTES if lent_pieces and size == 2 else 0
        if small_bytes < 0:
            small_bytes = 2 << 20 if size == 2 else 1 << 20
        self._small_bytes = small_bytes
        self._halving_auto = halving_bytes < 0
        if halving_bytes < 0:
            # Measured with every rank on one host: across hosts the log-step algorithms'
            # partners at every distance would send each step's share over the network.
            one_host = hosts is None or len(set(hosts)) == 1
            halving_bytes = auto_halving_bytes(size) if one_host else 0
        self._halving_bytes = halving_bytes
        mode = {"1": "on", "0": "off"}.get(hierarchical, hierarchical)
        layout = host_groups(hosts) if hosts is not None and mode != "off" else None
        if mode == "on" and layout is None and rank == 0:
            logger.warning("totalreduce: TOTALREDUCE_HIERARCHICAL=on, but the ranks' hosts "
                           "%s do not split into two or more hosts of the same number (>= 2) "
                           "of ranks: allreduce runs flat", hosts)
        self._hosts = hosts if layout is not None else None
        # With a layout, allreduces above this many bytes run hierarchically.
        self._hier_above = -1 if mode == "on" else small_bytes

    def _job(self, schedule: Schedule) -> Schedule:
        """``schedule`` with the job's ranks in it (a process set's are its own)."""
        members = self._members
        if members is None:
            return schedule
        hit = self._mapped.get(id(schedule))
        if hit is not None and hit[0] is schedule:
            return hit[1]
        mapped = remap(schedule, members)
        self._mapped.put(id(schedule), (schedule, mapped))
        return mapped

    def segment(self, dtype: np.dtype) -> int:
        """Elements per pipelined piece."""
        return max(1, self._segment_bytes // np.dtype(dtype).itemsize)

    def _moved_piece(self, nbytes: int, itemsize: int) -> int:
        """Elements per piece of a data-only op that moves ``nbytes`` between the two
        ranks (the same number on both), if it takes lent pieces; else 0."""
        if not self._lent_piece or nbytes <= 2 * self._segment_bytes:
            return 0
        return max(1, self._lent_piece // itemsize)

    def allreduce(self, count: int, dtype: np.dtype, fresh: bool = False) -> AllreducePlan:
        """``fresh``: the caller can leave its buffer undefined where the algorithm
        allows (the ring: the plan says whether it took it)."""
        itemsize = dtype.itemsize  # every op pays for this call: no conversions
        seg = max(1, self._segment_bytes // itemsize)
        nbytes = count * itemsize
        if self._hosts is not None and nbytes > self._hier_above:
            return AllreducePlan(
                self._job(hierarchical_allreduce(self.rank, self._hosts, count, seg)),
                "hierarchical", RECIPE_HIERARCHICAL_ALLREDUCE)
        if nbytes <= self._small_bytes:
            return AllreducePlan(self._job(doubling_allreduce(self.rank, self.size, count, seg)),
                                 "doubling", RECIPE_DOUBLING_ALLREDUCE)
        if nbytes <= self._halving_bytes:
            return AllreducePlan(self._job(halving_allreduce(self.rank, self.size, count, seg)),
                                 "halving", RECIPE_HALVING_ALLREDUCE)
        return AllreducePlan(self._job(ring_allreduce(self.rank, self.size, count, seg,
                                                      fresh)),
                             "ring", RECIPE_RING_ALLREDUCE, fresh)

    def allreduce_from_recipe(self, recipe: int, count: int, dtype: np.dtype
                              ) -> Schedule | None:
        """The schedule a peer's op was built with (its header's recipe), or None."""
        if recipe == RECIPE_RING_ALLREDUCE:
            return self._job(ring_allreduce(self.rank, self.size, count, self.segment(dtype)))
        if recipe == RECIPE_DOUBLING_ALLREDUCE:
            return self._job(doubling_allreduce(self.rank, self.size, count,
                                                self.segment(dtype)))
        if recipe == RECIPE_HALVING_ALLREDUCE:
            return self._job(halving_allreduce(self.rank, self.size, count,
                                               self.segment(dtype)))
        if recipe == RECIPE_HIERARCHICAL_ALLREDUCE and self._hosts is not None:
            return self._job(hierarchical_allreduce(self.rank, self._hosts, count,
                                                    self.segment(dtype)))
        return None

    def broadcast(self, root: int, count: int, dtype: np.dtype) -> tuple[Schedule, str]:
        """The schedule and its algorithm ("chain" or "scatter-allgather")."""
        seg = self.segment(dtype)
        itemsize = np.dtype(dtype).itemsize
        if self._log_steps(count * itemsize, broadcast=True):
            return (self._job(scatter_allgather_broadcast(self.rank, self.size, root, count,
                                                          seg)), "scatter-allgather")
        nbytes = count * itemsize
        if self._lent_piece and nbytes >= PUSH_MIN:
            lent = max(1, self._lent_piece // itemsize)
            return (self._job(chain_broadcast(self.rank, self.size, root, count, lent)),
                    "chain, lent pieces")
        if nbytes <= self._small_bytes:
            seg = min(seg, max(1, _SMALL_BROADCAST_PIECE // itemsize))
        elif nbytes <= 2 * seg * itemsize:
            seg = max(1, seg // 2)
        return self._job(chain_broadcast(self.rank, self.size, root, count, seg)), "chain"

    def _log_steps(self, nbytes: int, broadcast: bool = False) -> bool:
        """Whether a reduce-scatter, allgather or broadcast of ``nbytes`` in all takes
        recursive halving or doubling (``log2 n`` steps each way) rather than the ring or
        the chain (``n - 1``), in a power-of-two world: up to TOTALREDUCE_HALVING_BYTES
        where it is set.  Auto, on 16 cores with one rank per core, measured against the
        ring and the chain: from 8 ranks the broadcast won at every size (1 MB at 16 ranks:
        1.3 against 7.6 ms; 64 MB at par), the allgather and the reduce-scatter from 4 MB
        (2-4x) to 16 MB, and lost below 1 MB and at 64 MB (the reduce-scatter reduces
        into a copy of its input, where the ring reads the input itself); at 4 ranks
        neither side won."""
        size = self.size
        if size < 4 or size & (size - 1):
            return False
        if not self._halving_auto:
            return nbytes <= self._halving_bytes
        if size < 8 or not self._halving_bytes:  # not measured: fewer ranks, several hosts
            return False
        return broadcast or self._small_bytes < nbytes <= size << 20

    def reducescatter(self, bounds: tuple[int, ...], dtype: np.dtype,
                      fresh: bool = False) -> tuple[Schedule, str, bool]:
        """The schedule, its algorithm ("ring" or "halving") and whether it took
        ``fresh`` (recursive halving reduces into a region more than once: it cannot)."""
        seg = self.segment(dtype)
        if self._log_steps(bounds[-1] * dtype.itemsize):
            return (self._job(halving_reducescatter(self.rank, self.size, bounds, seg)),
                    "halving", False)
        return self._job(ring_reducescatter(self.rank, self.size, bounds, seg, fresh)), \
            "ring", fresh

    def allgather(self, bounds: tuple[int, ...], dtype: np.dtype | None = None,
                  own: bool = False) -> tuple[Schedule, str, bool]:
        """Gather blocks of ``bounds``; without a dtype, one element per piece (a
        sizes exchange, of int64).  The schedule, its algorithm and whether it took
        ``own`` (the op copies this rank's block from its source: ring_allgatherv):
        up to SMALL_BYTES from 4 ranks "doubling-small", one message a step (at 16
        ranks on 16 cores a sizes exchange took 0.9-1.0 ms through the ring's 15 steps,
        stalling wherever one rank was late); else "doubling" (a message per block,
        which pipelines) where :meth:`_log_steps` says, else "ring"."""
        seg = 1 if dtype is None else self.segment(dtype)
        itemsize = 8 if dtype is None else dtype.itemsize
        nbytes = bounds[-1] * itemsize
        if self.size >= 4 and nbytes <= self._small_bytes:
            return self._job(doubling_allgather(self.rank, self.size, bounds)), \
                "doubling-small", False
        if self._log_steps(nbytes):
            return self._job(doubling_allgatherv(self.rank, self.size, bounds, seg)), \
                "doubling", False
        lent = 0 if dtype is None else self._moved_piece(nbytes, itemsize)
        if lent:
            return self._job(ring_allgatherv(self.rank, self.size, bounds, lent, own)), \
                "ring, lent pieces", own
        return self._job(ring_allgatherv(self.rank, self.size, bounds, seg, own)), "ring", \
            own

    def alltoall(self, send_bounds: tuple[int, ...], recv_bounds: tuple[int, ...],
                 dtype: np.dtype | None = None, own: bool = False) -> tuple[Schedule, str]:
        """The schedule and its algorithm ("pairwise", or "pairwise, lent pieces");
        ``own``: the op copies this rank's block itself (pairwise_alltoallv)."""
        if dtype is None:
            return self._job(pairwise_alltoallv(self.rank, self.size, send_bounds,
                                                recv_bounds, 1, own)), "pairwise"
        itemsize = dtype.itemsize
        seg = self.segment(dtype)
        if self._lent_piece:
            # What crosses between the two ranks, each way: both ranks count the same.
            me = self.rank
            crossed = (send_bounds[-1] - send_bounds[me + 1] + send_bounds[me]
                       + recv_bounds[-1] - recv_bounds[me + 1] + recv_bounds[me])
            lent = self._moved_piece(crossed * itemsize, itemsize)
            if lent:
                return self._job(pairwise_alltoallv(self.rank, self.size, send_bounds,
                                                    recv_bounds, lent, own)), \
                    "pairwise, lent pieces"
        return self._job(pairwise_alltoallv(self.rank, self.size, send_bounds, recv_bounds,
                                            seg, own)), "pairwise"
