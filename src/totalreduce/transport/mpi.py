"""MPI transport: the engine's messages over mpi4py point-to-point calls.

Used when the job was started by ``mpiexec``/``mpirun`` (or ``TOTALREDUCE_TRANSPORT=mpi``):
MPI then already knows every rank, so there is no rendezvous store, no listening socket and
no job secret to set — MPI's own launcher is the trust boundary.

All traffic runs on a private duplicate of ``COMM_WORLD`` so that the application's own MPI
messages can never match ours.  Each message is a header (tag ``_HEADER_TAG``); a body of
up to the transport's inline size (16-256 KiB, by the number of peers: see ``_inline``)
travels in the same MPI message as its header, into a buffer posted for the peer's next
header; a bigger one follows as a second message (tag ``_BODY_TAG``) received straight
into the buffer the handler names.  MPI keeps messages of one (source, tag) in order,
which is all the pairing needs.

MPI has no call that waits for "a request completed *or* another thread wants attention",
so :meth:`MpiTransport.poll` tests its requests, spins briefly, then backs off in short
sleeps that :meth:`wake` cuts short.  Bytes are only ever moved as raw buffers: nothing is
pickled.

A small op on the caller's thread (engine/smallpath.py, express.py, repeat.py) sends and
reads its messages itself, as over the shared-memory rings, with no turn of the loop:
:meth:`MpiTransport.post_now` sends a message whose body fits in its header's (copied,
so the caller may write over its array at once), and :meth:`MpiTransport.peek` tests the
peer's posted header receive in place and shows what came, body included when it came
inline; :meth:`MpiTransport.take` posts the receive again.  A header seen that way and
not taken is the loop's (MPI reports a request done only once): poll() reads it first.
An 8-byte allreduce at 2 ranks took 126 us through the loop and 24 us this way, at 4
ranks on 2 cores 815 and 232 us (bench latency, one sitting).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from typing import Any

from .base import Counters, MessageHandler, Port, Transport
from .poller import GiveWay, cores, local_spin
from .ring_lane import LANE_RING_BYTES, RingLane
from .shmring import RingReader, RingWriter, ring_capacity, shm_available
from .socket_lane import LANE_BODY
from .wire import HEADER_SIZE, KIND_DATA, Header, Kind, WireError, unpack_header

_HEADER_TAG = 1
_BODY_TAG = 2
_LANE_TAG = 3  # the urgent lane's messages (engine/urgent.py), header and body in one
_RING_NAME = 64  # bytes per peer in the exchange of lane ring names (_share_lanes)
# A body this big at most travels with its header (every rank computes the same size
# from the world's): the header buffers posted for all peers together hold at most
# _INLINE_BUDGET, so 2-33 ranks inline up to 256 KiB, 513 and more 16 KiB.  An inline
# body is what a caller's thread can send and read itself (post_now, peek), without a
# turn of the loop: at 2 ranks, 64 KiB allreduces took 0.068-0.081 ms through the loop
# and 0.020-0.031 ms this way, 256 KiB ones 0.097-0.113 and 0.046-0.066 ms (MPI's own
# 0.08); 1 MiB ones, which go through the loop either way, stayed as they were.
_INLINE_MIN = 16 << 10
_INLINE_MAX = 256 << 10
_INLINE_BUDGET = 8 << 20
# A message with a body past this is copied into a buffer kept for reuse (at most _SPARE
# kept idle): a fresh bytearray of 224 KiB cost 130 us here, its pages faulted in anew on
# every send, against 25 us for the MPI send itself.
_POOL_FROM = 16 << 10
_SPARE = 4
_MAX_SENDS_PER_PEER = 16  # messages in flight to one peer before we stop pulling
# ... or body bytes: what MPI holds to a peer is a queue that a more urgent message waits
# behind, since messages of one tag arrive in order.  An urgent 1 KB op during a 64 MB
# allreduce at 2 ranks took 3.9-5.3 ms with sixteen 2 MiB pieces in flight, 1.6 ms with
# 8 MiB and 0.9-1.4 ms with 4 MiB; but at 4 ranks on 2 cores 4 MiB made 64 MB allreduces
# and broadcasts 5-15 % slower, where 8 MiB stayed within the noise (2 ranks: 1-64 MB
# allreduces and allgathers as before).
_MAX_BYTES_PER_PEER = 8 << 20
_SPIN = 50e-6             # keep testing this long before the first sleep
_MAX_NAP = 1e-3           # longest sleep between tests while idle
# Messages a caller's thread sent (post_now) that MPI has not reported done; past this
# many, the loop sends.
_MAX_QUICK = 64


# Sends still in flight when a transport aborted, with their buffers (see abort()).
_ABANDONED: list[tuple[Any, Any]] = []


def import_mpi() -> Any:
    """Import mpi4py's MPI module with thread support for the progress thread.

    Raises:
        ImportError: mpi4py is not installed (``pip install "totalreduce[mpi]"``).
        RuntimeError: MPI was initialized before us without thread support.
    """
    try:
        import mpi4py
    except ImportError as exc:
        raise ImportError("TOTALREDUCE_TRANSPORT=mpi needs mpi4py: "
                          "pip install 'totalreduce[mpi]'") from exc
    mpi4py.rc.thread_level = "multiple"  # takes effect only if MPI is not yet initialized
    from mpi4py import MPI

    if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
        raise RuntimeError(
            "MPI was initialized without thread support (level "
            f"{MPI.Query_thread()}); totalreduce calls MPI from its progress thread. "
            "Import totalreduce before mpi4py.MPI, or set mpi4py.rc.thread_level = "
            "'multiple' before importing it")
    return MPI


class _Send:
    __slots__ = ("peer", "left", "token", "keep", "nbytes", "pooled")

    def __init__(self, peer: int, left: int, token: object, keep: tuple[Any, ...],
                 nbytes: int, pooled: bytearray | None = None) -> None:
        self.peer = peer
        self.left = left
        self.token = token
        self.keep = keep  # buffers MPI reads from until the request completes
        self.nbytes = nbytes  # of the body
        self.pooled = pooled  # the reusable buffer the message was copied into


class _MpiPort:
    """One peer's :class:`.base.Port`: the transport's post_now, peek and take for it."""

    __slots__ = ("_transport", "_peer")

    def __init__(self, transport: MpiTransport, peer: int) -> None:
        self._transport = transport
        self._peer = peer

    def post_now(self, header: bytes, body: memoryview | None) -> bool:
        return self._transport.post_now(self._peer, header, body)

    def peek(self) -> tuple[Header, memoryview | None] | None:
        return self._transport.peek(self._peer)

    def take(self, header: Header) -> None:
        self._transport.take(self._peer, header)


class _Lane:
    """The urgent lane to a peer on another host (or any, with TOTALREDUCE_SHM_BYTES=0;
    a peer on this host has a RingLane): its own tag, which no big op's bytes queue on.  Read
    and written from any thread (MPI_THREAD_MULTIPLE): a caller's thread runs an urgent
    op through it while another drives the loop, which reads the messages its ops need
    (MessageHandler.lane_claims).  A message read is held here until one of them takes
    it."""

    def __init__(self, transport: MpiTransport, peer: int) -> None:
        self._transport = transport
        self.peer = peer
        self.lane_lock = threading.Lock()  # reading
        self._writing = threading.Lock()
        self._sends: list[tuple[Any, bytes]] = []  # sends in flight, with their buffers
        self._buf = bytearray(HEADER_SIZE + LANE_BODY)
        self._front: tuple[Header, memoryview] | None = None
        self.recheck = False  # a message held here may be the loop's now
        self.lane_counts = {"messages_sent": 0, "bytes_sent": 0, "messages_received": 0,
                            "bytes_received": 0}

    def lane_room(self) -> int:
        return 0 if self._transport.closed else LANE_BODY

    def holds(self) -> bool:
        """Whether a message read from MPI waits here for a thread to take it."""
        return self._front is not None

    def lane_post(self, header: bytes, body: memoryview | None) -> bool:
        n = 0 if body is None else body.nbytes
        if n > LANE_BODY:
            return False
        data = header + (bytes(body) if body is not None and n else b"")
        transport = self._transport
        with self._writing:
            if transport.closed:
                return False
            self._sends = [(req, buf) for req, buf in self._sends if not req.Test()]
            if len(self._sends) >= _MAX_SENDS_PER_PEER:
                return False  # the peer is not reading its lane: the loop sends it
            try:
                req = transport.comm.Isend([data, transport.mpi.BYTE], self.peer, _LANE_TAG)
            except transport.mpi.Exception:
                return False
            self._sends.append((req, data))
            counts = self.lane_counts
            counts["messages_sent"] += 1
            counts["bytes_sent"] += len(data)
        return True

    def lane_peek(self) -> tuple[Header, memoryview] | None:
        """(Hold :attr:`lane_lock`.)"""
        if self._front is not None:
            return self._front
        transport = self._transport
        if transport.closed:
            return None
        mpi = transport.mpi
        status = mpi.Status()
        try:
            if not transport.comm.Iprobe(source=self.peer, tag=_LANE_TAG, status=status):
                return None
            n = status.Get_count(mpi.BYTE)
            if not HEADER_SIZE <= n <= len(self._buf):
                return None  # not a lane message: left for nobody, as MPI holds it
            transport.comm.Recv([self._buf, n, mpi.BYTE], source=self.peer, tag=_LANE_TAG)
        except mpi.Exception:
            return None
        header = unpack_header(memoryview(self._buf)[:HEADER_SIZE])
        if header.kind != Kind.DATA or HEADER_SIZE + header.nbytes != n:
            return None
        self._front = (header, memoryview(self._buf)[HEADER_SIZE:n])
        return self._front

    def lane_take(self, header: Header) -> None:
        """(Hold :attr:`lane_lock`.)"""
        self._taken(header)
        self.recheck = True  # more may have come behind it
        self._transport.wake()

    def lane_wait(self, timeout: float) -> None:
        """Nap ``timeout``: MPI has no wait that a message on this tag would end without
        the lane's lock (base.LaneEnd)."""
        time.sleep(timeout)

    def _taken(self, header: Header) -> None:
        """The message held here (``header``) has been handled."""
        self._front = None
        counts = self.lane_counts
        counts["messages_received"] += 1
        counts["bytes_received"] += HEADER_SIZE + header.nbytes

    def read(self, handler: MessageHandler) -> None:
        """The loop's look: hand over the messages the handler claims, oldest first, up
        to the first it does not (a caller's thread will take that one)."""
        if not self.lane_lock.acquire(False):
            return
        try:
            self.recheck = False
            transport = self._transport
            while (record := self.lane_peek()) is not None:
                header, body = record
                try:
                    behind = transport.comm.Iprobe(source=self.peer, tag=_LANE_TAG)
                except transport.mpi.Exception:
                    behind = False
                if not handler.lane_claims(self.peer, header, bool(behind)):
                    break
                # A body on the body tag may be arriving meanwhile: its route stays.
                handler.received_ahead(self.peer, header, body)
                self._taken(header)
        finally:
            self.lane_lock.release()


class MpiTransport(Transport):
    def __init__(self, comm: Any, hosts: tuple[int, ...] | None = None,
                 shm_lanes: bool = True) -> None:
        """``shm_lanes``: a lane to a peer on this host may be a pair of shared-memory
        rings (ring_lane.py) rather than a tag (``TOTALREDUCE_SHM_BYTES=0``: never)."""
        self._mpi = import_mpi()
        self._comm = comm.Dup()
        self.rank = self._comm.Get_rank()
        self.size = self._comm.Get_size()
        self.hosts = hosts
        self._inline = _inline(self.size)
        self.counters = Counters()
        self._handler: MessageHandler | None = None
        self._event = threading.Event()
        self._pending: set[int] = set()
        self._in_flight = dict.fromkeys(range(self.size), 0)
        self._bytes_out = dict.fromkeys(range(self.size), 0)  # body bytes in flight
        self._reqs: list[Any] = []
        self._what: list[tuple[str, Any]] = []
        self._hdr_bufs: dict[int, bytearray] = {}
        # Each peer's posted header receive (None while its body is being received), and
        # the peers whose header a caller's thread saw complete (peek) and left to the
        # loop: MPI reports a request done once, so the loop reads those from here.
        self._hdr_reqs: dict[int, Any] = {}
        self._held: set[int] = set()
        self._ports: dict[int, _MpiPort] = {}
        # Sends of post_now (request, the bytes MPI reads, the reusable buffer they are
        # in or None), oldest first.
        self._quick: deque[tuple[Any, Any, bytearray | None]] = deque()
        self._spare: list[bytearray] = []  # idle buffers of _message
        self._closed = False
        self._sends_open = 0
        # Lanes need threads other than the loop's to call MPI at once.  Where this
        # host's ranks outnumber its cores they cost more than they give: a caller
        # probing its lane takes turns at MPI's lock and the cores with ranks it waits
        # for (a 4-rank barrier on 2 cores went from 0.67 to 0.97 ms).
        self._lane_ends: dict[int, _Lane | RingLane] = {}
        self._tag_lanes: dict[int, _Lane] = {}
        self._ring_lanes: list[RingLane] = []
        local = hosts.count(hosts[self.rank]) if hosts else 1
        self._crowded = local > cores()
        self._give_way = GiveWay(not self._crowded)
        lanes = (self._mpi.Query_thread() >= self._mpi.THREAD_MULTIPLE
                 and not self._crowded)
        here = [p for p in range(self.size) if p != self.rank and hosts is not None
                and hosts[p] == hosts[self.rank]] if lanes and shm_lanes else []
        # Every rank takes part, lanes or not: the exchange is a collective.
        rings = _share_lanes(self._comm, self._mpi, here)
        if lanes:
            for p in range(self.size):
                if p in rings:
                    lane = RingLane(p, *rings[p], self.wake)
                    self._ring_lanes.append(lane)
                    self._lane_ends[p] = lane
                elif p != self.rank:
                    self._lane_ends[p] = self._tag_lanes[p] = _Lane(self, p)

    def start(self, handler: MessageHandler) -> None:
        self._handler = handler
        for peer in range(self.size):
            if peer != self.rank:
                self._hdr_bufs[peer] = bytearray(HEADER_SIZE + self._inline)
                self._post_header(peer)

    def want_send(self, peer: int) -> None:
        self._pending.add(peer)

    # The lanes, read by the lanes (any thread).
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def comm(self) -> Any:
        return self._comm

    @property
    def mpi(self) -> Any:
        return self._mpi

    def resume(self) -> None:
        for lane in self._lane_ends.values():
            lane.recheck = True

    def stats(self) -> dict[str, int]:
        out = self.counters.as_dict()
        for lane in self._lane_ends.values():
            for name, value in lane.lane_counts.items():
                out[name] += value
        return out

    def wake(self) -> None:
        self._event.set()

    def pending_output(self) -> bool:
        return self._sends_open > 0 or bool(self._quick)

    # The caller's thread that drives (engine/smallpath.py, express.py): it sends and
    # reads one small op's messages itself while it holds the drive lock, so nothing here
    # runs beside poll().

    def post_now(self, peer: int, header: bytes, body: memoryview | None) -> bool:
        quick = self._quick
        try:
            self._reap_quick()
        except self._mpi.Exception:
            return False  # the loop's poll() reports it
        # Messages of one tag arrive in order: this one must not pass output the loop
        # still holds for the peer.
        if (self._closed or peer in self._pending or len(quick) >= _MAX_QUICK
                or (body is not None and body.nbytes > self._inline)):
            return False
        data, pooled = self._message(header, body)
        try:
            req = self._comm.Isend([data, self._mpi.BYTE], peer, _HEADER_TAG)
        except self._mpi.Exception:
            self._recycle(pooled)
            return False  # the loop sends it, and reports what fails
        quick.append((req, data, pooled))
        counters = self.counters
        counters.messages_sent += 1
        counters.bytes_sent += len(data)
        return True

    def peek(self, peer: int) -> tuple[Header, memoryview | None] | None:
        if peer not in self._held:
            req = self._hdr_reqs.get(peer)
            if req is None or self._closed:
                return None
            try:
                if not req.Test():
                    return None
            except self._mpi.Exception:
                return None  # Testsome in the loop's poll() reports it
            self._forget(req)
            self._hdr_reqs[peer] = None
            self._held.add(peer)
        buf = self._hdr_bufs[peer]
        try:
            header = unpack_header(buf)
        except WireError:
            return (Header(Kind.RING_WRAP), None)  # for poll() to report
        n = header.nbytes
        if header.kind != KIND_DATA or n > self._inline:
            return (header, None)
        return (header, memoryview(buf)[HEADER_SIZE:HEADER_SIZE + n])

    def peeks(self, peer: int) -> bool:
        return peer != self.rank and 0 <= peer < self.size

    def port(self, peer: int) -> Port | None:
        if not self.peeks(peer):
            return None
        port = self._ports.get(peer)
        if port is None:
            port = self._ports[peer] = _MpiPort(self, peer)
        return port

    def take(self, peer: int, header: Header) -> None:
        self._held.discard(peer)
        counters = self.counters
        counters.messages_received += 1
        counters.bytes_received += HEADER_SIZE + header.nbytes
        self._post_header(peer)

    def spin_for(self) -> float:
        return local_spin(self._crowded)

    def crowded(self) -> bool:
        return self._crowded

    def poll(self, timeout: float | None) -> None:
        now = start = time.monotonic()
        nap = 5e-6
        while True:
            self._give_way.now_and_then(now)
            if self._progress() or timeout == 0 or self._closed:
                return
            if self._event.is_set():
                self._event.clear()
                return
            now = time.monotonic()
            waited = now - start
            if timeout is not None and waited >= timeout:
                return
            if waited < _SPIN:
                continue
            nap = min(nap * 2, _MAX_NAP)
            if timeout is not None:
                nap = min(nap, timeout - waited)
            if self._event.wait(nap):
                self._event.clear()
                return

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        for lane in self._ring_lanes:
            lane.close()
        for req, (what, data) in zip(self._reqs, self._what, strict=True):
            if what == "send":
                # MPI may still read a send's buffer (a large one moves only when the
                # peer matches it): freeing it here let peers read garbage headers
                # after a rank failed.  Kept until the process ends; aborting is once.
                _ABANDONED.append((req, data))
            else:
                with contextlib.suppress(Exception):
                    req.Cancel()
                    req.Wait()
        _ABANDONED.extend((req, data) for req, data, _pooled in self._quick)
        self._quick.clear()
        self._reqs.clear()
        self._what.clear()

    # --- internals -----------------------------------------------------------------

    def _post_header(self, peer: int) -> None:
        buf = self._hdr_bufs[peer]
        req = self._comm.Irecv([buf, self._mpi.BYTE], source=peer, tag=_HEADER_TAG)
        self._hdr_reqs[peer] = req
        self._reqs.append(req)
        self._what.append(("header", peer))

    def _reap_quick(self) -> None:
        """Let go of the post_now sends MPI is done with, oldest first."""
        quick = self._quick
        while quick and quick[0][0].Test():
            self._recycle(quick.popleft()[2])

    def _message(self, header: bytes, body: memoryview | None
                 ) -> tuple[Any, bytearray | None]:
        """``header`` and an inline ``body`` as one message, copied once, and the
        reusable buffer it was copied into (None: a plain copy), which :meth:`_recycle`
        takes back once MPI has sent it."""
        if body is None or not body.nbytes:
            return header, None
        n = HEADER_SIZE + body.nbytes
        if body.nbytes <= _POOL_FROM:
            data = bytearray(n)
            data[:HEADER_SIZE] = header
            data[HEADER_SIZE:] = body
            return data, None
        spare = self._spare
        buf = spare.pop() if spare else bytearray(HEADER_SIZE + self._inline)
        buf[:HEADER_SIZE] = header
        buf[HEADER_SIZE:n] = body
        return memoryview(buf)[:n], buf

    def _recycle(self, buf: bytearray | None) -> None:
        if buf is not None and len(self._spare) < _SPARE:
            self._spare.append(buf)

    def _forget(self, req: Any) -> None:
        """Drop ``req``, done outside Testsome, from the requests poll() tests."""
        for i, r in enumerate(self._reqs):
            if r is req:
                del self._reqs[i]
                del self._what[i]
                return

    def _progress(self) -> bool:
        did = False
        if self._held:
            # Headers a caller's thread saw arrive (peek) and did not take.
            for peer in sorted(self._held):
                self._held.discard(peer)
                self._header_arrived(peer)
            did = True
        try:
            self._reap_quick()
        except self._mpi.Exception as exc:
            self._fail_all(f"MPI error: {exc}")
            return True
        did |= self._pull_sends()
        if self._ring_lanes:
            did |= self._read_ring_lanes()
        if self._tag_lanes:
            did |= self._read_lanes()
        if not self._reqs:
            return did
        try:
            done = self._mpi.Request.Testsome(self._reqs)
        except self._mpi.Exception as exc:
            self._fail_all(f"MPI error: {exc}")
            return True
        if not done:
            return did
        finished = [(self._reqs[i], self._what[i]) for i in done]
        keep = set(done)
        self._reqs = [r for i, r in enumerate(self._reqs) if i not in keep]
        self._what = [w for i, w in enumerate(self._what) if i not in keep]
        for _req, (what, data) in finished:
            if what == "send":
                self._send_done(data)
            elif what == "header":
                self._header_arrived(data)
            else:
                peer, header, body = data
                assert self._handler is not None
                self._handler.received(peer, header, body)
                self._post_header(peer)
        return True

    def _read_ring_lanes(self) -> bool:
        """Hand over what the shared-memory lanes with news hold for the loop; returns
        whether anything was.  A lane that holds garbage loses its peer."""
        assert self._handler is not None
        did = False
        for lane in self._ring_lanes:
            if not lane.news():
                continue
            before = lane.lane_counts["messages_received"]
            try:
                lane.read(self._handler)
            except WireError as exc:
                self._ring_lanes.remove(lane)
                del self._lane_ends[lane.peer]
                lane.close()
                self._handler.peer_lost(lane.peer, f"corrupt shared-memory lane: {exc}",
                                        orderly=False)
                return True
            did |= lane.lane_counts["messages_received"] > before
        return did

    def _read_lanes(self) -> bool:
        """Look at the tag lanes that have news: one a message came into (one probe for
        all of them), or one whose held message may be the loop's now.  Returns whether
        any message was handed over."""
        assert self._handler is not None
        status = self._mpi.Status()
        lanes = [lane for lane in self._tag_lanes.values() if lane.recheck]
        if any(lane.holds() for lane in self._tag_lanes.values()):
            # A lane's next message, still in MPI behind one held for a caller's thread,
            # would match the probe below every time, hiding the other lanes' news.
            lanes = list(self._tag_lanes.values())
        else:
            try:
                if self._comm.Iprobe(source=self._mpi.ANY_SOURCE, tag=_LANE_TAG,
                                     status=status):
                    lane = self._tag_lanes.get(status.Get_source())
                    if lane is not None and lane not in lanes:
                        lanes.append(lane)
            except self._mpi.Exception:
                return False
        before = sum(lane.lane_counts["messages_received"] for lane in lanes)
        for lane in lanes:
            lane.read(self._handler)
        return sum(lane.lane_counts["messages_received"] for lane in lanes) > before

    def _pull_sends(self) -> bool:
        assert self._handler is not None
        did = False
        for peer in list(self._pending):
            while (self._in_flight[peer] < _MAX_SENDS_PER_PEER
                   and self._bytes_out[peer] < _MAX_BYTES_PER_PEER):
                msg = self._handler.next_outgoing(peer)
                if msg is None:
                    self._pending.discard(peer)
                    break
                did = True
                body = msg.body
                self.counters.messages_sent += 1
                self.counters.bytes_sent += len(msg.header) + (body.nbytes if body else 0)
                pooled = None
                if body is None or body.nbytes <= self._inline:
                    data, pooled = self._message(msg.header, body)
                    reqs = [self._comm.Isend([data, self._mpi.BYTE], peer, _HEADER_TAG)]
                    keep: tuple[Any, ...] = (data,)
                else:
                    reqs = [self._comm.Isend([msg.header, self._mpi.BYTE], peer, _HEADER_TAG),
                            self._comm.Isend([body, self._mpi.BYTE], peer, _BODY_TAG)]
                    keep = (msg.header, body)
                nbytes = body.nbytes if body is not None else 0
                send = _Send(peer, len(reqs), msg.token, keep, nbytes, pooled)
                self._bytes_out[peer] += nbytes
                self._in_flight[peer] += 1
                self._sends_open += 1
                for req in reqs:
                    self._reqs.append(req)
                    self._what.append(("send", send))
        return did

    def _send_done(self, send: _Send) -> None:
        send.left -= 1
        if send.left:
            return
        send.keep = ()
        self._recycle(send.pooled)
        send.pooled = None
        self._in_flight[send.peer] -= 1
        was = self._bytes_out[send.peer]
        self._bytes_out[send.peer] = was - send.nbytes
        self._sends_open -= 1
        if (self._in_flight[send.peer] == _MAX_SENDS_PER_PEER - 1
                or was >= _MAX_BYTES_PER_PEER > was - send.nbytes):
            self._pending.add(send.peer)  # below a cap again: pull the next
        assert self._handler is not None
        self._handler.sent(send.peer, send.token)

    def _header_arrived(self, peer: int) -> None:
        assert self._handler is not None
        self._hdr_reqs[peer] = None
        buf = self._hdr_bufs[peer]
        header = unpack_header(buf)
        n = header.nbytes
        self.counters.messages_received += 1
        self.counters.bytes_received += HEADER_SIZE + n
        dest = self._handler.body_buffer(peer, header)
        if n <= self._inline:
            if n:
                dest[:] = memoryview(buf)[HEADER_SIZE:HEADER_SIZE + n]
            self._handler.received(peer, header, dest)
            self._post_header(peer)
            return
        self._reqs.append(self._comm.Irecv([dest, self._mpi.BYTE], source=peer,
                                           tag=_BODY_TAG))
        self._what.append(("body", (peer, header, dest)))

    def _fail_all(self, reason: str) -> None:
        self._closed = True
        assert self._handler is not None
        for peer in range(self.size):
            if peer != self.rank:
                self._handler.peer_lost(peer, reason, orderly=False)


def _inline(size: int) -> int:
    """The biggest body that travels with its header in a world of ``size`` ranks."""
    per_peer = _INLINE_BUDGET // max(1, size - 1)
    return max(_INLINE_MIN, min(_INLINE_MAX, per_peer - per_peer % 4096))


def _share_lanes(comm: Any, mpi: Any, peers: list[int]
                 ) -> dict[int, tuple[RingWriter, RingReader]]:
    """A pair of lane rings with each of ``peers`` (on this host) that both ends could
    set up: ours to write, theirs to read.  Collective over ``comm`` (every rank calls
    it, with no peers if it wants none), in two rounds: the names of the rings each rank
    made for each other, then whether each could open the one named for it.  The writer
    unlinks its file after the second round whatever happened, so nothing outlives the
    set-up in /dev/shm; the names go only to the peers they are for, through MPI."""
    size = comm.Get_size()
    capacity = ring_capacity(LANE_RING_BYTES)
    writers: dict[int, RingWriter] = {}
    readers: dict[int, RingReader] = {}
    names = bytearray(_RING_NAME * size)
    opened = bytearray(size)
    theirs = bytearray(size)
    try:
        for peer in peers if shm_available() else []:
            try:
                writers[peer] = RingWriter(capacity)
            except OSError:
                continue
            name = writers[peer].name.encode()
            names[peer * _RING_NAME:peer * _RING_NAME + len(name)] = name
        got = bytearray(_RING_NAME * size)
        comm.Alltoall([names, mpi.BYTE], [got, mpi.BYTE])
        for peer in writers:
            name = bytes(got[peer * _RING_NAME:(peer + 1) * _RING_NAME]).rstrip(b"\0")
            if name:
                try:
                    readers[peer] = RingReader(name.decode("ascii"), capacity)
                    opened[peer] = 1
                except (OSError, ValueError, UnicodeDecodeError):
                    pass
        comm.Alltoall([opened, mpi.BYTE], [theirs, mpi.BYTE])
    finally:
        for writer in writers.values():
            writer.unlink()
    pairs: dict[int, tuple[RingWriter, RingReader]] = {}
    for peer, writer in writers.items():
        reader = readers.get(peer)
        if reader is not None and theirs[peer]:
            pairs[peer] = (writer, reader)
            continue
        writer.close()
        if reader is not None:
            reader.close()
    return pairs


def mpi_world() -> tuple[Any, int, int, tuple[int, ...]]:
    """COMM_WORLD, this rank's (local rank, local size) among ranks on its node, and
    every rank's node (see Transport.hosts)."""
    from .mesh import number_hosts

    MPI = import_mpi()
    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    try:
        # A node is named by its first rank: the same on every rank, unlike a hostname.
        leader = node.bcast(world.Get_rank(), root=0)
        hosts = number_hosts([str(r) for r in world.allgather(leader)])
        return world, node.Get_rank(), node.Get_size(), hosts
    finally:
        node.Free()
