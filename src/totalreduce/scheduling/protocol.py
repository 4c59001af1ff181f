"""The one interface the public API calls, whichever way ops are scheduled: self-guided
(selfguided.py), negotiated (negotiated.py), or either under recovery (recovery/robust.py
wraps one).  Arguments are checked by checks.py before any of them schedules a call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from .handle import Handle


class Scheduler(Protocol):
    """Collectives on numpy arrays, each returning a handle to wait on."""

    rank: int
    size: int

    def allreduce(self, x: Any, op: Any, name: str | None, priority: int,
                  inplace: bool) -> Handle: ...
    def grouped_allreduce(self, xs: Sequence[Any], op: Any, name: str | None,
                          priority: int, inplace: bool) -> Handle: ...
    def broadcast(self, x: Any, root_rank: int, name: str | None, priority: int,
                  inplace: bool) -> Handle: ...
    def allgather(self, x: Any, name: str | None, priority: int,
                  out: Any = None, same_shape: bool = False) -> Handle: ...
    def alltoall(self, x: Any, splits: Any, name: str | None, priority: int,
                 out: Any = None, same_shape: bool = False) -> Handle: ...
    def reducescatter(self, x: Any, op: Any, name: str | None, priority: int) -> Handle: ...
    def barrier(self) -> Handle: ...
    def allreduce_now(self, x: Any, op: Any, name: str | None, priority: int,
                      inplace: bool) -> Any:
        """A blocking allreduce's result if it ran to its end at once (a repeated small
        one); None, nothing done, otherwise: call :meth:`allreduce` and wait."""
    def allgather_now(self, x: Any, name: str | None, priority: int, out: Any,
                      same_shape: bool) -> Any:
        """A blocking allgather's result if it ran to its end at once (a repeated small
        one); None, nothing done, otherwise: call :meth:`allgather`."""
    def alltoall_now(self, x: Any, splits: Any, name: str | None, priority: int, out: Any,
                     same_shape: bool) -> Any:
        """As :meth:`allgather_now`, for an alltoall (its result and splits)."""
    def reducescatter_now(self, x: Any, op: Any, name: str | None, priority: int) -> Any:
        """As :meth:`allreduce_now`, for a reducescatter (its result)."""
    def broadcast_now(self, x: Any, root_rank: Any, name: str | None, priority: int,
                      inplace: bool) -> Any:
        """A blocking broadcast's result if it ran to its end at once (a repeated small
        one); None, nothing done, otherwise: call :meth:`broadcast` and wait."""
    def barrier_now(self) -> bool:
        """A barrier run to its end at once: True; False, nothing done: call
        :meth:`barrier` and wait."""
    def join(self) -> int:
        """Stand in for this rank in the others' allreduces until every rank has joined;
        the rank that joined last."""
    def caller_waits(self) -> Any:
        """``with caller_waits():`` this thread waits for what it submits inside."""
    def stats(self) -> dict[str, int]: ...
    def close(self) -> None: ...


class NothingAtOnce:
    """The ``*_now`` methods of a scheduler whose every op takes a step of its own before
    it runs (a negotiation, a log for replay): none runs at once, so the API submits each
    and waits."""

    def allreduce_now(self, x: Any, op: Any, name: str | None, priority: int,
                      inplace: bool) -> None:
        return None

    def allgather_now(self, x: Any, name: str | None, priority: int, out: Any,
                      same_shape: bool) -> None:
        return None

    def alltoall_now(self, x: Any, splits: Any, name: str | None, priority: int,
                     out: Any, same_shape: bool) -> None:
        return None

    def reducescatter_now(self, x: Any, op: Any, name: str | None, priority: int
                          ) -> None:
        return None

    def broadcast_now(self, x: Any, root_rank: Any, name: str | None, priority: int,
                      inplace: bool) -> None:
        return None

    def barrier_now(self) -> bool:
        return False
