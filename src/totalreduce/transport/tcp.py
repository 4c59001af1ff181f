"""TCP transport: one authenticated, nonblocking connection per pair of ranks.

The connections are set up and authenticated by :func:`.mesh.connect_mesh`.  After the
handshake the sockets are nonblocking and driven by one selector loop, whichever thread
drives the engine, which both sends and receives (a thread per direction costs a GIL
hand-off per message: see DESIGN.md).  Small messages are batched into one ``sendmsg``;
headers are read through a staging buffer so that many small messages cost one ``recv``;
large bodies are read with ``recv_into`` straight into the destination the handler names,
with no copy.

Peers on the same host also get a shared-memory ring per direction (:mod:`.shmring`), and
then every message between them, header and body, travels through the rings: no system
call per message, and the receiver reduces straight out of the sender's slot.  Their
socket stays open as a doorbell (one byte when the reader may be asleep, see shmring) and
as the failure detector: a dead peer's socket ends, and what it wrote to the ring before
is read first, so an orderly GOODBYE is never mistaken for a crash.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import time
from collections import deque
from typing import Any, Protocol

from . import cma
from .base import MessageHandler, Outgoing, Transport
from .shmring import RingReader, RingWriter
from .wire import (
    FLAG_CHUNKED,
    FLAG_LENDABLE,
    FLAG_REMOTE,
    HEADER_SIZE,
    REMOTE_BODY,
    Header,
    Kind,
    WireError,
    has_flag,
    unpack_header,
    with_flag,
)

logger = logging.getLogger(__name__)

_STAGING = 256 << 10
_BATCH_BYTES = 256 << 10
_BATCH_MESSAGES = 64
_READ_BUDGET = 2 << 20  # bytes read from one link per poll (ring bodies included)
_WRITE_BUDGET = 2 << 20  # bytes written to one link per poll (ring bodies included)
_SPIN = 50e-6  # busy-poll this long before a blocking select (see poll)
# A thread waiting for its own op spins this long when every local rank can have a core
# of its own (shared-memory peers reply within tens of us, a sleep+doorbell costs ~50 us).
_SPIN_OWN_CORE = 2e-3
_SPIN_SOCKET_EVERY = 16  # while spinning on rings, look at the sockets this seldom
_RING_RETRY = 0.001  # safety-net poll while a ring is full (a doorbell normally wakes us)
_RING_SLEEP = 0.02  # the longest nap with shared-memory peers (in case a doorbell is lost)
_DOORBELL = b"\x01"
_LEND_MIN = 64 << 10  # smaller lendable bodies are copied: a read costs a system call


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class _LendFailed(Exception):
    """The peer's memory could not be read: it has exited, or was never readable."""


class _Stoppable(Protocol):
    def stop(self) -> None: ...


class _Link:
    __slots__ = ("peer", "sock", "out", "marks", "writing", "staging", "rstart", "rend",
                 "header", "body", "body_off", "goodbye", "closed", "ring_out", "ring_in",
                 "blocked", "chunk_off", "lent", "next_lend", "acks", "deferred",
                 "write_closed")

    def __init__(self, peer: int, sock: socket.socket) -> None:
        self.peer = peer
        self.sock = sock
        self.out: deque[memoryview] = deque()
        self.marks: deque[list[Any]] = deque()  # [bytes left in this message, token]
        self.writing = False  # registered for EVENT_WRITE
        self.staging = bytearray(_STAGING)
        self.rstart = 0
        self.rend = 0
        self.header: Header | None = None
        self.body: memoryview | None = None
        self.body_off = 0
        self.goodbye = False
        self.closed = False
        self.ring_out: RingWriter | None = None
        self.ring_in: RingReader | None = None
        self.blocked: Outgoing | None = None  # waiting for room in ring_out
        self.chunk_off = -1  # bytes of blocked's body already in the ring (-1: not begun)
        self.lent: dict[int, Outgoing] = {}  # bodies the peer has yet to copy out of us
        self.next_lend = 0
        self.acks: deque[int] = deque()  # lend ids of the peer's bodies we have copied
        self.deferred = False  # the ring's next record waits for the engine (resume())
        self.write_closed = False  # we sent our last message and half-closed the socket


class TcpTransport(Transport):
    """See the module docstring.  Build it with :func:`.mesh.connect_mesh`."""

    def __init__(self, rank: int, size: int, socks: dict[int, socket.socket],
                 acceptor: _Stoppable | None,
                 rings: dict[int, tuple[RingWriter | None, RingReader | None]] | None = None,
                 ) -> None:
        self.rank = rank
        self.size = size
        self._links = {p: _Link(p, s) for p, s in socks.items()}
        for peer, (ring_out, ring_in) in (rings or {}).items():
            if ring_out is not None and ring_in is not None:
                self._links[peer].ring_out = ring_out
                self._links[peer].ring_in = ring_in
            else:  # one direction only: the socket carries both (see _share_rings)
                for ring in (ring_out, ring_in):
                    if ring is not None:
                        ring.close()
        self._ring_links = [link for link in self._links.values() if link.ring_in]

        local = len(self._ring_links) + 1
        self._spin = _SPIN_OWN_CORE if self._ring_links and local <= _cores() else _SPIN
        self._acceptor = acceptor
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._pending: set[int] = set()
        self._socket_turns = 0  # turns since _select last looked at the sockets
        self._handler: MessageHandler | None = None
        for link in self._links.values():
            link.sock.setblocking(False)
            self._selector.register(link.sock, selectors.EVENT_READ, link)

    # --- interface -----------------------------------------------------------------

    def start(self, handler: MessageHandler) -> None:
        self._handler = handler

    def want_send(self, peer: int) -> None:
        self._pending.add(peer)

    def resume(self) -> None:
        for link in self._ring_links:
            link.deferred = False

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def pending_output(self) -> bool:
        return any(link.out or link.blocked or link.acks for link in self._links.values()
                   if not link.closed)

    def ring_peers(self) -> list[int]:
        """Peers whose messages travel through shared memory."""
        return sorted(link.peer for link in self._ring_links)

    def flush(self) -> None:
        # One batch per link: an async submit must return to the application quickly, and
        # whatever is left goes out from the next poll().
        self._retry_blocked()
        self._flush_pending(_BATCH_BYTES)

    def can_wait(self) -> bool:
        return True

    def has_backlog(self) -> bool:
        return bool(self._pending) or self._ring_blocked()

    def _ring_blocked(self) -> bool:
        return any(link.blocked is not None for link in self._ring_links)

    def _retry_blocked(self) -> bool:
        """Queue every link whose message waits for ring room for another try; returns
        whether there was one."""
        found = False
        for link in self._ring_links:  # only ring writes leave a message blocked
            if link.blocked is not None:
                self._pending.add(link.peer)
                found = True
        return found

    def wait(self, timeout: float) -> None:
        if self._pending:
            return
        if self._ring_blocked():
            timeout = min(timeout, _RING_RETRY)
        try:
            self._select(timeout, slot=1)
        except (OSError, ValueError):
            return  # closed under us by the thread that holds the lock

    def _rings_ready(self) -> bool:
        """Whether a ring has a record for us or has freed room for a message that found
        it full."""
        for link in self._ring_links:
            ring = link.ring_in
            if ring is not None and ring.ready() and not link.deferred:
                return True
            if self._room_freed(link):
                return True
        return False

    @staticmethod
    def _room_freed(link: _Link) -> bool:
        """Whether the ring that ``link``'s blocked message did not fit in has room now."""
        return link.blocked is not None and link.ring_out is not None and \
            link.ring_out.room_changed()

    def _ask_for_room(self) -> list[_Link]:
        """Before blocking: ask the readers of full rings for a doorbell when they free
        room; returns those links."""
        stuck = [link for link in self._ring_links
                 if link.blocked is not None and link.ring_out is not None]
        for link in stuck:
            link.ring_out.set_waiting(True)  # type: ignore[union-attr]
        return stuck

    def _select(self, timeout: float | None, slot: int = 0) -> list[tuple[Any, int]]:
        """Socket events, after spinning briefly and before sleeping; returns early when a
        ring has a record (the caller drains the rings whatever this returns)."""
        if self._ring_links and self._rings_ready() and self._socket_turns < _SPIN_SOCKET_EVERY:
            # Records are waiting: take them first and look at the sockets (doorbells, EOF,
            # a remote peer's bytes) on a later turn, though never fewer than one in so many.
            self._socket_turns += 1
            return []
        self._socket_turns = 0
        events = self._selector.select(0)
        if events or timeout == 0 or self._rings_ready():
            return events
        # Spin before sleeping: a blocked select() costs a scheduler wake-up (tens of us on
        # a loaded host) on every hop of a small op's critical path.  The progress thread
        # (slot 1) spins briefly only: the application may want the GIL meanwhile.
        spin_until = time.monotonic() + (self._spin if slot == 0 else _SPIN)
        turns = 0
        while time.monotonic() < spin_until and not self._pending:
            if self._rings_ready():
                return events
            turns += 1
            if turns % _SPIN_SOCKET_EVERY == 0 or not self._ring_links:
                events = self._selector.select(0)
                if events:
                    return events
        rings = self._ring_links
        stuck: list[_Link] = []
        if rings:
            timeout = _RING_SLEEP if timeout is None else min(timeout, _RING_SLEEP)
            for link in rings:
                if link.ring_in is not None:
                    link.ring_in.set_sleeping(slot, True)
            stuck = self._ask_for_room()
        try:
            if not (rings and self._rings_ready()):
                events = self._selector.select(timeout)
        finally:
            for link in rings:
                if link.ring_in is not None:
                    link.ring_in.set_sleeping(slot, False)
            for link in stuck:
                if link.ring_out is not None:
                    link.ring_out.set_waiting(False)
        return events

    def poll(self, timeout: float | None) -> None:
        blocked = self._retry_blocked()
        if self._pending:
            self._flush_pending()
        if self._pending:
            timeout = 0
        elif blocked and self._ring_blocked():
            timeout = _RING_RETRY if timeout is None else min(timeout, _RING_RETRY)
        events = self._select(timeout)
        for key, mask in events:
            link = key.data
            if link is None:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
                continue
            if mask & selectors.EVENT_READ and not link.closed:
                if link.ring_in is not None:
                    self._read_doorbells(link)
                else:
                    self._read(link)
            if mask & selectors.EVENT_WRITE and not link.closed:
                self._write(link)
        for link in self._ring_links:
            if not link.closed:
                self._read_ring(link)
                if self._room_freed(link):
                    self._pending.add(link.peer)
        if self._pending:
            self._flush_pending()

    def close_writes(self) -> bool:
        for link in self._links.values():
            if not link.closed and not link.write_closed:
                link.write_closed = True
                with contextlib.suppress(OSError):
                    link.sock.shutdown(socket.SHUT_WR)
        return True

    def abort(self) -> None:
        if self._acceptor is not None:
            self._acceptor.stop()
        for link in self._links.values():
            link.closed = True
            with contextlib.suppress(Exception):
                self._selector.unregister(link.sock)
            with contextlib.suppress(OSError):
                link.sock.close()
        with contextlib.suppress(Exception):
            self._selector.close()
        self._ring_links = []
        for link in self._links.values():
            link.blocked = None
            for ring in (link.ring_out, link.ring_in):
                if ring is not None:
                    ring.close()
            link.ring_out = link.ring_in = None
        for s in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                s.close()

    # --- writing -------------------------------------------------------------------

    def _flush_pending(self, budget: int = _WRITE_BUDGET) -> None:
        peers = list(self._pending)
        self._pending.clear()  # a link whose write budget runs out puts itself back
        for peer in peers:
            link = self._links.get(peer)
            if link is not None and not link.closed and not link.writing:
                self._write(link, budget)

    def _fill(self, link: _Link) -> int:
        """Queue a batch of messages on ``link.out``; returns their bytes."""
        assert self._handler is not None
        total = 0
        count = 0
        while total < _BATCH_BYTES and count < _BATCH_MESSAGES:
            msg = self._handler.next_outgoing(link.peer)
            if msg is None:
                break
            header, body = msg.header, msg.body
            size = len(header)
            link.out.append(memoryview(header))
            if body is not None and body.nbytes:
                link.out.append(body)
                size += body.nbytes
            link.marks.append([size, msg.token])
            total += size
            count += 1
        return total

    def _write(self, link: _Link, budget: int = _WRITE_BUDGET) -> None:
        assert self._handler is not None
        if link.write_closed:
            return  # after our last message; whatever the engine still has is moot
        if link.ring_out is not None:
            self._write_ring(link, budget)
            return
        while True:
            if not link.out:
                if budget <= 0:
                    # The rest goes out on the next poll(), so one poll never streams a
                    # whole big op while a waiter's small op is already done.
                    self._pending.add(link.peer)
                    return
                budget -= self._fill(link)
                if not link.out:
                    self._set_writing(link, False)
                    return
            try:
                n = link.sock.sendmsg(link.out)
            except (BlockingIOError, InterruptedError):
                self._set_writing(link, True)
                return
            except OSError as exc:
                self._lost(link, f"send failed: {exc}")
                return
            self._consume(link, n)
            if link.out:
                self._set_writing(link, True)
                return

    def _consume(self, link: _Link, n: int) -> None:
        assert self._handler is not None
        out, marks = link.out, link.marks
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
                self._handler.sent(link.peer, mark[1])
            else:
                mark[0] -= left
                left = 0
        # Zero-byte tail messages cannot exist: every message has a 64-byte header.

    def _write_ring(self, link: _Link, budget: int) -> None:
        """Post messages into the shared-memory ring until it is full, the handler has
        none, or ``budget`` bytes went in; then ring the reader's doorbell if needed."""
        assert self._handler is not None and link.ring_out is not None
        ring = link.ring_out
        posted = 0
        while link.acks:
            if not ring.post(Header(Kind.RING_ACK, seq=link.acks[0]).pack()):
                self._pending.add(link.peer)  # retried on the next turn: the reader is busy
                break
            link.acks.popleft()
            posted += HEADER_SIZE
        while not link.acks:
            msg = link.blocked
            if msg is None:
                if budget - posted <= 0:
                    self._pending.add(link.peer)  # the rest on the next poll()
                    break
                msg = self._handler.next_outgoing(link.peer)
                if msg is None:
                    break
            body = msg.body
            n = 0 if body is None else body.nbytes
            if ring.lend and n >= _LEND_MIN and has_flag(msg.header, FLAG_LENDABLE):
                # The reader's kernel copies it straight out of our memory (see .cma):
                # one copy, where the ring costs a copy in and a copy out.
                assert body is not None
                lend = link.next_lend
                desc = REMOTE_BODY.pack(cma.address_of(body), lend)
                if not ring.post(with_flag(msg.header, FLAG_REMOTE), memoryview(desc)):
                    link.blocked = msg
                    break
                link.next_lend += 1
                link.lent[lend] = msg  # sent() when the reader says it has copied it
                link.blocked = None
                posted += HEADER_SIZE
                continue
            if n <= ring.max_body:
                if not ring.post(msg.header, body):
                    link.blocked = msg  # retried on a doorbell or the next _RING_RETRY
                    break
                posted += HEADER_SIZE + n
            else:
                done = self._post_chunks(link, msg)
                posted += done
                if link.blocked is not None:
                    break
            link.blocked = None
            self._handler.sent(link.peer, msg.token)
        if posted and ring.reader_sleeping():
            self._ring_doorbell(link)

    def _post_chunks(self, link: _Link, msg: Outgoing) -> int:
        """Post a body bigger than a ring record: the header, then as many CHUNK records as
        fit.  Leaves ``msg`` in ``link.blocked`` until the last one is in."""
        ring = link.ring_out
        assert ring is not None and msg.body is not None
        body = msg.body
        posted = 0
        if link.chunk_off < 0:
            if not ring.post(with_flag(msg.header, FLAG_CHUNKED)):
                link.blocked = msg
                return posted
            link.chunk_off = 0
            posted += HEADER_SIZE
        while link.chunk_off < body.nbytes:
            piece = body[link.chunk_off:link.chunk_off + ring.max_body]
            if not ring.post(Header(Kind.RING_CHUNK, nbytes=piece.nbytes).pack(), piece):
                link.blocked = msg
                return posted
            link.chunk_off += piece.nbytes
            posted += HEADER_SIZE + piece.nbytes
        link.chunk_off = -1
        link.blocked = None
        return posted

    def _ring_doorbell(self, link: _Link) -> None:
        if link.write_closed:
            return  # we are leaving: the peer reads the ring at our EOF anyway
        try:
            link.sock.send(_DOORBELL)
        except (BlockingIOError, InterruptedError):
            pass  # the socket is full of unread doorbells: the peer wakes anyway
        except OSError as exc:
            self._lost(link, f"send failed: {exc}")

    def _set_writing(self, link: _Link, on: bool) -> None:
        if link.writing == on or link.closed:
            return
        link.writing = on
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if on else 0)
        self._selector.modify(link.sock, events, link)

    # --- reading -------------------------------------------------------------------

    def _read(self, link: _Link) -> None:
        budget = _READ_BUDGET
        try:
            while budget > 0 and not link.closed:
                if link.body is not None:
                    n = link.sock.recv_into(link.body[link.body_off:])
                    if n == 0:
                        self._eof(link)
                        return
                    budget -= n
                    link.body_off += n
                    if link.body_off == link.body.nbytes:
                        self._deliver(link)
                    continue
                if link.rstart == link.rend:
                    link.rstart = link.rend = 0
                elif link.rend == len(link.staging):
                    tail = link.staging[link.rstart:link.rend]
                    link.staging[: len(tail)] = tail
                    link.rstart, link.rend = 0, len(tail)
                n = link.sock.recv_into(memoryview(link.staging)[link.rend:])
                if n == 0:
                    self._eof(link)
                    return
                budget -= n
                link.rend += n
                self._parse(link)
        except (BlockingIOError, InterruptedError):
            return
        except WireError as exc:
            self._lost(link, f"corrupt stream: {exc}")
        except OSError as exc:
            self._lost(link, f"receive failed: {exc}")

    def _parse(self, link: _Link) -> None:
        """Handle every whole header in the staging buffer."""
        assert self._handler is not None
        staging = link.staging
        while link.body is None and link.rend - link.rstart >= HEADER_SIZE:
            header = unpack_header(memoryview(staging)[link.rstart:link.rstart + HEADER_SIZE])
            link.rstart += HEADER_SIZE
            if header.kind == Kind.GOODBYE:
                link.goodbye = True
            link.header = header
            dest = self._handler.body_buffer(link.peer, header)
            if dest.nbytes != header.nbytes:
                raise AssertionError("body_buffer returned a buffer of the wrong size")
            avail = min(link.rend - link.rstart, header.nbytes)
            if avail:
                dest[:avail] = staging[link.rstart:link.rstart + avail]
                link.rstart += avail
            link.body = dest
            link.body_off = avail
            if avail == header.nbytes:
                self._deliver(link)

    def _read_doorbells(self, link: _Link) -> None:
        """A shared-memory peer's socket carries only doorbells, then its end."""
        try:
            while True:
                data = link.sock.recv(4096)
                if not data:
                    self._read_ring(link, None)  # what it wrote before it went
                    self._eof(link)
                    return
                if data.strip(_DOORBELL):
                    raise WireError("unexpected bytes on a shared-memory peer's socket")
        except (BlockingIOError, InterruptedError):
            return
        except WireError as exc:
            self._lost(link, f"corrupt stream: {exc}")
        except OSError as exc:
            self._read_ring(link, None)
            self._lost(link, f"receive failed: {exc}")

    def _read_ring(self, link: _Link, budget: int | None = _READ_BUDGET) -> None:
        """Hand the records waiting in the peer's ring to the handler (``budget`` bytes'
        worth per poll, None: all of them)."""
        assert self._handler is not None
        ring = link.ring_in
        if ring is None:
            return
        handler = self._handler
        peer = link.peer
        freed = False
        if link.deferred and budget is not None:
            return
        link.deferred = False
        try:
            while budget is None or budget > 0:
                record = ring.next()
                if record is None:
                    break
                header, body = record
                if budget is not None and link.body is None and header.kind == Kind.DATA \
                        and handler.can_defer(peer, header):
                    # Data for an op not submitted here yet: left in the ring, it is
                    # reduced straight out of it once the op starts, instead of copied
                    # aside now (on the path back to the caller) and reduced later.
                    link.deferred = True
                    break
                if budget is not None:
                    budget -= HEADER_SIZE + header.nbytes
                if link.body is not None:  # inside a chunked body
                    left = link.body.nbytes - link.body_off
                    if header.kind != Kind.RING_CHUNK or not 0 < header.nbytes <= left:
                        raise WireError("a chunked body was interrupted")
                    link.body[link.body_off:link.body_off + header.nbytes] = body
                    link.body_off += header.nbytes
                    freed |= ring.release()
                    if link.body_off == link.body.nbytes:
                        self._deliver(link)
                elif header.kind == Kind.RING_CHUNK:
                    raise WireError("a body chunk arrived without its header")
                elif header.kind == Kind.RING_ACK:
                    msg = link.lent.pop(header.seq, None)
                    if msg is None:
                        raise WireError(f"acknowledgement of unknown lent body {header.seq}")
                    freed |= ring.release()
                    handler.sent(peer, msg.token)
                elif header.flags & FLAG_REMOTE:
                    address, lend = REMOTE_BODY.unpack_from(body)
                    freed |= ring.release()
                    self._copy_lent(link, header._replace(flags=header.flags & ~FLAG_REMOTE),
                                    address, lend)
                elif header.flags & FLAG_CHUNKED:
                    freed |= ring.release()
                    header = header._replace(flags=header.flags & ~FLAG_CHUNKED)
                    dest = handler.body_buffer(peer, header)
                    if dest.nbytes != header.nbytes:
                        raise AssertionError("body_buffer returned a buffer of the wrong size")
                    link.header, link.body, link.body_off = header, dest, 0
                    if not header.nbytes:
                        self._deliver(link)
                else:
                    if header.kind == Kind.GOODBYE:
                        link.goodbye = True
                    handler.received_view(peer, header, body)
                    freed |= ring.release()
        except WireError as exc:
            self._lost(link, f"corrupt shared-memory ring: {exc}")
            return
        except _LendFailed as exc:
            self._lost(link, str(exc))  # it exited (or its memory is gone) mid-op
            return
        if freed and not link.closed:
            self._ring_doorbell(link)  # its writer waits for room

    def _copy_lent(self, link: _Link, header: Header, address: int, lend: int) -> None:
        """Copy a body the peer lent us out of its memory, acknowledge it, hand it on."""
        assert self._handler is not None
        pid = link.ring_in.lender_pid if link.ring_in is not None else None
        if pid is None:
            raise WireError("a lent body from a peer whose memory we cannot read")
        dest = self._handler.body_buffer(link.peer, header)
        if dest.nbytes != header.nbytes:
            raise AssertionError("body_buffer returned a buffer of the wrong size")
        try:
            cma.read_into(pid, dest, address)
        except OSError as exc:
            raise _LendFailed(f"cannot copy a body out of rank {link.peer}: {exc}") from None
        # Acknowledge before handing it on: the handler may reduce it (hundreds of us)
        # while the sender waits for this to finish its op.
        ring = link.ring_out
        if not link.acks and ring is not None and ring.post(
                Header(Kind.RING_ACK, seq=lend).pack()):
            if ring.reader_sleeping():
                self._ring_doorbell(link)
        else:
            link.acks.append(lend)
            self._pending.add(link.peer)
        self._handler.received(link.peer, header, dest)

    def _deliver(self, link: _Link) -> None:
        assert self._handler is not None and link.body is not None
        header, body = link.header, link.body
        assert header is not None
        link.header = None
        link.body = None
        link.body_off = 0
        self._handler.received(link.peer, header, body)

    def _eof(self, link: _Link) -> None:
        self._lost(link, "connection closed by peer", orderly=link.goodbye)

    def _lost(self, link: _Link, reason: str, orderly: bool = False) -> None:
        """The link ended; after the peer's GOODBYE any end is orderly (a reset included:
        a peer that leaves with our last bytes unread resets the connection)."""
        orderly = orderly or link.goodbye
        if link.closed:
            return
        link.closed = True
        self._ring_links = [other for other in self._ring_links if other is not link]
        with contextlib.suppress(Exception):
            self._selector.unregister(link.sock)
        with contextlib.suppress(OSError):
            link.sock.close()
        link.out.clear()
        link.marks.clear()
        link.blocked = None
        link.lent.clear()
        link.acks.clear()
        if self._handler is not None:
            self._handler.peer_lost(link.peer, reason, orderly)
