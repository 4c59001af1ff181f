"""What the self-guided scheduler's parts (gathering.py, broadcasting.py) share with it:
the state SelfGuided sets, the methods it defines for them, and the one they share."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..engine.algorithms import Algorithms
from ..engine.driving import CallerWaits
from ..engine.engine import Engine
from ..engine.payload import OpFuture, OpKey, OpSpec
from ..engine.repeat import Repeat
from ..engine.schedule import Schedule
from .call_names import CallNames, Ident
from .handle import Handle
from .slow_rings import SlowRingChoice
from .thresholds import LENT_WHEN_SLOW


class SchedulerParts:
    """A base of SelfGuided's mixins; SelfGuided sets what is declared here."""

    size: int
    rank: int
    _engine: Engine
    _lock: threading.Lock
    _members: tuple[int, ...] | None
    _algorithms: Algorithms
    _direct_bytes: int
    _peers: list[int]
    _slow_rings: SlowRingChoice
    _caller_waits: CallerWaits
    _names: CallNames
    _tag: str  # appended to every name: a process set's calls count apart

    if TYPE_CHECKING:  # SelfGuided's
        def _call(self, kind: str, name: str | None, phase: str = ""
                  ) -> tuple[OpKey, str]: ...

        def _ident(self, kind: str, name: str | None, phase: str = "") -> Ident: ...

        def _label(self, kind: str, name: str | None, seq: int) -> str: ...

        def _spec(self, ident: Ident, view: dict[str, Any] | Callable[[], dict[str, Any]],
                  dtype: np.dtype, count: int, schedule: Schedule, work: np.ndarray,
                  priority: int, known: tuple[Any, ...] | None = None,
                  shown: dict[str, Any] | Callable[[], dict[str, Any]] | None = None,
                  **kw: Any) -> OpSpec: ...

        def _launch(self, spec: OpSpec, finish: Callable[[], Any],
                    direct: int | None = None, slow_from: int | None = None
                    ) -> Handle: ...

        def _working_copy(self, arr: np.ndarray, inplace: bool
                          ) -> tuple[np.ndarray, bool]: ...

        def _repeat(self, repeat: Repeat, work: np.ndarray, name: str | None,
                    source: np.ndarray | None = None) -> None: ...

        def _repeat_ended(self, repeat: Repeat, work: np.ndarray, ident: OpKey,
                          source: np.ndarray | None, ran: OpFuture | bool) -> None: ...

    def _repeat_way(self, kind: str, nbytes: int) -> tuple[bool, tuple[str, int] | None]:
        """Whether a blocking call of ``kind`` and ``nbytes`` runs from its Repeat now; and,
        while the rings copy slowly, the key to time it under as the caller's-thread way
        against the loop's lending (as _launch times it, asking the same)."""
        if nbytes < LENT_WHEN_SLOW or not self._engine.lends(self._peers):
            return True, None
        slow = SlowRingChoice.key(kind, nbytes)
        return not self._slow_rings.leave(slow), slow
