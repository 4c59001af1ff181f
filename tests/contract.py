"""The transport contract, checked from one rank's side: ``check_rank(transport)``.

Every transport must, for a handler that follows :class:`MessageHandler`:

* deliver every message to its peer exactly once, in the order sent on that link, with
  the header unchanged and the body byte for byte (empty bodies, odd sizes, bodies bigger
  than a ring record, bodies of ops big enough to be lent);
* call ``sent()`` once per message, after which the sender's buffer is free;
* ask ``body_buffer`` for exactly ``header.nbytes`` (or hand a view to ``received_view``);
* count what it moved (``stats()``) as whole messages, headers included;
* return from a blocked ``poll()`` soon after ``wake()`` from another thread;
* after a GOODBYE and ``close_writes()``, report each peer's end as orderly.

Every rank of a job runs it at once; the ranks need nothing else in common.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from totalreduce.transport.base import Outgoing, Transport
from totalreduce.transport.wire import HEADER_SIZE, Header, Kind

# Body sizes: empty, odd, a segment, more than a ring record, an op big enough to lend.
SIZES = [0, 1, 63, 4097, 70_000, 3 << 20, 0, 129]
_BIG_OP = 40 << 20  # bytes the lent-size bodies claim their op has (count * 4)


def _body(src: int, dst: int, i: int, n: int) -> bytes:
    pattern = bytes((src * 31 + dst * 7 + i * 13 + k) % 251 for k in range(251))
    return (pattern * (n // 251 + 1))[:n]


def _header(src: int, dst: int, i: int, n: int) -> Header:
    count = _BIG_OP // 4 if n >= 65536 else max(n // 4, 1)
    return Header(Kind.DATA, 6, 0, step=i, name_key=1000 * src + dst, seq=i, sig=src,
                  piece=i, nbytes=n, count=count)


class Recorder:
    """A MessageHandler that sends a fixed script and records everything it is told."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.peers = [p for p in range(size) if p != rank]
        self.queue: dict[int, deque[tuple[Header, bytes]]] = {
            p: deque((_header(rank, p, i, n), _body(rank, p, i, n))
                     for i, n in enumerate(SIZES)) for p in self.peers}
        self.sent_tokens: list[tuple[int, int]] = []
        self.got: dict[int, list[tuple[Header, bytes]]] = {p: [] for p in self.peers}
        self.lost: dict[int, bool] = {}
        self._buffers: dict[int, tuple[Header, bytearray]] = {}

    def say_goodbye(self, transport: Transport) -> None:
        for p in self.peers:
            self.queue[p].append((Header(Kind.GOODBYE), b""))
            transport.want_send(p)

    def next_outgoing(self, peer: int) -> Outgoing | None:
        if not self.queue[peer]:
            return None
        header, body = self.queue[peer].popleft()
        # A fresh buffer per message: ``sent()`` says when the transport is done with it.
        return Outgoing(header.pack(), memoryview(bytearray(body)) if body else None,
                        (peer, header.seq if header.kind == Kind.DATA else -1))

    def sent(self, peer: int, token: object) -> None:
        assert isinstance(token, tuple) and token[0] == peer, token
        self.sent_tokens.append(token)

    def body_buffer(self, peer: int, header: Header) -> memoryview:
        buf = bytearray(header.nbytes)
        self._buffers[peer] = (header, buf)
        return memoryview(buf)

    def received(self, peer: int, header: Header, body: memoryview) -> None:
        expected_header, buf = self._buffers.pop(peer)
        assert expected_header == header, (expected_header, header)
        assert body.obj is buf or bytes(body) == bytes(buf)
        self.got[peer].append((header, bytes(body)))

    def received_view(self, peer: int, header: Header, body: memoryview) -> None:
        assert body.nbytes == header.nbytes
        self.got[peer].append((header, bytes(body)))

    def can_defer(self, peer: int, header: Header) -> bool:
        return False

    def overtaking(self, peer: int, front: Header) -> None:
        return None

    def pressing(self) -> bool:
        return False

    def received_ahead(self, peer: int, header: Header, body: memoryview) -> None:
        raise AssertionError("no message may overtake another here")

    def peer_lost(self, peer: int, reason: str, orderly: bool) -> None:
        assert peer not in self.lost, f"peer {peer} reported lost twice"
        self.lost[peer] = orderly

    def all_in(self) -> bool:
        return all(len(self.got[p]) >= len(SIZES) for p in self.peers)


def _poll_until(transport: Transport, done: object, deadline: float, what: str) -> None:
    while not done():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"rank {transport.rank}: timed out waiting for {what}")
        transport.poll(0.05)


def check_rank(transport: Transport, timeout: float = 60.0) -> dict[str, int]:
    """Run the contract on this rank; returns the transport's stats at the end."""
    rank, size = transport.rank, transport.size
    rec = Recorder(rank, size)
    transport.start(rec)
    deadline = time.monotonic() + timeout
    for p in rec.peers:
        transport.want_send(p)
    _poll_until(transport, lambda: rec.all_in() and len(rec.sent_tokens) == len(SIZES) *
                len(rec.peers), deadline, "the script's messages")
    for p in rec.peers:
        got = rec.got[p][:len(SIZES)]
        for i, n in enumerate(SIZES):
            header, body = got[i]
            assert header == _header(p, rank, i, n), (p, i, header)
            assert body == _body(p, rank, i, n), f"rank {rank}: body {i} from {p} differs"
    tokens = sorted(rec.sent_tokens)
    assert tokens == sorted((p, i) for p in rec.peers for i in range(len(SIZES))), tokens

    # wake() from another thread ends a blocked poll() soon.
    timer = threading.Timer(0.2, transport.wake)
    start = time.monotonic()
    timer.start()
    transport.poll(60.0)
    woke_after = time.monotonic() - start
    timer.join()
    assert woke_after < 30.0, f"poll(60) returned {woke_after:.1f} s after wake()"

    _check_counts(transport, rec)

    # An orderly end: GOODBYE last, then our write side closes; every peer's end is
    # reported once, as orderly.
    rec.say_goodbye(transport)
    # A peer says goodbye only once it has everything of ours: after every peer's, none
    # needs anything more from us.
    _poll_until(transport, lambda: len(rec.sent_tokens) == (len(SIZES) + 1) *
                len(rec.peers) and not transport.pending_output() and all(
                    len(rec.got[p]) == len(SIZES) + 1 for p in rec.peers), deadline,
                "the goodbyes")
    if transport.close_writes():
        _poll_until(transport, lambda: len(rec.lost) == len(rec.peers), deadline,
                    "the peers' ends")
        assert all(rec.lost.values()), rec.lost
    stats = _check_counts(transport, rec)
    transport.abort()
    return stats


def _check_counts(transport: Transport, rec: Recorder) -> dict[str, int]:
    """The transport's counters agree with what the handler saw go and come (a peer may
    be a step ahead: its goodbye can be in already)."""
    stats = transport.stats()
    sent = len(rec.sent_tokens)
    sent_bytes = sum(HEADER_SIZE + (SIZES[i] if i >= 0 else 0) for _p, i in rec.sent_tokens)
    got = [msg for p in rec.peers for msg in rec.got[p]]
    assert (stats["messages_sent"], stats["bytes_sent"]) == (sent, sent_bytes), stats
    assert stats["messages_received"] == len(got), stats
    assert stats["bytes_received"] == sum(HEADER_SIZE + len(b) for _h, b in got), stats
    return stats
