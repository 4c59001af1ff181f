"""Runs the workers, relays their output, and ends the job on the first failure."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import IO, Any

from .exit_codes import NO_RESTART

_KILL_AFTER_TERM = 3.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: a SIGKILLed launcher takes its workers along.
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _status(code: int | None) -> str:
    if code is None:
        return "running"
    if code == NO_RESTART:
        return f"exit code {code} (an error no restart can mend)"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _CannotStart(Exception):
    """A worker's command could not be started (the message is one line for the user);
    ``code`` is the shell's exit status for it (127: not found, 126: not executable)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class _Worker:
    def __init__(self, rank: int, proc: subprocess.Popen[bytes], attempt: int = 0) -> None:
        self.rank = rank
        self.proc = proc
        self.attempt = attempt  # how many times this rank was restarted before this life
        self.code: int | None = None
        self.exited_at = float("inf")
        self.tail: deque[str] = deque(maxlen=8)
        self.pumps: list[threading.Thread] = []


class Supervisor:
    """``max_restarts``: how many times each rank may be restarted after it dies (0: the
    first failure ends the job).  ``on_restart(generation)`` is told before a restarted
    worker starts; the generation counts the restarts so far, and the ranks meet again
    under it (the recovery layer's rendezvous)."""

    def __init__(self, command: list[str], n: int, env: dict[str, str], grace: float,
                 output_dir: str | None, max_restarts: int = 0,
                 on_restart: Callable[[int], None] | None = None) -> None:
        self._command = command
        self._n = n
        self._env = env
        self._grace = grace
        self._output_dir = output_dir
        self._lock = threading.Lock()    # one output line at a time
        self._bar_open = False           # a progress line is drawn on the terminal
        self._state = threading.Lock()   # exit codes and times
        self._workers: list[_Worker] = []
        self._first_failure: _Worker | None = None
        self._signalled: int | None = None
        self._changed = threading.Event()
        self._width = len(str(n - 1))
        self._watchdog: int | None = None  # write end of the pipe to watchdog.py
        # Where a failing rank notes whether it failed on its own or because another rank
        # did (runtime._tell_launcher): the root cause is named by it.
        self._notes = tempfile.mkdtemp(prefix="totalrun-failures-")
        self._max_restarts = max_restarts
        self._on_restart = on_restart
        self._generation = 0  # restarts so far
        self._lives: list[_Worker] = []  # every worker process ever started, in order

    # --- output ---------------------------------------------------------------------

    def _pump(self, worker: _Worker, stream: IO[bytes], out: Any, name: str) -> None:
        copy = None
        if self._output_dir:
            folder = os.path.join(self._output_dir, f"rank.{worker.rank:0{self._width}d}")
            os.makedirs(folder, exist_ok=True)
            copy = open(os.path.join(folder, name), "wb")  # noqa: SIM115
        prefix = f"[{worker.rank}]: ".encode()
        tty = out.isatty()
        pending = b""
        try:
            for chunk in iter(lambda: stream.read1(1 << 16), b""):  # type: ignore[attr-defined]
                pending += chunk
                while True:
                    ends = [i for i in (pending.find(b"\n"), pending.find(b"\r")) if i >= 0]
                    if not ends:
                        break
                    i = min(ends)
                    record, sep, pending = pending[:i], pending[i:i + 1], pending[i + 1:]
                    if sep == b"\r" and not pending.startswith(b"\n"):
                        # A progress bar (tqdm) redrawing its line: live on a terminal,
                        # left out of logs, which would otherwise get one huge line.
                        if tty and record:
                            with self._lock:
                                out.buffer.write(b"\r\x1b[K" + prefix + record)
                                out.flush()
                                self._bar_open = True
                        continue
                    self._line(worker, out, name, prefix, record + b"\n", copy)
            if pending:
                self._line(worker, out, name, prefix, pending + b"\n", copy)
        finally:
            stream.close()
            if copy is not None:
                copy.close()

    def _line(self, worker: _Worker, out: Any, name: str, prefix: bytes, line: bytes,
              copy: IO[bytes] | None) -> None:
        line = line.replace(b"\r", b"")
        if name == "stderr":
            worker.tail.append(line.decode(errors="replace").rstrip())
        with self._lock:
            try:
                if self._bar_open:
                    out.buffer.write(b"\r\x1b[K")
                    self._bar_open = False
                out.buffer.write(prefix + line)
                out.flush()
            except BrokenPipeError:
                # Whoever read our output stopped (``totalrun ... | head``): the job goes
                # on and its lines go nowhere, as a rank's own prints would not fail.
                # The descriptor now points at /dev/null, so that the flush at exit does
                # not fail either.
                _discard(out)
        if copy is not None:
            copy.write(line)

    def _say(self, text: str) -> None:
        with self._lock:
            sys.stderr.write(f"totalrun: {text}\n")
            sys.stderr.flush()

    # --- lifecycle ------------------------------------------------------------------

    def _start(self) -> None:
        for rank in range(self._n):
            self._workers.append(self._spawn(rank, 0))

    def _spawn(self, rank: int, attempt: int) -> _Worker:
        env = dict(self._env, TOTALREDUCE_RANK=str(rank), TOTALREDUCE_LOCAL_RANK=str(rank),
                   RANK=str(rank), LOCAL_RANK=str(rank), HOROVOD_RANK=str(rank),
                   HOROVOD_LOCAL_RANK=str(rank), TOTALREDUCE_ATTEMPT=str(attempt),
                   TOTALREDUCE_FAILURE_DIR=self._notes)
        try:
            proc = subprocess.Popen(self._command, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=_die_with_parent)
        except OSError as exc:  # cli.py checked the program; exec can fail still
            why = exc.strerror or str(exc)
            if exc.errno == errno.ENOENT and os.path.isfile(self._command[0]):
                why = "the interpreter on its #! line was not found"
            raise _CannotStart(f"cannot start the workers: {self._command[0]}: {why}",
                               127 if exc.errno == errno.ENOENT else 126) from exc
        worker = _Worker(rank, proc, attempt)
        self._tell_watchdog(f"{proc.pid}\n")  # its own group (start_new_session)
        # A waiter per worker stamps the exact exit time, so the root cause is the
        # worker that died first, not the first one a polling sweep happens to see.
        threading.Thread(target=self._wait, args=(worker,), daemon=True).start()
        for stream, out, name in ((proc.stdout, sys.stdout, "stdout"),
                                  (proc.stderr, sys.stderr, "stderr")):
            t = threading.Thread(target=self._pump, args=(worker, stream, out, name),
                                 daemon=True)
            t.start()
            worker.pumps.append(t)
        self._lives.append(worker)
        return worker

    def _restart(self, dead: _Worker) -> None:
        """Start ``dead``'s rank again; the others keep running and wait for it."""
        attempt = dead.attempt + 1
        self._generation += 1
        self._say(f"rank {dead.rank} (pid {dead.proc.pid}) failed: {_status(dead.code)}; "
                  f"restarting it ({attempt}/{self._max_restarts} restarts of this rank)")
        with contextlib.suppress(OSError):  # its note was its last life's
            os.unlink(os.path.join(self._notes, f"rank.{dead.rank}"))
        if self._on_restart is not None:
            self._on_restart(self._generation)
        self._workers[dead.rank] = self._spawn(dead.rank, attempt)

    def _start_watchdog(self) -> None:
        """See watchdog.py: it ends the workers' groups if we are killed outright."""
        read_end, write_end = os.pipe()
        try:
            subprocess.Popen([sys.executable, "-I", os.path.join(os.path.dirname(__file__),
                                                                 "watchdog.py"), str(read_end)],
                             pass_fds=(read_end,), stdin=subprocess.DEVNULL,
                             start_new_session=True)
        except OSError as exc:
            os.close(write_end)
            self._say(f"warning: no watchdog ({exc}); if totalrun is killed with SIGKILL, "
                      "workers below a wrapper script may outlive it")
            return
        finally:
            os.close(read_end)
        self._watchdog = write_end

    def _tell_watchdog(self, text: str) -> None:
        if self._watchdog is not None:
            with contextlib.suppress(OSError):
                os.write(self._watchdog, text.encode())

    def _wait(self, worker: _Worker) -> None:
        code = worker.proc.wait()
        with self._state:
            worker.exited_at = time.monotonic()
            worker.code = code
        self._changed.set()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._signalled = signum

    def _signal_all(self, sig: int) -> None:
        for w in self._lives:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(w.proc.pid, sig)

    def run(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        cannot_start: _CannotStart | None = None
        try:
            self._start_watchdog()
            self._tell_watchdog(f"notes {self._notes}\n")  # gone with us, even killed
            try:
                self._start()
            except _CannotStart as exc:
                cannot_start = exc
            else:
                self._supervise()
        finally:
            # Whatever happened, nothing of ours outlives us: kill every worker's group.
            self._signal_all(signal.SIGKILL)
            for w in self._lives:
                with contextlib.suppress(Exception):
                    w.proc.wait(timeout=5)
                for t in w.pumps:
                    t.join(timeout=2)
            self._tell_watchdog("done\n")
            if self._watchdog is not None:
                os.close(self._watchdog)
            for s, h in old.items():
                signal.signal(s, h)
        try:
            if cannot_start is not None:
                self._say(str(cannot_start))
                return cannot_start.code
            return self._report()
        finally:
            shutil.rmtree(self._notes, ignore_errors=True)

    def _supervise(self) -> None:
        stop_at: float | None = None   # when to send SIGTERM
        kill_at: float | None = None   # when to send SIGKILL
        forwarded = False
        while True:
            now = time.monotonic()
            with self._state:
                failed = [w for w in self._workers if w.code]
            if failed and self._signalled is None and stop_at is None:
                restartable = [w for w in failed if w.attempt < self._max_restarts
                               and w.code != NO_RESTART]
                for w in sorted(restartable, key=lambda w: w.exited_at):
                    self._restart(w)
                failed = [w for w in failed if w not in restartable]
            with self._state:
                running = sum(1 for w in self._workers if w.code is None)
            if failed and self._signalled is None:
                if stop_at is None:
                    stop_at = now + self._grace
                if self._first_failure is None:
                    first = self._root_cause(failed, final=running == 0)
                    if first is not None:
                        self._first_failure = first
                        self._say(f"rank {first.rank} (pid {first.proc.pid}) failed: "
                                  f"{_status(first.code)}; stopping the other ranks")
            if running == 0:
                return
            if self._signalled is not None and not forwarded:
                forwarded = True
                self._say(f"received {signal.Signals(self._signalled).name}; forwarding it "
                          "to every rank")
                self._signal_all(self._signalled)
                kill_at = now + _KILL_AFTER_TERM + self._grace
            if stop_at is not None and now >= stop_at and kill_at is None:
                self._signal_all(signal.SIGTERM)
                kill_at = now + _KILL_AFTER_TERM
            if kill_at is not None and now >= kill_at:
                self._signal_all(signal.SIGKILL)
                kill_at = now + 3600
            self._changed.wait(0.05)
            self._changed.clear()

    def _note(self, worker: _Worker) -> int | None:
        """The rank whose failure ``worker`` says it failed of, if it left such a note."""
        try:
            with open(os.path.join(self._notes, f"rank.{worker.rank}")) as f:
                words = f.read().split()
        except OSError:
            return None
        if len(words) == 2 and words[0] == "peer" and words[1].isdigit():
            return int(words[1])
        return None

    def _root_cause(self, failed: list[_Worker], final: bool) -> _Worker | None:
        """The first rank to fail of its own accord (one that noted it failed because
        another did is passed over), or None to wait: every rank that failed so far names
        another one, which is still running (it will fail, or be stopped, shortly)."""
        blamed = {w.rank: self._note(w) for w in failed}
        own = [w for w in failed if blamed[w.rank] is None]
        if own:
            return min(own, key=lambda w: w.exited_at)
        named = [self._workers[r] for r in blamed.values()
                 if r is not None and 0 <= r < len(self._workers)]
        if not final and any(w.code is None for w in named):
            return None
        return next((w for w in named if w.code), min(failed, key=lambda w: w.exited_at))

    def _report(self) -> int:
        failed = [w for w in self._workers if w.code]
        restarted = [w for w in self._lives if w not in self._workers]
        if not failed and self._signalled is None:
            if restarted:
                self._say(f"job finished after {len(restarted)} restart(s): " + "; ".join(
                    f"rank {w.rank} (pid {w.proc.pid}) {_status(w.code)}" for w in restarted))
            return 0
        root = self._first_failure
        title = "job failed" if root is not None or self._signalled is None else \
            f"job stopped by {signal.Signals(self._signalled).name}"
        lines = ["", f"totalrun: {title}", f"  {'rank':>4}  {'pid':>7}  status"]
        for w in sorted(self._lives, key=lambda w: (w.rank, w.attempt)):
            mark = "  <- first failure (root cause)" if w is root else \
                "  (restarted)" if w in restarted else ""
            lines.append(f"  {w.rank:>4}  {w.proc.pid:>7}  {_status(w.code)}{mark}")
        if root is not None and root.tail:
            lines.append(f"  last stderr lines of rank {root.rank}:")
            lines.extend(f"    {t}" for t in root.tail)
        self._say("\n".join(lines))
        if self._signalled is not None and root is None:
            return 128 + self._signalled
        assert root is not None and root.code is not None
        return root.code if root.code > 0 else 128 - root.code


def _discard(out: Any) -> None:
    """Send what is still written to ``out`` (a stream whose reader is gone) nowhere."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, out.fileno())
    finally:
        os.close(null)
