"""A lane to a peer on this host through a pair of small shared-memory rings, for a
transport whose own messages go another way (MPI's: transport/mpi.py).

Over MPI a lane of its own tag still goes through the MPI library, which lets one thread
in at a time and moves a big op's bytes inside the very calls an urgent op's thread
makes; on one host such a message waited behind them for 1-3 ms at the median during a
64 MB allreduce at 2 ranks.  A ring that only lane messages use is written and read
without any library call or lock but its own, as the shared-memory transport's lanes are
(ring_link.py, where the lane shares its file with the peer's ring).

It is read and written from any thread: a caller's thread posts its messages and reads
the peer's while another thread drives the loop, which reads the messages its ops need
(MessageHandler.lane_claims) when it polls.  A message stays in the ring, whole and in
order, until one of the two takes it.  Nothing rings a doorbell: the owner's poll looks
at :meth:`RingLane.ready` on every turn.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from .base import MessageHandler
from .shmring import NOT_INLINE, RingReader, RingWriter
from .wire import HEADER_SIZE, Header, Kind, WireError

# Each direction's ring: room for a few small ops' messages, as a ring's lane has.
LANE_RING_BYTES = 64 << 10


def hand_claimed(lane: RingReader, handler: MessageHandler, peer: int, all_of_it: bool,
                 counts: dict[str, int]) -> None:
    """Hand ``handler`` the messages in ``lane`` (``peer``'s) that it claims
    (MessageHandler.lane_claims), oldest first, up to the first it does not, which stays
    for a caller's thread; ``all_of_it``: every message, at the peer's end.  ``counts``:
    the lane's, for what is taken.  The caller holds the lane's reading lock.

    Raises:
        WireError: the lane holds something that is not a whole DATA message.
    """
    while (record := lane.next()) is not None:
        header, body = record
        if header.kind != Kind.DATA or header.flags & NOT_INLINE:
            raise WireError(f"a {header.kind!r} message in a lane")
        if not all_of_it and not handler.lane_claims(peer, header,
                                                      lane.behind() != lane.head()):
            return
        # A body of the peer's may be arriving the usual way meanwhile (lent, or in
        # chunks): its route stays for it.
        handler.received_ahead(peer, header, body)
        lane.release()
        count_taken(counts, header)


def count_taken(counts: dict[str, int], header: Header) -> None:
    """Count a lane message taken (``header``'s) in the lane's ``counts``."""
    counts["messages_received"] += 1
    counts["bytes_received"] += HEADER_SIZE + header.nbytes


class RingLane:
    def __init__(self, peer: int, out: RingWriter, into: RingReader,
                 wake: Callable[[], None]) -> None:
        """``out``: the ring the peer reads, ``into``: the one it writes; ``wake()``: make
        the owner's poll look again soon (any thread)."""
        self.peer = peer
        self._out: RingWriter | None = out
        self._in: RingReader | None = into
        self._wake = wake
        self.lane_lock = threading.Lock()  # reading
        self._writing = threading.Lock()
        self.recheck = False  # a message left here may be the loop's now (read() again)
        # The reading end's head when the loop last looked: records past it are news.
        self._seen = 0
        self.lane_counts = {"messages_sent": 0, "bytes_sent": 0, "messages_received": 0,
                            "bytes_received": 0}

    def lane_room(self) -> int:
        out = self._out
        return 0 if out is None or self._in is None else out.max_body

    def lane_post(self, header: bytes, body: memoryview | None) -> bool:
        with self._writing:
            out = self._out
            if (out is None or (body is not None and body.nbytes > out.max_body)
                    or not out.post(header, body)):
                return False
            counts = self.lane_counts
            counts["messages_sent"] += 1
            counts["bytes_sent"] += HEADER_SIZE + (0 if body is None else body.nbytes)
        return True

    def lane_peek(self) -> tuple[Header, memoryview] | None:
        """(Hold :attr:`lane_lock`.)"""
        lane = self._in
        if lane is None:
            return None
        try:
            return lane.next()
        except WireError:
            return None  # read() reports it

    def lane_take(self, header: Header) -> None:
        """(Hold :attr:`lane_lock`.)"""
        lane = self._in
        assert lane is not None
        lane.release()  # writers never wait for room: nobody is owed a wake-up
        count_taken(self.lane_counts, header)
        if lane.ready():
            self.recheck = True  # the loop may claim what is behind it
            self._wake()

    def lane_wait(self, timeout: float) -> None:
        """Nap ``timeout``: a ring has nothing to wait on (base.LaneEnd)."""
        time.sleep(timeout)

    def news(self) -> bool:
        """Whether the loop should :meth:`read`: records came in since it last looked, or
        one left for a caller's thread may be the loop's now (any thread)."""
        lane = self._in
        if lane is None:
            return False
        if self.recheck:
            return True
        try:
            return lane.head() != self._seen
        except (TypeError, ValueError):  # closed meanwhile (abort() on another thread)
            return False

    def read(self, handler: MessageHandler) -> None:
        """The loop's look: hand over the messages the handler claims, oldest first, up
        to the first it does not (a caller's thread will take that one).  Skipped while a
        caller's thread reads the lane.

        Raises:
            WireError: the lane holds something that is not a whole DATA message.
        """
        lane = self._in
        if lane is None or not self.lane_lock.acquire(False):
            return
        try:
            self.recheck = False
            self._seen = lane.head()
            hand_claimed(lane, handler, self.peer, False, self.lane_counts)
        finally:
            self.lane_lock.release()

    def close(self) -> None:
        """Unmap both rings; the lane takes nothing more."""
        with self._writing, self.lane_lock:
            for ring in (self._out, self._in):
                if ring is not None:
                    ring.close()
            self._out = self._in = None
