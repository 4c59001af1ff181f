"""The transport contract, checked from one rank's side: ``check_rank(transport)``.

Every transport must, for a handler that follows :class:`MessageHandler`:

* deliver every message to its peer exactly once, in the order sent on that link, with
  the header unchanged and the body byte for byte (empty bodies, odd sizes, bodies bigger
  than a ring record, bodies of ops big enough to be lent);
* call ``sent()`` once per message, after which the sender's buffer is free;
* ask ``body_buffer`` for exactly ``header.nbytes`` (or hand a view to ``received_view``);
* count what it moved (``stats()``) as whole messages, headers included;
* return from a blocked ``poll()`` soon after ``wake()`` from another thread;
* where it has a ``port()`` to every peer (the thread that drives sends and reads small
  messages itself): deliver what ``post_now`` sent, shown by ``peek`` with its body, and
  show a big message the loop sent either with its body or without it, for ``poll()`` to
  deliver;
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
# The port's messages: bodies posted with post_now, then one the loop sends, bigger than
# some transports show in place.  Their seqs follow the script's.
PORT_SIZES = [0, 5, 200]
PORT_BIG = 70_000
_PORT_SEQ = len(SIZES)
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
        self.posted_bytes: list[int] = []  # messages sent with post_now, headers included
        self.ported = False  # the port's messages went and came (check_port)
        self.shown = 0  # of them, small ones peek showed

    def size_of(self, seq: int) -> int:
        """The body size of this rank's DATA message ``seq``."""
        if seq < len(SIZES):
            return SIZES[seq]
        return PORT_BIG if seq == _PORT_SEQ + len(PORT_SIZES) else PORT_SIZES[seq - _PORT_SEQ]

    def extra(self) -> int:
        """Messages each way per peer beyond the script's (the port's)."""
        return len(PORT_SIZES) + 1 if self.ported else 0

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
    _check_port(transport, rec, deadline)
    _check_counts(transport, rec)

    # An orderly end: GOODBYE last, then our write side closes; every peer's end is
    # reported once, as orderly.
    rec.say_goodbye(transport)
    # A peer says goodbye only once it has everything of ours: after every peer's, none
    # needs anything more from us.
    extra = rec.extra()
    _poll_until(transport, lambda: len(rec.sent_tokens) == (len(SIZES) + 1 + (
                extra and 1)) * len(rec.peers) and not transport.pending_output() and all(
                    len(rec.got[p]) == len(SIZES) + 1 + extra for p in rec.peers),
                deadline, "the goodbyes")
    if transport.close_writes():
        _poll_until(transport, lambda: len(rec.lost) == len(rec.peers), deadline,
                    "the peers' ends")
        assert all(rec.lost.values()), rec.lost
    stats = _check_counts(transport, rec)
    transport.abort()
    return dict(stats, ported=int(rec.ported), shown=rec.shown)


def _check_port(transport: Transport, rec: Recorder, deadline: float) -> None:
    """Small messages sent by the thread that drives (post_now) and read with ``peek``
    and ``take``, then a big one the loop sends: each arrives once, whole, in order.
    Shown by ``peek``, or delivered by ``poll()`` where it came in during one (this
    rank's earlier polls may take a faster peer's) or where the port leaves it to the
    loop (a body it does not show in place).  The rank that gets here first polls
    nothing while its peers post, so it is shown every small message (``rec.shown``)."""
    ports = {p: transport.port(p) for p in rec.peers}
    if any(port is None for port in ports.values()):
        return
    rank = rec.rank
    big = _PORT_SEQ + len(PORT_SIZES)
    expected = {p: [(_header(p, rank, _PORT_SEQ + j, n), _body(p, rank, _PORT_SEQ + j, n))
                    for j, n in enumerate([*PORT_SIZES, PORT_BIG])] for p in rec.peers}
    checked = dict.fromkeys(rec.peers, len(SIZES))  # entries of rec.got checked

    def take_delivered(p: int) -> None:
        # What the loop delivered (after it, a peer that is done may say goodbye).
        while checked[p] < min(len(rec.got[p]), len(SIZES) + len(expected[p])):
            k = checked[p] - len(SIZES)
            assert rec.got[p][checked[p]] == expected[p][k], (rank, p, k)
            checked[p] += 1

    for p, port in ports.items():
        assert port is not None
        for j, n in enumerate(PORT_SIZES):
            body = _body(rank, p, _PORT_SEQ + j, n)
            header = _header(rank, p, _PORT_SEQ + j, n).pack()
            while not port.post_now(header, memoryview(bytearray(body)) if n else None):
                if time.monotonic() > deadline:
                    raise AssertionError(f"rank {rank}: post_now to {p} never went")
            rec.posted_bytes.append(HEADER_SIZE + n)
    # The small ones: no poll() meanwhile, so what comes now is shown.
    for p, port in ports.items():
        assert port is not None
        take_delivered(p)
        while checked[p] < len(SIZES) + len(PORT_SIZES):
            if time.monotonic() > deadline:
                raise AssertionError(f"rank {rank}: posted messages from {p} did not come")
            record = port.peek()
            if record is None:
                continue
            header, body = record
            want_header, want_body = expected[p][checked[p] - len(SIZES)]
            assert header == want_header, (rank, p, header)
            assert body is not None and bytes(body) == want_body, (rank, p, header)
            rec.got[p].append((header, bytes(body)))
            port.take(header)
            checked[p] += 1
            rec.shown += 1
    # The big one, through the loop: shown with its body, or left to poll().
    for p in rec.peers:
        rec.queue[p].append((_header(rank, p, big, PORT_BIG), _body(rank, p, big, PORT_BIG)))
        transport.want_send(p)
    left: set[int] = set()
    while any(checked[p] < len(SIZES) + len(expected[p]) for p in rec.peers):
        if time.monotonic() > deadline:
            raise AssertionError(f"rank {rank}: the big messages did not come: {checked}")
        transport.flush()  # ours go (a ring's next chunks)
        for p, port in ports.items():
            assert port is not None
            before = checked[p]
            take_delivered(p)
            if checked[p] > before:
                left.discard(p)
            if checked[p] == len(SIZES) + len(expected[p]) or p in left:
                continue
            record = port.peek()
            if record is None:
                continue
            header, body = record
            # Its flags may say how the transport carries it (a ring's chunks, say).
            assert header._replace(flags=0) == expected[p][-1][0], (rank, p, header)
            if body is None:  # the loop's to take, as the small path leaves it
                left.add(p)
                transport.resume()
                continue
            assert bytes(body) == expected[p][-1][1], f"rank {rank}: big body from {p}"
            rec.got[p].append((header, bytes(body)))
            port.take(header)
            checked[p] += 1
        # A message the loop began reading (its body in part) is shown to no peek.
        transport.poll(0.001 if not left else 0)
    _poll_until(transport, lambda: len(rec.sent_tokens) == (len(SIZES) + 1) *
                len(rec.peers), deadline, "the port's big messages to go")
    rec.ported = True


def _check_counts(transport: Transport, rec: Recorder) -> dict[str, int]:
    """The transport's counters agree with what the handler saw go and come (a peer may
    be a step ahead: its goodbye can be in already)."""
    stats = transport.stats()
    sent = len(rec.sent_tokens) + len(rec.posted_bytes)
    sent_bytes = sum(HEADER_SIZE + (rec.size_of(i) if i >= 0 else 0)
                     for _p, i in rec.sent_tokens) + sum(rec.posted_bytes)
    got = [msg for p in rec.peers for msg in rec.got[p]]
    assert (stats["messages_sent"], stats["bytes_sent"]) == (sent, sent_bytes), stats
    assert stats["messages_received"] == len(got), stats
    assert stats["bytes_received"] == sum(HEADER_SIZE + len(b) for _h, b in got), stats
    return stats
