"""A lane over a socket (transport/socket_lane.py) on its own: messages come out whole
and in order however the stream splits them, the loop's reads take only what the handler
claims, the peer's end hands over everything left and closes the lane, and a goodbye
waits for the lane messages it says were sent before it."""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from totalreduce.transport.base import Transport
from totalreduce.transport.socket_lane import LANE_BODY, SocketLane
from totalreduce.transport.wire import Header, Kind


class _Owner:
    def __init__(self, claim: set[int]) -> None:
        self.claim = claim  # the steps the handler claims
        self.got: list[tuple[int, bytes]] = []
        self.woken = 0
        self.ended: list[SocketLane] = []
        self.behind: list[bool] = []
        self.handler: Any = self

    def lane_claims(self, peer: int, header: Header, behind: bool) -> bool:
        self.behind.append(behind)
        return header.step in self.claim

    def received_ahead(self, peer: int, header: Header, body: memoryview) -> None:
        self.got.append((header.step, bytes(body)))

    def wake(self) -> None:
        self.woken += 1

    def lane_ended(self, lane: SocketLane) -> None:
        self.ended.append(lane)
        lane.close()


def _msg(step: int, body: bytes) -> bytes:
    return Header(Kind.DATA, 6, 0, step, 1, 2, 3, 0, len(body), len(body)).pack() + body


@pytest.fixture
def pair() -> Any:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_a_message_shows_only_once_whole(pair: Any) -> None:
    raw, theirs = pair
    lane = SocketLane(_Owner(set()), 1, theirs)
    data = _msg(4, b"x" * 1000)
    raw.sendall(data[:70])  # the header and a few body bytes
    with lane.lane_lock:
        assert lane.lane_peek() is None
    raw.sendall(data[70:] + _msg(5, b"yz"))
    with lane.lane_lock:
        header, body = lane.lane_peek()
        assert header.step == 4 and bytes(body) == b"x" * 1000
        lane.lane_take(header)
        header, body = lane.lane_peek()
        assert header.step == 5 and bytes(body) == b"yz"
        lane.lane_take(header)
        assert lane.lane_peek() is None
    assert lane.lane_counts["messages_received"] == 2


def test_posts_arrive_in_order_and_big_bodies_are_refused(pair: Any) -> None:
    mine, theirs = pair
    out = SocketLane(_Owner(set()), 1, mine)
    into = SocketLane(_Owner(set()), 0, theirs)
    assert not out.lane_post(Header(Kind.DATA, nbytes=LANE_BODY + 1).pack(),
                             memoryview(bytes(LANE_BODY + 1)))
    for step in range(20):
        body = bytes([step]) * (step * 300)
        header = Header(Kind.DATA, 6, 0, step, 1, 2, 3, 0, len(body), len(body)).pack()
        assert out.lane_post(header, memoryview(body) if body else None)
    seen = []
    with into.lane_lock:
        while (record := into.lane_peek()) is not None:
            header, body = record
            seen.append((header.step, bytes(body)))
            into.lane_take(header)
    assert seen == [(s, bytes([s]) * (s * 300)) for s in range(20)]
    assert out.lane_counts["messages_sent"] == 20


def test_the_loop_takes_what_it_claims_and_all_at_the_end(pair: Any) -> None:
    raw, theirs = pair
    owner = _Owner({1})
    lane = SocketLane(owner, 1, theirs)
    raw.sendall(_msg(1, b"a") + _msg(2, b"b") + _msg(1, b"c"))
    lane.read()
    # The first is claimed; the second is not (a caller's thread will take it), and the
    # third waits behind it.  The handler is told whether others wait behind each.
    assert owner.got == [(1, b"a")] and owner.behind == [True, True]
    with lane.lane_lock:
        header, _body = lane.lane_peek()
        assert header.step == 2
        lane.lane_take(header)
    assert lane.recheck and owner.woken == 1  # the loop must look again
    lane.read()
    assert owner.got == [(1, b"a"), (1, b"c")] and not lane.recheck
    assert owner.behind[-1] is False
    raw.sendall(_msg(7, b"d") + _msg(8, b"e" * 100)[:80])  # then the peer's end, mid-message
    raw.close()
    lane.read()
    assert owner.got[-1] == (7, b"d")  # unclaimed, but the peer has gone
    assert owner.ended == [lane] and lane.closed
    with lane.lane_lock:
        assert lane.lane_peek() is None


def test_what_is_not_a_lane_message_closes_the_lane(pair: Any) -> None:
    raw, theirs = pair
    owner = _Owner({1})
    lane = SocketLane(owner, 1, theirs)
    raw.sendall(Header(Kind.READY).pack())
    lane.read()
    assert owner.ended == [lane] and owner.got == []


def test_a_goodbye_waits_for_the_lane_messages_it_counts(pair: Any) -> None:
    # The peer's goodbye came through its first connection while its last lane message
    # was still on the way (two sockets are not ordered): the drain waits for the count
    # the goodbye carries, and hands over every message, claimed or not.
    raw, theirs = pair
    owner = _Owner(set())
    lane = SocketLane(owner, 1, theirs)
    transport = SimpleNamespace(_lane_ends={1: lane})
    raw.sendall(_msg(1, b"a"))
    late = threading.Timer(0.05, lambda: raw.sendall(_msg(2, b"b")))
    late.start()
    holder = threading.Thread(target=_hold, args=(lane.lane_lock, 0.02))
    holder.start()  # a caller's thread looking at the lane meanwhile
    Transport.drain_lane(transport, 1, owner, 2)  # type: ignore[arg-type]
    late.join()
    holder.join()
    assert owner.got == [(1, b"a"), (2, b"b")]
    assert lane.lane_counts["messages_received"] == 2
    # Nothing more was sent: no wait.
    Transport.drain_lane(transport, 1, owner, 2)  # type: ignore[arg-type]
    assert owner.got == [(1, b"a"), (2, b"b")]


def _hold(lock: threading.Lock, seconds: float) -> None:
    with lock:
        time.sleep(seconds)
