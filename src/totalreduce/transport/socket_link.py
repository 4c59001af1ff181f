"""One peer's connection, and the stream protocol over its socket.

Small messages are batched into one ``sendmsg``; headers are read through a staging
buffer so that many small messages cost one ``recv``; large bodies are read with
``recv_into`` straight into the destination the handler names, with no copy.  The link
is also its peer's port (base.Port) for the thread that drives: ``post_now`` sends one
message at once, ``peek`` receives what the kernel holds into the staging buffer and shows
the front message in place, ``take`` moves past it; what ``peek`` received and left is
parsed by the next poll() (the transport's ``staged``), socket readable or not.  A link
whose peer shares this host carries its messages in shared-memory rings instead
(ring_link.py) and keeps the socket as a doorbell and failure detector.
"""

from __future__ import annotations

import errno
import socket
from collections import deque
from typing import Any, Protocol

from .base import Counters, MessageHandler
from .wire import (
    FLAG_CHUNKED,
    FLAG_REMOTE,
    HEADER_SIZE,
    KIND_DATA,
    Header,
    Kind,
    WireError,
    unpack_header,
)

_STAGING = 256 << 10
BATCH_BYTES = 256 << 10
_BATCH_MESSAGES = 64
READ_BUDGET = 2 << 20  # bytes read from one link per poll (ring bodies included)
WRITE_BUDGET = 2 << 20  # bytes written to one link per poll (ring bodies included)


# A message a caller's thread reads in place (Link.peek) lies whole in the staging buffer;
# a bigger one is read by poll() into its destination.
_PEEK_MAX = _STAGING - HEADER_SIZE
# The biggest body a caller's thread sends (Link.post_now): the kernel takes that much at
# once where nothing of ours waits (a local socket's send buffer is 256 KiB, doubled by
# the kernel).  A bigger one goes from the loop, which reads the peer's answer while it
# writes: posted from the caller's thread, the rest of a 1 MiB allreduce's body waited for
# the loop's next turns (1.6 ms at 2 ranks, against 0.33 ms on the loop).
_POST_MAX = 256 << 10
# Flags of a DATA message whose body is not simply the bytes after its header.
_NOT_INLINE = FLAG_CHUNKED | FLAG_REMOTE

_SILENT_HOST = (errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN)


def explain(exc: OSError) -> str:
    """The error, and what it means where the peer's host went silent (mesh.py's
    keepalives give up after about 25 s without an answer)."""
    if exc.errno in _SILENT_HOST:
        return (f"{exc}: its host stopped answering (the network between us, or that "
                "host, is down)")
    return str(exc)


class LinkOwner(Protocol):
    """What a link needs from its transport."""

    handler: MessageHandler
    counters: Counters
    shm_counters: Counters  # what goes through shared-memory rings
    pending: set[int]  # peers with output of ours waiting: no message may pass it
    # Links whose staging buffer holds what peek() received and left, or whose peek()
    # met the connection's end: the next poll() reads them, socket readable or not.
    staged: set[Link]

    def again(self, peer: int) -> None:
        """Write more to ``peer`` on the next turn (its budget ran out, or it must retry)."""

    def set_writing(self, link: Link, on: bool) -> None:
        """Watch (or stop watching) ``link``'s socket for room to write."""

    def lost(self, link: Link, reason: str, orderly: bool = False) -> None:
        """The link ended."""

    def wake(self) -> None:
        """Make a blocked poll() return soon (any thread)."""


class Link:
    """A connection to one peer over a socket."""

    def __init__(self, owner: LinkOwner, peer: int, sock: socket.socket) -> None:
        self.owner = owner
        self.counters = owner.counters
        self.peer = peer
        self.sock = sock
        self.out: deque[memoryview] = deque()
        self.marks: deque[list[Any]] = deque()  # [bytes left in this message, token]
        self.writing = False  # registered for EVENT_WRITE
        self.header: Header | None = None  # the message whose body is arriving
        self.body: memoryview | None = None
        self.body_off = 0
        self.goodbye = False
        self.closed = False
        self.write_closed = False  # we sent our last message and half-closed the socket
        self._staging = bytearray(_STAGING)
        self._rstart = 0
        self._rend = 0
        # What a receive on the caller's thread (peek) met: poll()'s read() reports it.
        self._peek_error: OSError | None = None
        self._peek_eof = False

    def pending_output(self) -> bool:
        return bool(self.out)

    def drop_output(self) -> None:
        self.out.clear()
        self.marks.clear()

    def deliver(self) -> None:
        """The arriving body is whole: hand the message on."""
        header, body = self.header, self.body
        assert header is not None and body is not None
        self.header = None
        self.body = None
        self.body_off = 0
        counters = self.counters
        counters.messages_received += 1
        counters.bytes_received += HEADER_SIZE + header.nbytes
        self.owner.handler.received(self.peer, header, body)

    # --- writing -------------------------------------------------------------------

    def write(self, budget: int = WRITE_BUDGET) -> None:
        if self.write_closed:
            return  # after our last message; whatever the engine still has is moot
        while True:
            if not self.out:
                if budget <= 0:
                    # The rest goes out on the next poll(), so one poll never streams a
                    # whole big op while a waiter's small op is already done.
                    self.owner.again(self.peer)
                    return
                budget -= self._fill()
                if not self.out:
                    self.owner.set_writing(self, False)
                    return
            try:
                n = self.sock.sendmsg(self.out)
            except (BlockingIOError, InterruptedError):
                self.owner.set_writing(self, True)
                return
            except OSError as exc:
                self.owner.lost(self, f"send failed: {explain(exc)}")
                return
            self._consume(n)
            if self.out:
                self.owner.set_writing(self, True)
                return

    def _fill(self) -> int:
        """Queue a batch of messages on ``out``; returns their bytes."""
        handler = self.owner.handler
        total = 0
        count = 0
        while total < BATCH_BYTES and count < _BATCH_MESSAGES:
            msg = handler.next_outgoing(self.peer)
            if msg is None:
                break
            header, body = msg.header, msg.body
            size = len(header)
            self.out.append(memoryview(header))
            if body is not None and body.nbytes:
                self.out.append(body)
                size += body.nbytes
            self.marks.append([size, msg.token])
            total += size
            count += 1
        counters = self.counters
        counters.messages_sent += count
        counters.bytes_sent += total
        return total

    def _consume(self, n: int) -> None:
        out, marks = self.out, self.marks
        left = n
        while left:
            head = out[0]
            if head.nbytes <= left:
                left -= head.nbytes
                out.popleft()
            else:
                out[0] = head[left:]
                left = 0
        left = n
        while left and marks:
            mark = marks[0]
            if mark[0] <= left:
                left -= mark[0]
                marks.popleft()
                self.owner.handler.sent(self.peer, mark[1])
            else:
                mark[0] -= left
                left = 0
        # Zero-byte tail messages cannot exist: every message has a 64-byte header.

    def post_now(self, header: bytes, body: memoryview | None) -> bool:
        """Send one message from the thread that drives (:meth:`.base.Transport.post_now`),
        ahead of nothing: False, nothing sent, while output of ours waits or the link is
        down.  What the kernel does not take at once is copied and left to poll()."""
        if (self.out or self.writing or self.closed or self.write_closed
                or self.peer in self.owner.pending
                or (body is not None and body.nbytes > _POST_MAX)):
            return False
        parts: list[bytes | memoryview] = [header]
        size = len(header)
        if body is not None and body.nbytes:
            parts.append(body)
            size += body.nbytes
        try:
            n = self.sock.sendmsg(parts)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return False  # poll() meets the error too, and reports the peer lost
        counters = self.counters
        counters.messages_sent += 1
        counters.bytes_sent += size
        if n < size:
            # The caller may write over its body once we return: the rest goes as a copy,
            # first on the link, so nothing passes it.
            rest = b"".join(bytes(part) for part in parts)[n:]
            self.out.append(memoryview(rest))
            self.marks.append([len(rest), None])
            self.owner.set_writing(self, True)
        return True

    def peek(self) -> tuple[Header, memoryview | None] | None:
        """The peer's next message, if it has arrived, without taking it
        (:meth:`.base.Transport.peek`): a DATA message whose body lies whole in the
        staging buffer with its body, anything else with None; None when nothing whole
        is here yet.  Receives what the kernel holds, without waiting."""
        if self.body is not None or self.closed or self._peek_error or self._peek_eof:
            return None
        shown = self._front()
        if shown is not None:
            return shown
        if self._rend == len(self._staging):
            if self._rstart == 0:
                return None  # a message as big as the buffer: poll() reads it
            tail = self._staging[self._rstart:self._rend]
            self._staging[: len(tail)] = tail
            self._rstart, self._rend = 0, len(tail)
        try:
            n = self.sock.recv_into(memoryview(self._staging)[self._rend:])
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            self._peek_error = exc
            self.owner.staged.add(self)
            return None
        self.owner.staged.add(self)
        if n == 0:
            self._peek_eof = True
            return None
        self._rend += n
        return self._front()

    def _front(self) -> tuple[Header, memoryview | None] | None:
        """The message at the front of the staging buffer, as :meth:`peek` shows it."""
        start = self._rstart
        avail = self._rend - start
        if avail < HEADER_SIZE:
            return None
        view = memoryview(self._staging)
        try:
            header = unpack_header(view[start:start + HEADER_SIZE])
        except WireError:
            return None  # poll()'s read() reports it
        if header.kind != KIND_DATA or header.flags & _NOT_INLINE:
            return (header, None)
        if header.nbytes > _PEEK_MAX:
            return (header, None)
        if avail - HEADER_SIZE < header.nbytes:
            return None
        return (header, view[start + HEADER_SIZE:start + HEADER_SIZE + header.nbytes])

    def take(self, header: Header) -> None:
        """The message :meth:`peek` showed (``header``) has been handled."""
        self._rstart += HEADER_SIZE + header.nbytes
        counters = self.counters
        counters.messages_received += 1
        counters.bytes_received += HEADER_SIZE + header.nbytes

    # --- reading -------------------------------------------------------------------

    def read(self) -> None:
        if self._peek_error is not None:
            error, self._peek_error = self._peek_error, None
            self.owner.lost(self, f"receive failed: {explain(error)}")
            return
        if self._peek_eof:
            self.eof()
            return
        budget = READ_BUDGET
        sock = self.sock
        try:
            if self.body is None and self._rend - self._rstart >= HEADER_SIZE:
                self._parse()  # what peek() received and left
            while budget > 0 and not self.closed:
                if self.body is not None:
                    n = sock.recv_into(self.body[self.body_off:])
                    if n == 0:
                        self.eof()
                        return
                    budget -= n
                    self.body_off += n
                    if self.body_off == self.body.nbytes:
                        self.deliver()
                    continue
                if self._rstart == self._rend:
                    self._rstart = self._rend = 0
                elif self._rend == len(self._staging):
                    tail = self._staging[self._rstart:self._rend]
                    self._staging[: len(tail)] = tail
                    self._rstart, self._rend = 0, len(tail)
                n = sock.recv_into(memoryview(self._staging)[self._rend:])
                if n == 0:
                    self.eof()
                    return
                budget -= n
                self._rend += n
                self._parse()
        except (BlockingIOError, InterruptedError):
            return
        except WireError as exc:
            self.owner.lost(self, f"corrupt stream: {exc}")
        except OSError as exc:
            self.owner.lost(self, f"receive failed: {explain(exc)}")

    def _parse(self) -> None:
        """Handle every whole header in the staging buffer."""
        handler = self.owner.handler
        staging = self._staging
        while self.body is None and self._rend - self._rstart >= HEADER_SIZE:
            start = self._rstart
            header = unpack_header(memoryview(staging)[start:start + HEADER_SIZE])
            self._rstart += HEADER_SIZE
            if header.kind == Kind.GOODBYE:
                self.goodbye = True
            self.header = header
            dest = handler.body_buffer(self.peer, header)
            if dest.nbytes != header.nbytes:
                raise AssertionError("body_buffer returned a buffer of the wrong size")
            avail = min(self._rend - self._rstart, header.nbytes)
            if avail:
                dest[:avail] = staging[self._rstart:self._rstart + avail]
                self._rstart += avail
            self.body = dest
            self.body_off = avail
            if avail == header.nbytes:
                self.deliver()

    def eof(self) -> None:
        self.owner.lost(self, "connection closed by peer", orderly=self.goodbye)
