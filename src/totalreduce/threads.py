"""The threads the library starts inside the application's process.

Each blocks every signal the application may handle, so the kernel delivers them to the
main thread: Python runs signal handlers only there, and only a signal delivered to the
main thread interrupts what it is blocked in (a ``select``, a lock).  Delivered to one
of ours, Ctrl-C would wait until the main thread happened to wake, and meanwhile a
peer's news (another rank leaving on its own Ctrl-C) could turn it into a different
error.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2}


def start_daemon(target: Callable[..., Any], name: str, args: tuple[Any, ...] = ()
                 ) -> threading.Thread:
    def run() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        target(*args)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
