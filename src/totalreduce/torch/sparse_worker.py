"""Sparse allreduces (Ok-Topk, TopkA, gTopk) of gradient buckets, off the backward thread.

A sparse allreduce is a chain of blocking steps (selection, then several collectives
whose sizes depend on what the previous one returned), so it cannot be one async op the
engine completes.  Run on the thread that calls backward, it stalls backward until every
step is done; here it runs on a thread of its own as soon as its bucket is ready, and
backward goes on meanwhile: the waits for peers hide behind the remaining layers, and so
does the selection's CPU work where a rank has a core to spare.

One thread per owner, and jobs run in the order submitted: the blocking collectives of
two buckets must come in the same order on every rank, or each rank would wait in a
different bucket's collective for the others.  Owners submit in an order every rank
shares (bucket index).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class SparseWorker:
    """A thread that runs submitted jobs one at a time, first in first out.

    The thread starts with the first job.  It is shut down when the worker is garbage
    collected (an idle thread per discarded optimizer would otherwise pile up).
    """

    def __init__(self, label: str) -> None:
        self._label = label
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=self._label)
            weakref.finalize(self, self._pool.shutdown, wait=False)
        return self._pool.submit(job)
