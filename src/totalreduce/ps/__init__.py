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

Servers keep the weights in memory.  Without restarts a server that dies ends the job;
with ``totalrun --max-restarts K`` and two servers or more, each server's share is
replicated on the next server, and a killed server's replacement takes it from there:
the workers wait for it and go on, and no push they were told was taken is lost (see
server.py).  A killed worker's replacement runs the script again: ``ps.init`` returns
the current weights and :func:`iterations_done` says where it had stopped.
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
           "iterations_done", "num_workers", "pull", "push", "register_updater", "start",
           "worker_rank", "workers"]

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
            a bad ``max_delay``, an unknown updater, ``start`` called twice, or
            recovery (``--max-restarts``) with one server (it has no peer to keep a
            copy of its share).
    """
    global _client, _roles, _workers, _why_no_workers
    if not tr.is_initialized():
        tr.init()
    rank, size = tr.rank(), tr.size()
    if _roles is not None:
        raise ValueError(f"rank {rank}: ps.start was called already")
    config = _runtime.current().config
    recovery = config.max_restarts > 0
    servers = config.servers
    if not 0 < servers < size:
        raise ValueError(
            f"rank {rank}: ps.start: {servers} servers among {size} ranks; start the job "
            "with totalrun -np N --servers S (or TOTALREDUCE_SERVERS=S under mpirun or "
            "srun), 0 < S < N")
    if max_delay is not None and (not isinstance(max_delay, int) or max_delay < 0):
        raise ValueError(f"rank {rank}: ps.start: max_delay must be an int >= 0 or None, "
                         f"got {max_delay!r}")
    if recovery and servers < 2:
        raise ValueError(
            f"rank {rank}: ps.start: --max-restarts with {servers} server: a server's "
            "share survives its loss only as a copy on another server; start the job "
            "with --servers 2 or more")
    roles = Roles(size, servers)
    apply = make_updater(updater, roles.workers, options)
    _roles = roles
    if recovery:
        # A process set's collectives cannot be replayed to a restarted rank.
        _why_no_workers = "process sets do not run with recovery on (--max-restarts)"
    else:
        try:  # registered by every rank, servers included, as process sets are
            _workers = tr.add_process_set(list(range(roles.workers)))
        except NotImplementedError as exc:  # negotiated coordination has no process sets
            _why_no_workers = str(exc)
    replacement = config.attempt > 0
    if roles.is_server(rank):
        server = Server(roles, rank, apply, replicated=recovery)
        server.serve(replacement)
        log.info("server rank %d: done; the fastest worker was at most %d iterations "
                 "ahead of the slowest", rank, server.lead)
        tr.shutdown()
        raise SystemExit(0)
    _client = Client(roles, rank, max_delay)
    if replacement:
        _client.resume()
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


def iterations_done() -> int:
    """How many iterations this worker has finished (called :func:`clock` for): 0 in a
    fresh job; in a killed worker's replacement, where its predecessor stopped."""
    return _worker("iterations_done").done


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
