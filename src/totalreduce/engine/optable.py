"""The op table: every op running here, which ops have finished, and the ops a peer
failed before this rank submitted them.  An op's own state lives in its :class:`LiveOp`;
how it ends (``finished``, ``forgotten``) is decided here and nowhere else."""

from __future__ import annotations

import time
from collections.abc import Callable

from ..exceptions import PeerFailureError
from ..lru import LRU
from ..timeline import Timeline
from .opstate import LiveOp
from .payload import OpKey

_FAILED_EARLY_ENTRIES = 4096


class OpTable:
    def __init__(self, timeline: Timeline | None = None) -> None:
        self.timeline = timeline
        self.active: dict[OpKey, LiveOp] = {}
        # How many active ops have each priority: whether any may pass another is then a
        # look at a few keys, not at every op (hundreds of per-tensor ops in flight).
        self.priorities: dict[int, int] = {}
        self.done = DoneSet()
        # Ops a peer failed before we submitted them (OP_FAILED), with the error to raise.
        self.failed_early: LRU[OpKey, PeerFailureError] = LRU(_FAILED_EARLY_ENTRIES)
        self._on_fail: list[Callable[[OpKey], None]] = []

    def on_fail(self, forget: Callable[[OpKey], None]) -> None:
        """Have ``forget(key)`` called whenever an op fails, after its future is resolved:
        the parts that keep something per op (parked pieces, mismatch views) drop it."""
        self._on_fail.append(forget)

    def open(self, op: LiveOp) -> None:
        """``op`` runs here from now on."""
        self.active[op.spec.key] = op
        priority = op.spec.priority
        self.priorities[priority] = self.priorities.get(priority, 0) + 1

    def _closed(self, op: LiveOp) -> None:
        """``op`` left ``active``."""
        priority = op.spec.priority
        left = self.priorities[priority] - 1
        if left:
            self.priorities[priority] = left
        else:
            del self.priorities[priority]

    def known(self, key: OpKey) -> bool:
        """Whether op ``key`` runs here or has ended here."""
        return key in self.active or key in self.done

    def live(self) -> list[LiveOp]:
        return list(self.active.values())

    def forget(self, name_key: int) -> None:
        """The scheduler forgot this name: its next call is 0 again.  An op of it still
        running must not be counted finished when it ends, or that record would outlive
        the forgetting and swallow a later use's messages."""
        self.done.forget(name_key)
        for key, op in self.active.items():
            if key[0] == name_key:
                op.forgotten = True

    def _finished(self, op: LiveOp) -> None:
        if not op.forgotten:
            self.done.add(op.spec.key)

    def complete(self, op: LiveOp) -> None:
        """Resolve ``op`` if its last message came and its last went."""
        if op.recvs_left == 0 and op.sends_left == 0 and not op.finished:
            op.finished = True
            del self.active[op.spec.key]
            self._closed(op)
            self._finished(op)
            if self.timeline is not None and self.timeline.active:
                self._trace(op)
            op.future.resolve(None)

    def fail(self, op: LiveOp, error: BaseException) -> None:
        """Fail ``op`` with ``error`` (nothing if it has ended already)."""
        if op.finished:
            return
        op.finished = True
        key = op.spec.key
        if self.active.pop(key, None) is not None:
            self._closed(op)
        self._finished(op)
        if self.timeline is not None and self.timeline.active:
            self._trace(op, "FAILED ")
        op.future.resolve(error)
        for forget in self._on_fail:
            forget(key)

    def ran(self, key: OpKey) -> None:
        """Op ``key`` ran to its end outside the table (the small path): count it ended."""
        self.done.add(key)

    def tracing(self) -> bool:
        """Whether ops are traced on a timeline now."""
        return self.timeline is not None and self.timeline.active

    def refuse(self, key: OpKey) -> None:
        """Op ``key`` will not run here (a peer it needs has left or failed it, or a joined
        rank cannot serve it): count it ended, so its late messages are discarded."""
        self.done.add(key)

    def _trace(self, op: LiveOp, prefix: str = "") -> None:
        """The op's spans on the timeline: the op, its wait for a peer's first piece, and
        how long pieces sent ahead of it waited here for it."""
        assert self.timeline is not None
        spec = op.spec
        name = str(spec.describe.get("name") or spec.label)
        now = time.monotonic()
        kind = str(spec.describe.get("kind", "op")).upper()
        self.timeline.span(name, prefix + kind, op.t_start, now)
        if op.t_first > op.t_start:
            self.timeline.span(name, "WAIT_FOR_PEER", op.t_start, op.t_first)
        if 0 < op.t_floated < op.t_start:
            self.timeline.span(name, "FLOATING", op.t_floated, op.t_start)


class DoneSet:
    """Which call counts of each name have finished here (a watermark plus stragglers).

    One entry per name the scheduler remembers: it calls :meth:`forget` for each name it
    forgets, which bounds this table by ``name_capacity``."""

    def __init__(self) -> None:
        self._low: dict[int, int] = {}
        self._above: dict[int, set[int]] = {}

    def add(self, key: OpKey) -> None:
        name, seq = key
        low = self._low.get(name, 0)
        if seq < low:
            return
        if seq == low and name not in self._above:  # in order, as nearly every op ends
            self._low[name] = low + 1
            return
        above = self._above.setdefault(name, set())
        above.add(seq)
        while low in above:
            above.discard(low)
            low += 1
        self._low[name] = low
        if not above:
            del self._above[name]

    def names(self) -> int:
        return len(self._low.keys() | self._above.keys())

    def forget(self, name: int) -> None:
        self._low.pop(name, None)
        self._above.pop(name, None)

    def __contains__(self, key: OpKey) -> bool:
        name, seq = key
        return seq < self._low.get(name, 0) or seq in self._above.get(name, ())
