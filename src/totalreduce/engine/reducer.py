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
import threading
from collections.abc import Callable
from typing import Any

import numpy as np


def reduce_into(ufunc: np.ufunc, dest: np.ndarray, incoming: Any) -> None:
    if dest.size == 0:
        return
    src = np.frombuffer(incoming, dtype=dest.dtype, count=dest.size)
    # Overflow to inf or a wrapped integer is the defined result (as in MPI), not an error
    # to print from a background thread.
    with np.errstate(all="ignore"):
        ufunc(dest, src, out=dest)


class ScratchPool:
    """Reusable receive buffers keyed by size, so steady-state ops allocate nothing."""

    def __init__(self, keep: int = 8) -> None:
        self._free: dict[int, list[bytearray]] = {}
        self._keep = keep

    def get(self, nbytes: int) -> bytearray:
        free = self._free.get(nbytes)
        return free.pop() if free else bytearray(nbytes)

    def put(self, buf: bytearray) -> None:
        free = self._free.setdefault(len(buf), [])
        if len(free) < self._keep:
            free.append(buf)


class ReduceThread:
    """Runs reduction jobs in order; reports each back through ``on_done`` + ``wake``."""

    def __init__(self, on_done: Callable[[Any], None], wake: Callable[[], None]) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._on_done = on_done
        self._wake = wake
        self._thread = threading.Thread(target=self._run, name="totalreduce-reduce",
                                        daemon=True)
        self._thread.start()

    def submit(self, ufunc: np.ufunc, dest: np.ndarray, incoming: Any, token: Any) -> None:
        self._jobs.put((ufunc, dest, incoming, token))

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            ufunc, dest, incoming, token = job
            error: BaseException | None = None
            try:
                reduce_into(ufunc, dest, incoming)
            except BaseException as exc:  # reported to the op, never lost
                error = exc
            self._on_done((token, error))
            self._wake()

    def stop(self) -> None:
        self._jobs.put(None)
        with contextlib.suppress(RuntimeError):
            self._thread.join(timeout=5.0)
