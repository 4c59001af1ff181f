"""A socket link's port (transport/socket_link.py) on its own: what the thread that
drives sends with ``post_now`` and reads with ``peek``/``take``, and what it leaves to the
loop's ``read()``/``write()``.  The transport-wide contract (contract.py) runs the same
port between real ranks; here the stream is split and stalled on purpose."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from totalreduce.transport.base import Counters, Outgoing
from totalreduce.transport.socket_link import Link
from totalreduce.transport.wire import HEADER_SIZE, Header, Kind


class _Owner:
    """A transport's side of a link, recording what the link asks of it."""

    def __init__(self) -> None:
        self.counters = Counters()
        self.shm_counters = Counters()
        self.pending: set[int] = set()
        self.staged: set[Link] = set()
        self.got: list[tuple[Header, bytes]] = []
        self.sent_tokens: list[object] = []
        self.queue: list[Outgoing] = []
        self.lost_reasons: list[str] = []
        self.writing: list[bool] = []
        self.handler: Any = self

    # MessageHandler
    def next_outgoing(self, peer: int) -> Outgoing | None:
        return self.queue.pop(0) if self.queue else None

    def sent(self, peer: int, token: object) -> None:
        self.sent_tokens.append(token)

    def body_buffer(self, peer: int, header: Header) -> memoryview:
        return memoryview(bytearray(header.nbytes))

    def received(self, peer: int, header: Header, body: memoryview) -> None:
        self.got.append((header, bytes(body)))

    # LinkOwner
    def again(self, peer: int) -> None:
        self.pending.add(peer)

    def set_writing(self, link: Link, on: bool) -> None:
        link.writing = on
        self.writing.append(on)

    def lost(self, link: Link, reason: str, orderly: bool = False) -> None:
        link.closed = True
        self.lost_reasons.append(reason)

    def wake(self) -> None:
        pass


def _header(step: int, n: int, kind: Kind = Kind.DATA) -> Header:
    return Header(kind, 6, 0, step, 1, 2, 3, 0, n, n)


@pytest.fixture
def pair() -> Any:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    yield a, b
    a.close()
    b.close()


def test_peek_shows_a_message_once_whole_and_take_moves_past_it(pair: Any) -> None:
    raw, theirs = pair
    owner = _Owner()
    link = Link(owner, 1, theirs)
    body = bytes(range(256)) * 4 + b"odd"
    data = _header(4, len(body)).pack() + body
    raw.sendall(data[:HEADER_SIZE + 10])
    assert link.peek() is None  # the header is in, the body not yet
    raw.sendall(data[HEADER_SIZE + 10:] + _header(5, 0, Kind.READY).pack())
    header, shown = link.peek()
    assert header == _header(4, len(body)) and shown is not None and bytes(shown) == body
    assert link.peek()[0] == header  # shown again until taken
    link.take(header)
    header, shown = link.peek()
    assert header.kind == Kind.READY and shown is None  # no body: handled from its header
    link.take(header)
    assert link.peek() is None
    assert owner.counters.messages_received == 2
    assert owner.counters.bytes_received == 2 * HEADER_SIZE + len(body)
    assert owner.got == []  # nothing went through the loop's delivery


def test_what_peek_received_and_left_is_delivered_by_read_without_new_bytes(pair: Any
                                                                          ) -> None:
    raw, theirs = pair
    owner = _Owner()
    link = Link(owner, 1, theirs)
    big = bytes(300 << 10)  # more than the staging buffer shows in place
    raw.sendall(_header(1, 7).pack() + b"seven!!" + _header(2, len(big)).pack())
    header, shown = link.peek()
    assert header.step == 1 and bytes(shown) == b"seven!!"
    # Left for the loop, as the small path leaves another op's message.
    assert owner.staged == {link}
    link.read()  # the socket holds nothing new: the staged bytes are parsed all the same
    assert owner.got == [(_header(1, 7), b"seven!!")]
    assert link.peek() is None  # the big body has begun: only the loop reads on
    sent = 0
    while sent < len(big):
        sent += raw.send(big[sent:])
        link.read()
    assert owner.got[1] == (_header(2, len(big)), big)


def test_a_post_the_kernel_takes_in_part_finishes_from_the_loop_in_order(pair: Any
                                                                       ) -> None:
    mine, theirs = pair
    mine.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    owner = _Owner()
    link = Link(owner, 1, mine)
    filler = b"f" * (64 << 10)
    gone = 0
    try:
        while True:  # fill the kernel's buffers, leaving a little room
            gone += mine.send(filler[:1024])
    except BlockingIOError:
        pass
    theirs.recv(2048)
    body = bytearray(b"b" * (128 << 10))
    assert link.post_now(_header(9, len(body)).pack(), memoryview(body))
    assert link.out, "the kernel took the whole post: the test needs a fuller buffer"
    body[:] = b"X" * len(body)  # the caller may write over its body at once
    # Nothing passes the rest: further posts wait for it.
    assert not link.post_now(_header(10, 0).pack(), None)
    got = bytearray()
    want = gone - 2048 + HEADER_SIZE + (128 << 10)
    while len(got) < want:
        try:
            got += theirs.recv(1 << 20)
        except BlockingIOError:
            link.write()
    assert link.out == type(link.out)() and owner.writing[-1] is False
    assert owner.sent_tokens == [None]  # the rest's mark, no op's token
    assert bytes(got[gone - 2048:]) == _header(9, 128 << 10).pack() + b"b" * (128 << 10)
    assert link.post_now(_header(10, 0).pack(), None)


def test_posts_refuse_while_output_of_ours_waits_and_bodies_past_the_bound(pair: Any
                                                                         ) -> None:
    mine, _ = pair
    owner = _Owner()
    link = Link(owner, 1, mine)
    owner.pending.add(1)  # the outbox has messages for the peer the loop has not sent
    assert not link.post_now(_header(1, 0).pack(), None)
    owner.pending.clear()
    assert not link.post_now(_header(1, 1 << 20).pack(), memoryview(bytes(1 << 20)))
    assert owner.counters.messages_sent == 0
    assert link.post_now(_header(1, 3).pack(), memoryview(b"abc"))
    assert owner.counters.messages_sent == 1


def test_the_end_of_the_connection_met_by_peek_is_reported_by_read(pair: Any) -> None:
    raw, theirs = pair
    owner = _Owner()
    link = Link(owner, 1, theirs)
    raw.close()
    assert link.peek() is None
    assert owner.staged == {link} and owner.lost_reasons == []  # the loop reports it
    link.read()
    assert owner.lost_reasons == ["connection closed by peer"]
