"""The process-wide context: wires rendezvous -> transport -> engine -> scheduling.

One :class:`Runtime` exists between ``init()`` and ``shutdown()``; the public functions
reach it through :func:`current`.  It is registered with ``atexit`` so an interpreter that
exits without ``shutdown()`` still says goodbye to its peers (otherwise they would report
it as failed).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import numpy as np

from . import memcopy
from .config import Config, horovod_notices
from .engine.engine import Engine
from .exceptions import PeerFailureError, ShutdownError, TotalReduceError
from .launcher.exit_codes import NO_RESTART
from .recovery.codec import copy_state
from .recovery.robust import Robust
from .rendezvous import detect_launch
from .rendezvous.generations import Generations
from .scheduling import Negotiated, SelfGuided
from .scheduling.point_to_point import PointToPoint
from .scheduling.process_sets import ProcessSets
from .timeline import Timeline, timeline_path
from .transport.mesh import WorldMoved
from .transport.registry import Connected, choose, connect

logger = logging.getLogger(__name__)

_MPI_FAILED_LINGER = 1.0
# A rank that dies of another rank's failure leaves this much later, so that a launcher
# naming the first rank to exit as the root cause names the one that really failed.
_FOLLOWER_DELAY = 0.5
# Ctrl-C reaches the ranks one after another (a launcher forwards it rank by rank, and a
# loaded host may run the last one's handler many ms later).  A rank that leaves because
# of it waits until this long after its own, so that the others meet their own
# KeyboardInterrupt before the news of its departure.
_INTERRUPT_SETTLE = 0.5
# How long a rank that lost a peer waits for its old world's last messages to leave
# before it drops the links and meets the replacement (with recovery on).
_QUICK_SHUTDOWN = 2.0


class Runtime:
    def __init__(self, config: Config, world: int = 0) -> None:
        self.config = config
        self._generations: Generations | None = None
        self.generation = 0
        if config.max_restarts > 0:
            self._generations = _recovery_generations(config)
            self.generation = self._generations.current()
            connected = self._meet(time.monotonic() + config.connect_timeout)
        else:
            self.transport_name, connected = connect(config, world)
        self.rank, self.size = connected.transport.rank, connected.transport.size
        self.local_rank, self.local_size = connected.local_rank, connected.local_size
        # Always there, so that start_timeline() can switch it on in a running job.
        self.timeline = Timeline(
            timeline_path(config.timeline, self.rank) if config.timeline else None, self.rank)
        self._wire(connected)
        self.collectives: SelfGuided | Negotiated | Robust = self.scheduler
        if self._generations is not None:
            self.collectives = Robust(self.scheduler, self.rank, self.size, config.attempt,
                                      config.recovery_log_bytes, config.recovery_timeout,
                                      config.mock_death, self.rebuild)
        self.process_sets = ProcessSets(self.rank, self.size, self.collectives,
                                        self._agree, self._process_set)
        self._kept: tuple[int, dict[str, Any] | None] = (0, None)  # without recovery
        if self.rank == 0:
            for line in horovod_notices():
                print(line, file=sys.stderr)

    def _wire(self, connected: Connected) -> None:
        """An engine and a scheduler on a freshly joined transport."""
        config = self.config
        self.transport = connected.transport
        self._close_also = connected.close
        negotiated = config.coordination == "negotiated"
        # Self-guided ops are traced by the engine; negotiated ones by the cycle, which
        # knows the tensors behind a fused op.
        self.engine = Engine(self.transport, config,
                             timeline=None if negotiated else self.timeline)
        self.scheduler: SelfGuided | Negotiated = \
            Negotiated(self.engine, config, self.timeline) if negotiated \
            else SelfGuided(self.engine, config)
        self._messages = PointToPoint(self.engine, config)

    def messages(self, what: str, retried: bool = False) -> PointToPoint:
        """What sends and receives point-to-point messages.  ``retried``: the caller
        meets a lost rank's replacement itself (:meth:`meet_replacement`) and then sends
        again what the lost world did not deliver (the parameter server), so its messages
        need no replay and may run with recovery on."""
        if self._generations is not None and not retried:
            raise NotImplementedError(
                f"{what}: point-to-point messages cannot be replayed to a restarted rank, "
                "so they are not available with recovery on (totalrun --max-restarts)")
        return self._messages

    # --- process sets ---------------------------------------------------------------------

    def _agree(self, kind: str, mine: np.ndarray) -> np.ndarray:
        """Every rank's ``mine``, concatenated in rank order (a collective of the job)."""
        with self.collectives.caller_waits():
            return np.asarray(self.collectives.allgather(mine, f"\x00{kind}", 0).wait())

    def _process_set(self, members: tuple[int, ...], set_id: int) -> SelfGuided:
        if self.collectives is not self.scheduler or not isinstance(self.scheduler,
                                                                     SelfGuided):
            raise NotImplementedError(
                "add_process_set: process sets run under self-guided coordination (the "
                "default) without --max-restarts; this job has "
                f"TOTALREDUCE_COORDINATION={self.config.coordination}"
                + (" and recovery on" if self._generations is not None else ""))
        return SelfGuided(self.engine, self.config, members, set_id)

    # --- checkpoints (Rabit's API; with recovery, the Robust layer's) --------------------

    def checkpoint(self, state: Any) -> None:
        if isinstance(self.collectives, Robust):
            self.collectives.checkpoint(state)
            return
        kept = copy_state(state)
        with self.scheduler.caller_waits():
            self.scheduler.barrier().wait()
        self._kept = (self._kept[0] + 1, kept)

    def load_checkpoint(self) -> tuple[int, dict[str, Any] | None]:
        if isinstance(self.collectives, Robust):
            return self.collectives.load_checkpoint()
        version, state = self._kept
        return version, (None if state is None else copy_state(state))

    def version_number(self) -> int:
        if isinstance(self.collectives, Robust):
            return self.collectives.version_number()
        return self._kept[0]

    # --- recovery (totalrun --max-restarts) -------------------------------------------

    def _meet(self, deadline: float) -> Connected:
        """Join the world of the newest restart generation; a rank lost meanwhile moves
        every rank on to the next one.

        Raises:
            TimeoutError: the world was not whole before ``deadline``.
        """
        generations = self._generations
        assert generations is not None
        while True:
            g = self.generation

            def moved(g: int = g) -> bool:
                return generations.current() != g or time.monotonic() >= deadline

            try:
                self.transport_name, connected = connect(self.config, f"g{g}", moved)
                return connected
            except WorldMoved:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"rank meeting under generation {g}: not every rank "
                                       "joined in time") from None
                self.generation = generations.current()
            except OSError as exc:  # a rank died while the others were meeting
                logger.debug("rank meeting under generation %d failed: %s", g, exc)
                self.generation = generations.after(g, deadline)

    def rebuild(self, deadline: float) -> SelfGuided | Negotiated:
        """A rank was lost: drop this world's links (every peer drops its own), wait for
        the launcher to restart it, meet again with the replacement and return the new
        scheduler.  Memory above the scheduler (the checkpoint, the log) stays.

        Raises:
            TimeoutError: no rank was restarted before ``deadline``.
        """
        assert self._generations is not None
        self._stop_world(quick=True)
        self.generation = self._generations.after(self.generation, deadline)
        self._wire(self._meet(deadline))
        return self.scheduler

    def meet_replacement(self, cause: PeerFailureError) -> None:
        """For a caller of :meth:`messages` with ``retried``: a rank was lost; drop this
        world and meet its replacement (the collectives go on on the new world too).

        Raises:
            PeerFailureError: no recovery here (``cause`` itself), the rank left in order
                (a shutdown is no death), or no replacement joined within
                ``TOTALREDUCE_RECOVERY_TIMEOUT``.
        """
        if self._generations is None or cause.orderly or not cause.recoverable:
            raise cause
        logger.warning("rank %d: waiting for rank %d's replacement", self.rank, cause.rank)
        try:
            self.rebuild(time.monotonic() + self.config.recovery_timeout)
        except (OSError, TimeoutError) as exc:
            error = PeerFailureError(cause.rank, f"rank {self.rank}: lost rank {cause.rank} "
                                     "and no replacement joined within "
                                     "TOTALREDUCE_RECOVERY_TIMEOUT="
                                     f"{self.config.recovery_timeout:g} s ({exc}); {cause}")
            error.recoverable = False
            raise error from cause
        if isinstance(self.collectives, Robust):
            self.collectives.rewire(self.scheduler)

    def _stop_world(self, quick: bool = False) -> None:
        try:
            try:
                self.scheduler.close()
            finally:
                self.engine.shutdown(_QUICK_SHUTDOWN if quick else None)
        finally:
            if quick:
                self.transport.abort()
            if self._close_also is not None:
                self._close_also()

    def shutdown(self) -> None:
        self.process_sets.close()
        try:
            self._stop_world()
        finally:
            self.timeline.close()
            if self._generations is not None:
                self._generations.close()


def _recovery_generations(config: Config) -> Generations:
    """Recovery's preconditions, said plainly, and the launcher's restart count."""
    launch = detect_launch()
    if launch.launcher != "totalrun":
        raise ValueError(
            f"TOTALREDUCE_MAX_RESTARTS={config.max_restarts}, but this job was started by "
            f"{launch.launcher}, which cannot restart one rank while the others wait: run "
            "it with totalrun -np N --max-restarts K, or unset TOTALREDUCE_MAX_RESTARTS")
    if choose(config) not in ("shm", "tcp"):
        raise ValueError(f"restarts (TOTALREDUCE_MAX_RESTARTS) need the shm or tcp "
                         f"transport, not {choose(config)}")
    return Generations(launch, config.connect_timeout)


class _Holder:
    """Holds the one live runtime; a lock makes init/shutdown race-free."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runtime: Runtime | None = None
        self.previous_hook: Any = sys.excepthook
        self.exit_code: int | None = None  # set when an uncaught error ends an MPI rank
        self.follower = False  # this rank dies of PeerFailureError: another failed first
        self.interrupted_at: float | None = None  # when this process last got SIGINT
        # init() calls so far: each makes a world of its own, which the ranks agree on by
        # counting alike (Horovod's contract too: every rank shuts down and starts again).
        self.worlds = 0


_HOLDER = _Holder()


def init(**overrides: Any) -> Runtime:
    with _HOLDER.lock:
        live = _HOLDER.runtime
        if live is not None:
            # Horovod's second init() is a no-op; ours is too, but not a silent one for
            # settings it would ignore.
            wanted = Config.from_env(**overrides)  # unknown names: TypeError
            differ = [f"{k}={getattr(live.config, k)!r} (asked: {getattr(wanted, k)!r})"
                      for k in sorted(overrides) if getattr(wanted, k) != getattr(live.config, k)]
            if differ:
                raise ValueError("totalreduce is already initialized with "
                                 f"{', '.join(differ)}; call shutdown() first to change it")
            return live
        config = Config.from_env(**overrides)
        if config.max_restarts > 0 and _HOLDER.worlds:
            raise ValueError("a job with restarts (totalrun --max-restarts) initializes "
                             "once: its worlds are the launcher's restart generations")
        world, _HOLDER.worlds = _HOLDER.worlds, _HOLDER.worlds + 1
        memcopy.set_piece(config.copy_piece)
        runtime = Runtime(config, world)
        _HOLDER.runtime = runtime
        if sys.excepthook is not _on_uncaught:
            _HOLDER.previous_hook = sys.excepthook
            sys.excepthook = _on_uncaught
        # Only where Python's own Ctrl-C handler is in place: an application's handler is
        # its business, and signals can only be set from the main thread.
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _on_sigint)
        if config.gc_freeze:
            # A full garbage collection walks every object the imports made (torch's alone
            # take it ~150 ms); one rank's pause stalls every rank at the next collective.
            # What exists now is mostly modules: keep it out of the collector's walks.
            gc.collect()
            gc.freeze()
        return runtime


def _on_uncaught(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
    """``sys.excepthook`` while initialized: after the usual traceback, tell every peer
    that this rank is failing, so they raise PeerFailureError naming it within
    milliseconds instead of waiting for data that will never come; the ``atexit``
    shutdown that follows then only flushes that news and closes."""
    _HOLDER.previous_hook(exc_type, exc, tb)
    runtime = _HOLDER.runtime
    if runtime is not None:
        _settle_after_interrupt()
        lost = _lost_peer(exc, runtime)
        _tell_launcher(runtime.rank, lost)
        what = "interrupted (KeyboardInterrupt)" if issubclass(exc_type, KeyboardInterrupt) \
            else f"it raised {exc_type.__name__}: {exc}"
        runtime.engine.abort(what)
        _HOLDER.follower = lost is not None
        if runtime.transport_name == "mpi":
            _HOLDER.exit_code = 130 if issubclass(exc_type, KeyboardInterrupt) else 1
        elif runtime.config.max_restarts > 0 and isinstance(exc, TotalReduceError) and \
                not exc.recoverable:
            _HOLDER.exit_code = NO_RESTART


def abandon(exc: BaseException) -> None:
    """What an uncaught ``exc`` does to the world (see :func:`_on_uncaught`), for a host
    that catches it and lives on, as a Ray actor does after its task raised: tell every
    peer that this rank failed, then shut down.  Without it the peers would wait for this
    rank's next op, which never comes, for as long as the process lives."""
    runtime = _HOLDER.runtime
    if runtime is None:
        return
    if _lost_peer(exc, runtime) is None:
        runtime.engine.abort(f"it raised {type(exc).__name__}: {exc}")
    shutdown()


def _lost_peer(exc: BaseException, runtime: Runtime) -> int | None:
    """The rank whose failure this uncaught exception follows from, if it does: a
    PeerFailureError naming another rank, in the exception's chain or, when a layer in
    between dropped the chain (a C++ one: DDP, autograd), as the engine's own state."""
    seen: set[int] = set()
    chained: BaseException | None = exc
    while chained is not None and id(chained) not in seen:
        seen.add(id(chained))
        if isinstance(chained, PeerFailureError) and chained.rank != runtime.rank:
            return chained.rank
        chained = chained.__cause__ or chained.__context__
    broken = runtime.engine.broken
    if isinstance(broken, PeerFailureError) and broken.rank != runtime.rank and \
            not isinstance(exc, KeyboardInterrupt):
        return broken.rank
    return None


def _tell_launcher(rank: int, lost: int | None) -> None:
    """Leave a note for totalrun (``TOTALREDUCE_FAILURE_DIR``): this rank failed on its
    own, or because rank ``lost`` did.  The launcher names the root cause by it rather than
    by who exits first, which a slow rank (a long traceback, a loaded host) can upset."""
    folder = os.environ.get("TOTALREDUCE_FAILURE_DIR")
    if not folder:
        return
    path = os.path.join(folder, f"rank.{rank}")
    with contextlib.suppress(OSError):
        with open(path + ".tmp", "w") as f:
            f.write("origin\n" if lost is None else f"peer {lost}\n")
        os.replace(path + ".tmp", path)


def _inside_engine(frame: Any) -> bool:
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith(("totalreduce.engine", "totalreduce.transport")):
            return True
        frame = frame.f_back
    return False


def _on_sigint(signum: int, frame: Any) -> None:
    """Ctrl-C as Python delivers it (KeyboardInterrupt in the main thread), except while
    the main thread is inside the engine: there the engine raises it itself a moment
    later, between two turns of its loop, so no message is left half handled and the
    application's ``except KeyboardInterrupt`` sees exactly that, not an engine error."""
    _HOLDER.interrupted_at = time.monotonic()
    runtime = _HOLDER.runtime
    if runtime is not None and _inside_engine(frame):
        runtime.engine.interrupt()
        return
    raise KeyboardInterrupt


def _leave_after_failure() -> None:
    """Runs after ``shutdown`` at exit (registered before it), when an uncaught error
    ends this rank.  A rank failing because another did waits ``_FOLLOWER_DELAY`` first.

    With restarts (totalrun --max-restarts), an error no restart can mend leaves with
    ``NO_RESTART``, so that the launcher ends the job rather than restart into it again.

    Under MPI: MPI_Finalize waits for every other rank to finalize too, so a failing rank
    would hang there for as long as its peers run.  It leaves without finalizing instead,
    after giving its peers a moment to report the failure it sent them: mpiexec ends the
    whole job as soon as one rank exits with an error."""
    if _HOLDER.follower:
        time.sleep(_FOLLOWER_DELAY)
    code = _HOLDER.exit_code
    if code is None:
        return
    time.sleep(_MPI_FAILED_LINGER)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _settle_after_interrupt() -> None:
    if _HOLDER.interrupted_at is not None:
        time.sleep(max(0.0, _HOLDER.interrupted_at + _INTERRUPT_SETTLE - time.monotonic()))


def shutdown() -> None:
    with _HOLDER.lock:
        runtime, _HOLDER.runtime = _HOLDER.runtime, None
    if runtime is not None:
        _settle_after_interrupt()
        try:
            runtime.shutdown()
        finally:
            if runtime.config.gc_freeze:
                gc.unfreeze()


def current() -> Runtime:
    runtime = _HOLDER.runtime
    if runtime is None:
        raise ShutdownError("totalreduce is not initialized: call totalreduce.init() first")
    return runtime


def is_initialized() -> bool:
    return _HOLDER.runtime is not None


atexit.register(_leave_after_failure)
atexit.register(shutdown)
