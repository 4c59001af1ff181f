"""A Ctrl-C that arrived while the main thread was inside the engine, kept until a point
where raising it leaves everything whole.

Raising ``KeyboardInterrupt`` in the middle of the engine's loop could leave a message
half handled; so the runtime's SIGINT handler only sets :data:`deferred` there, and the
engine's loops and :meth:`Handle.wait` raise it between two turns or on the way out.  A
module-level flag, not engine state, because the way out passes through the layers
above the engine too.
"""

from __future__ import annotations

import threading
import time


class _Deferred:
    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending = False

    def raise_if_pending(self) -> None:
        """Raise the kept KeyboardInterrupt, on the main thread only (where Python would
        have raised it)."""
        if self.pending and threading.current_thread() is threading.main_thread():
            self.pending = False
            raise KeyboardInterrupt

    def wait_for(self, seconds: float) -> None:
        """Give a Ctrl-C up to ``seconds`` to arrive, then raise it if it did (main
        thread only).  A launcher forwards Ctrl-C to every rank at once, but a rank that
        is scheduled first can handle it, shut down, and fail a peer's op before that
        peer's own signal is handled: the peer should still see KeyboardInterrupt."""
        if threading.current_thread() is not threading.main_thread():
            return
        deadline = time.monotonic() + seconds
        while not self.pending and time.monotonic() < deadline:
            time.sleep(0.01)
        self.raise_if_pending()


deferred = _Deferred()
