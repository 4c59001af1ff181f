"""A one-way shared-memory message ring between two processes on the same host.

The producer owns the file: it creates it in ``/dev/shm`` with mode 0600 under a name
drawn from :mod:`secrets`, tells the consumer the name over their authenticated socket,
and unlinks it as soon as the consumer has mapped it (or has failed to), so a crash
afterwards leaves nothing behind and no third process can open it later.

Whole messages travel through the ring: a record is the 64-byte wire header followed by
the body, padded to 64 bytes, so the consumer reduces straight out of the producer's slot
and no system call is made per message.  Positions only grow; the producer publishes its
``head`` after a record is written and the consumer its ``tail`` after it is done with one.
x86-64 keeps stores in order and loads in order, which is all those two counters need, so
the ring is used only there (:func:`shm_available`).  A record that would straddle the end
starts again at offset 0, behind a WRAP header that tells the consumer to jump.  The ring's
footprint is its capacity, so it is kept small: room for two segments by default
(``Config.ring_bytes``), which stays in cache and still lets the producer run one record
ahead.  A body too big for one record follows its header in CHUNK records.  A FLAG_REMOTE
record carries only a descriptor of a body the reader copies out of the writer's memory
itself (:mod:`.cma`).

A ring's file may hold a second, small ring after it, its *lane* (:attr:`RingWriter.lane`):
the same records, for the few messages that must not wait behind the ring's
(engine/urgent.py).

Sleeping needs a doorbell: a consumer about to block on its socket raises one of its
``sleeping`` flags and looks at ``head`` once more; a producer that published looks at the
flags and, if one is up, sends one byte over the socket.  A producer that found the ring
full watches ``tail`` while it spins and raises ``waiting`` only before it blocks; the
consumer that frees room and sees the flag rings the producer's doorbell the same way.
Each side stores its flag and then loads the other's counter (and the other way round),
which x86 may reorder, so a full fence stands between them.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import secrets
import struct
import threading
import time
from collections.abc import Iterator

import numpy as np

from ..memcopy import MIN_PIECE, copy_bytes
from .copy_pace import PACE_MIN, CopyPace
from .wire import (
    FLAG_CHUNKED,
    FLAG_REMOTE,
    HEADER_SIZE,
    KIND_RING_WRAP,
    MAGIC,
    REMOTE_BODY,
    Header,
    Kind,
    WireError,
    unpack_header,
)

_CONTROL = 4096  # the counters and flags; a page of their own, so data stays page-aligned
_SHM_DIR = "/dev/shm"
_ALIGN = 64
# Offsets (in uint64 words) of the control fields, one cache line each: a line written by
# one side only, so the two sides do not steal lines from each other on every store.
_TAIL, _WAITING, _HEAD, _SLEEPING = 0, 8, 16, 24
SLEEPERS = 2  # the driving thread and the progress thread may each sleep on the ring
_WRAP = Header(Kind.RING_WRAP).pack()
# What a look ahead reads of each header (magic, kind, flags, name_key, seq, nbytes):
# a quarter of unpacking it whole, for every record behind a big body on every look.
_GLANCE = struct.Struct("<HBxB3xQQ16xQ")
_fence_lock = threading.Lock()
# Each direction's lane (RingWriter.lane): room for a small op's few messages, whose
# bodies are at most half of it.
LANE_BYTES = 64 << 10


NOT_INLINE = FLAG_CHUNKED | FLAG_REMOTE  # records whose body is not whole in the ring


def fence() -> None:
    """A full memory barrier: CPython's lock takes and gives back with locked
    instructions, which x86 never reorders loads or stores across."""
    _fence_lock.acquire()
    _fence_lock.release()


def shm_available() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and \
        os.path.isdir(_SHM_DIR) and os.access(_SHM_DIR, os.W_OK)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) & ~(_ALIGN - 1)


def _in_ring(flags: int, nbytes: int) -> tuple[int, int]:
    """A record's body bytes in the ring and its whole size there, padding included: a
    chunked body follows in records of its own, a lent one is a descriptor."""
    if flags & FLAG_CHUNKED:
        return 0, HEADER_SIZE
    body = REMOTE_BODY.size if flags & FLAG_REMOTE else nbytes
    return body, _align(HEADER_SIZE + body)


def ring_capacity(nbytes: int) -> int:
    """The usable size of a ring asked for as ``nbytes``: whole 64-byte lines, at least a
    page (so records of a few KiB fit)."""
    return max(4096, nbytes & ~(_ALIGN - 1))


def _file_size(capacity: int, lane: int) -> int:
    """A ring's file: its control page and records, then its lane's (``lane`` bytes of
    records; 0: no lane)."""
    return _CONTROL + capacity + (_CONTROL + lane if lane else 0)


def _map_file(fd: int, size: int) -> mmap.mmap:
    # Every page mapped now, not on its first touch: the first lap of a ring otherwise
    # faults in its pages one by one (tmpfs allocates and zeroes them on the writer's
    # side), which made a job's first three 1 MiB allreduces take 1 ms each instead of
    # 0.1-0.2 ms.
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


class _Mapping:
    """One ring's part of a mapped file: its control page at ``offset``, then
    ``capacity`` bytes of records."""

    def __init__(self, mm: mmap.mmap, offset: int, capacity: int) -> None:
        self.capacity = capacity
        self.map = mm
        start = offset + _CONTROL
        # A memoryview reads a counter in a third of the time a numpy array takes, and
        # every small message reads and writes several.
        self.ctl = memoryview(mm)[offset:start].cast("Q")
        self.data = np.frombuffer(mm, dtype=np.uint8, count=capacity, offset=start)
        self.view = memoryview(mm)[start:start + capacity]

    def close(self) -> None:
        # Views pin the buffer; drop them first or mmap.close() raises BufferError (as it
        # does while the file's other ring, main or lane, still has its own).
        self.data = None  # type: ignore[assignment]
        self.ctl.release()
        self.view.release()
        with contextlib.suppress(BufferError, ValueError):
            self.map.close()


class RingWriter:
    """The producer's end."""

    def __init__(self, capacity: int, lane: int = 0) -> None:
        """``lane``: the bytes of a second, small ring in the same file (:attr:`lane`)."""
        self.name = "totalreduce-" + secrets.token_hex(16)
        self.path = os.path.join(_SHM_DIR, self.name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        size = _file_size(capacity, lane)
        try:
            os.ftruncate(fd, size)
            # The ring's memory is taken now: where /dev/shm is too small for every ring
            # (a container's is often 64 MiB), a ring with pages missing killed the
            # process with SIGBUS at its first write past the space; this way the pair
            # is told at set-up (ENOSPC) and keeps to its socket, with a warning.
            os.posix_fallocate(fd, 0, size)
            mm = _map_file(fd, size)
        except BaseException:
            self.unlink()
            raise
        finally:
            os.close(fd)
        self._attach(_Mapping(mm, 0, capacity))
        # The lane: a ring of its own in the same file, for messages that must not wait
        # behind this one's (engine/urgent.py).
        self.lane: RingWriter | None = None
        if lane:
            self.lane = RingWriter.__new__(RingWriter)
            self.lane.name = self.lane.path = ""
            self.lane.lane = None
            self.lane._attach(_Mapping(mm, _CONTROL + capacity, lane))

    def _attach(self, mapping: _Mapping) -> None:
        self._m = mapping
        self.capacity = capacity = mapping.capacity
        self._ctl = mapping.ctl
        self._head = 0  # total bytes written, padding included
        self._stuck_at = -1  # the reader's tail when a post last found the ring full
        self.lend = False  # the reader can copy bodies out of our memory (see .cma)
        self.pace = CopyPace(lap=capacity)  # how fast big bodies went in lately
        # Records are at most half the ring, so one always fits once the reader catches up.
        self.max_body = capacity // 2 - HEADER_SIZE
        # A body bigger than that goes in chunks of a quarter ring: three are in at once,
        # so the reader copies one out while the writer copies the next in.  In chunks of
        # half a ring only one fit once the ring had wrapped, and the two copies took
        # turns: 16 MiB broadcasts in one piece took 2.6 ms against 2.0 in 2 MiB pieces.
        self.chunk_bytes = max(1, capacity // 4 - HEADER_SIZE)

    def unlink(self) -> None:
        if self.path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def post(self, header: bytes, body: memoryview | None = None) -> bool:
        """Write one record and publish it; False (nothing written) while the ring is full.
        ``body`` must be at most :attr:`max_body` bytes."""
        n = 0 if body is None else body.nbytes
        size = (HEADER_SIZE + n + _ALIGN - 1) & ~(_ALIGN - 1)  # _align, inline: every message
        cap = self.capacity
        ctl = self._ctl
        head = self._head
        start = head
        offset = start % cap
        tail = ctl[_TAIL]
        if offset + size > cap:
            start += cap - offset
        if start + size - tail > cap:
            self._stuck_at = tail
            return False
        view = self._m.view
        if start != head:
            view[offset:offset + HEADER_SIZE] = _WRAP
        at = start % cap
        # Slices of a memoryview: a quarter of the cost of numpy's for a small record,
        # the same memcpy for a big one.
        view[at:at + HEADER_SIZE] = header
        if n:
            assert body is not None
            t0 = time.perf_counter() if n >= PACE_MIN else 0.0  # small bodies: not timed
            at += HEADER_SIZE
            try:
                if n >= 2 * MIN_PIECE:  # a small body's record skips the call
                    copy_bytes(view[at:at + n], body)
                else:
                    view[at:at + n] = body
            except (TypeError, ValueError):  # not a flat byte view: numpy copies anything
                np.copyto(self._m.data[at:at + n], np.frombuffer(body, dtype=np.uint8))
            if t0:
                self.pace.timed(n, time.perf_counter() - t0)
        self._head = start + size
        ctl[_HEAD] = self._head
        return True

    def room_changed(self) -> bool:
        """After a failed :meth:`post`: whether the reader has freed anything since (worth
        a retry)."""
        return int(self._ctl[_TAIL]) != self._stuck_at

    def set_waiting(self, on: bool) -> None:
        """Ask for a doorbell when the reader frees room, before blocking on the socket;
        after raising the flag, check :meth:`room_changed` once more."""
        ctl = self._ctl
        if ctl is not None:
            ctl[_WAITING] = 1 if on else 0
            if on:
                fence()

    def reader_sleeping(self) -> bool:
        """Whether the reader may be blocked and must be sent a doorbell (call after
        :meth:`post`)."""
        _fence_lock.acquire()  # fence(), inline: after every post
        _fence_lock.release()
        ctl = self._ctl
        return bool(ctl[_SLEEPING] or ctl[_SLEEPING + 8])  # SLEEPERS == 2

    def close(self) -> None:
        self._ctl = None  # type: ignore[assignment]
        self._m.close()


class RingReader:
    """The consumer's end."""

    def __init__(self, name: str, capacity: int, lane: int = 0) -> None:
        """``lane``: as the writer's (:attr:`lane`)."""
        if not name.startswith("totalreduce-") or "/" in name:
            raise ValueError(f"not a totalreduce ring name: {name!r}")
        fd = os.open(os.path.join(_SHM_DIR, name), os.O_RDWR)
        try:
            size = _file_size(capacity, lane)
            if os.fstat(fd).st_size != size:
                raise ValueError("ring file has the wrong size")
            mm = _map_file(fd, size)
        finally:
            os.close(fd)
        self._attach(_Mapping(mm, 0, capacity))
        self.lane: RingReader | None = None
        if lane:
            self.lane = RingReader.__new__(RingReader)
            self.lane.lane = None
            self.lane._attach(_Mapping(mm, _CONTROL + capacity, lane))

    def _attach(self, mapping: _Mapping) -> None:
        self._m = mapping
        self._ctl = mapping.ctl
        self.capacity = mapping.capacity
        self._pos = 0
        self._size = 0  # of the record handed out by next(), until release()
        self.lender_pid: int | None = None  # set when we can read the writer's memory

    def head(self) -> int:
        """Where the writer will post next (safe to ask from any thread)."""
        return int(self._ctl[_HEAD])

    def ready(self) -> bool:
        """Whether a record is waiting (safe to ask from any thread)."""
        ctl = self._ctl
        return ctl is not None and int(ctl[_HEAD]) != self._pos

    def next(self) -> tuple[Header, memoryview] | None:
        """The oldest record's header and body (valid until :meth:`release`), or None.
        A header flagged FLAG_CHUNKED comes with an empty body: RING_CHUNK records follow.

        Raises:
            WireError: the ring holds something that is not a record.
        """
        head = self._ctl[_HEAD]  # an int already: the memoryview is of "Q"
        pos = self._pos
        if head == pos:
            return None
        # _record, inline for a whole body before the ring's end: nearly every record,
        # and on a small op's path a call and a tuple are a share of the cost.
        offset = pos % self.capacity
        view = self._m.view
        header = unpack_header(view, offset)
        if header.kind == KIND_RING_WRAP or header.flags & NOT_INLINE:
            self._pos, header, self._size, body = self._record(pos, head)
            return header, body
        n = header.nbytes
        size = (HEADER_SIZE + n + _ALIGN - 1) & ~(_ALIGN - 1)
        if offset + size > self.capacity or pos + size > head:
            raise WireError(f"ring record of {n} bytes at {offset} overruns")
        self._size = size
        offset += HEADER_SIZE
        return header, view[offset:offset + n]

    def behind(self) -> int:
        """Where the records posted after the one :meth:`next` returned begin."""
        return self._pos + self._size

    def glance(self, pos: int) -> Iterator[tuple[int, int, int, int, int, int]]:
        """The records from ``pos`` (one :meth:`behind` gave, or a later one this gave) to
        the newest, oldest first, without taking them or unpacking them whole: (where,
        kind, flags, name_key, seq, where the next begins).  :meth:`record_at` gives one
        whole (its body as :meth:`next` gives it).

        Raises:
            WireError: what is there is not a record.
        """
        head = int(self._ctl[_HEAD])
        cap = self.capacity
        view = self._m.view
        unpack = _GLANCE.unpack_from
        while pos < head:
            offset = pos % cap
            magic, kind, flags, name_key, seq, nbytes = unpack(view, offset)
            if kind == Kind.RING_WRAP:
                pos += cap - offset
                offset = 0
                magic, kind, flags, name_key, seq, nbytes = unpack(view, 0)
            if magic != MAGIC:
                raise WireError(f"bad magic 0x{magic:04x} in message header")
            _body, size = _in_ring(flags, nbytes)
            if offset + size > cap or pos + size > head:
                raise WireError(f"ring record of {nbytes} bytes at {offset} overruns")
            yield pos, kind, flags, name_key, seq, pos + size
            pos += size

    def record_at(self, where: int) -> tuple[Header, memoryview]:
        """The record :meth:`glance` found at ``where``: its header and body."""
        _pos, header, _size, body = self._record(where, int(self._ctl[_HEAD]))
        return header, body

    def _record(self, pos: int, head: int) -> tuple[int, Header, int, memoryview]:
        """The record at ``pos`` (past a wrap marker there): (its position, header, size
        in the ring, body).

        Raises:
            WireError: what is there is not a record.
        """
        cap = self.capacity
        view = self._m.view
        offset = pos % cap
        header = unpack_header(view, offset)
        if header.kind == KIND_RING_WRAP:
            pos += cap - offset
            offset = 0
            header = unpack_header(view)
        flags = header.flags
        if flags & NOT_INLINE:
            body, size = _in_ring(flags, header.nbytes)
        else:  # _in_ring, inline: nearly every record
            body = header.nbytes
            size = (HEADER_SIZE + body + _ALIGN - 1) & ~(_ALIGN - 1)
        if offset + size > cap or pos + size > head:
            raise WireError(f"ring record of {header.nbytes} bytes at {offset} overruns")
        start = offset + HEADER_SIZE
        return pos, header, size, view[start:start + body]

    def mark_taken(self, where: int, header: Header) -> None:
        """A record from :meth:`glance` (a whole-bodied one) has been handled: :meth:`next`
        will show it as RING_TAKEN, to be released unread."""
        offset = where % self.capacity
        self._m.view[offset:offset + HEADER_SIZE] = \
            Header(Kind.RING_TAKEN, nbytes=header.nbytes).pack()

    def release(self) -> bool:
        """Free the record from :meth:`next`; True if the producer waits for room (ring
        its doorbell)."""
        self._pos += self._size
        self._size = 0
        ctl = self._ctl
        ctl[_TAIL] = self._pos
        _fence_lock.acquire()  # fence(), inline: after every record
        _fence_lock.release()
        if ctl[_WAITING]:
            ctl[_WAITING] = 0
            return True
        return False

    def set_sleeping(self, slot: int, on: bool) -> None:
        """Raise or lower one of the sleeping flags (see the module docstring); after
        raising, check :meth:`ready` once more before blocking."""
        ctl = self._ctl
        if ctl is not None:
            ctl[_SLEEPING + 8 * slot] = 1 if on else 0
            if on:
                fence()

    def close(self) -> None:
        self._ctl = None  # type: ignore[assignment]
        self._m.close()
