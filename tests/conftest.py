"""Shared fixtures: which transports the multi-process tests run over, and a leak check
that fails any test leaving processes, threads or shared-memory segments behind."""

from __future__ import annotations

import compileall
import contextlib
import glob
import os
import secrets
import signal
import threading
import time
from collections.abc import Iterator

import pytest

import totalreduce
from harness import TRANSPORTS, mpiexec

# Every process a test starts inherits this variable (the harness and the tests copy the
# environment), which is how a leftover is recognised however deep it sits.
_MARK_NAME = "TRTEST_SESSION"
os.environ[_MARK_NAME] = secrets.token_hex(8)
_MARK = f"{_MARK_NAME}={os.environ[_MARK_NAME]}".encode()
_GRACE = 5.0  # a job's processes and threads may take this long to be gone


def pytest_sessionstart(session: pytest.Session) -> None:
    # Most tests start processes that import the library and the test workers afresh;
    # where PYTHONDONTWRITEBYTECODE is set (CI machines set it), each of them compiled
    # every module from source (0.35 s of an import that takes 0.2 s from bytecode).
    # Python still reads bytecode that exists, so it is written once here.
    here = os.path.dirname(os.path.abspath(__file__))
    package = os.path.dirname(os.path.abspath(totalreduce.__file__))
    for folder in (package, here):
        compileall.compile_dir(folder, quiet=1)


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    if request.param == "mpi" and mpiexec() is None:
        pytest.skip("mpi transport: mpi4py/mpiexec not installed (pip install '.[mpi]')")
    return request.param


def _our_processes() -> list[int]:
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if _MARK in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


def _segments() -> set[str]:
    return set(glob.glob("/dev/shm/totalreduce-*"))


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Iterator[None]:
    threads = set(threading.enumerate())
    segments = _segments()
    yield
    deadline = time.monotonic() + _GRACE
    while True:
        procs = _our_processes()
        extra_threads = [t for t in threading.enumerate() if t not in threads and t.is_alive()]
        extra_segments = _segments() - segments
        if not (procs or extra_threads or extra_segments) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid in procs:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    problems = []
    if procs:
        problems.append(f"processes still running: {procs}")
    if extra_threads:
        problems.append(f"threads still running: {[t.name for t in extra_threads]}")
    if extra_segments:
        problems.append(f"shared-memory segments left: {sorted(extra_segments)}")
    assert not problems, "the test left things behind: " + "; ".join(problems)
