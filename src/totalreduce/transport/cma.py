"""Reading another local process's memory with ``process_vm_readv`` (cross-memory attach).

A large message between two ranks on one host need not pass through the shared ring at
all: the sender lends the receiver the address of its body and the receiver's kernel copies
it straight into the destination, one copy instead of two (into the ring, out of it), and
the sender's core does no copying at all.  MPICH does the same for large local messages.

Whether it works is decided per direction when the rings are set up: the kernel allows it
only to a process that could ptrace the other (same user; a Yama ``ptrace_scope`` or a
seccomp filter may forbid it), so the reader tries to read a random token from the writer
and compares (:func:`probe`).

One write goes the other way (:func:`write_from`): a reader that copies a lent body while
its lender sits idle asks the lender to copy the body's back half into the reader's
memory meanwhile (ring_link.py), at the address the reader gave, so that both cores copy.
The kernel allows it by the same rule, and the lender writes only where it was asked.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import time
from typing import Any

import numpy as np


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load(name: str = "process_vm_readv") -> Any:
    if platform.system() != "Linux":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                   ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    return fn


_readv = _load()
_writev = _load("process_vm_writev")


def address_of(buf: Any) -> int:
    """The address of a C-contiguous buffer's first byte (the buffer must outlive its use)."""
    try:  # a writable buffer: a fifth of the time of numpy's way, which is on every lend
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))
    except (TypeError, ValueError):  # read-only, or empty
        return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def read_into(pid: int, dest: memoryview, address: int) -> None:
    """Copy ``dest.nbytes`` bytes from ``address`` in process ``pid`` into ``dest``.

    Raises:
        OSError: the read failed or came back short (the process is gone, or the range
            is not mapped there).
    """
    _between(_readv, "process_vm_readv", "from", "read", pid, dest, address)


def _between(fn: Any, name: str, way: str, did: str, pid: int, here: memoryview,
             address: int) -> None:
    """Copy ``here.nbytes`` bytes between ``here`` and ``address`` in ``pid`` with
    ``fn``, the system call ``name``; ``way`` and ``did`` say which way in its error."""
    want = here.nbytes
    if not want:
        return
    if fn is None:
        raise OSError(f"{name} is not available")
    local = _IoVec(address_of(here), want)
    remote = _IoVec(address, want)
    got = fn(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if got != want:
        err = ctypes.get_errno() if got < 0 else 0
        raise OSError(err, f"{name} {way} pid {pid} {did} {got} of {want} bytes"
                      + (f": {os.strerror(err)}" if err else ""))


# What read_rate() copies, and how often (the best try counts): ~1 ms at start, once per
# transport.  A piece this big is what lending is for (ring_link._LEND_MIN and up).
_RATE_BYTES = 512 << 10
_RATE_TRIES = 5


def read_rate() -> float:
    """How fast (bytes per second) the kernel copies a lent body here: the best of a few
    reads of a fresh buffer of this process's own, which costs what a peer's does (the
    pages are pinned one by one either way); 0.0 where it cannot read at all.

    Hosts differ by more than the ring's copies do: 11 GB/s on one 2-vCPU VM, 6.5 GB/s on
    another whose plain copies ran at 25-30 GB/s on both (copy_pace.py weighs the two)."""
    if _readv is None:
        return 0.0
    src = np.ones(_RATE_BYTES, dtype=np.uint8)
    dest = np.zeros(_RATE_BYTES, dtype=np.uint8)
    dest[::4096] = 1  # its pages mapped: a first touch is not what is timed
    view = dest.data
    address = address_of(src)
    best = float("inf")
    for _ in range(_RATE_TRIES):
        start = time.perf_counter()
        try:
            read_into(os.getpid(), view, address)
        except OSError:
            return 0.0
        best = min(best, time.perf_counter() - start)
    return _RATE_BYTES / max(best, 1e-9)


def write_from(pid: int, src: memoryview, address: int) -> None:
    """Copy ``src`` to ``address`` in process ``pid`` (one the reader asked for).

    Raises:
        OSError: the write failed or came back short.
    """
    _between(_writev, "process_vm_writev", "to", "wrote", pid, src, address)


def probe(pid: int, address: int, expected: bytes) -> bool:
    """Whether ``expected`` can be read back from ``address`` in ``pid``."""
    dest = bytearray(len(expected))
    try:
        read_into(pid, memoryview(dest), address)
    except OSError:
        return False
    return bytes(dest) == expected


def cma_works() -> bool:
    """Whether this process may read its own memory this way (a child of ours, with the
    same credentials, then may too unless a ptrace policy singles it out)."""
    token = b"totalreduce-cma!"
    buf = bytearray(token)
    return probe(os.getpid(), address_of(buf), token)
