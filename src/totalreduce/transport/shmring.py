"""A one-way shared-memory ring between two processes on the same host.

The producer owns the file: it creates it in ``/dev/shm`` with mode 0600 under a name
drawn from :mod:`secrets`, tells the consumer the name over their authenticated socket,
and unlinks it as soon as the consumer has mapped it (or has failed to), so a crash
afterwards leaves nothing behind and no third process can open it later.

Only the *consumer's* position, and a "producer is waiting" flag, live in shared memory.
Where each body starts travels in the message header over the socket, and the socket's
system calls order memory, so the consumer never reads a slot before its header has
arrived.  The consumer stores its position after it is done with a body; the producer
reads it to learn how much space is free.  A producer that finds the ring full raises the
flag; the consumer that frees room and sees it says so over the socket (the two sides can
miss each other's stores, so the producer also re-polls now and then).  Bodies are
contiguous: one that would straddle the end starts again at offset 0, as does the first
body after the reader has caught up (so that a few hot slots are reused), and the reader
skips to offset 0 whenever a header says so, so neither side needs to be told.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets

import numpy as np

_CONTROL = 4096  # the consumer's position; a page of its own, so data stays page-aligned
_SHM_DIR = "/dev/shm"


def shm_available() -> bool:
    return os.path.isdir(_SHM_DIR) and os.access(_SHM_DIR, os.W_OK)


class _Mapping:
    def __init__(self, fd: int, capacity: int) -> None:
        self.capacity = capacity
        self.map = mmap.mmap(fd, _CONTROL + capacity)
        self._tail = np.frombuffer(self.map, dtype=np.uint64, count=1)
        self._waiting = np.frombuffer(self.map, dtype=np.uint64, count=1, offset=64)
        self.data = np.frombuffer(self.map, dtype=np.uint8, offset=_CONTROL)
        self.view = memoryview(self.map)[_CONTROL:]

    def close(self) -> None:
        # numpy views pin the buffer; drop them first or mmap.close() raises BufferError.
        self._tail = self._waiting = self.data = None  # type: ignore[assignment]
        self.view.release()
        with contextlib.suppress(BufferError, ValueError):
            self.map.close()


class RingWriter:
    """The producer's end."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.name = "totalreduce-" + secrets.token_hex(16)
        self.path = os.path.join(_SHM_DIR, self.name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, _CONTROL + capacity)
            self._m = _Mapping(fd, capacity)
        except BaseException:
            self.unlink()
            raise
        finally:
            os.close(fd)
        self._head = 0  # total bytes handed out, padding included
        self._floor = 0  # where the reader will be once it skips the last restart's padding

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def fits(self, nbytes: int) -> bool:
        """Whether a body of this size can ever go through the ring."""
        return 0 < nbytes <= self.capacity // 2

    def put(self, body: memoryview) -> int | None:
        """Copy ``body`` into the ring and return its offset, or None while it is full."""
        n = body.nbytes
        cap = self.capacity
        start = self._head
        offset = start % cap
        if offset and int(self._m._tail[0]) == start:
            # The reader has caught up: start again at 0, so that the same few slots are
            # reused and stay in cache (1-16 MB ops ran up to 1.6x faster).  The reader
            # skips the padding as it does at a wrap, so that padding is free already.
            start += cap - offset
            offset = 0
            self._floor = start
        elif offset + n > cap:
            start += cap - offset
            offset = 0
        if start + n - max(int(self._m._tail[0]), self._floor) > cap:
            self._m._waiting[0] = 1
            # The reader may have freed room just before seeing the flag.
            if start + n - max(int(self._m._tail[0]), self._floor) > cap:
                return None
            self._m._waiting[0] = 0
        np.copyto(self._m.data[offset:offset + n], np.frombuffer(body, dtype=np.uint8))
        self._head = start + n
        return offset

    def close(self) -> None:
        self._m.close()


class RingReader:
    """The consumer's end; bodies must be consumed in the order they were put."""

    def __init__(self, name: str, capacity: int) -> None:
        if not name.startswith("totalreduce-") or "/" in name:
            raise ValueError(f"not a totalreduce ring name: {name!r}")
        fd = os.open(os.path.join(_SHM_DIR, name), os.O_RDWR)
        try:
            if os.fstat(fd).st_size != _CONTROL + capacity:
                raise ValueError("ring file has the wrong size")
            self._m = _Mapping(fd, capacity)
        finally:
            os.close(fd)
        self.capacity = capacity
        self._pos = 0

    def body(self, offset: int, nbytes: int) -> memoryview:
        """The body at ``offset``: valid until :meth:`release`."""
        if offset + nbytes > self.capacity:
            raise ValueError(f"ring body [{offset}, {offset + nbytes}) is out of bounds")
        return self._m.view[offset:offset + nbytes]

    def release(self, offset: int, nbytes: int) -> bool:
        """Free the body's room; True if the producer was waiting for room (tell it)."""
        cap = self.capacity
        pos = self._pos
        if pos % cap != offset:  # the producer skipped the tail and wrapped to 0
            pos += cap - pos % cap
        self._pos = pos + nbytes
        self._m._tail[0] = self._pos
        if self._m._waiting[0]:
            self._m._waiting[0] = 0
            return True
        return False

    def close(self) -> None:
        self._m.close()
