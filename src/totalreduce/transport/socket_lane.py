"""A lane to a peer reached over a socket: a second connection that carries only the
urgent lane's messages (engine/urgent.py), so they do not queue behind the bytes of a big
op in the first one's kernel buffers.

It is read and written from any thread, as a ring link's lane is (ring_link.py): a
caller's thread posts its messages and reads the peer's while another thread drives the
loop, which reads the messages its ops need (MessageHandler.lane_claims) when the socket
is readable.  Whoever reads takes what has arrived into one staging buffer, where
messages stay, whole and in order, until one of the two takes them.  The connection is
authenticated as the first is (mesh.py); its end says nothing about the peer, whose first
connection is the failure detector: a lane that ends or fails is only closed, and what
would have gone through it goes through the first connection instead.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from typing import Protocol

from .base import MessageHandler
from .wire import FLAG_CHUNKED, FLAG_REMOTE, HEADER_SIZE, Header, Kind, WireError, unpack_header

# The biggest body a lane message may have; the staging buffer holds a few of them.
LANE_BODY = (32 << 10) - HEADER_SIZE
_STAGING = 4 * (LANE_BODY + HEADER_SIZE)
# A message the kernel took only in part is finished within this long, or the lane is
# closed (the peer then drops the part, and the op goes on through the first connection).
_FINISH_SEND = 5.0


class LaneOwner(Protocol):
    handler: MessageHandler

    def wake(self) -> None:
        """Make a blocked poll() return soon (any thread)."""

    def lane_ended(self, lane: SocketLane) -> None:
        """Stop watching the lane's socket, then close it (the loop's thread)."""


class SocketLane:
    def __init__(self, owner: LaneOwner, peer: int, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.owner = owner
        self.peer = peer
        self.sock = sock
        self.lane_lock = threading.Lock()  # reading (the staging buffer)
        self._writing = threading.Lock()
        self._staging = bytearray(_STAGING)
        self._start = self._end = 0
        self._eof = False
        self.closed = False
        self.recheck = False  # messages left here may be the loop's now (read() again)
        self.lane_counts = {"messages_sent": 0, "bytes_sent": 0, "messages_received": 0,
                            "bytes_received": 0}

    def lane_room(self) -> int:
        return 0 if self.closed else LANE_BODY

    # --- any thread ---------------------------------------------------------------------

    def lane_post(self, header: bytes, body: memoryview | None) -> bool:
        """Send one message; False, nothing sent, when the kernel takes none of it now or
        the lane has closed."""
        n = 0 if body is None else body.nbytes
        if n > LANE_BODY:
            return False
        parts: list[bytes | memoryview] = [header, body] if body is not None and n else [header]
        with self._writing:
            if self.closed:
                return False
            try:
                sent = self.sock.sendmsg(parts)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:
                self.closed = True
                return False
            if sent < HEADER_SIZE + n and not self._finish(parts, sent):
                self.closed = True
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)
                return False
            counts = self.lane_counts
            counts["messages_sent"] += 1
            counts["bytes_sent"] += HEADER_SIZE + n
        return True

    def lane_peek(self) -> tuple[Header, memoryview] | None:
        """The oldest message that has arrived, with its body (hold :attr:`lane_lock`;
        valid until :meth:`lane_take` or the lock goes), or None."""
        if self.closed:
            return None
        self._fill()
        return self._front()

    def lane_wait(self, timeout: float) -> None:
        """Block until the socket has bytes (perhaps already taken by the loop's read) or
        ``timeout`` passes: a thread waiting on the kernel is woken when they come, where
        one that naps may find its core taken."""
        with contextlib.suppress(OSError, ValueError):
            select.select([self.sock], [], [], timeout)

    def lane_take(self, header: Header) -> None:
        """The message :meth:`lane_peek` showed (``header``) has been handled (hold
        :attr:`lane_lock`)."""
        if self._took(header):
            self.recheck = True  # the loop may claim what is behind it
            self.owner.wake()

    # --- the loop's thread ----------------------------------------------------------------

    def read(self) -> None:
        """Take what has arrived and hand the handler the messages it claims, oldest
        first, up to the first it does not (a caller's thread will take that one); every
        one at the peer's end.  Skipped while a caller's thread reads the lane."""
        if self.closed:
            self.owner.lane_ended(self)  # a post that failed closed it
            return
        if not self.lane_lock.acquire(False):
            return
        try:
            self.recheck = False
            self._fill()
            handler = self.owner.handler
            while (record := self._front()) is not None:
                header, body = record
                behind = self._end - self._start > HEADER_SIZE + header.nbytes
                if not self._eof and not handler.lane_claims(self.peer, header, behind):
                    break
                # A body from the first connection may be arriving meanwhile: its
                # route stays for it.
                handler.received_ahead(self.peer, header, body)
                self._took(header)
            if self._eof:
                self.closed = True  # a message cut short by the end is dropped
        except WireError:
            self.closed = True
        finally:
            self.lane_lock.release()
        if self.closed:
            self.owner.lane_ended(self)

    def close(self) -> None:
        """Close the socket (the owner has stopped watching it)."""
        with self._writing, self.lane_lock:
            self.closed = True
            with contextlib.suppress(OSError):
                self.sock.close()

    # --- helpers ----------------------------------------------------------------------

    def _took(self, header: Header) -> bool:
        """Drop the front message (``header``'s); returns whether others are left."""
        self._start += HEADER_SIZE + header.nbytes
        counts = self.lane_counts
        counts["messages_received"] += 1
        counts["bytes_received"] += HEADER_SIZE + header.nbytes
        if self._start == self._end:
            self._start = self._end = 0
            return False
        return True

    def _fill(self) -> None:
        """Move what the kernel holds into the staging buffer (as much as fits)."""
        staging = self._staging
        if self._start and self._end == len(staging):
            left = staging[self._start:self._end]
            staging[:len(left)] = left
            self._start, self._end = 0, len(left)
        while not self._eof and self._end < len(staging):
            try:
                n = self.sock.recv_into(memoryview(staging)[self._end:])
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                n = 0
            if n == 0:
                self._eof = True
                return
            self._end += n

    def _front(self) -> tuple[Header, memoryview] | None:
        """The whole message at the front of the staging buffer, if there is one.

        Raises:
            WireError: what is there is not a lane message.
        """
        have = self._end - self._start
        if have < HEADER_SIZE:
            return None
        view = memoryview(self._staging)
        start = self._start
        header = unpack_header(view[start:start + HEADER_SIZE])
        if header.kind != Kind.DATA or header.flags & (FLAG_CHUNKED | FLAG_REMOTE) \
                or header.nbytes > LANE_BODY:
            raise WireError(f"a {header.kind!r} message of {header.nbytes} bytes in a lane")
        if have < HEADER_SIZE + header.nbytes:
            return None
        body = start + HEADER_SIZE
        return header, view[body:body + header.nbytes]

    def _finish(self, parts: list[bytes | memoryview], sent: int) -> bool:
        """Send the rest of a message the kernel took only ``sent`` bytes of."""
        rest = memoryview(b"".join(bytes(p) for p in parts))[sent:]
        deadline = time.monotonic() + _FINISH_SEND
        while rest.nbytes:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                select.select([], [self.sock], [], left)
                rest = rest[self.sock.send(rest):]
            except (BlockingIOError, InterruptedError):
                continue
            except (OSError, ValueError):
                return False
        return True
