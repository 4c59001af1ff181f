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

The thread is kept off the CPU the reader's thread runs on when a copy starts.  Woken by
the reader, the scheduler put it on the reader's CPU for the first calls of a job, where
the two copies took turns until one of them moved: at 2 ranks 16 MiB broadcasts took
1.7-2.2 ms a call so (the thread's half 1.3 ms), 1.1 once apart (its half 0.63-0.70),
and the broadcast's choice between lending and the rings (scheduling/slow_rings.py),
timed on those first calls, chose the rings (1.4-2.0 ms a call) in 5 runs of 6; kept
apart, lending in 6 of 6.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections.abc import Callable

from ..threads import start_daemon
from . import cma


def _cpu_of_caller() -> Callable[[], int] | None:
    """glibc's ``sched_getcpu`` (the CPU the calling thread runs on), or None where there
    is none to call."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        fn = libc.sched_getcpu
    except (OSError, AttributeError):
        return None
    fn.argtypes = []
    fn.restype = ctypes.c_int
    return fn


_sched_getcpu = _cpu_of_caller()

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
        try:
            self._cpus = frozenset(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self._cpus = frozenset()
        self._kept_off: int | None = None  # the CPU this thread is kept off now

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
            self._keep_off_callers_cpu()
            self._busy = True
            self._error = None
            self._job = (pid, dest, address)
            self._cond.notify()
        return True

    def _keep_off_callers_cpu(self) -> None:
        """Let the thread run anywhere the process may but on the caller's CPU (see the
        module docstring); where that cannot be done, leave it where it is."""
        tid = self._thread.native_id
        if _sched_getcpu is None or len(self._cpus) < 2 or tid is None:
            return
        here = _sched_getcpu()
        if here == self._kept_off or here not in self._cpus:
            return
        try:
            os.sched_setaffinity(tid, self._cpus - {here})
        except OSError:
            self._cpus = frozenset()  # not allowed here (a cpuset that changed): stop
            return
        self._kept_off = here

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
