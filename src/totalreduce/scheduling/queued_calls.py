"""Calls run from their template's Repeat where calls queue (2 ranks on the
shared-memory rings, SelfGuided._queues): async allreduces and grouped parts queued for
the loop's driver (Engine.submit_repeat), and a blocking grouped call's parts run on the
caller's thread (a mixin of SelfGuided)."""

from __future__ import annotations

import functools

import numpy as np

from ..engine.payload import OpFuture, OpKey
from ..engine.repeat import Repeat
from ..interrupts import deferred as ctrl_c
from .call_names import UNNAMED, CallNames
from .handle import FutureHandle, Handle
from .scheduler_parts import SchedulerParts
from .templates import OpTemplate

# The identity a Repeat is built with: it keeps none of its template's (repeat.py).
NO_CALL: OpKey = (0, 0)


def nothing() -> None:
    return None


class QueuedCalls(SchedulerParts):
    """SelfGuided's calls from a template's Repeat; SelfGuided sets what is declared
    here."""

    _names: CallNames
    _tag: str
    _queues: bool
    _direct_ring: int
    _queued_big: int

    def _queue_repeat(self, plan: OpTemplate, x: np.ndarray, name: str | None,
                      inplace: bool) -> Handle | None:
        """An async allreduce like one made before, queued (:meth:`_queued`); None,
        nothing done, where it cannot be (submit it).  Not in place, its input's copy is
        the call's own work, no gap in a burst (Loop.queuing_calls): a 2 MB one took past
        the 200 us grace, and the calls queued before it went to the general path."""
        if inplace:
            queued = self._queued(plan, x if x.ndim == 1 else x.ravel(), "allreduce", name)
            result = x
        else:
            with self._engine.queuing_calls():
                work = x.flatten()
                queued = self._queued(plan, work, "allreduce", name)
            result = work.reshape(x.shape)
        if queued is None:
            return None
        return FutureHandle([queued[0]], lambda: result, queued[1])

    def _part_now(self, plan: OpTemplate, work: np.ndarray, name: str | None
                  ) -> list[OpFuture] | None:
        """A blocking grouped allreduce's part like one made before, run from its plan's
        Repeat on this thread where calls queue (as _queued would, blocking): the futures
        it left to wait for (none where it ran to its end here; the general path's where
        it went on there, failing at ``wait()`` as a part does, the parts after it still
        going).  None, nothing done, where it cannot run that way (submit its spec)."""
        repeat = self._repeat_of(plan, work, "grouped_allreduce", name)
        if repeat is None:
            return None
        ident = self._names.next_call((UNNAMED if name is None else name) + self._tag)
        ran = repeat.run(work, ident)
        if ran is False:
            # Not begun: its spec, as any call's, under the identity it has taken.
            spec = repeat.spec(work, ident)
            return list(self._launch(spec, nothing, self._direct_ring).futures)
        if ran is True:
            ctrl_c.raise_if_pending()
            return []
        return [ran]

    def _repeat_of(self, plan: OpTemplate, work: np.ndarray, kind: str, name: str | None
                   ) -> Repeat | None:
        """The Repeat that runs calls of ``plan`` into ``work`` where calls queue (made
        once); None where they do not, past _queued_big, or for an op that reads its
        input in place (never async).

        While the rings copy slowly too: the Repeat lends where the loop would (as
        _big_allreduce's).  At 2 ranks on a VM whose rings were taken for slow, calls of
        8 MiB and more had gone to the loop then, and ResNet-50's 29 gradients of 1 MB
        and more, async at once, took 35.4-36.7 ms that way against 21.2-24.9 queued (the
        three of 9.4 MB); in `bench replay`, per tensor, ResNet-50's took 37.8-42.0
        against 29.5-32.2 and BERT-base's (24 of 9.4 MB) were level, 139-147 against
        139-148 (alternated four times)."""
        if not self._queues or work.nbytes > self._queued_big or plan.fresh:
            return None
        return self._plan_repeat(plan, work, kind, name)

    def _plan_repeat(self, plan: OpTemplate, work: np.ndarray, kind: str,
                     name: str | None, source: np.ndarray | None = None) -> Repeat | None:
        """``plan``'s Repeat, made the first time it is asked for (None where the engine
        cannot make one: Engine.repeat).  Its calls lend their pieces where the loop would
        (and, where the ranks may differ on that, where the peer's would too: repeat.py)."""
        if plan.repeat is None and not plan.repeat_tried:
            plan.repeat_tried = True
            plan.repeat = self._engine.repeat(
                plan.spec(NO_CALL, "", work, 0, self._members, source),
                functools.partial(self._label, kind, name), lends=True)
        return plan.repeat

    def _queued(self, plan: OpTemplate, work: np.ndarray, kind: str, name: str | None
                ) -> tuple[OpFuture, str] | None:
        """An async reduction into ``work`` made from ``plan``, queued for the loop's
        driver to run from the plan's Repeat (Engine.submit_repeat): its future and
        label.  None, nothing done, where it cannot run that way (submit its spec): where
        calls do not queue (``_queues``), past _queued_big, or an op that reads its input
        in place (never async)."""
        repeat = self._repeat_of(plan, work, kind, name)
        if repeat is None:
            return None
        ident = self._names.next_call((UNNAMED if name is None else name) + self._tag)
        return self._engine.submit_repeat(repeat, work, ident), repeat.label(ident[1])
