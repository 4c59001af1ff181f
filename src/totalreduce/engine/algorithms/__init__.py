"""Collective algorithms as step machines: each returns a :class:`Schedule` for one rank.

Schedules depend only on (rank, size, block sizes, segment size), so they are cached.
"""

from .chain import chain_broadcast
from .doubling import doubling_allgather, doubling_allreduce
from .halving import (
    doubling_allgatherv,
    halving_allreduce,
    halving_reducescatter,
    scatter_allgather_broadcast,
)
from .hierarchical import hierarchical_allreduce
from .pairwise import pairwise_alltoallv
from .ring import ring_allgatherv, ring_allreduce, ring_reducescatter
from .select import Algorithms, AllreducePlan

__all__ = ["AllreducePlan", "Algorithms", "chain_broadcast", "doubling_allgather",
           "doubling_allgatherv", "doubling_allreduce", "halving_allreduce",
           "halving_reducescatter", "hierarchical_allreduce", "pairwise_alltoallv",
           "ring_allgatherv", "ring_allreduce", "ring_reducescatter",
           "scatter_allgather_broadcast"]
