"""A link to a peer on this host: every message, header and body, travels through a
shared-memory ring per direction (shmring.py).

No system call per message, and the receiver reduces straight out of the sender's slot.
The socket stays open as a doorbell (one byte when the reader may be asleep, see shmring)
and as the failure detector: a dead peer's socket ends, and what it wrote to the ring
before is read first, so an orderly GOODBYE is never mistaken for a crash.  Bodies of big
ops may be *lent* instead (cma.py): the reader's kernel copies them straight out of the
writer's memory, one copy where the ring costs two.

A lender that sits idle while its body is copied (a broadcast's root, FLAG_SPREAD) copies
the body's back half into the reader meanwhile, when the reader asks (ring_push.py).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

from . import cma, ring_push
from .base import NOT_TAKEN, TAKEN, Outgoing
from .ring_lane import count_taken, hand_claimed
from .ring_push import PUSH_MIN, push_front
from .shmring import NOT_INLINE, RingReader, RingWriter
from .socket_link import READ_BUDGET, WRITE_BUDGET, Link, LinkOwner, explain
from .wire import (
    FLAG_CHUNKED,
    FLAG_REMOTE,
    FLAG_SPREAD,
    HEADER_SIZE,
    KIND_DATA,
    REMOTE_BODY,
    Header,
    Kind,
    WireError,
    op_nbytes,
    with_flag,
)

_DOORBELL = b"\x01"
_LEND_MIN = 64 << 10  # smaller bodies are copied: a lent body costs the reader a syscall
# Before handling a body at least this big (lent, or in the ring), more urgent messages
# posted behind it are handled first (_overtake): it takes tens of microseconds or more.
_OVERTAKE_MIN = 256 << 10
# A lent body is copied in slices of this size: between two, the copy may stop for
# something more urgent (an op submitted here, or an urgent op's messages behind it) and
# go on at the next turn.  A slice costs one syscall (~4 us here): 1 MiB slices cost
# nothing measurable, 512 KiB ones made a 64 MB allreduce about 4 % slower, and 256 KiB
# ones a lone 2 MiB copy 25 % slower.
_SLICE = 1 << 20
# ... but a body comes in at most this many slices: each call pins the lender's pages
# afresh, which costs more than the syscall where huge pages back them.  On an Intel VM
# one process read 32 MiB of its own huge pages in 3.0 ms whole, 3.1-3.3 in 4 MiB slices
# and 3.5-3.9 in 1 MiB ones.  At 2 ranks big gathers and broadcasts come in lent pieces
# of up to 32 MiB (algorithms/select.py): 64 MB allgathers took 9.8-10.5 ms in 4 MiB
# slices against 11.0-12.2 in 1 MiB ones, 64 MB alltoalls 10.2-11.0 against 10.9-12.6,
# 256 MB ones 44.2-45.6 against 45.6-46.5 (old and new alternated four times).  The
# slices of a reduction's pieces (a segment, 2 MiB) stay 1 MiB: fewer slices give the
# core away (below) less often, which an urgent op issued meanwhile waits for.
_SLICES_MAX = 8
# ... and while a more urgent op runs here, in slices of this size.
_URGENT_SLICE = 256 << 10


class _Scan:
    """How far :meth:`RingLink._overtake` has looked behind the record at ``front``, for
    which ops, and the ops it passed (their later messages must not overtake)."""

    __slots__ = ("front", "urgent", "pos", "passed")

    def __init__(self, front: int, urgent: frozenset[tuple[int, int]]) -> None:
        self.front = front
        self.urgent = urgent
        self.pos = front
        self.passed: set[tuple[int, int]] = set()


class _LentCopy:
    """A body the peer lent us, partly copied (``done`` bytes) into ``dest``; ``spread``:
    its lender sits idle, and may be asked to copy the back from ``end`` (``end`` < the
    body's size: it was asked, and has not said it did)."""

    __slots__ = ("header", "address", "lend", "dest", "done", "spread", "end")

    def __init__(self, header: Header, address: int, lend: int, dest: memoryview,
                 spread: bool = False) -> None:
        self.header = header
        self.address = address
        self.lend = lend
        self.dest = dest
        self.done = 0
        self.spread = spread
        self.end = dest.nbytes


class _LendFailed(Exception):
    """The peer's memory could not be read: it has exited, or was never readable."""


class RingLink(Link):
    def __init__(self, owner: LinkOwner, peer: int, sock: socket.socket,
                 ring_out: RingWriter, ring_in: RingReader, lend_bytes: int) -> None:
        super().__init__(owner, peer, sock)
        self.counters = owner.shm_counters
        self._pending = owner.pending
        self.ring_out: RingWriter | None = ring_out
        self.ring_in: RingReader | None = ring_in
        self._lend_bytes = lend_bytes if ring_out.lend else 0
        self.blocked: Outgoing | None = None  # waiting for room in ring_out
        self._chunk_off = -1  # bytes of blocked's body already in the ring (-1: not begun)
        self._lent: dict[int, Outgoing] = {}  # bodies the peer has yet to copy out of us
        # The lent body whose back the peer copies into us now (take_lent_front): its
        # lend id, the peer's pid and the body's address there.
        self._pushing: tuple[int, int, int] | None = None
        self._next_lend = 0
        # Records we owe the peer (RING_ACK, RING_PUSHED), packed, that found the ring full.
        self._acks: deque[bytes] = deque()
        # A lent body whose copy stopped between two slices; it goes on before any later
        # record is read (only records that overtake it are handled first).
        self.lent_in: _LentCopy | None = None
        self._scan: _Scan | None = None  # the last look behind a big body (_overtake)
        # Give the core away between the slices of a lent copy (set by the transport where
        # every local rank has a core of its own; see _copy_on).
        self.yields = False
        self.deferred = False  # the ring's next record waits for the handler (resume())
        # The lanes (shmring.RingWriter.lane), used from any thread: a caller's thread
        # runs an urgent op through them while the loop's thread runs the rings.  Each end
        # has its lock; the loop only tries the reading end's (read_lane).
        self.lane_out = ring_out.lane
        self.lane_in = ring_in.lane
        self.lane_lock = threading.Lock()  # reading lane_in
        self._lane_writing = threading.Lock()
        # Messages and bytes through the lanes, counted under their locks (Counters are
        # the loop's alone).
        self.lane_counts = {"messages_sent": 0, "bytes_sent": 0, "messages_received": 0,
                            "bytes_received": 0}
        # The lane's head when the loop last looked: records past it are news to the loop
        # (the poller's rings_ready), older ones were left for a caller's thread.
        self.lane_seen = 0

    def pending_output(self) -> bool:
        return bool(self.out or self.blocked or self._acks)

    def drop_output(self) -> None:
        super().drop_output()
        self.blocked = None
        self._lent.clear()
        self._acks.clear()
        self.lent_in = None

    def close_rings(self) -> None:
        self.blocked = None
        with self._lane_writing, self.lane_lock:
            for lane in (self.lane_out, self.lane_in):
                if lane is not None:
                    lane.close()
            self.lane_out = self.lane_in = None
        for ring in (self.ring_out, self.ring_in):
            if ring is not None:
                ring.close()
        self.ring_out = self.ring_in = None

    def ready(self) -> bool:
        """Whether the peer's ring has a record for us (not one left for later)."""
        ring = self.ring_in
        lane = self.lane_in
        return ring is not None and (self.lent_in is not None
                                     or (not self.deferred and ring.ready())
                                     or (lane is not None and lane.head() != self.lane_seen))

    def watch_copies(self, slow_rate: float) -> None:
        """Lend every big body while this ring's big copies run slower than ``slow_rate``
        bytes per second (copy_pace.py; 0: never), where bodies can be lent at all."""
        if self.ring_out is not None:
            self.ring_out.pace.far_rate = slow_rate if self._lend_bytes else 0.0

    def ring_beats_lending(self) -> bool:
        """CopyPace.beats_lending of this ring (True where there is none)."""
        ring = self.ring_out
        return ring is None or ring.pace.beats_lending()

    def lends_big(self) -> bool:
        """Whether the next big body would be lent because this ring is slow."""
        ring = self.ring_out
        return ring is not None and ring.pace.lend()

    def room_freed(self) -> bool:
        """Whether the ring our blocked message did not fit in has room now."""
        return self.blocked is not None and self.ring_out is not None and \
            self.ring_out.room_changed()

    def set_sleeping(self, slot: int, on: bool) -> None:
        if self.ring_in is not None:
            self.ring_in.set_sleeping(slot, on)

    def ask_for_room(self, on: bool) -> bool:
        """Ask the reader of our full ring to ring the doorbell when it frees room (or
        stop asking); returns whether our ring is full."""
        if self.blocked is None or self.ring_out is None:
            return False
        self.ring_out.set_waiting(on)
        return True

    # --- writing -------------------------------------------------------------------

    def write(self, budget: int = WRITE_BUDGET) -> None:
        """Post messages into the ring until it is full, the handler has none, or
        ``budget`` bytes went in; then ring the reader's doorbell if needed."""
        if self.write_closed:
            return
        ring = self.ring_out
        assert ring is not None
        handler = self.owner.handler
        counters = self.counters
        posted = 0
        while True:
            # Acknowledgements go first, but never between a chunked body's records.
            if self._acks and self._chunk_off < 0:
                while self._acks:
                    if not ring.post(self._acks[0]):
                        self.owner.again(self.peer)  # retried next turn: the reader is busy
                        break
                    self._acks.popleft()
                    posted += HEADER_SIZE
                if self._acks:
                    break
            msg = self.blocked
            if msg is None:
                if budget - posted <= 0:
                    self.owner.again(self.peer)  # the rest on the next poll()
                    break
                msg = handler.next_outgoing(self.peer)
                if msg is None:
                    break
            body = msg.body
            n = 0 if body is None else body.nbytes
            # An op's size decides (a big op's small tail pieces are lent too), or the
            # body's where the header carries none (an alltoall's count is 0); and any
            # body its op lets be lent while copies through this ring are slow
            # (copy_pace.py).  Not one whose chunks have begun to go through the ring.
            if self._lend_bytes and n >= _LEND_MIN and self._chunk_off < 0 and (
                    (msg.lend and max(op_nbytes(msg.header), n) >= self._lend_bytes)
                    or (msg.lend_slow and ring.pace.lend())):
                if not self._post_lent(ring, msg):
                    self.blocked = msg
                    break
                self.blocked = None
                posted += HEADER_SIZE
                continue
            if n <= ring.max_body:
                if not ring.post(msg.header, body):
                    self.blocked = msg  # retried on a doorbell or the owner's next retry
                    break
                posted += HEADER_SIZE + n
            else:
                posted += self._post_chunks(msg)
                if self.blocked is not None:
                    break
            self.blocked = None
            counters.messages_sent += 1
            counters.bytes_sent += HEADER_SIZE + n
            handler.sent(self.peer, msg.token)
        if posted and ring.reader_sleeping():
            self.doorbell()

    def post_now(self, header: bytes, body: memoryview | None) -> bool:
        """Post one whole message at once, ahead of nothing (no output of ours waits);
        False, nothing written, when it cannot go now."""
        ring = self.ring_out
        if (ring is None or self.blocked is not None or self._acks or self.write_closed
                or self.closed or self.peer in self._pending
                or (body is not None and body.nbytes > ring.max_body)
                or not ring.post(header, body)):
            return False
        counters = self.counters
        counters.messages_sent += 1
        counters.bytes_sent += HEADER_SIZE + (0 if body is None else body.nbytes)
        if ring.reader_sleeping():
            self.doorbell()
        return True

    def lends_body(self, op_bytes: int, n: int) -> bool:
        """Whether a body of ``n`` bytes of an op of ``op_bytes`` is lent by the rule
        :meth:`write` applies to a lendable one (its op's size decides)."""
        return bool(self._lend_bytes) and n >= _LEND_MIN and max(op_bytes, n) >= \
            self._lend_bytes

    def lend_now(self, header: bytes, body: memoryview, token: object,
                 spread: bool = False) -> bool:
        """Lend ``body`` to the peer at once, as :meth:`write` lends one (``token`` comes
        back through the handler's ``sent`` once the peer has copied it; ``body`` must
        stay as it is until then); False, nothing posted, when it cannot go now."""
        ring = self.ring_out
        if (ring is None or not self._lend_bytes or self.blocked is not None or self._acks
                or self.write_closed or self.closed
                or not self._post_lent(ring, Outgoing(header, body, token, spread=spread))):
            return False
        if ring.reader_sleeping():
            self.doorbell()
        return True

    def _post_lent(self, ring: RingWriter, msg: Outgoing) -> bool:
        """Post ``msg``'s descriptor (where its body is, under a new lend id) instead of
        its body; False, nothing posted, while the ring is full.  The handler's ``sent``
        gets its token when the reader says it has copied the body."""
        body = msg.body
        assert body is not None
        lend = self._next_lend
        desc = REMOTE_BODY.pack(cma.address_of(body), lend)
        # Asked to, this process writes into the peer's: only where it could read it.
        spread = msg.spread and body.nbytes >= PUSH_MIN and self.ring_in is not None \
            and self.ring_in.lender_pid is not None
        flags = FLAG_REMOTE | FLAG_SPREAD if spread else FLAG_REMOTE
        if not ring.post(with_flag(msg.header, flags), memoryview(desc)):
            return False
        self._next_lend += 1
        self._lent[lend] = msg
        counters = self.counters
        counters.messages_sent += 1
        counters.bytes_sent += HEADER_SIZE + body.nbytes
        counters.bodies_lent += 1
        return True

    def _post_chunks(self, msg: Outgoing) -> int:
        """Post a body bigger than a ring record: the header, then as many CHUNK records as
        fit.  Leaves ``msg`` in ``blocked`` until the last one is in."""
        ring = self.ring_out
        assert ring is not None and msg.body is not None
        body = msg.body
        posted = 0
        if self._chunk_off < 0:
            if not ring.post(with_flag(msg.header, FLAG_CHUNKED)):
                self.blocked = msg
                return posted
            self._chunk_off = 0
            posted += HEADER_SIZE
        while self._chunk_off < body.nbytes:
            piece = body[self._chunk_off:self._chunk_off + ring.chunk_bytes]
            if not ring.post(Header(Kind.RING_CHUNK, nbytes=piece.nbytes).pack(), piece):
                self.blocked = msg
                return posted
            self._chunk_off += piece.nbytes
            posted += HEADER_SIZE + piece.nbytes
        self._chunk_off = -1
        self.blocked = None
        return posted

    def doorbell(self) -> None:
        if self.write_closed:
            return  # we are leaving: the peer reads the ring at our EOF anyway
        try:
            self.sock.send(_DOORBELL)
        except (BlockingIOError, InterruptedError):
            pass  # the socket is full of unread doorbells: the peer wakes anyway
        except OSError as exc:
            self.owner.lost(self, f"send failed: {explain(exc)}")

    # --- the lanes (any thread) -------------------------------------------------------

    def lane_room(self) -> int:
        """The biggest body :meth:`lane_post` takes; 0: no lane."""
        lane = self.lane_out
        return 0 if lane is None or self.lane_in is None else lane.max_body

    def lane_wait(self, timeout: float) -> None:
        """Nap ``timeout``: a ring has no descriptor to wait on (base.LaneEnd)."""
        time.sleep(timeout)

    def lane_post(self, header: bytes, body: memoryview | None) -> bool:
        """Post one message into the peer's lane; False, nothing written, when it cannot
        go now (no room, or the link is ending)."""
        with self._lane_writing:
            lane = self.lane_out
            if (lane is None or self.write_closed or self.closed
                    or (body is not None and body.nbytes > lane.max_body)
                    or not lane.post(header, body)):
                return False
            counts = self.lane_counts
            counts["messages_sent"] += 1
            counts["bytes_sent"] += HEADER_SIZE + (0 if body is None else body.nbytes)
        ring = self.ring_out
        if ring is not None and ring.reader_sleeping():
            # Errors are the loop's to see and report: this may be any thread.
            with contextlib.suppress(OSError):
                self.sock.send(_DOORBELL)
        return True

    def lane_peek(self) -> tuple[Header, memoryview] | None:
        """The oldest message in our lane, with its body, or None (hold
        :attr:`lane_lock`; the body is valid until :meth:`lane_take` or the lock goes)."""
        lane = self.lane_in
        if lane is None:
            return None
        try:
            return lane.next()
        except WireError:
            return None  # the loop's read_lane reports it

    def lane_take(self, header: Header) -> None:
        """The message :meth:`lane_peek` showed (``header``) has been handled (hold
        :attr:`lane_lock`)."""
        lane = self.lane_in
        assert lane is not None
        lane.release()  # lane writers never wait for room, so no doorbell is owed
        count_taken(self.lane_counts, header)
        if lane.ready():
            self.lane_seen = -1  # the loop may claim what is behind it
            self.owner.wake()

    def read_lane(self, all_of_it: bool) -> None:
        """Hand the handler the lane's messages it claims (MessageHandler.lane_claims),
        oldest first, up to the first it does not (a caller's thread will take that one);
        ``all_of_it``: every message, at the peer's end.  Skipped while a caller's thread
        reads the lane.

        Raises:
            WireError: the lane holds something that is not a whole DATA message.
        """
        lane = self.lane_in
        if lane is None:
            return
        self.lane_seen = lane.head()
        if not lane.ready() or not self.lane_lock.acquire(False):
            return  # a caller that leaves records behind its own says so (lane_take)
        try:
            hand_claimed(lane, self.owner.handler, self.peer, all_of_it, self.lane_counts)
        finally:
            self.lane_lock.release()

    # --- reading -------------------------------------------------------------------

    def read(self) -> None:
        """The socket carries only doorbells, then the peer's end."""
        try:
            while True:
                data = self.sock.recv(4096)
                if not data:
                    self.read_ring(None)  # what it wrote before it went
                    self.eof()
                    return
                if data.strip(_DOORBELL):
                    raise WireError("unexpected bytes on a shared-memory peer's socket")
        except (BlockingIOError, InterruptedError):
            return
        except WireError as exc:
            self.owner.lost(self, f"corrupt stream: {exc}")
        except OSError as exc:
            self.read_ring(None)
            self.owner.lost(self, f"receive failed: {explain(exc)}")

    def peek(self) -> tuple[Header, memoryview | None] | None:
        """See :meth:`.base.Transport.peek`: the ring's next record, with its body if it
        is a DATA message whose body lies whole in the slot (not chunked, not lent)."""
        ring = self.ring_in
        if ring is None or self.body is not None or self.lent_in is not None or self.closed:
            return None
        try:
            record = ring.next()
            while record is not None and record[0].kind == Kind.RING_TAKEN:
                # Handled out of turn (_overtake, _pushed): nothing to show.
                if ring.release() and not self.closed:
                    self.doorbell()
                record = ring.next()
        except WireError:
            return (Header(Kind.RING_WRAP), None)  # for read_ring() to report
        if record is None:
            return None
        header, body = record
        if header.kind != KIND_DATA or header.flags & NOT_INLINE:
            return (header, None)
        return record

    def take(self, header: Header) -> None:
        """The record :meth:`peek` returned has been handled."""
        ring = self.ring_in
        assert ring is not None
        counters = self.counters
        counters.messages_received += 1
        counters.bytes_received += HEADER_SIZE + header.nbytes
        if ring.release() and not self.closed:
            self.doorbell()  # its writer waits for room

    def take_lent(self, dest: memoryview) -> bool:
        """Copy the lent body :meth:`peek` showed (a FLAG_REMOTE DATA record) out of the
        peer into ``dest``, its size, then free the record and acknowledge the body; False,
        nothing taken, if it cannot be copied here now (the loop then reads it again and
        reports a peer whose memory is gone).  A body whose lender sits idle comes half
        from the lender (RING_PUSH), which this thread waits for."""
        pending = self.take_lent_front(dest)
        return pending != NOT_TAKEN and (pending == TAKEN or self.wait_pushed(pending))

    def take_lent_front(self, dest: memoryview) -> int:
        """:meth:`take_lent` up to the wait for the lender's half: copy the body whole, or
        where its lender sits idle, ask the lender for the back and copy the front; then
        free the record and acknowledge the body (it is not read again: a lender that
        fails to write loses the link).  Returns NOT_TAKEN (nothing taken), TAKEN (the
        body is whole), or the lend id to give :meth:`wait_pushed`."""
        n = dest.nbytes
        found = self._lent_record(n)
        if found is None:
            return NOT_TAKEN
        header, address, lend, pid = found
        end = n
        if header.flags & FLAG_SPREAD and self._ask_push(lend, dest):
            end = push_front(n)
        try:
            cma.read_into(pid, dest[:end], address)
        except OSError as exc:
            if end == n:
                return NOT_TAKEN
            # The lender may write into dest yet: the op cannot go on elsewhere.
            self.owner.lost(self, f"cannot copy a body out of rank {self.peer}: {exc}")
            return NOT_TAKEN
        self._took_lent(header, lend)
        if end == n:
            return TAKEN
        self._pushing = (lend, pid, address)
        return lend

    def wait_pushed(self, lend: int) -> bool:
        """Wait until the lender of body ``lend`` (:meth:`take_lent_front`) says it wrote
        its half; False where it could not, or is gone: the link is then lost."""
        assert self._pushing is not None and self._pushing[0] == lend
        _lend, pid, address = self._pushing
        self._pushing = None
        try:
            if self._pushed(lend, pid, address, wait=True):
                self.counters.bodies_spread += 1
                return True
            reason = "could not copy its half of a body into this process"
        except (OSError, WireError) as exc:
            reason = f"did not copy its half of a body into this process: {exc}"
        self.owner.lost(self, f"rank {self.peer} {reason}")
        return False

    def _lent_record(self, nbytes: int) -> tuple[Header, int, int, int] | None:
        """The ring's next record if it is a lent body of ``nbytes`` that can be copied
        here now: its header, address, lend id and the lender's pid."""
        ring = self.ring_in
        pid = None if ring is None else ring.lender_pid
        if (ring is None or pid is None or self.body is not None
                or self.lent_in is not None or self.closed):
            return None
        try:
            record = ring.next()
        except WireError:
            return None
        if record is None:
            return None
        header, desc = record
        if not header.flags & FLAG_REMOTE or header.nbytes != nbytes:
            return None
        address, lend = REMOTE_BODY.unpack_from(desc)
        return header, address, lend, pid

    def _took_lent(self, header: Header, lend: int) -> None:
        """The lent body of ``header`` (the ring's next record) is copied: free its record
        and acknowledge it."""
        ring = self.ring_in
        assert ring is not None
        freed = ring.release()
        self._acknowledge(lend)
        counters = self.counters
        counters.messages_received += 1
        counters.bytes_received += HEADER_SIZE + header.nbytes
        if freed and not self.closed:
            self.doorbell()

    def take_lent_each(self, scratch: memoryview, nbytes: int,
                       each: Callable[[memoryview, int], None]) -> bool:
        """:meth:`take_lent` for a body of ``nbytes`` copied in slices of ``scratch``'s
        size, ``each(slice, offset)`` called after each one: a slice used at once is still
        in the reader's cache (2 MiB lent pieces summed after they were copied whole took
        16 MB of them 3.0-3.3 ms to copy and sum, in 512 KiB slices 2.2-2.3).  A copy that
        fails after the first slice loses the link (the op fails where it goes on) and
        returns False."""
        found = self._lent_record(nbytes)
        if found is None:
            return False
        header, address, lend, pid = found
        step = scratch.nbytes
        at = 0
        try:
            while at < nbytes:
                view = scratch if nbytes - at >= step else scratch[:nbytes - at]
                cma.read_into(pid, view, address + at)
                each(view, at)
                at += view.nbytes
        except OSError as exc:
            if at:
                self.owner.lost(self, f"cannot copy a body out of rank {self.peer}: {exc}")
            return False
        self._took_lent(header, lend)
        return True

    def take_ack(self, header: Header) -> bool:
        """Take the peer's RING_ACK or RING_PUSH :meth:`peek` showed (``header``).  An
        acknowledgement: the body we lent under its id has been copied, and its token
        goes back through the handler's ``sent``.  A push: its back half is copied into
        the peer now.  False, nothing taken, for an id not lent (the loop reports it)."""
        ring = self.ring_in
        if ring is None or header.seq not in self._lent:
            return False
        if header.kind == Kind.RING_PUSH:
            record = ring.next()
            assert record is not None
            address = ring_push.asked_at(record[1])
            freed = ring.release()
            self._push(header.seq, address)
        else:
            msg = self._lent.pop(header.seq)
            freed = ring.release()
            self.owner.handler.sent(self.peer, msg.token)
        if freed and not self.closed:
            self.doorbell()
        return True

    def _push(self, lend: int, address: int) -> None:
        """Copy the back of the body lent under ``lend`` to ``address`` (where the peer
        keeps the whole body) in the peer, as it asked, and say so; where the copy fails,
        say that instead: the peer copies it then (or is gone, as its socket will say).

        Raises:
            WireError: no body is lent under ``lend``.
        """
        msg = self._lent.get(lend)
        if msg is None or msg.body is None:
            raise WireError(f"push of unknown lent body {lend}")
        ring = self.ring_in
        pid = None if ring is None else ring.lender_pid
        self._owe(ring_push.write_back(pid, msg.body, address, lend))

    def read_ring(self, budget: int | None = READ_BUDGET) -> None:
        """Hand the records waiting in the peer's ring to the handler (``budget`` bytes'
        worth per poll, None: all of them)."""
        ring = self.ring_in
        if self.lane_in is not None:
            try:
                self.read_lane(budget is None)
            except WireError as exc:
                self.owner.lost(self, f"corrupt shared-memory lane: {exc}")
                return
        if ring is None:
            return
        if self.deferred and budget is not None:
            # Left for an op not submitted here yet; its peer may wait meanwhile for a push
            # of ours that stands behind it.
            try:
                ring_push.answer_behind(ring, self._push)
            except WireError as exc:
                self.owner.lost(self, f"corrupt shared-memory ring: {exc}")
            return
        handler = self.owner.handler
        counters = self.counters
        peer = self.peer
        freed = False
        self.deferred = False
        try:
            lent = self.lent_in
            if lent is not None and self._copy_on(
                    lent, budget is not None, handler.overtaking(peer, lent.header)):
                return  # stopped again between two slices (nothing was released)
            while budget is None or budget > 0:
                record = ring.next()
                if record is None:
                    break
                header, body = record
                if budget is not None and self.body is None and header.kind == KIND_DATA \
                        and handler.can_defer(peer, header):
                    # Data for an op not submitted here yet: left in the ring, it is
                    # reduced straight out of it once the op starts, instead of copied
                    # aside now (on the path back to the caller) and reduced later.
                    self.deferred = True
                    ring_push.answer_behind(ring, self._push)
                    break
                if budget is not None:
                    budget -= HEADER_SIZE + header.nbytes
                if self.body is not None:  # inside a chunked body
                    left = self.body.nbytes - self.body_off
                    if header.kind != Kind.RING_CHUNK or not 0 < header.nbytes <= left:
                        raise WireError("a chunked body was interrupted")
                    self.body[self.body_off:self.body_off + header.nbytes] = body
                    self.body_off += header.nbytes
                    freed |= ring.release()
                    if self.body_off == self.body.nbytes:
                        self.deliver()
                elif header.kind == Kind.RING_CHUNK:
                    raise WireError("a body chunk arrived without its header")
                elif header.kind == Kind.RING_ACK:
                    msg = self._lent.pop(header.seq, None)
                    if msg is None:
                        raise WireError(f"acknowledgement of unknown lent body {header.seq}")
                    freed |= ring.release()
                    handler.sent(peer, msg.token)
                elif header.kind == Kind.RING_PUSH:
                    address = ring_push.asked_at(body)
                    freed |= ring.release()
                    self._push(header.seq, address)
                elif header.kind == Kind.RING_PUSHED:
                    raise WireError(f"push of lent body {header.seq} said done out of turn")
                elif header.kind == Kind.RING_TAKEN:
                    freed |= ring.release()
                elif header.flags & FLAG_REMOTE:
                    urgent = handler.overtaking(peer, header)
                    if urgent is not None and self._overtake(urgent):
                        break  # this turn's caller may be waiting for what they finished
                    address, lend = REMOTE_BODY.unpack_from(body)
                    freed |= ring.release()
                    spread = bool(header.flags & FLAG_SPREAD)
                    header = header._replace(flags=header.flags & ~(FLAG_REMOTE | FLAG_SPREAD))
                    dest = handler.body_buffer(peer, header)
                    if dest.nbytes != header.nbytes:
                        raise AssertionError("body_buffer returned a buffer of the wrong size")
                    self.lent_in = _LentCopy(header, address, lend, dest, spread)
                    if self._copy_on(self.lent_in, budget is not None, urgent):
                        break
                elif header.flags & FLAG_CHUNKED:
                    freed |= ring.release()
                    header = header._replace(flags=header.flags & ~FLAG_CHUNKED)
                    dest = handler.body_buffer(peer, header)
                    if dest.nbytes != header.nbytes:
                        raise AssertionError("body_buffer returned a buffer of the wrong size")
                    self.header, self.body, self.body_off = header, dest, 0
                    if not header.nbytes:
                        self.deliver()
                else:
                    if header.kind == Kind.GOODBYE:
                        self.goodbye = True
                    if header.nbytes >= _OVERTAKE_MIN:
                        urgent = handler.overtaking(peer, header)
                        if urgent is not None and self._overtake(urgent):
                            break
                    counters.messages_received += 1
                    counters.bytes_received += HEADER_SIZE + header.nbytes
                    handler.received_view(peer, header, body)
                    freed |= ring.release()
        except WireError as exc:
            self.owner.lost(self, f"corrupt shared-memory ring: {exc}")
            return
        except _LendFailed as exc:
            self.owner.lost(self, str(exc))  # it exited (or its memory is gone) mid-op
            return
        if freed and not self.closed:
            self.doorbell()  # its writer waits for room

    def _overtake(self, urgent: frozenset[tuple[int, int]]) -> bool:
        """Before or while handling a big body (a lent one: hundreds of microseconds),
        handle the more urgent messages posted behind it: DATA of the ops in ``urgent``
        (the handler's choice: MessageHandler.overtaking), whose body lies whole in the
        ring.  They would wait for every big body ahead of them otherwise, since records
        are read in order.  A message is never handled before an earlier one of its own
        op.  Returns whether any was: the big body then waits for the next turn of the
        loop, whose driver may be waiting for the op they finished.

        Looks are incremental: between the slices of one body, with the same ops urgent,
        only records posted since the last look are read (dozens of lent pieces' records
        may wait behind it, and a look at each on every slice cost more than the copy)."""
        ring = self.ring_in
        assert ring is not None
        front = ring.behind()
        scan = self._scan
        if scan is None or scan.front != front or scan.urgent != urgent:
            scan = self._scan = _Scan(front, urgent)
        handler = self.owner.handler
        counters = self.counters
        passed = scan.passed
        took = False
        for where, kind, flags, name_key, seq, after in ring.glance(scan.pos):
            scan.pos = after
            key = (name_key, seq)
            if (kind != KIND_DATA or flags & NOT_INLINE or key in passed
                    or key not in urgent):
                passed.add(key)
                continue
            header, body = ring.record_at(where)
            counters.messages_received += 1
            counters.bytes_received += HEADER_SIZE + header.nbytes
            counters.overtaken += 1
            handler.received_ahead(self.peer, header, body)
            ring.mark_taken(where, header)
            took = True
        return took

    def _copy_on(self, lent: _LentCopy, may_stop: bool,
                 urgent: frozenset[tuple[int, int]] | None) -> bool:
        """Copy on a body the peer lent us, out of its memory; once whole, acknowledge it
        and hand it on.  Between two slices the copy stops (``may_stop``: not while the
        ring is being drained whole) when an op was submitted here, whose turn should not
        wait for the rest, or when more urgent messages behind it were handled
        (:meth:`_overtake`, also looked for before the first slice of a turn), whose
        driver may be waiting for the op they finished.  ``urgent``: the ops whose
        messages may overtake it (MessageHandler.overtaking).  Returns whether the copy
        stopped."""
        handler = self.owner.handler
        pid = self.ring_in.lender_pid if self.ring_in is not None else None
        if pid is None:
            raise WireError("a lent body from a peer whose memory we cannot read")
        header, dest, address = lent.header, lent.dest, lent.address
        n = dest.nbytes
        size = max(_SLICE, -(-n // _SLICES_MAX)) if urgent is None else _URGENT_SLICE
        pressing = handler.pressing
        if may_stop and urgent is not None and self._overtake(urgent):
            return True
        if lent.spread and not lent.done and lent.end == n and self._ask_push(lent.lend, dest):
            lent.end = push_front(n)  # the lender copies the rest meanwhile
        try:
            while True:
                last = lent.end
                while lent.done < last:
                    at = lent.done
                    end = last if not may_stop else min(last, at + size)
                    cma.read_into(pid, dest[at:end], address + at)
                    lent.done = end
                    if end < last:
                        if self.yields and last == n:
                            # A thread of ours woken meanwhile (the application's, about
                            # to submit an urgent op) gets this core now, not when the
                            # scheduler next looks: without this an urgent op during a 64
                            # MB one waited 4 ms in 1 of 10 tries at 2 ranks on 2 cores.
                            # Where ranks outnumber cores the core would go to another
                            # rank's copy instead (64 MB ops at 4 ranks on 2 cores ran
                            # ~10 % slower).  Not while the lender copies too: its core
                            # is busy then, and a yield only delays this half.
                            os.sched_yield()
                        if pressing() or (urgent is not None and self._overtake(urgent)):
                            return True
                if last == n:
                    break
                pushed = self._pushed(lent.lend, pid, address, wait=not may_stop)
                if pushed is None:
                    return True  # not yet: looked for again on the next turn
                lent.end = n
                if pushed:
                    lent.done = n
                    self.counters.bodies_spread += 1
        except OSError as exc:
            raise _LendFailed(f"cannot copy a body out of rank {self.peer}: {exc}") from None
        self.lent_in = None
        # Acknowledge before handing it on: the handler may reduce it (hundreds of us)
        # while the sender waits for this to finish its op.
        self._acknowledge(lent.lend)
        counters = self.counters
        counters.messages_received += 1
        counters.bytes_received += HEADER_SIZE + header.nbytes
        handler.received(self.peer, header, dest)
        return False

    def _acknowledge(self, lend: int) -> None:
        """Tell the peer its body ``lend`` has been copied."""
        self._owe(Header(Kind.RING_ACK, seq=lend).pack())

    def _owe(self, record: bytes) -> None:
        """Post a bodiless ``record`` (RING_ACK, RING_PUSHED) now, or on the next write if
        earlier ones wait or the ring is full."""
        ring = self.ring_out
        if not self._acks and self._chunk_off < 0 and ring is not None and ring.post(record):
            if ring.reader_sleeping():
                self.doorbell()
        else:
            self._acks.append(record)
            self.owner.again(self.peer)

    def _ask_push(self, lend: int, dest: memoryview) -> bool:
        """Ask the lender of body ``lend`` to copy its back (from push_front) into
        ``dest``, where the whole body goes; False, nothing asked, where the request
        cannot go now (the reader then copies all of it)."""
        ring = self.ring_out
        if (ring is None or self._acks or self._chunk_off >= 0 or self.write_closed
                or self.closed or not ring_push.ask(ring, lend, dest)):
            return False
        if ring.reader_sleeping():
            self.doorbell()
        return True

    def asked_to_push(self) -> bool:
        """Whether a push stands behind the ring's next record (one left for an op not
        begun here): its reader waits for it."""
        ring = self.ring_in
        return ring is not None and ring_push.asks_behind(ring)

    def _pushed(self, lend: int, pid: int, address: int, wait: bool) -> bool | None:
        """ring_push.pushed for this link's body ``lend``, answering the pushes asked of
        us meanwhile (two blocking broadcasts the other way round).

        Raises:
            OSError: the lender is gone.
            WireError: a push of a body we did not lend.
        """
        ring = self.ring_in
        assert ring is not None
        return ring_push.pushed(ring, self._push, lend, pid, address, wait)
