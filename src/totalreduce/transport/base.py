"""The transport interface: move (header, bytes) between ranks, nothing more.

A transport is driven by one thread at a time, whichever holds the engine's drive lock (its
progress thread, or an application thread waiting for its op), through
:meth:`Transport.poll`.  It does not queue on its own: when a peer can take more bytes it
*pulls* the next message from the handler, so the engine, which knows priorities, decides
what goes next (that is where preemption between ops happens).  When a header arrives it
asks the handler where the body should land, so bodies go straight into their destination
array whenever the op is known.  Only :meth:`Transport.wake` and :meth:`Transport.wait`
may be called without that lock.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import NamedTuple, Protocol

from .wire import Header

# How long a peer's goodbye waits for the lane messages it says it sent before it (see
# Transport.drain_lane); over loopback they trail it by microseconds.
LANE_DRAIN_TIME = 1.0


# Transport.take_lent_front's answers besides a lend id.
NOT_TAKEN = -2
TAKEN = -1


class Counters:
    """What a transport moved: whole messages (header included) in each direction, bodies
    lent rather than copied, lent bodies copied half by their idle lender, and messages read
    ahead of slower ones (ring links).  Counted
    where each message leaves or arrives, so a benchmark reads volume from here rather
    than from formulas."""

    __slots__ = ("messages_sent", "bytes_sent", "messages_received", "bytes_received",
                 "bodies_lent", "bodies_spread", "overtaken")

    def __init__(self) -> None:
        self.messages_sent = 0
        self.bytes_sent = 0
        self.messages_received = 0
        self.bytes_received = 0
        self.bodies_lent = 0
        self.bodies_spread = 0
        self.overtaken = 0

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


class Outgoing(NamedTuple):
    """One message to send.  ``token`` comes back in :meth:`MessageHandler.sent`."""

    header: bytes
    body: memoryview | None
    token: object
    lend: bool = True  # the body may be lent instead of copied (OpSpec.lend)
    lend_slow: bool = True  # ... while the ring copies slowly (OpSpec.lend_slow)
    spread: bool = False  # the lender copies half of a lent body (OpSpec.spread)


class LaneEnd(Protocol):
    """One peer's lane, as a transport keeps it (Transport._lane_ends): the transport's
    lane methods, for that peer."""

    lane_lock: threading.Lock
    # messages_sent / messages_received (taken) / bytes_sent / bytes_received
    lane_counts: dict[str, int]

    def lane_room(self) -> int: ...

    def lane_post(self, header: bytes, body: memoryview | None) -> bool: ...

    def lane_peek(self) -> tuple[Header, memoryview] | None: ...

    def lane_take(self, header: Header) -> None: ...

    def lane_wait(self, timeout: float) -> None: ...


class MessageHandler(Protocol):
    def next_outgoing(self, peer: int) -> Outgoing | None:
        """The next message for ``peer``, or None when there is nothing to send now."""

    def sent(self, peer: int, token: object) -> None:
        """The whole message has left this process (it sits in the kernel or on the wire)."""

    def body_buffer(self, peer: int, header: Header) -> memoryview:
        """A writable byte buffer of exactly ``header.nbytes`` for the body to land in."""

    def received(self, peer: int, header: Header, body: memoryview) -> None:
        """A whole message arrived; ``body`` is the buffer returned by body_buffer."""

    def received_view(self, peer: int, header: Header, body: memoryview) -> None:
        """A whole message whose body stays in the transport's memory (a shared-memory
        slot).  ``body`` is valid only during the call: reduce or copy it before returning.
        """

    def can_defer(self, peer: int, header: Header) -> bool:
        """Whether a DATA message still in the transport's memory (a shared-memory slot)
        may stay there, unread, until :meth:`Transport.resume`: its op is not known here
        yet and nothing here waits on anything queued behind it."""

    def overtaking(self, peer: int, front: Header) -> frozenset[tuple[int, int]] | None:
        """Which messages from ``peer`` posted behind ``front``, a slow one (a lent body),
        may be handled first (:meth:`received_ahead`): DATA of these ops (``op_key``s)
        whose body lies whole in the transport's memory; None when none may."""

    def lane_claims(self, peer: int, header: Header, behind: bool) -> bool:
        """Whether a DATA message in ``peer``'s lane is the loop's to handle now
        (:meth:`received_ahead`: a body from ``peer`` may be arriving the usual way
        meanwhile); ``behind``: other messages wait behind it.  One that is
        not stays, with what is behind it, for the thread that runs its op
        (engine/urgent.py)."""

    def pressing(self) -> bool:
        """Whether the handler has work waiting that a long copy should stop for (the
        transport goes on with the copy at its next poll)."""

    def received_ahead(self, peer: int, header: Header, body: memoryview) -> None:
        """:meth:`received_view` for a message that overtook others from ``peer``
        (:meth:`overtaking`), perhaps while the body of one of them is arriving into the
        buffer :meth:`body_buffer` gave for it."""

    def peer_lost(self, peer: int, reason: str, orderly: bool) -> None:
        """The link to ``peer`` ended.  ``orderly`` is True after the peer said goodbye."""


class Port(Protocol):
    """One peer's messages as the thread that drives posts and reads them
    (:meth:`Transport.port`): :meth:`Transport.post_now`, :meth:`Transport.peek` and
    :meth:`Transport.take` for that peer, without the transport's dispatch by peer."""

    def post_now(self, header: bytes, body: memoryview | None) -> bool: ...

    def peek(self) -> tuple[Header, memoryview | None] | None: ...

    def take(self, header: Header) -> None: ...


class Transport(abc.ABC):
    """Abstract base of tcp (and later shm/mpi) transports."""

    rank: int
    size: int
    counters: Counters
    # Each rank's host, numbered in the order of its first rank (so rank 0's is 0); None
    # where the transport does not know.  Algorithms that mind locality read it.
    hosts: tuple[int, ...] | None = None

    def stats(self) -> dict[str, int]:
        """Messages and bytes sent and received so far (see :class:`Counters`)."""
        return self.counters.as_dict()

    @abc.abstractmethod
    def start(self, handler: MessageHandler) -> None:
        """Attach the handler; after this, poll() may call it."""

    @abc.abstractmethod
    def want_send(self, peer: int) -> None:
        """The handler has something for ``peer``: pull it when the link can take it.

        Progress-thread only.
        """

    @abc.abstractmethod
    def poll(self, timeout: float | None) -> None:
        """Do all I/O that is possible now, blocking up to ``timeout`` if there is none.

        Errors of one link are reported through ``handler.peer_lost``; poll() itself raises
        only on a bug.
        """

    def post_now(self, peer: int, header: bytes, body: memoryview | None) -> bool:
        """Send one small message to ``peer`` at once, from the thread that drives, if
        that costs no more than a memory write (a shared-memory ring with room and no
        output of ours waiting); False, nothing sent, otherwise."""
        return False

    def peek(self, peer: int) -> tuple[Header, memoryview | None] | None:
        """The next message from ``peer`` if one has arrived, without taking it: with its
        body when it is a DATA message lying whole in this process's memory (a
        shared-memory slot, the MPI transport's header buffer, a socket link's staging
        buffer), to be handled in place and
        then freed by :meth:`take`; with
        None instead for anything else, which only poll() takes.  None when nothing has
        arrived, or where the transport cannot tell without a poll() (then always).  A
        thread waiting for one small op reads its messages this way, without a turn of
        poll() (engine/smallpath.py)."""
        return None

    def peeks(self, peer: int) -> bool:
        """Whether :meth:`peek` can show ``peer``'s messages (a ring's, MPI's, a
        socket's)."""
        return False

    def port(self, peer: int) -> Port | None:
        """``peer``'s :class:`Port`, where :meth:`peeks`; None elsewhere.  The same object
        for the transport's life: a caller running the same small op again and again
        keeps it."""
        return None

    def ring_room(self, peer: int) -> int:
        """Bytes of messages the ring to ``peer`` holds at once, headers included (0: no
        ring to it)."""
        return 0

    def ring_body(self, peer: int) -> int:
        """The biggest body the ring to ``peer`` holds whole (0: no ring to it)."""
        return 0

    def ring_beats_lending(self, peer: int) -> bool:
        """Whether a body out of small pages that the ring to ``peer`` holds whole goes
        faster through it than lent, by its copies' recent pace (copy_pace.py)."""
        return True

    def lends(self, peer: int) -> bool:
        """Whether a big body to ``peer`` would be lent now rather than copied through a
        ring that has been slow lately (copy_pace.py): the caller's thread, which cannot
        lend, should leave such a message to the loop."""
        return False

    def take(self, peer: int, header: Header) -> None:
        """The message from :meth:`peek` (``header``) has been handled: free it.  Besides
        a DATA message shown with its body, that may be one with no body at all (a
        READY), which the caller handled from its header alone."""
        raise NotImplementedError

    # Lending from the thread that drives (engine/express.py), where :meth:`peek` works:
    # the sender posts where its body is, the receiver's kernel copies it out, and the
    # sender's op ends once the receiver says so.

    def lends_body(self, peer: int, op_bytes: int, n: int) -> bool:
        """Whether a body of ``n`` bytes of an op of ``op_bytes`` to ``peer`` would be
        lent, by the size rule the loop's sends follow (TOTALREDUCE_CMA_BYTES)."""
        return False

    def lend_now(self, peer: int, header: bytes, body: memoryview, token: object,
                 spread: bool = False) -> bool:
        """Lend ``body`` to ``peer`` at once (as :meth:`post_now` sends one): ``token``
        comes back through ``handler.sent`` once the peer has copied it, and ``body`` must
        stay as it is until then.  ``spread``: this rank sits idle meanwhile, and copies
        half of it into the peer when asked (Outgoing.spread).  False, nothing sent, if it
        cannot go now."""
        return False

    def take_lent(self, peer: int, dest: memoryview) -> bool:
        """Copy the lent body of the DATA message :meth:`peek` showed from ``peer`` (its
        header flagged FLAG_REMOTE, no body) into ``dest``, then free the message and
        acknowledge the body.  False, nothing taken, if that cannot be done here."""
        return False

    def take_lent_front(self, peer: int, dest: memoryview) -> int:
        """:meth:`take_lent` but for the wait for the lender's half of a body its idle
        lender copies half of (FLAG_SPREAD): NOT_TAKEN, TAKEN (the body is whole in
        ``dest``), or the lend id to give :meth:`wait_pushed`.  A body taken is
        acknowledged either way."""
        return NOT_TAKEN

    def wait_pushed(self, peer: int, lend: int) -> bool:
        """Wait until ``peer`` says it copied its half of the body ``lend``
        (:meth:`take_lent_front`) into ours; False where it did not (the peer is then
        lost)."""
        return False

    def take_lent_each(self, peer: int, scratch: memoryview, nbytes: int,
                       each: Callable[[memoryview, int], None]) -> bool:
        """As :meth:`take_lent`, for a body of ``nbytes`` copied into ``scratch`` a slice
        of its size at a time, ``each(slice, offset)`` called after each one (where the
        slice is used at once, it is still in the cache).  False, nothing taken, if that
        cannot be done here, or where a copy failed part way (the peer is then lost)."""
        return False

    def take_ack(self, peer: int, header: Header) -> bool:
        """Take ``peer``'s reply to a lent body :meth:`peek` showed (``header``, of
        wire.LEND_REPLIES): RING_ACK, the body lent under its id has been copied (its
        token goes to ``handler.sent``); RING_PUSH, copy its back half into the peer
        now.  False, nothing taken, if it cannot be taken here."""
        return False

    # The lanes: a second channel each way to a peer (a small ring beside the ring, a
    # second connection, an MPI tag of its own), which a caller's thread reads and writes
    # itself while another thread drives the loop (engine/urgent.py).  Only such a
    # thread uses them; the loop reads the messages in this rank's lanes that the handler
    # claims (MessageHandler.lane_claims).  A transport with lanes keeps one LaneEnd per
    # peer in ``_lane_ends``; without, every peer has none.

    _lane_ends: Mapping[int, LaneEnd] = MappingProxyType({})

    def lane_room(self, peer: int) -> int:
        """The biggest body :meth:`lane_post` takes for ``peer``; 0: no lane to it."""
        end = self._lane_ends.get(peer)
        return 0 if end is None else end.lane_room()

    def lane_post(self, peer: int, header: bytes, body: memoryview | None) -> bool:
        """Post one DATA message into ``peer``'s lane (any thread); False, nothing sent,
        when it cannot go now."""
        end = self._lane_ends.get(peer)
        return end is not None and end.lane_post(header, body)

    def lane_lock(self, peer: int) -> threading.Lock:
        """The lock a thread holds while it reads ``peer``'s lane (:meth:`lane_peek`)."""
        return self._lane_ends[peer].lane_lock

    def lane_peek(self, peer: int) -> tuple[Header, memoryview] | None:
        """The oldest message in ``peer``'s lane, with its body (valid until
        :meth:`lane_take` or the lock is let go), or None."""
        end = self._lane_ends.get(peer)
        return None if end is None else end.lane_peek()

    def lane_take(self, peer: int, header: Header) -> None:
        """The message :meth:`lane_peek` showed (``header``) has been handled: free it."""
        self._lane_ends[peer].lane_take(header)

    def lane_sent(self, peer: int) -> int:
        """How many messages this rank has posted into ``peer``'s lane (0: no lane)."""
        end = self._lane_ends.get(peer)
        return 0 if end is None else end.lane_counts["messages_sent"]

    def drain_lane(self, peer: int, handler: MessageHandler, sent: int) -> None:
        """Hand ``handler`` every message ``peer``'s lane holds, as at the peer's end
        (MessageHandler.received_ahead), until ``sent`` messages in all have been taken
        from it (the peer's :meth:`lane_sent` at its goodbye) or :data:`LANE_DRAIN_TIME`
        passes: the peer said goodbye through its first channel, and what it sent through
        the lane before that must not seem lost behind the goodbye.  A second connection
        may deliver after the first (even on one host, the kernel does not order two
        sockets), so what is not there yet is waited for.  The loop's thread only."""
        end = self._lane_ends.get(peer)
        if end is None:
            return
        counts = end.lane_counts
        deadline = time.monotonic() + LANE_DRAIN_TIME
        while True:
            # A caller's thread holds the lock only to look at or apply one message.
            if not end.lane_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return
            try:
                while (record := end.lane_peek()) is not None:
                    header, body = record
                    handler.received_ahead(peer, header, body)
                    end.lane_take(header)
            finally:
                end.lane_lock.release()
            if counts["messages_received"] >= sent or time.monotonic() >= deadline:
                return
            end.lane_wait(LANE_DRAIN_TIME / 100)

    def lane_wait(self, peer: int, timeout: float) -> None:
        """Block, without the lane's lock, until something may have come into ``peer``'s
        lane or ``timeout`` passes (a spurious return is harmless)."""
        end = self._lane_ends.get(peer)
        if end is None:
            time.sleep(timeout)
        else:
            end.lane_wait(timeout)

    def crowded(self) -> bool:
        """Whether this host's ranks outnumber its cores: a thread waiting for a peer then
        gives its core away between looks (``os.sched_yield``), since the peer it waits
        for may need that very core, and a sleep costs a wake-up on every hop."""
        return False

    def spin_for(self) -> float:
        """How long a thread waiting for a peer's message should busy-poll
        (:meth:`peek`) before it blocks in poll(): long when every local rank can have a
        core of its own, short when they share cores, 0 where peek() sees nothing."""
        return 0.0

    def flush(self) -> None:
        """Write what can be written now, without reading or blocking."""
        self.poll(0)

    def can_wait(self) -> bool:
        """Whether :meth:`wait` can block for I/O without the drive lock."""
        return False

    def wait(self, timeout: float) -> None:
        """Block until poll() may have work (I/O ready, wake(), a timer due) or ``timeout``
        passes.  Does no I/O and touches no handler, so it may run beside a poll() on
        another thread; a spurious return is harmless."""
        raise NotImplementedError

    def has_backlog(self) -> bool:
        """True when output waits that only a later poll() will write (a full ring, a
        batch left by flush()), so a :meth:`wait` begun earlier must be woken."""
        return False

    def resume(self) -> None:
        """Read again the links where a message was left unread (see
        :meth:`MessageHandler.can_defer`).  Progress-thread only."""
        return  # a transport that never leaves a message unread has nothing to do

    @abc.abstractmethod
    def wake(self) -> None:
        """Make a blocked poll() return soon.  Safe from any thread."""

    @abc.abstractmethod
    def pending_output(self) -> bool:
        """True while some message is partly written."""

    def close_writes(self) -> bool:
        """Everything we will ever send is out (GOODBYE or ABORT last): end our side of
        every link.  Returns whether each peer's end will then be reported through
        ``handler.peer_lost`` (a socket's EOF), which a closing engine waits for so that
        it never closes with the peer's bytes unread."""
        return False

    @abc.abstractmethod
    def abort(self) -> None:
        """Immediate close, safe in ``finally`` blocks and from ``__del__``."""

