"""broadcast, for the self-guided scheduler (a mixin of SelfGuided).

A repeated call takes its template (templates.py) instead of the checks and set-up; a
blocking one small enough for the caller's thread runs from the template's Repeat."""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np

from ..lru import LRU
from .call_names import Ident
from .checks import check_broadcast
from .handle import FutureHandle, Handle
from .scheduler_parts import SchedulerParts
from .slow_rings import SlowRingChoice
from .templates import OpTemplate, broadcast_key
from .thresholds import LENT_WHEN_SLOW
from .views import with_algorithm


class BroadcastOps(SchedulerParts):
    """SelfGuided's broadcast; SelfGuided sets what is declared here."""

    _direct_broadcast: int
    _broadcasts: LRU[tuple[Any, ...], tuple[OpTemplate, int]]

    def broadcast(self, x: Any, root_rank: int, name: str | None, priority: int,
                  inplace: bool) -> Handle:
        key = broadcast_key(x, root_rank, name, inplace)
        kept = None
        if key is not None:
            with self._lock:
                kept = self._broadcasts.get(key)
        if kept is None:
            arr, root = check_broadcast(x, root_rank, name, inplace, self.size,
                                        self._members)
        else:
            arr, root = x, kept[1]
        call_key, label = self._call("broadcast", name)
        work, writeback = self._broadcast_buffer(arr, root, inplace)
        if kept is not None:
            template = kept[0]
            spec = template.spec(call_key, label, work, priority, self._members)
            if not template.repeat_tried and not priority:
                template.repeat_tried = True
                if self._repeats_broadcast(work.nbytes):
                    # At 2 ranks the root's Repeat lends its pieces, and copies half of
                    # each into the peer as it copies the other half (repeat.py), or
                    # lends them where huge pages back them.
                    template.repeat = self._engine.repeat(
                        spec, functools.partial(self._label, "broadcast", name),
                        lends_one_way=self.size == 2 and self.rank == root)
        else:
            schedule, algorithm = self._algorithms.broadcast(root, work.size, arr.dtype)

            def view() -> dict[str, Any]:
                return {"kind": "broadcast", "dtype": str(arr.dtype),
                        "shape": list(arr.shape), "root": int(root_rank)}

            spec = self._spec(Ident(call_key, name, label),
                              with_algorithm(view, algorithm), arr.dtype, work.size,
                              schedule, work, priority,
                              ("broadcast", arr.dtype, arr.shape, root, algorithm),
                              lend=self.rank != root)
            if key is not None:
                with self._lock:
                    self._broadcasts.put(key, (OpTemplate(spec), root))

        def finish() -> np.ndarray:
            return _broadcast_result(arr, work, writeback, inplace)

        if (self.rank == root and (self.size == 2 or work.nbytes > self._direct_broadcast)
                and self._engine.waits_here()
                and self._engine.spreads(self._peers, work.nbytes)):
            # The root lends its bodies and, idle otherwise, copies the back half of each
            # into its peer while the peer copies the front (transport/ring_link.py).
            if self.size == 2:
                spec.lend = spec.spread = spec.lend_slow = True
                return FutureHandle([self._engine.submit(spec)], finish, spec.label)
            # Past 2 ranks, where the next rank passes each piece on, that way is timed
            # against the rings' and the faster taken (not measured there against the
            # rings, with a core per rank, since the root copies half).
            key = SlowRingChoice.key("broadcast spread", work.nbytes)
            spread = self._slow_rings.leave(key)
            spec.lend = spec.spread = spec.lend_slow = spread
            timed = self._slow_rings.timed(finish, key, spread)  # submit() may run it
            return FutureHandle([self._engine.submit(spec)], timed, spec.label)
        return self._launch(spec, finish, self._direct_broadcast, slow_from=LENT_WHEN_SLOW)

    def _repeats_broadcast(self, nbytes: int) -> bool:
        """Whether blocking broadcasts of ``nbytes`` may run from a Repeat: those that
        :meth:`_launch` runs on the caller's thread (from LENT_WHEN_SLOW, only while the
        rings copy fast, or where that has been faster: :meth:`broadcast_now`), and at 2
        ranks any whose root copies half of what it lends into its peer."""
        return self._direct_bytes > 0 and (nbytes <= self._direct_broadcast
                                           or self._pushes(nbytes))

    def _pushes(self, nbytes: int) -> bool:
        """Whether a 2-rank broadcast of ``nbytes`` is lent, its root copying half of it
        into the receiver (Engine.spreads, which both ranks answer alike)."""
        return self.size == 2 and self._engine.spreads(self._peers, nbytes)

    def broadcast_now(self, x: Any, root_rank: Any, name: str | None, priority: int,
                      inplace: bool) -> np.ndarray | None:
        """A blocking broadcast like one made before, small enough to run on this thread
        from its template's Repeat: its result, as :meth:`allreduce_now`.  None, with
        nothing done, where it is not one: call :meth:`broadcast` and wait."""
        key = broadcast_key(x, root_rank, name, inplace)
        if key is None or priority:
            return None
        with self._lock:
            kept = self._broadcasts.get(key)
        if kept is None or kept[0].repeat is None:
            return None
        arr: np.ndarray = x
        # One whose root copies half of what it lends runs here on both ranks (the
        # rings' pace does not matter to it).
        here, slow = (True, None) if self._pushes(arr.nbytes) else \
            self._repeat_way("broadcast", arr.nbytes)
        if not here:
            return None
        start = time.perf_counter()
        work, writeback = self._broadcast_buffer(arr, kept[1], inplace)
        self._repeat(kept[0].repeat, work, name)
        if slow is not None:
            self._slow_rings.took(slow, False, time.perf_counter() - start)
        return _broadcast_result(arr, work, writeback, inplace)

    def _broadcast_buffer(self, arr: np.ndarray, root: int, inplace: bool
                          ) -> tuple[np.ndarray, bool]:
        """The buffer the op runs in, and whether the result is copied back into
        ``arr``: the root's data (or an in-place caller's array), else a new one."""
        if self.rank == root or inplace:
            return self._working_copy(arr, inplace)
        return np.empty(arr.size, arr.dtype), False


def _broadcast_result(arr: np.ndarray, work: np.ndarray, writeback: bool, inplace: bool
                      ) -> np.ndarray:
    """What the call returns once ``work`` holds the root's data."""
    if writeback:
        arr[...] = work.reshape(arr.shape)
    return arr if inplace else work.reshape(arr.shape)
