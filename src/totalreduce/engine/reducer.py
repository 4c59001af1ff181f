"""Reductions, and the optional reduce thread that runs the large ones.

Small reductions run inline on the progress thread: handing them to another thread costs a
GIL hand-off (~100 us on a loaded 2-core host), more than the add itself.  Large ones go to
the reduce thread, so the progress loop keeps reading the next piece off the socket while
numpy (which releases the GIL) adds this one.  ``TOTALREDUCE_REDUCE_THREAD_BYTES`` sets the
cut-over; it is off by default because on 2 cores the hand-off lost (numbers in config.py).
Every reduction writes into the destination with ``out=``: no temporaries.
"""

from __future__ import annotations

import contextlib
import queue
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from ..threads import start_daemon


def _quiet_state() -> tuple[Any, Any] | None:
    """numpy's floating-point error state as a context variable, and its value with every
    error ignored: setting it is what ``np.errstate(all="ignore")`` does, without building
    the context manager, which cost 0.7 us of a 2-element reduction's 1.1 (numpy 2).  None
    where numpy keeps it otherwise (then np.errstate is used)."""
    try:
        from numpy._core._ufunc_config import (  # type: ignore[attr-defined]
            _extobj_contextvar as var,
        )
    except ImportError:
        return None
    with np.errstate(all="ignore"):
        return var, var.get()


QUIET = _quiet_state()


def reduce_into(ufunc: np.ufunc, dest: np.ndarray, incoming: Any,
                left: np.ndarray | None = None) -> None:
    """``dest = ufunc(left, incoming)``; ``left`` defaults to ``dest`` itself."""
    n = dest.size
    if not n:
        return
    dtype = dest.dtype
    # Positional arguments: numpy parses keywords to frombuffer at twice the cost of the
    # call itself, on every small op.
    src = _frombuffer(incoming, dtype, n)
    if left is None:
        left = dest
    # The output by keyword: numpy 2.4 deprecates a third positional argument to maximum
    # and minimum (40 ns a call more than positional).
    if dtype.kind not in "fc":
        ufunc(left, src, out=dest)  # integer arrays wrap without a warning
        return
    # Overflow to inf is the defined result (as in MPI), not an error to print from a
    # background thread, nor to raise where the caller's np.seterr says "raise".
    if QUIET is None:
        with np.errstate(all="ignore"):
            ufunc(left, src, out=dest)
        return
    var, quiet = QUIET
    token = var.set(quiet)
    try:
        ufunc(left, src, out=dest)
    finally:
        var.reset(token)


_frombuffer = np.frombuffer


def size_class(nbytes: int) -> int:
    """The buffer size that serves a request of ``nbytes``: eight classes per power of two
    from 4 KiB (at most 1/8 wasted), so bodies whose sizes vary every step share buffers
    instead of each size keeping its own."""
    if nbytes <= 4096:
        return 4096
    step = 1 << (nbytes - 1).bit_length() - 4
    return -(-nbytes // step) * step


class ScratchPool:
    """Reusable receive buffers, so steady-state ops allocate nothing (a fresh 1 MiB
    bytearray costs 256 page faults).

    Buffers come in :func:`size_class` sizes; ``get`` hands out a view of exactly the
    bytes asked for (out of a buffer of its class, else of a larger idle one of up to
    twice the size) and ``put`` takes that view back.  At most ``cap`` bytes of buffers
    are kept idle: past it the classes used least recently are freed first.
    """

    def __init__(self, cap: int) -> None:
        self._free: OrderedDict[int, list[bytearray]] = OrderedDict()
        self._cap = cap
        self.idle_bytes = 0

    def get(self, nbytes: int) -> memoryview:
        cls = size_class(nbytes)
        free = self._free.get(cls)
        if not free:
            # An idle buffer of a larger class, up to twice the size, rather than a fresh
            # one: ops in flight together change from step to step (ranks ready in their
            # own order), and at 2 ranks under the skew benchmark three in four misses
            # had one idle while a fresh buffer's page faults and zeroing cost 0.1-0.5 ms
            # per MiB, on the path of the op that wanted it.
            spare = min((c for c in self._free if cls < c <= 2 * cls), default=0)
            if spare:
                cls, free = spare, self._free[spare]
        if free:
            self.idle_bytes -= cls
            buf = free.pop()
            if free:
                self._free.move_to_end(cls)
            else:
                del self._free[cls]  # the eviction loop expects no empty classes
        else:
            buf = bytearray(cls)
        return memoryview(buf)[:nbytes]

    def put(self, view: memoryview) -> None:
        buf = view.obj
        assert isinstance(buf, bytearray)
        cls = len(buf)
        if cls > self._cap:
            return
        free = self._free.get(cls)
        if free is None:
            free = self._free[cls] = []
        self._free.move_to_end(cls)
        free.append(buf)
        self.idle_bytes += cls
        while self.idle_bytes > self._cap:
            stale = next(iter(self._free))
            bufs = self._free[stale]
            bufs.pop()
            self.idle_bytes -= stale
            if not bufs:
                del self._free[stale]


class ReduceThread:
    """Runs reduction jobs in order; reports each back through ``on_done`` + ``wake``."""

    def __init__(self, on_done: Callable[[Any], None], wake: Callable[[], None]) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._on_done = on_done
        self._wake = wake
        self._thread = start_daemon(self._run, "totalreduce-reduce")

    def submit(self, ufunc: np.ufunc, dest: np.ndarray, incoming: Any, token: Any,
               left: np.ndarray | None = None) -> None:
        self._jobs.put((ufunc, dest, incoming, token, left))

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            ufunc, dest, incoming, token, left = job
            error: BaseException | None = None
            try:
                reduce_into(ufunc, dest, incoming, left)
            except BaseException as exc:  # reported to the op, never lost
                error = exc
            self._on_done((token, error))
            self._wake()

    def stop(self) -> None:
        self._jobs.put(None)
        with contextlib.suppress(RuntimeError):
            self._thread.join(timeout=5.0)
