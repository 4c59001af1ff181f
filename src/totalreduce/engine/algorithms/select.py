"""Which algorithm runs a collective, and with which segment size: the scheduler above
says what an op is (kind, sizes, root), this says how.

Allreduce picks recursive doubling (fewest hops) or the ring by size
(``TOTALREDUCE_SMALL_BYTES``; auto: doubling up to 1 MiB, the ring above).  At 2 ranks
doubling moves the same bytes as the ring, but each rank reduces the whole buffer and a
piece that arrives before our own send of it has left must be copied aside; the ring
reduces half and never waits on itself.  Up to 2 MiB at 2 ranks the ring's second hop
costs more than that: doubling was 15-20% faster at 2 MB, even at 3-4 MB and slower from
6 MB (docs/dev/perf-log.md).  The choice is part of the op's signature (the scheduler
puts ``algorithm`` in its description), so ranks configured differently get a
MismatchError, not a hang.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ...transport.wire import RECIPE_DOUBLING_ALLREDUCE, RECIPE_RING_ALLREDUCE
from ..schedule import Schedule
from .chain import chain_broadcast
from .doubling import doubling_allreduce
from .pairwise import pairwise_alltoallv
from .ring import ring_allgatherv, ring_allreduce, ring_reducescatter


class AllreducePlan(NamedTuple):
    schedule: Schedule
    algorithm: str  # "ring" or "doubling"
    recipe: int  # wire.Header.recipe without the op: how a joined rank rebuilds it


class Algorithms:
    """Schedules for one rank of a ``size``-rank job."""

    def __init__(self, rank: int, size: int, segment_bytes: int, small_bytes: int) -> None:
        self.rank = rank
        self.size = size
        self._segment_bytes = segment_bytes
        if small_bytes < 0:
            small_bytes = 2 << 20 if size == 2 else 1 << 20
        self._small_bytes = small_bytes

    def segment(self, dtype: np.dtype) -> int:
        """Elements per pipelined piece."""
        return max(1, self._segment_bytes // np.dtype(dtype).itemsize)

    def allreduce(self, count: int, dtype: np.dtype) -> AllreducePlan:
        itemsize = dtype.itemsize  # every op pays for this call: no conversions
        seg = max(1, self._segment_bytes // itemsize)
        if count * itemsize <= self._small_bytes:
            return AllreducePlan(doubling_allreduce(self.rank, self.size, count, seg),
                                 "doubling", RECIPE_DOUBLING_ALLREDUCE)
        return AllreducePlan(ring_allreduce(self.rank, self.size, count, seg), "ring",
                             RECIPE_RING_ALLREDUCE)

    def allreduce_from_recipe(self, recipe: int, count: int, dtype: np.dtype
                              ) -> Schedule | None:
        """The schedule a peer's op was built with (its header's recipe), or None."""
        if recipe == RECIPE_RING_ALLREDUCE:
            return ring_allreduce(self.rank, self.size, count, self.segment(dtype))
        if recipe == RECIPE_DOUBLING_ALLREDUCE:
            return doubling_allreduce(self.rank, self.size, count, self.segment(dtype))
        return None

    def broadcast(self, root: int, count: int, dtype: np.dtype) -> Schedule:
        return chain_broadcast(self.rank, self.size, root, count, self.segment(dtype))

    def reducescatter(self, bounds: tuple[int, ...], dtype: np.dtype) -> Schedule:
        return ring_reducescatter(self.rank, self.size, bounds, self.segment(dtype))

    def allgather(self, bounds: tuple[int, ...], dtype: np.dtype | None = None) -> Schedule:
        """Gather blocks of ``bounds``; without a dtype, one element per piece (a
        sizes exchange)."""
        seg = 1 if dtype is None else self.segment(dtype)
        return ring_allgatherv(self.rank, self.size, bounds, seg)

    def alltoall(self, send_bounds: tuple[int, ...], recv_bounds: tuple[int, ...],
                 dtype: np.dtype | None = None) -> Schedule:
        seg = 1 if dtype is None else self.segment(dtype)
        return pairwise_alltoallv(self.rank, self.size, send_bounds, recv_bounds, seg)
