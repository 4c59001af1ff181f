"""What async collectives return: a handle to wait on, as in Horovod.

:class:`Handle` is what the API promises; :class:`FutureHandle` is the handle of one or
more engine ops.  Negotiated mode's requests (requests.py) are handles themselves: a
training step may submit thousands of tiny tensors, and one object per tensor instead of
two is a measurable part of each one's cost.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

from ..engine.payload import OpFuture
from ..exceptions import PeerFailureError
from ..interrupts import deferred as ctrl_c

# How long an op failed by a peer's orderly shutdown waits for a Ctrl-C of its own.
_PEER_LEFT_GRACE = 1.0


class Handle:
    """The pending result of an async collective.

    ``wait()`` returns what the blocking form of the call would have returned, or raises
    its error; ``done()`` never blocks.
    """

    __slots__ = ()

    @property
    def label(self) -> str:
        """The op, as messages name it."""
        raise NotImplementedError

    @property
    def futures(self) -> list[OpFuture]:
        """The futures the handle is done with when all are."""
        raise NotImplementedError

    def done(self) -> bool:
        raise NotImplementedError

    def error(self) -> BaseException | None:
        """The first error among the handle's finished ops, or None."""
        raise NotImplementedError

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        """Call ``fn(handle)`` once every op of the handle is done, on the thread that
        finished the last one (at once if already done).  ``fn`` must not block: it may
        run on the engine's progress thread."""
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the op completes and return its result.

        Raises:
            TimeoutError: ``timeout`` seconds passed first (the op keeps running).
            TotalReduceError: the op failed (mismatch, lost peer, op timeout, shutdown).
        """
        raise NotImplementedError

    def result_now(self) -> Any:
        """The result of a handle known to be done without error (a completion callback's
        view: no waiting, no Ctrl-C check)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<Handle {self.label} {'done' if self.done() else 'pending'}>"


def raise_failure(error: BaseException) -> NoReturn:
    """Raise a finished op's error from ``wait()``."""
    if isinstance(error, PeerFailureError) and error.orderly:
        # The peer may have left on a Ctrl-C that is on its way here too; the application's
        # except KeyboardInterrupt must see that, not the peer's leaving.
        ctrl_c.wait_for(_PEER_LEFT_GRACE)
    raise error


class FutureHandle(Handle):
    """The handle of engine ops: done when every future is, its result made by
    ``finish()`` once."""

    __slots__ = ("_futures", "_finish", "_result", "_finished", "_label")

    def __init__(self, futures: list[OpFuture], finish: Callable[[], Any], label: str) -> None:
        self._futures = futures
        self._finish = finish
        self._result: Any = None
        self._finished = False
        self._label = label

    @property
    def label(self) -> str:
        return self._label

    @property
    def futures(self) -> list[OpFuture]:
        return self._futures

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def error(self) -> BaseException | None:
        for future in self._futures:
            error = future.error()
            if error is not None:
                return error
        return None

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        if not self._futures:
            fn(self)
            return
        left = [len(self._futures)]
        lock = threading.Lock()

        def one_done(_future: OpFuture) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                fn(self)

        for future in self._futures:
            future.add_done_callback(one_done)

    def wait(self, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        for future in self._futures:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not future.wait_done(left):
                raise TimeoutError(f"{self._label} is not done after {timeout} s")
        # A Ctrl-C kept while the engine finished (or failed) the op still wins: the
        # application's except KeyboardInterrupt must see it, not what the op became.
        ctrl_c.raise_if_pending()
        for future in self._futures:
            error = future.error()
            if error is not None:
                raise_failure(error)
        return self.result_now()

    def result_now(self) -> Any:
        if not self._finished:
            self._result = self._finish()
            self._finished = True
        return self._result


class DoneHandle(Handle):
    """The handle of an op that ran to its end on the caller's thread (the small path):
    nothing to wait for.  With ``error``, the op failed: ``wait()`` raises it, as any
    handle's would (callers may expect failures from ``wait()``, not from the submit)."""

    __slots__ = ("_result", "_label", "_error")

    def __init__(self, result: Any, label: str, error: BaseException | None = None) -> None:
        self._result = result
        self._label = label
        self._error = error

    @property
    def label(self) -> str:
        return self._label

    @property
    def futures(self) -> list[OpFuture]:
        return []

    def done(self) -> bool:
        return True

    def error(self) -> BaseException | None:
        return self._error

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        fn(self)

    def wait(self, timeout: float | None = None) -> Any:
        ctrl_c.raise_if_pending()
        if self._error is not None:
            raise_failure(self._error)
        return self._result

    def result_now(self) -> Any:
        return self._result
