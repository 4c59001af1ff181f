"""A parameter server on totalreduce's own transport (Li et al., OSDI 2014).

    totalrun -np 5 --servers 2 python train.py

makes the last 2 ranks servers and ranks 0..2 workers.  Every rank runs the script and
calls :func:`start`; on a server it serves until every worker has finished and then ends
the process (as ``byteps.server`` does), so what follows it is the workers' code::

    import totalreduce.ps as ps

    ps.start(updater="sgd", lr=0.1, max_delay=0)
    w = ps.init("w", np.zeros(1000, np.float32))   # worker 0's value wins
    for step in range(steps):
        ps.push("w", gradient(w))                   # applied by the servers on arrival
        ps.clock()                                  # the iteration is over
        w = ps.pull("w")
    ps.finish()                                     # also done at exit

Keys are named arrays; each server owns one contiguous range of every key's elements.
``max_delay`` bounds staleness: iteration t starts only once every worker has finished
iteration t - max_delay - 1 (0: synchronous SGD; None: never wait).  Under mpirun or srun
set ``TOTALREDUCE_SERVERS`` instead of ``--servers``.

Servers keep the weights in memory only: a server that dies ends the job.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
from typing import Any

import numpy as np

import totalreduce as tr

from .. import runtime as _runtime
from .client import Client, TopK
from .keys import Roles
from .server import Server
from .updaters import SGD, Adam, Updater, make_updater, register_updater

__all__ = ["SGD", "Adam", "TopK", "Updater", "clock", "finish", "init", "is_server",
           "num_workers", "pull", "push", "register_updater", "start", "worker_rank",
           "workers"]

log = logging.getLogger(__name__)
_client: Client | None = None
_roles: Roles | None = None
_workers: tr.ProcessSet | None = None
_why_no_workers = "call ps.start() first"


def start(updater: str | Updater = "sgd", max_delay: int | None = 0,
          **options: Any) -> None:
    """Take this rank's role.  A server serves and then exits the process (status 0);
    a worker returns, ready for :func:`init`, :func:`push`, :func:`pull` and
    :func:`clock`.  Initializes totalreduce first if the script has not.

    ``updater``: what servers do with a pushed gradient: ``"sgd"`` (options ``lr``,
    ``momentum``), ``"adam"`` (``lr``, ``betas``, ``eps``), a name given to
    :func:`register_updater`, or a callable ``fn(name, weights, grad, state)`` updating
    ``weights`` in place.  Every rank passes the same arguments.

    Raises:
        ValueError: no servers (``--servers``/``TOTALREDUCE_SERVERS``), no workers left,
            a bad ``max_delay``, an unknown updater, or ``start`` called twice.
        NotImplementedError: recovery (``--max-restarts``) is on.
    """
    global _client, _roles, _workers, _why_no_workers
    if not tr.is_initialized():
        tr.init()
    rank, size = tr.rank(), tr.size()
    if _roles is not None:
        raise ValueError(f"rank {rank}: ps.start was called already")
    config = _runtime.current().config
    if config.max_restarts > 0:
        raise NotImplementedError(
            f"rank {rank}: ps.start: the parameter server does not survive restarts yet "
            "(its weights live in the servers' memory only); run it without --max-restarts")
    servers = config.servers
    if not 0 < servers < size:
        raise ValueError(
            f"rank {rank}: ps.start: {servers} servers among {size} ranks; start the job "
            "with totalrun -np N --servers S (or TOTALREDUCE_SERVERS=S under mpirun or "
            "srun), 0 < S < N")
    if max_delay is not None and (not isinstance(max_delay, int) or max_delay < 0):
        raise ValueError(f"rank {rank}: ps.start: max_delay must be an int >= 0 or None, "
                         f"got {max_delay!r}")
    roles = Roles(size, servers)
    apply = make_updater(updater, roles.workers, options)
    _roles = roles
    try:  # registered by every rank, servers included, as process sets are
        _workers = tr.add_process_set(list(range(roles.workers)))
    except NotImplementedError as exc:  # negotiated coordination has no process sets
        _why_no_workers = str(exc)
    if roles.is_server(rank):
        server = Server(roles, rank, apply)
        server.serve()
        log.info("server rank %d: done; the fastest worker was at most %d iterations "
                 "ahead of the slowest", rank, server.lead)
        tr.shutdown()
        raise SystemExit(0)
    _client = Client(roles, rank, max_delay)
    atexit.register(_finish_at_exit)


def _worker(what: str) -> Client:
    if _client is None:
        raise ValueError(f"ps.{what}: this rank is not a parameter-server worker; call "
                         "ps.start() first")
    return _client


def is_server() -> bool:
    """Whether this rank is a server (after :func:`start`, a server never gets here)."""
    return _roles is not None and _roles.is_server(tr.rank())


def num_workers() -> int:
    if _roles is None:
        raise ValueError("ps.num_workers: call ps.start() first")
    return _roles.workers


def workers() -> tr.ProcessSet:
    """The workers as a process set, for collectives among them only (a loss average:
    ``tr.allreduce(x, process_set=ps.workers())``); the servers never join a collective."""
    if _workers is None:
        raise ValueError(f"ps.workers: no process set of the workers: {_why_no_workers}")
    return _workers


def worker_rank() -> int:
    """This worker's index among the workers, 0..num_workers()-1 (its rank)."""
    return _worker("worker_rank").rank


def init(name: str, array: Any) -> np.ndarray:
    """Create key ``name`` on the servers with worker 0's ``array`` (every worker calls
    it, as a broadcast) and return the servers' value: worker 0's, or, for a key that
    already exists there, its current weights.

    Raises:
        ValueError: a key of that name with another size or dtype.
    """
    return _worker("init").init(name, array)


def push(name: str, grad: Any, lo: int | None = None, hi: int | None = None,
         compression: str | TopK | None = None) -> None:
    """Send a gradient for elements [lo, hi) of ``name`` (default: all, in the key's
    shape or flat); returns once every server holding a part has applied it.
    ``compression``: None, ``"fp16"``, or ``TopK(density)`` (the rest kept as a residual
    on this worker and added to its next push).

    Raises:
        ValueError: an unknown key, a range outside it, or the wrong number of values.
        TypeError: a dtype other than the key's.
    """
    _worker("push").push(name, grad, lo, hi, compression)


def pull(name: str, lo: int | None = None, hi: int | None = None) -> np.ndarray:
    """The servers' current weights of ``name``: in its shape, or, given ``lo``/``hi``,
    elements [lo, hi) flat."""
    return _worker("pull").pull(name, lo, hi)


def clock() -> int:
    """End this worker's iteration; waits as ``max_delay`` requires and returns how many
    iterations the slowest worker has finished."""
    return _worker("clock").clock()


def finish() -> None:
    """Tell the servers this worker is done (at exit if not called); they end once every
    worker has."""
    _worker("finish").finish()


def _finish_at_exit() -> None:
    if _client is not None and not _client.finished and tr.is_initialized():
        with contextlib.suppress(tr.TotalReduceError):
            _client.finish()
