"""TCP transport: one authenticated, nonblocking connection per pair of ranks.

The connections are set up and authenticated by :func:`.mesh.connect_mesh`.  After the
handshake the sockets are nonblocking and driven by one selector loop (poller.py),
whichever thread drives the engine, which both sends and receives (a thread per direction
costs a GIL hand-off per message: see DESIGN.md).  Each link speaks the stream protocol
over its socket (socket_link.py) or, for a peer on this host, through shared-memory rings
(ring_link.py).
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import time
from collections.abc import Callable
from typing import Protocol

from . import cma
from .base import NOT_TAKEN, Counters, MessageHandler, Port, Transport
from .poller import WAIT_SLOT, Poller
from .ring_link import RingLink
from .shmring import RingReader, RingWriter
from .socket_lane import SocketLane
from .socket_link import BATCH_BYTES, WRITE_BUDGET, Link
from .wire import Header

_RING_RETRY = 0.001  # safety-net poll while a ring is full (a doorbell normally wakes us)


class _Stoppable(Protocol):
    def stop(self) -> None: ...


class TcpTransport(Transport):
    """See the module docstring.  Build it with :func:`.mesh.connect_mesh`."""

    def __init__(self, rank: int, size: int, socks: dict[int, socket.socket],
                 acceptor: _Stoppable | None,
                 rings: dict[int, tuple[RingWriter | None, RingReader | None]] | None = None,
                 lend_bytes: int = 0, hosts: tuple[int, ...] | None = None,
                 slow_ring_rate: float = 0.0,
                 lanes: dict[int, socket.socket] | None = None) -> None:
        """``lanes``: a second connection to each peer reached over a socket, for the
        urgent lane (socket_lane.py); peers on rings have theirs in shared memory."""
        self.rank = rank
        self.size = size
        self.hosts = hosts
        self.counters = Counters()  # socket links'
        self.shm_counters = Counters()
        self.pending: set[int] = set()
        self.staged: set[Link] = set()
        self._links: dict[int, Link] = {}
        rings = rings or {}
        for peer, sock in socks.items():
            sock.setblocking(False)
            ring_out, ring_in = rings.get(peer, (None, None))
            if ring_out is not None and ring_in is not None:
                self._links[peer] = RingLink(self, peer, sock, ring_out, ring_in, lend_bytes)
            else:  # one direction only: the socket carries both (see _share_rings)
                for ring in (ring_out, ring_in):
                    if ring is not None:
                        ring.close()
                self._links[peer] = Link(self, peer, sock)
        self._ring_links = [link for link in self._links.values()
                            if isinstance(link, RingLink)]
        self._acceptor = acceptor
        # Ranks of this host that talk over sockets take turns on its cores as ring peers
        # do (at 4 ranks on 2 cores over sockets, 8-byte allreduces took 0.6 ms where the
        # caller's thread did not yield between looks, 0.1 ms where it does).
        self._poller = Poller(self._ring_links,
                             rings_only=len(self._ring_links) == len(self._links),
                             local=size if hosts is None else hosts.count(hosts[rank]))
        # Where ranks take turns on cores, a copy's time says more about the scheduler
        # than about caches: at 4 ranks on 2 cores the slow-ring rule made 1 MiB
        # broadcasts, alltoalls and allreduces 1.3-3x slower.
        if self._poller.crowded:
            slow_ring_rate = 0.0
        elif slow_ring_rate < 0:  # auto: slower than a lent body's copy here
            slow_ring_rate = cma.read_rate() if lend_bytes and self._ring_links else 0.0
        for ring_link in self._ring_links:
            ring_link.yields = self._poller.own_core
            ring_link.watch_copies(slow_ring_rate)
        self.handler: MessageHandler
        for link in self._links.values():
            self._poller.selector.register(link.sock, selectors.EVENT_READ, link)
        self._lane_ends: dict[int, RingLink | SocketLane] = {
            link.peer: link for link in self._ring_links if link.lane_in is not None}
        self._socket_lanes: list[SocketLane] = []
        for peer, sock in (lanes or {}).items():
            if type(self._links.get(peer)) is Link:
                lane = SocketLane(self, peer, sock)
                self._lane_ends[peer] = lane
                self._socket_lanes.append(lane)
                self._poller.selector.register(sock, selectors.EVENT_READ, lane)
            else:
                sock.close()

    # --- interface -----------------------------------------------------------------

    def start(self, handler: MessageHandler) -> None:
        self.handler = handler

    def want_send(self, peer: int) -> None:
        self.pending.add(peer)

    def resume(self) -> None:
        for link in self._ring_links:
            link.deferred = False
            link.lane_seen = -1  # what was left there may be the loop's now
        for lane in self._socket_lanes:
            lane.recheck = True

    def wake(self) -> None:
        self._poller.wake()

    def pending_output(self) -> bool:
        return any(link.pending_output() for link in self._links.values() if not link.closed)

    def stats(self) -> dict[str, int]:
        """The totals, then the same counts for each kind of link: ``tcp_*`` for peers
        reached over sockets, ``shm_*`` for those on this host's shared-memory rings."""
        tcp, shm = self.counters.as_dict(), self.shm_counters.as_dict()
        for link in self._ring_links:
            for name, value in link.lane_counts.items():
                shm[name] += value
        for lane in self._socket_lanes:
            for name, value in lane.lane_counts.items():
                tcp[name] += value
        out = {name: tcp[name] + shm[name] for name in tcp}
        out.update({f"tcp_{name}": value for name, value in tcp.items()})
        out.update({f"shm_{name}": value for name, value in shm.items()})
        return out

    def ring_peers(self) -> list[int]:
        """Peers whose messages travel through shared memory."""
        return sorted(link.peer for link in self._ring_links)

    def post_now(self, peer: int, header: bytes, body: memoryview | None) -> bool:
        link = self._links.get(peer)
        return link is not None and link.post_now(header, body)

    def peek(self, peer: int) -> tuple[Header, memoryview | None] | None:
        link = self._links.get(peer)
        return None if link is None else link.peek()

    def peeks(self, peer: int) -> bool:
        return peer in self._links

    def port(self, peer: int) -> Port | None:
        return self._links.get(peer)

    def ring_room(self, peer: int) -> int:
        link = self._links.get(peer)
        ring = link.ring_out if type(link) is RingLink else None
        return 0 if ring is None else ring.capacity

    def ring_body(self, peer: int) -> int:
        link = self._links.get(peer)
        ring = link.ring_out if type(link) is RingLink else None
        return 0 if ring is None else ring.max_body

    def ring_beats_lending(self, peer: int) -> bool:
        link = self._links.get(peer)
        return type(link) is not RingLink or link.ring_beats_lending()

    def lends(self, peer: int) -> bool:
        link = self._links.get(peer)
        return type(link) is RingLink and link.lends_big()

    def take(self, peer: int, header: Header) -> None:
        self._links[peer].take(header)

    def lends_body(self, peer: int, op_bytes: int, n: int) -> bool:
        link = self._links.get(peer)
        return type(link) is RingLink and link.lends_body(op_bytes, n)

    def lend_now(self, peer: int, header: bytes, body: memoryview, token: object,
                 spread: bool = False) -> bool:
        if peer in self.pending:
            return False  # output of ours for it waits: this message must not pass it
        link = self._links.get(peer)
        return type(link) is RingLink and link.lend_now(header, body, token, spread)

    def take_lent(self, peer: int, dest: memoryview) -> bool:
        link = self._links.get(peer)
        return type(link) is RingLink and link.take_lent(dest)

    def take_lent_front(self, peer: int, dest: memoryview) -> int:
        link = self._links.get(peer)
        return link.take_lent_front(dest) if type(link) is RingLink else NOT_TAKEN

    def wait_pushed(self, peer: int, lend: int) -> bool:
        link = self._links.get(peer)
        return type(link) is RingLink and link.wait_pushed(lend)

    def take_lent_each(self, peer: int, scratch: memoryview, nbytes: int,
                       each: Callable[[memoryview, int], None]) -> bool:
        link = self._links.get(peer)
        return type(link) is RingLink and link.take_lent_each(scratch, nbytes, each)

    def take_ack(self, peer: int, header: Header) -> bool:
        link = self._links.get(peer)
        return type(link) is RingLink and link.take_ack(header)

    def lane_ended(self, lane: SocketLane) -> None:
        if lane in self._socket_lanes:
            self._socket_lanes.remove(lane)
            with contextlib.suppress(Exception):
                self._poller.selector.unregister(lane.sock)
        lane.close()

    def spin_for(self) -> float:
        return self._poller.spin if self._links else 0.0

    def crowded(self) -> bool:
        return self._poller.crowded

    def flush(self) -> None:
        # One batch per link: an async submit must return to the application quickly, and
        # whatever is left goes out from the next poll().
        self._retry_blocked()
        self._flush_pending(BATCH_BYTES)

    def can_wait(self) -> bool:
        return True

    def has_backlog(self) -> bool:
        return bool(self.pending) or bool(self.staged) or self._ring_blocked()

    def wait(self, timeout: float) -> None:
        if self.pending or self.staged:
            return
        if self._ring_blocked():
            timeout = min(timeout, _RING_RETRY)
        try:
            self._poller.select(timeout, WAIT_SLOT, self.pending)
        except (OSError, ValueError):
            return  # closed under us by the thread that holds the lock

    def poll(self, timeout: float | None) -> None:
        self._poller.give_way.now_and_then(time.monotonic())
        blocked = self._retry_blocked()
        if self.pending:
            self._flush_pending()
        if self.pending:
            timeout = 0
        elif blocked and self._ring_blocked():
            timeout = _RING_RETRY if timeout is None else min(timeout, _RING_RETRY)
        if self.staged:  # read by peek() and left, or its end met there
            timeout = 0
            staged = list(self.staged)
            self.staged.clear()
            for link in staged:
                if not link.closed:
                    link.read()
        if self._socket_lanes:  # none where every peer is on a ring
            # A copy: a lane that reads its peer's end leaves the list.
            lanes = [lane for lane in self._socket_lanes if lane.recheck]
            if lanes:
                timeout = 0
                for lane in lanes:
                    lane.read()
        for key, mask in self._poller.select(timeout, pending=self.pending):
            link = key.data
            if link is None:
                self._poller.woken()
                continue
            if mask & selectors.EVENT_READ and not link.closed:
                link.read()
            if mask & selectors.EVENT_WRITE and not link.closed:
                link.write()
        for ring_link in self._ring_links:
            if not ring_link.closed:
                ring_link.read_ring()
                if ring_link.room_freed():
                    self.pending.add(ring_link.peer)
        if self.pending:
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
        selector = self._poller.selector
        for link in self._links.values():
            link.closed = True
            with contextlib.suppress(Exception):
                selector.unregister(link.sock)
            with contextlib.suppress(OSError):
                link.sock.close()
        self._poller.close()
        for ring_link in self._ring_links:
            ring_link.close_rings()
        self._ring_links.clear()
        for lane in self._socket_lanes:
            lane.close()
        self._socket_lanes.clear()

    # --- what links ask of us (socket_link.LinkOwner) --------------------------------

    def again(self, peer: int) -> None:
        self.pending.add(peer)

    def set_writing(self, link: Link, on: bool) -> None:
        if link.writing == on or link.closed:
            return
        link.writing = on
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if on else 0)
        self._poller.selector.modify(link.sock, events, link)

    def lost(self, link: Link, reason: str, orderly: bool = False) -> None:
        """The link ended; after the peer's GOODBYE any end is orderly (a reset included:
        a peer that leaves with our last bytes unread resets the connection)."""
        orderly = orderly or link.goodbye
        if link.closed:
            return
        link.closed = True
        if isinstance(link, RingLink):
            # In place: the poller holds the same list.
            self._ring_links[:] = [other for other in self._ring_links if other is not link]
        with contextlib.suppress(Exception):
            self._poller.selector.unregister(link.sock)
        with contextlib.suppress(OSError):
            link.sock.close()
        link.drop_output()
        if getattr(self, "handler", None) is not None:
            self.handler.peer_lost(link.peer, reason, orderly)

    # --- helpers -----------------------------------------------------------------------

    def _ring_blocked(self) -> bool:
        for link in self._ring_links:  # noqa: SIM110 - any() and a generator cost ~1 us here
            if link.blocked is not None:
                return True
        return False

    def _retry_blocked(self) -> bool:
        """Queue every link whose message waits for ring room for another try; returns
        whether there was one."""
        found = False
        for link in self._ring_links:  # only ring writes leave a message blocked
            if link.blocked is not None:
                self.pending.add(link.peer)
                found = True
        return found

    def _flush_pending(self, budget: int = WRITE_BUDGET) -> None:
        peers = list(self.pending)
        self.pending.clear()  # a link whose write budget runs out puts itself back
        for peer in peers:
            link = self._links.get(peer)
            if link is not None and not link.closed and not link.writing:
                link.write(budget)
