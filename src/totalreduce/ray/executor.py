"""Start one Ray actor per rank, give each its place in the job, run functions on all.

The driver serves the job's rendezvous store, as totalrun does, on the driver node's
address: the store outlives any one worker, and no port has to be guessed on a node the
driver cannot see.  Each actor gets its rank, the world size, its local rank and size
(ranks are numbered node by node), the store's address and a fresh job secret through the
environment variables ``totalreduce.init()`` reads under Ray (rendezvous/env.py).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

try:
    import ray
    from ray.exceptions import RayTaskError
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError("totalreduce.ray needs Ray: pip install 'totalreduce[ray]'") from exc

from ..rendezvous import KVServer
from .failures import WorkerFailedError, root_cause
from .worker import Worker

logger = logging.getLogger(__name__)

# How long start() waits for Ray to place every actor before it says what it waits for
# (and again each time as long after): Ray itself says nothing while an actor waits for
# CPUs or GPUs that the cluster lacks or that other actors hold.
PLACEMENT_NOTICE = 30.0


class RayExecutor:
    """A job of ``num_workers`` ranks, one Ray actor each.

    ``start()`` creates the actors (``ray.init()`` first, or the executor connects to the
    cluster ``ray.init()`` finds by default); ``run(fn)`` calls ``fn`` on every rank at
    once and returns the results in rank order; ``shutdown()`` ends the actors.  ``fn``
    calls ``totalreduce.init()`` (or ``totalreduce.torch.init()``) itself.  Also a
    context manager: ``with RayExecutor(2) as ex: ex.run(fn)``.

    Args:
        num_workers: ranks in the job.
        cpus_per_worker: CPUs Ray reserves for each actor.
        use_gpu: reserve ``gpus_per_worker`` GPUs for each actor as well.
        gpus_per_worker: GPUs per actor when ``use_gpu``.
        env: environment variables for every rank (``TOTALREDUCE_*`` settings, say).
        failure_grace: after one rank fails, how many seconds the others have to finish
            or raise (they normally raise ``PeerFailureError`` within milliseconds)
            before they are killed.

    The workers must reach the driver's node over the network, which a driver attached
    through Ray Client (``ray://``) may not allow.
    """

    def __init__(self, num_workers: int, cpus_per_worker: float = 1, use_gpu: bool = False,
                 gpus_per_worker: float = 1, env: Mapping[str, str] | None = None,
                 failure_grace: float = 10.0) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, not {num_workers}")
        if failure_grace < 0:
            raise ValueError(f"failure_grace must be 0 or more seconds, not {failure_grace}")
        self.num_workers = num_workers
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker if use_gpu else 0
        self.env = dict(env or {})
        self.failure_grace = failure_grace
        self._workers: list[Any] = []  # actor handles, in rank order
        self._hosts: list[str] = []
        self._store: KVServer | None = None

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Create the actors and tell each its rank.  Waits until Ray has placed them all
        (for as long as the cluster needs to find the resources, with a warning every
        ``PLACEMENT_NOTICE`` seconds that says what is missing)."""
        if self._workers:
            raise RuntimeError("this RayExecutor is already started; shutdown() first")
        if not ray.is_initialized():
            ray.init()
        actor = ray.remote(Worker).options(num_cpus=self.cpus_per_worker,
                                           num_gpus=self.gpus_per_worker)
        workers: list[Any] = [actor.remote() for _ in range(self.num_workers)]
        try:
            places = ray.get(self._placed([w.where.remote() for w in workers]))
            # Ranks numbered node by node (nodes in the order their first actor came), so
            # that each node's ranks are consecutive, as launchers number them.
            first = {node: i for i, (node, _) in reversed(list(enumerate(places)))}
            order = sorted(range(len(workers)), key=lambda i: first[places[i][0]])
            workers = [workers[i] for i in order]
            places = [places[i] for i in order]
            secret = secrets.token_hex(32)
            job_id = secrets.token_hex(8)
            self._store = KVServer("0.0.0.0", 0, secret.encode(), job_id)
            port = self._store.address.rpartition(":")[2]
            address = f"{ray.util.get_node_ip_address()}:{port}"
            nodes = [node for node, _ in places]
            envs = []
            for rank, node in enumerate(nodes):
                envs.append(dict(
                    self.env,
                    TOTALREDUCE_RAY_RANK=str(rank),
                    TOTALREDUCE_RAY_SIZE=str(len(workers)),
                    TOTALREDUCE_RAY_LOCAL_RANK=str(nodes[:rank].count(node)),
                    TOTALREDUCE_RAY_LOCAL_SIZE=str(nodes.count(node)),
                    TOTALREDUCE_RENDEZVOUS=address,
                    TOTALREDUCE_SECRET=secret,
                    TOTALREDUCE_JOB_ID=job_id))
            ray.get([w.set_env.remote(e) for w, e in zip(workers, envs, strict=True)])
        except BaseException:
            self._kill(workers)
            self._close_store()
            raise
        self._workers = workers
        self._hosts = [host for _, host in places]

    def _placed(self, refs: list[Any]) -> list[Any]:
        """``refs`` once every actor is placed; a warning every ``PLACEMENT_NOTICE``
        seconds until then, naming what each needs and what the cluster has."""
        waited = 0.0
        while True:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=PLACEMENT_NOTICE)
            if len(done) == len(refs):
                return refs
            waited += PLACEMENT_NOTICE
            need = {"CPU": self.cpus_per_worker}
            if self.gpus_per_worker:
                need["GPU"] = self.gpus_per_worker
            logger.warning(
                "RayExecutor: %d of %d workers placed after %.0f s, still waiting; each "
                "needs %s, the cluster has %s in all and %s free (start Ray with more, "
                "or ask for fewer workers or cpus_per_worker)", len(done), len(refs),
                waited, need, _cpus_gpus(ray.cluster_resources()),
                _cpus_gpus(ray.available_resources()))

    def shutdown(self) -> None:
        """End the actors (a rank still initialized is cut off, not shut down) and the
        store.  Safe to call more than once."""
        workers, self._workers = self._workers, []
        self._kill(workers)
        self._close_store()

    def __enter__(self) -> RayExecutor:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()

    # --- running ------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None, timeout: float | None = None) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank at once; the results in rank order.

        Raises:
            WorkerFailedError: a rank's ``fn`` raised or its actor died.  It names the
                rank that failed first on its own; the others were given
                ``failure_grace`` seconds to end, then killed.  The executor is shut
                down then: ``start()`` it again for a fresh job.
            TimeoutError: ``timeout`` seconds passed first (the executor is shut down).
        """
        workers = self._started()
        refs = [w.run.remote(fn, args, kwargs or {}) for w in workers]
        return self._gather(refs, timeout)

    def execute(self, fn: Callable[[Worker], Any], timeout: float | None = None) -> list[Any]:
        """``fn(worker)`` on every rank's :class:`~totalreduce.ray.worker.Worker`; the
        results in rank order.  Fails as :meth:`run` does."""
        workers = self._started()
        return self._gather([w.execute.remote(fn) for w in workers], timeout)

    def _started(self) -> list[Any]:
        if not self._workers:
            raise RuntimeError("the RayExecutor is not started (or a failed run shut it "
                               "down): call start() first")
        return self._workers

    def _gather(self, refs: list[Any], timeout: float | None) -> list[Any]:
        """Every result, or after the first failure the errors of all ranks: the others
        get ``failure_grace`` seconds, which bounds the wait even when a failure leaves a
        rank stuck."""
        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        raised: dict[int, BaseException] = {}  # as Ray raised them (remote tracebacks)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while pending:
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                done, _ = ray.wait(list(pending), num_returns=1, timeout=wait)
                if not done:
                    break
                for ref in done:
                    rank = pending.pop(ref)
                    try:
                        results[rank] = ray.get(ref)
                    except Exception as exc:  # the user's error, or the actor's death
                        raised[rank] = exc
                        errors[rank] = _cause(exc)
                        if len(errors) == 1:
                            grace = time.monotonic() + self.failure_grace
                            deadline = grace if deadline is None else min(deadline, grace)
        except BaseException:  # Ctrl-C in the driver, say: leave nothing running
            self.shutdown()
            raise
        if not errors and not pending:
            return [results[r] for r in range(len(refs))]
        self.shutdown()
        killed = set(pending.values())
        if not errors:
            raise TimeoutError(f"RayExecutor: rank(s) {sorted(killed)} of {len(refs)} had "
                               "not finished when the timeout ran out; the workers were "
                               "killed")
        for rank in sorted(killed):
            errors[rank] = TimeoutError(f"still running {self.failure_grace:g} s after "
                                        "another rank failed; killed")
        rank = root_cause(errors, killed)
        raise WorkerFailedError(rank, len(refs), errors, results, self._hosts_or_unknown(
            len(refs))) from raised.get(rank)

    # --- helpers ------------------------------------------------------------------------

    def _hosts_or_unknown(self, n: int) -> list[str]:
        return self._hosts if len(self._hosts) == n else ["an unknown host"] * n

    @staticmethod
    def _kill(workers: list[Any]) -> None:
        for w in workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # already gone: nothing left to end
                pass

    def _close_store(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            store.close()


def _cpus_gpus(resources: Mapping[str, float]) -> dict[str, float]:
    return {k: resources.get(k, 0.0) for k in ("CPU", "GPU")}


def _cause(exc: Exception) -> BaseException:
    """The exception the function raised where Ray brought it back, else Ray's own (an
    actor that died has no other)."""
    if isinstance(exc, RayTaskError) and isinstance(exc.cause, BaseException):
        return exc.cause
    return exc
