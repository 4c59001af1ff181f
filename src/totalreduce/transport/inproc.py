"""The in-process transport: every rank of a world in one process.

It serves two purposes.  A world of one (``python train.py`` with no launcher) runs the
same code path as a job.  And tests run whole jobs in one process: ranks as threads (each
engine with its own progress thread), or with no threads at all, the test itself stepping
each rank's engine and choosing, from a seeded random generator, which link delivers next
(``InprocWorld(n, seed=...)``), so that every arrival order the real transports allow can
be replayed exactly.

Like a socket, each directed link delivers in order, copies a body when it is sent (the
sender's buffer is free again at once: ``sent()`` follows immediately) and ends with an EOF
after the sender's last message.  It holds at most ``link_messages`` messages in flight
per link, so a sender can find its link full and must wait for the reader, as with a
kernel's socket buffer or a shared-memory ring.
"""

from __future__ import annotations

import random
import threading
from collections import deque
from typing import NamedTuple

from .base import Counters, MessageHandler, Transport
from .wire import HEADER_SIZE, Header, Kind, unpack_header

_EOF = None


class _Message(NamedTuple):
    header: Header
    body: bytes


class InprocWorld:
    """The links between ``size`` in-process ranks.

    ``seed=None``: each poll() delivers everything that has arrived, in link order.  With a
    seed, each poll() delivers a random number of messages from randomly chosen links, and
    hands some bodies over as views (``received_view``, as a shared-memory ring does) and
    others through ``body_buffer``/``received`` (as a socket does).
    """

    def __init__(self, size: int, seed: int | None = None, link_messages: int = 64) -> None:
        self.size = size
        self.rng = random.Random(seed) if seed is not None else None
        self.link_messages = link_messages
        self.cond = threading.Condition()
        self.links: dict[tuple[int, int], deque[_Message | None]] = {
            (a, b): deque() for a in range(size) for b in range(size) if a != b}
        self.transports = [InprocTransport(self, r) for r in range(size)]
        self.messages = 0  # delivered, over all links

    def kill(self, rank: int) -> None:
        """Rank ``rank`` vanishes (SIGKILL): what it sent so far still arrives, then its
        peers see its links end without a goodbye."""
        self.transports[rank].abort()


class InprocTransport(Transport):
    def __init__(self, world: InprocWorld, rank: int) -> None:
        self.rank = rank
        self.size = world.size
        self.counters = Counters()
        self._world = world
        self._handler: MessageHandler | None = None
        self._pending: set[int] = set()
        self._woken = False
        self._ended: set[int] = set()  # peers whose link to us reached its end
        self._goodbye: set[int] = set()  # peers whose GOODBYE we read
        self._closed = False  # abort() ran: nothing in or out any more
        self._write_closed = False

    def start(self, handler: MessageHandler) -> None:
        self._handler = handler

    def want_send(self, peer: int) -> None:
        self._pending.add(peer)

    def wake(self) -> None:
        with self._world.cond:
            self._woken = True
            self._world.cond.notify_all()

    def pending_output(self) -> bool:
        return False  # a message leaves whole, at once

    def close_writes(self) -> bool:
        with self._world.cond:
            if not self._write_closed and not self._closed:
                self._write_closed = True
                for peer in range(self.size):
                    if peer != self.rank:
                        self._world.links[self.rank, peer].append(_EOF)
                self._world.cond.notify_all()
        return True

    def abort(self) -> None:
        world = self._world
        with world.cond:
            if self._closed:
                return
            self._closed = True
            for peer in range(self.size):
                if peer == self.rank:
                    continue
                world.links[peer, self.rank].clear()
                if not self._write_closed:
                    world.links[self.rank, peer].append(_EOF)
            self._write_closed = True
            world.cond.notify_all()

    def flush(self) -> None:
        if self._pending and not self._closed and self._handler is not None:
            self._send()

    def poll(self, timeout: float | None) -> None:
        if self._closed or self._handler is None:
            return
        self._send()
        if not self._receive() and timeout != 0:
            with self._world.cond:
                if not self._woken and not self._arrived():
                    self._world.cond.wait(timeout)
                self._woken = False
            self._receive()
        self._send()

    # --- sending -------------------------------------------------------------------

    def _send(self) -> None:
        assert self._handler is not None
        world = self._world
        while self._pending:
            peer = self._pending.pop()
            if self._write_closed or peer in self._ended or world.transports[peer]._closed:
                continue  # as a write to a closed socket: the link's end tells the rest
            link = world.links[self.rank, peer]
            while len(link) < world.link_messages:
                msg = self._handler.next_outgoing(peer)
                if msg is None:
                    break
                body = bytes(msg.body) if msg.body is not None else b""
                with world.cond:
                    link.append(_Message(unpack_header(msg.header), body))
                    world.cond.notify_all()
                self.counters.messages_sent += 1
                self.counters.bytes_sent += HEADER_SIZE + len(body)
                self._handler.sent(peer, msg.token)
            else:
                self._pending.add(peer)  # full: the rest when the reader has caught up
                return

    # --- receiving -----------------------------------------------------------------

    def _arrived(self) -> bool:
        links = self._world.links
        return any(links[p, self.rank] for p in range(self.size)
                   if p != self.rank and p not in self._ended)

    def _receive(self) -> bool:
        """Deliver what has arrived (seeded: a random share of it); returns whether any."""
        world = self._world
        rng = world.rng
        peers = [p for p in range(self.size)
                 if p != self.rank and p not in self._ended and world.links[p, self.rank]]
        if not peers:
            return False
        budget = 1 << 30 if rng is None else rng.randint(1, 4)
        while peers and budget > 0 and not self._closed:
            peer = peers[0] if rng is None else rng.choice(peers)
            link = world.links[peer, self.rank]
            if not link:
                peers.remove(peer)
                continue
            with world.cond:
                msg = link.popleft()
                world.cond.notify_all()
            budget -= 1
            if msg is None:
                self._end(peer)
            else:
                self._deliver(peer, msg)
            if peer in self._ended or not link:
                peers.remove(peer)
        return True

    def _deliver(self, peer: int, msg: _Message) -> None:
        assert self._handler is not None
        self._world.messages += 1
        header, body = msg
        self.counters.messages_received += 1
        self.counters.bytes_received += HEADER_SIZE + len(body)
        if header.kind == Kind.GOODBYE:
            self._goodbye.add(peer)
        rng = self._world.rng
        if rng is not None and rng.random() < 0.5:
            self._handler.received_view(peer, header, memoryview(body))
            return
        dest = self._handler.body_buffer(peer, header)
        if dest.nbytes != header.nbytes:
            raise AssertionError("body_buffer returned a buffer of the wrong size")
        dest[:] = body
        self._handler.received(peer, header, dest)

    def _end(self, peer: int) -> None:
        assert self._handler is not None
        self._ended.add(peer)
        orderly = peer in self._goodbye
        reason = "connection closed by peer" if orderly or not self._world.transports[
            peer]._closed else "peer vanished"
        self._handler.peer_lost(peer, reason, orderly)
