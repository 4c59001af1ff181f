"""Tensor fusion (negotiated mode): adjacent allreduce responses that share a dtype and a
reduction travel as one engine op, up to ``TOTALREDUCE_FUSION_THRESHOLD`` bytes.

Their inputs are copied into a fusion buffer, reduced in place as one op, and copied back
out.  Buffers are reused: a fused op holds one until it finishes (the next cycle's fused op
may start before that), and the idle ones kept are bounded by bytes (the threshold: what
one cycle's fused ops of one dtype need at most).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np

from .requests import Request


def groups(requests: list[Request], threshold: int
           ) -> Iterator[tuple[list[Request], int]]:
    """Runs of adjacent allreduces with one dtype and op, each within ``threshold`` bytes,
    with their bytes; everything else (and every tensor when ``threshold`` is 0) alone.
    A request's params are its response's: the cache or the coordinator found them
    equal."""
    run: list[Request] = []
    size = 0
    dtype = op = None  # the run's
    for request in requests:
        params = request.params
        array = request.array
        nbytes = 0 if array is None else array.nbytes
        if params[1] == dtype and params[3] == op and params[0] == "allreduce" and \
                size + nbytes <= threshold and run:
            run.append(request)
            size += nbytes
            continue
        if run:
            yield run, size
        if threshold and params[0] == "allreduce" and nbytes <= threshold:
            run, size, dtype, op = [request], nbytes, params[1], params[3]
        else:
            run, size, dtype, op = [], 0, None, None
            yield [request], nbytes
    if run:
        yield run, size


class FusionBuffers:
    def __init__(self, idle_bytes: int) -> None:
        self._idle: dict[np.dtype, list[np.ndarray]] = {}
        self._idle_bytes = idle_bytes
        self._lock = threading.Lock()  # taken on the cycle thread, given back by the loop

    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for bufs in self._idle.values() for b in bufs)

    def take(self, dtype: np.dtype, count: int) -> np.ndarray:
        with self._lock:
            idle = self._idle.get(dtype, [])
            for i, buf in enumerate(idle):
                if buf.size >= count:
                    return idle.pop(i)[:count]
        return np.empty(max(count, 1), dtype)[:count]

    def give(self, buf: np.ndarray) -> None:
        base = buf.base if isinstance(buf.base, np.ndarray) else buf
        with self._lock:
            idle = self._idle.setdefault(base.dtype, [])
            idle.append(base)
            idle.sort(key=lambda b: b.size)
            while idle and sum(b.nbytes for b in idle) > self._idle_bytes:
                idle.pop(0)  # the smallest goes: the big ones are the costly ones to make
