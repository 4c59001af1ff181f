"""An op as the engine sees it: its spec (what every rank must agree on, where its bytes
live, how to reduce) and its future (how the submitter learns the outcome)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..interrupts import deferred as ctrl_c
from ..memcopy import copy_array
from .schedule import Schedule

_CTRL_C_SLICE = 0.1

OpKey = tuple[int, int]  # (name hash, per-name call count)


@dataclasses.dataclass(eq=False)
class OpSpec:
    key: OpKey
    label: str                 # for messages: "allreduce 'grad.w' (call #3)"
    sig: int                   # hash of everything ranks must agree on but dtype/count
    dtype: int                 # wire dtype code
    count: int                 # element count every rank must agree on (0: not checked)
    describe: dict[str, Any]   # this rank's view, exchanged (as JSON) on a mismatch
    schedule: Schedule
    work: np.ndarray           # flat, contiguous: receives land here, most sends read here
    # Sends marked from_source read here (alltoall; allgather's own block), and a fresh
    # buffer's regions take their values from here: element i of it stands for element
    # ``source_at + i`` of ``work`` (see :meth:`source_part`).
    source: np.ndarray | None = None
    ufunc: np.ufunc | None = None      # reduction for REDUCE receives
    finalize: Callable[[np.ndarray], None] | None = None  # applied to each finished region
    priority: int = 0
    recipe: int = 0            # wire.Header.recipe: how a joined rank can serve this op
    epoch: int = -1            # wire.Header.epoch; -1: the engine stamps its own at start
    ranks: tuple[int, ...] | None = None  # who takes part (a process set); None: every rank
    # The working buffer starts undefined: REDUCE receives combine the source's region
    # with the body (schedules where each region is reduced once), and regions finished
    # without a receive are copied from the source.  Spares a copy of the input.
    fresh: bool = False
    # Its bodies may be lent to same-host peers (transport/cma.py).  A lent body is one
    # kernel copy on the reader's core, slower per byte than a memcpy; through the ring it
    # is a memcpy on each side.  So where the sender's core would sit idle meanwhile (a
    # broadcast's root) the ring is faster: 6.7-7.7 ms against 10.8-11.3 ms for 64 MB at
    # 2 ranks, unless the root copies half of it into the reader meanwhile (``spread``).
    # Elsewhere the
    # sender's core has copies or sums of its own to do.
    lend: bool = True
    # Its bodies may be lent while a ring copies slowly (transport/copy_pace.py), whatever
    # ``lend`` says; the scheduler turns it off where copying through the ring has been
    # the faster way for ops of its kind and size (scheduling/slow_rings.py).
    lend_slow: bool = True
    # At 2 ranks: ``lend_slow`` may differ from the peer's (it was decided by this rank's
    # pages or its rings' pace when the op was first made), so a Repeat's calls lend
    # while the rings are slow only where both ranks would (engine/repeat.py).
    agree_slow: bool = False
    # This rank sits idle while its peers copy its lent bodies (a broadcast's root): it
    # copies the back half of each into them meanwhile (transport/ring_push.py).
    spread: bool = False
    # Where ``source`` lies in the working buffer's coordinates: 0 for an alltoall's (each
    # block at its place in both), the rank's block for an allgather's (its input alone).
    source_at: int = 0

    def source_part(self, lo: int, hi: int) -> np.ndarray:
        """The source's elements for the working buffer's ``lo:hi``."""
        assert self.source is not None
        at = self.source_at
        return self.source[lo - at:hi - at]


def finish_local(spec: OpSpec, regions: tuple[tuple[int, int], ...]) -> None:
    """The regions this rank finishes without a receive (Schedule.local_final): taken from
    the source where the buffer starts undefined (OpSpec.fresh), then finalized."""
    assert spec.source is not None or not spec.fresh
    finish_regions(spec.work, spec.source if spec.fresh else None, spec.source_at,
                   spec.finalize, regions)


def finish_regions(work: np.ndarray, source: np.ndarray | None, at: int,
                   finalize: Callable[[np.ndarray], None] | None,
                   regions: tuple[tuple[int, int], ...]) -> None:
    """:func:`finish_local` on buffers of a call's own: each region copied from
    ``source`` (its element ``lo - at`` for the buffer's ``lo``) where one is given, then
    finalized (a Repeat keeps no spec)."""
    for lo, hi in regions:
        if hi > lo:
            if source is not None:
                copy_array(work[lo:hi], source[lo - at:hi - at])
            if finalize is not None:
                finalize(work[lo:hi])


# A gathering op's own block up to this size is copied into place after the op's
# receives (copied_last), bigger ones before its sends (the loop) or right after them (the
# express lane).  Last, the copy overlaps the wait for the peer's read of what we lent it,
# and the peer reads our block while we read its; but the copy then reads the input from
# memory, where first it had warmed the cache the peer's read then finds.  At 2 ranks,
# one job per way, alternated three times: 8 MB alltoalls (4 MiB blocks) took 0.59-0.68
# ms last against 0.74-0.81 first; 16 MB ones as long either way; 64 MB 7.40-7.99 against
# 7.19-7.51, 256 MB 31.1-35.5 against 29.4-30.1 (allgathers alike: 64 MB 8.09-9.27
# against 7.65-8.64).
COPY_LAST_MAX = 4 << 20


def copied_last(spec: OpSpec, regions: tuple[tuple[int, int], ...]) -> bool:
    """Whether ``spec``'s own ``regions`` (a gathering op's block, OpSpec.fresh) are
    copied from its source after its receives (COPY_LAST_MAX)."""
    if not spec.fresh or spec.ufunc is not None:
        return False
    return sum(hi - lo for lo, hi in regions) * spec.work.itemsize <= COPY_LAST_MAX


class OpFuture:
    """Completion of one op; resolved by whichever thread runs the engine loop, waited on
    anywhere.  ``waiter`` (the engine's) lets a waiting thread run the loop itself."""

    __slots__ = ("_done", "_event", "_error", "_callbacks", "_waiter")

    # One lock for every future: it is held for a few field writes only (callbacks run
    # outside it), and a lock per future cost a third of a small op's bookkeeping.
    _lock = threading.Lock()

    def __init__(self, waiter: Callable[[OpFuture, float | None], bool] | None = None
                 ) -> None:
        self._done = False
        # Created only if some thread must sleep on it: a waiter that drives the loop
        # itself never does, and an Event costs a Condition and two locks.
        self._event: threading.Event | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[OpFuture], None]] | None = None  # made on first use
        self._waiter = waiter

    def done(self) -> bool:
        return self._done

    def error(self) -> BaseException | None:
        return self._error

    def wait_done(self, timeout: float | None = None) -> bool:
        """Block until resolved (driving the engine meanwhile if the future's waiter
        does); False if ``timeout`` seconds pass first."""
        if self._done:
            return True
        if self._waiter is not None:
            return self._waiter(self, timeout)
        return self.wait_event(timeout)

    def wait_event(self, timeout: float | None = None) -> bool:
        """Sleep until resolved, without driving the engine.  Ctrl-C meanwhile is kept by
        our handler (interrupts.py), which cannot wake the sleep: it is checked every
        ``_CTRL_C_SLICE`` seconds and raised here."""
        with self._lock:
            if self._done:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = _CTRL_C_SLICE if deadline is None else \
                min(_CTRL_C_SLICE, deadline - time.monotonic())
            if event.wait(max(0.0, left)):
                return True
            if ctrl_c.pending:
                ctrl_c.raise_if_pending()
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def add_done_callback(self, fn: Callable[[OpFuture], None]) -> None:
        with self._lock:
            if not self._done:
                if self._callbacks is None:
                    self._callbacks = [fn]
                else:
                    self._callbacks.append(fn)
                return
        fn(self)

    @staticmethod
    def resolve_all(futures: Iterable[OpFuture], error: BaseException | None = None
                    ) -> None:
        """Resolve each of ``futures`` not done yet with ``error`` (None: success), taking
        the lock once (a fused op finishes thousands of tiny tensors' futures at once);
        wake their waiters and run their callbacks outside it."""
        woken = []
        with OpFuture._lock:
            for future in futures:
                if future._done:
                    continue
                future._error = error
                future._done = True
                if future._event is not None or future._callbacks is not None:
                    woken.append((future, future._event, future._callbacks))
                    future._callbacks = None
        for future, event, callbacks in woken:
            if event is not None:
                event.set()
            if callbacks is not None:
                for fn in callbacks:
                    fn(future)

    def resolve(self, error: BaseException | None = None) -> None:
        OpFuture.resolve_all((self,), error)
