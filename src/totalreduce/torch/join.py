"""Horovod's ``join()`` for ranks that run out of data first."""

from __future__ import annotations

import totalreduce as _tr


def join(device: int = -1) -> int:
    """Declare that this rank has no more batches; return once every rank has joined.

    Until then this rank takes part in its peers' allreduces (the DistributedOptimizer's
    included) with zeros, so their steps go on without it; averages still divide by the
    full world size, as in Horovod.  Other collectives fail on the peers with a
    MismatchError saying this rank has joined.

    Args:
        device: accepted for Horovod compatibility; totalreduce runs no device work here.

    Returns:
        The rank that called ``join()`` last (by the wall clock of the calls).
    """
    del device
    return _tr.join()
