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


deferred = _Deferred()
