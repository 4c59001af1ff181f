"""A second thread for the kernel copy of a lent body whose sender sits idle meanwhile.

A broadcast's root has nothing to do while its peer copies a lent body out of it, so at
2 ranks on 2 cores one core idles through the one copy the op needs.  The reader can put
it to work: this thread copies the front of the body (``process_vm_readv`` releases the
GIL) while the reader's own thread copies the rest.  Both copies went at full speed side
by side here, the root's process asleep: a 16 MiB body in 0.91 ms against 1.81 for one
thread, 64 MiB in 4.3 against 9.6 ms; below a few MiB the hand-off to the thread (tens of
microseconds each way) eats the gain (4 MiB: 0.53 against 0.42 ms).  If the root spins
instead, the three threads share two cores and the split loses (16 MiB: 1.76 against
1.47 ms), so a root waits for such a body without spinning (poller.py).

One copy at a time, for any of a transport's links: a reader that finds the thread busy
copies alone.
"""

from __future__ import annotations

import threading

from ..threads import start_daemon
from . import cma

# The smallest lent body worth splitting (see above).
SPREAD_MIN = 8 << 20


class SpreadCopy:
    """The thread and its one job: ``start`` a copy, go on with the rest, then ``wait``."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._job: tuple[int, memoryview, int] | None = None
        self._busy = False
        self._closing = False
        self._error: OSError | None = None
        # Started now, so that a first copy does not pay for it (and a scheduler that
        # times the two ways of a broadcast does not hold it against this one).
        self._thread = start_daemon(self._run, "totalreduce-spread-copy")

    def close(self) -> None:
        """End the thread once the copy in hand (milliseconds at most) is over."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=5.0)

    def start(self, pid: int, dest: memoryview, address: int) -> bool:
        """Copy ``dest.nbytes`` bytes from ``address`` in ``pid`` into ``dest`` on the
        thread; False (nothing started) while it copies for someone else."""
        with self._cond:
            if self._busy or self._closing:
                return False
            self._busy = True
            self._error = None
            self._job = (pid, dest, address)
            self._cond.notify()
        return True

    def wait(self) -> None:
        """Until the copy :meth:`start` began is over.

        Raises:
            OSError: it failed (the peer is gone, or the range is not mapped there).
        """
        with self._cond:
            while self._busy:
                self._cond.wait()
            error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self) -> None:
        cond = self._cond
        while True:
            with cond:
                while self._job is None and not self._closing:
                    cond.wait()
                if self._job is None:
                    return
                pid, dest, address = self._job
                self._job = None
            error = None
            try:
                cma.read_into(pid, dest, address)
            except OSError as exc:
                error = exc
            del dest  # the reader's buffer is not ours to keep alive
            with cond:
                self._error = error
                self._busy = False
                cond.notify_all()
