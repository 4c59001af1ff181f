"""Transports by scheme: the one table that says which transports exist and how each
joins a job.

===========  ==============================================================================
``shm``      TCP between every pair of ranks, plus shared-memory rings between ranks on one
             host (the default outside MPI)
``tcp``      TCP only
``mpi``      MPI point-to-point through mpi4py (the default under an MPI launcher)
``inproc``   every rank in this process (a world of one, and tests)
===========  ==============================================================================

``TOTALREDUCE_TRANSPORT=auto`` picks ``mpi`` when an MPI launcher started the process and
mpi4py imports, else ``shm``.  A job of one process runs over ``inproc`` whatever the
setting: there is nobody to talk to.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import NamedTuple

from ..config import Config
from ..rendezvous import detect_launch, mpi_launched
from .base import Transport


class Connected(NamedTuple):
    """A transport joined to its job, and what it learned on the way."""

    transport: Transport
    local_rank: int
    local_size: int
    close: Callable[[], None] | None = None  # what else to close at shutdown


Cancelled = Callable[[], bool]


def _sockets(config: Config, world: int | str, cancelled: Cancelled | None,
             rings: bool) -> Connected:
    from .connect import connect_job

    launch = detect_launch()
    if launch.size == 1:
        return _inproc(config, world, cancelled)
    return connect_job(launch, config, config.ring_bytes if rings else 0, world, cancelled)


def _mpi(config: Config, world: int | str, cancelled: Cancelled | None) -> Connected:
    from .mpi import MpiTransport, mpi_world

    world, local_rank, local_size, hosts = mpi_world()
    return Connected(MpiTransport(world, hosts, shm_lanes=config.ring_bytes != 0), local_rank,
                     local_size)


def _inproc(config: Config, world: int | str, cancelled: Cancelled | None) -> Connected:
    from .inproc import InprocWorld

    launch = detect_launch()
    if launch.size != 1:
        raise ValueError(f"the inproc transport runs a world of one process, but this "
                         f"job has {launch.size}; use shm, tcp or mpi")
    return Connected(InprocWorld(1).transports[0], 0, 1)


# Each joins with the config and the world: how many times this process called init()
# before, or with recovery on the restart generation (the socket transports keep worlds
# apart by it; see connect.py), and what says that the job moved on to a newer world.
TRANSPORTS: dict[str, Callable[[Config, int | str, Cancelled | None], Connected]] = {
    "shm": lambda config, world, cancelled: _sockets(config, world, cancelled, rings=True),
    "tcp": lambda config, world, cancelled: _sockets(config, world, cancelled, rings=False),
    "mpi": _mpi,
    "inproc": _inproc,
}


def choose(config: Config) -> str:
    """The scheme the setting names, or for ``auto`` MPI under an MPI launcher."""
    if config.transport != "auto":
        return config.transport
    if mpi_launched() and importlib.util.find_spec("mpi4py") is not None:
        return "mpi"
    return "shm"


def connect(config: Config, world: int | str = 0, cancelled: Cancelled | None = None
            ) -> tuple[str, Connected]:
    """Join this process to its job over the configured transport; ``world`` counts the
    process's earlier ``init()`` calls (every rank of the job must make as many), or
    names the restart generation; ``cancelled()`` True while joining: the job moved on
    (:class:`.mesh.WorldMoved`)."""
    scheme = choose(config)
    return scheme, TRANSPORTS[scheme](config, world, cancelled)
