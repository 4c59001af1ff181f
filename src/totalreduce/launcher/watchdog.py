"""Ends the workers' process groups when totalrun dies without doing it itself.

totalrun can end its workers on every way out but one: ``SIGKILL`` (or a crash of the
interpreter).  The Linux parent-death signal covers only its direct children, and a
command such as ``totalrun -np 4 ./train.sh`` puts the Python workers one level deeper.
So totalrun starts this small process first, in a session of its own, and keeps the
write end of a pipe to it; it writes each worker's process group id as it starts it,
``notes PATH`` for the folder where failing workers leave their notes, and ``done`` when
it has ended them itself.  If the pipe ends without ``done``, totalrun is gone: every
group it named gets SIGTERM (so workers can remove their shared memory) and,
``_KILL_AFTER`` seconds later, SIGKILL; then the notes folder goes, which totalrun
would have removed on its way out.

It is run as a script by path (``python -I watchdog.py FD``) and uses the standard
library only, so it starts in milliseconds and imports nothing of the package.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time

_KILL_AFTER = 2.0


def _signal(groups: list[int], sig: int) -> None:
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, sig)


def watch(fd: int) -> int:
    groups: list[int] = []
    notes: list[str] = []
    pending = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except InterruptedError:
            continue
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line == b"done":
                return 0
            if line.startswith(b"notes "):
                notes.append(os.fsdecode(line[6:]))
            else:
                groups.append(int(line))
    _signal(groups, signal.SIGTERM)
    time.sleep(_KILL_AFTER)
    _signal(groups, signal.SIGKILL)
    for path in notes:
        shutil.rmtree(path, ignore_errors=True)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is totalrun's to handle
    sys.exit(watch(int(sys.argv[1])))
