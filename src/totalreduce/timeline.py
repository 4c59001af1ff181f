"""The timeline: a Chrome trace (JSON array of trace events) of what each tensor went
through, for chrome://tracing or Perfetto (``TOTALREDUCE_TIMELINE=path.json``).

One row per tensor name; each phase is a complete event ("ph": "X") with its start and
duration in microseconds.  Negotiated mode writes NEGOTIATE (first request to ready on
every rank), QUEUE (ready to started), the copies in and out of the fusion buffer and
the collective itself;
self-guided mode writes the collective, the part of it spent waiting for a peer's first
data (WAIT_FOR_PEER), and how long data sent ahead waited here for its op (FLOATING).

Events are written as they happen (flushed at least every 50 ms) and the array is only
closed at shutdown: the trace format allows the closing bracket to be missing, so the
trace of a process that died mid-run still loads.  Rank 0 writes the path it is given;
rank r > 0 writes ``path.r``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import IO

from .lru import LRU

_FLUSH_EVERY = 0.05
_ROWS = 1 << 16  # tensor names with a row of their own; older ones give theirs up


def timeline_path(path: str, rank: int) -> str:
    return path if rank == 0 else f"{path}.{rank}"


class Timeline:
    """A trace that is written between :meth:`start` and :meth:`close` (from ``init()``
    when ``TOTALREDUCE_TIMELINE`` is set, or by ``start_timeline()``); while it is not
    :attr:`active` the tracing code skips its work."""

    def __init__(self, path: str | None, rank: int) -> None:
        self._rank = rank
        self._file: IO[str] | None = None
        # Whether a trace is being written: a plain attribute, not a property, since every
        # small op asks.
        self.active = False
        self._lock = threading.Lock()
        self._rows: LRU[str, int] = LRU(_ROWS, self._row_freed)
        self._free_rows: list[int] = []
        self._next_row = 1
        self._epoch = self._flushed = time.monotonic()
        if path:
            self.start(path)

    def start(self, path: str) -> None:
        """Write to ``path`` from now on (a trace being written is closed first)."""
        self.close()
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        with self._lock:
            self._file = open(path, "w")  # noqa: SIM115 - open until close()
            self._file.write("[\n")
            self.active = True
            # A new file needs its rows named again.
            self._rows = LRU(_ROWS, self._row_freed)
            self._free_rows = []
            self._next_row = 1
            self._epoch = self._flushed = time.monotonic()
            self._meta("process_name", 0, f"rank {self._rank}")

    def span(self, tensor: str, phase: str, start: float, end: float) -> None:
        """``tensor`` was in ``phase`` from ``start`` to ``end`` (time.monotonic())."""
        with self._lock:
            if self._file is None:
                return
            row = self._row(tensor)
            self._write({"name": phase, "ph": "X", "pid": self._rank, "tid": row,
                         "ts": round((start - self._epoch) * 1e6, 1),
                         "dur": round(max(0.0, end - start) * 1e6, 1)})

    def close(self) -> None:
        with self._lock:
            if self._file is None:
                return
            self._file.write(json.dumps({"name": "end", "ph": "i", "s": "p", "pid": self._rank,
                                         "tid": 0, "ts": self._now()}) + "\n]\n")
            self.active = False
            self._file.close()
            self._file = None

    # --- with the lock held ---------------------------------------------------------------

    def _row(self, tensor: str) -> int:
        row = self._rows.get(tensor)
        if row is None:
            row = self._free_rows.pop() if self._free_rows else self._next_row
            if row == self._next_row:
                self._next_row += 1
            self._rows.put(tensor, row)
            self._meta("thread_name", row, tensor.replace("\x00", "~"))
        return row

    def _row_freed(self, _tensor: str, row: int) -> None:
        self._free_rows.append(row)

    def _meta(self, what: str, row: int, name: str) -> None:
        self._write({"name": what, "ph": "M", "pid": self._rank, "tid": row,
                     "args": {"name": name}})

    def _write(self, event: dict[str, object]) -> None:
        assert self._file is not None
        self._file.write(json.dumps(event, separators=(",", ":")) + ",\n")
        now = time.monotonic()
        if now - self._flushed > _FLUSH_EVERY:
            self._file.flush()
            self._flushed = now

    def _now(self) -> float:
        return round((time.monotonic() - self._epoch) * 1e6, 1)
