"""Cross-memory attach: reading a buffer by address, the probe, the errors, and a ring
link copying a lent body in slices."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from totalreduce.transport import cma
from totalreduce.transport.base import Counters
from totalreduce.transport.mesh import _probe
from totalreduce.transport.ring_link import RingLink
from totalreduce.transport.ring_push import push_front
from totalreduce.transport.shmring import RingReader, RingWriter
from totalreduce.transport.wire import FLAG_REMOTE, REMOTE_BODY, Header, Kind

pytestmark = pytest.mark.skipif(not cma.cma_works(), reason="process_vm_readv not allowed")


def test_read_into_copies_the_bytes_at_an_address() -> None:
    src = np.arange(100_003, dtype=np.float32)
    dest = bytearray(src.nbytes)
    cma.read_into(os.getpid(), memoryview(dest), cma.address_of(src))
    assert np.array_equal(np.frombuffer(dest, np.float32), src)
    cma.read_into(os.getpid(), memoryview(bytearray(0)), 0)  # nothing to read: no call


def test_a_range_that_is_not_mapped_is_an_error_not_garbage() -> None:
    with pytest.raises(OSError, match="process_vm_readv from pid"):
        cma.read_into(os.getpid(), memoryview(bytearray(4096)), 4096)
    with pytest.raises(OSError, match="process_vm_writev to pid"):
        cma.write_from(os.getpid(), memoryview(bytearray(4096)), 4096)


def test_write_from_copies_the_bytes_to_an_address_and_no_further() -> None:
    src = np.arange(70_001, dtype=np.float32)
    dest = np.full(src.size + 3, -1.0, np.float32)
    cma.write_from(os.getpid(), src.data.cast("B"), cma.address_of(dest))
    assert np.array_equal(dest[:src.size], src) and np.all(dest[src.size:] == -1)
    cma.write_from(os.getpid(), memoryview(bytearray(0)), 0)  # nothing to write: no call


def test_read_rate_is_a_copy_speed_and_zero_where_nothing_can_be_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rate = cma.read_rate()
    # Bytes per second: any host reads 512 KiB in well under a second and over 1 ns.
    assert 512 << 10 < rate < 512e12
    monkeypatch.setattr(cma, "_readv", None)
    assert cma.read_rate() == 0.0


def test_probe_needs_the_right_token_the_right_pid_and_a_whole_offer() -> None:
    token = os.urandom(16)
    buf = bytearray(token)
    addr = cma.address_of(buf)
    assert cma.probe(os.getpid(), addr, token)
    assert not cma.probe(os.getpid(), addr, os.urandom(16))
    offer = {"pid": os.getpid(), "probe": addr, "token": token.hex()}
    assert _probe(offer)
    assert not _probe(dict(offer, pid=2**22 + 12345))  # no such process
    assert not _probe({"pid": os.getpid(), "probe": addr})
    assert not _probe(dict(offer, token="zz"))
    assert not _probe(dict(offer, token=token.hex()[:8]))


class _Owner:
    """A RingLink's transport, recording what the link hands its handler."""

    def __init__(self, urgent: frozenset[tuple[int, int]] | None, pressing: list[bool]
                 ) -> None:
        self.counters = Counters()
        self.shm_counters = Counters()
        self.pending: set[int] = set()
        self.handler = self
        self.events: list[tuple[str, int, bytes]] = []
        self.dest = bytearray(0)
        self._urgent = urgent
        self._pressing = pressing  # answers to pressing(), in order; then False
        self.defer = False

    # the handler's side
    def overtaking(self, peer: int, front: Header) -> frozenset[tuple[int, int]] | None:
        return self._urgent

    def pressing(self) -> bool:
        return self._pressing.pop(0) if self._pressing else False

    def body_buffer(self, peer: int, header: Header) -> memoryview:
        self.dest = bytearray(header.nbytes)
        return memoryview(self.dest)

    def received(self, peer: int, header: Header, body: memoryview) -> None:
        self.events.append(("whole", header.seq, bytes(body)))

    def received_view(self, peer: int, header: Header, body: memoryview) -> None:
        self.events.append(("in ring", header.seq, bytes(body)))

    def received_ahead(self, peer: int, header: Header, body: memoryview) -> None:
        self.events.append(("ahead", header.seq, bytes(body)))

    def can_defer(self, peer: int, header: Header) -> bool:
        return self.defer

    def sent(self, peer: int, token: object) -> None:
        self.events.append(("sent", 0, repr(token).encode()))

    # the transport's side
    def again(self, peer: int) -> None:
        pass

    def lost(self, link: object, reason: str, orderly: bool = False) -> None:
        raise AssertionError(reason)


@contextlib.contextmanager
def _lent_link(owner: _Owner) -> Iterator[tuple[RingLink, RingWriter, RingReader]]:
    """A link reading what the writer it gives posts, lent bodies copied out of this
    process; the reader it gives shows what the link posts back.  All closed on exit."""
    socks = socket.socketpair()
    out_w = RingWriter(1 << 16)
    out_r = RingReader(out_w.name, 1 << 16)  # where the link's acknowledgements go
    in_w = RingWriter(1 << 16)
    in_r = RingReader(in_w.name, 1 << 16)
    for w in (out_w, in_w):
        w.unlink()
    in_r.lender_pid = os.getpid()
    link = RingLink(owner, 1, socks[0], out_w, in_r, 1)  # type: ignore[arg-type]
    try:
        yield link, in_w, out_r
    finally:
        link.close_rings()
        in_w.close()
        out_r.close()
        for sock in socks:
            sock.close()


def _lend(writer: RingWriter, body: np.ndarray, seq: int) -> None:
    header = Header(Kind.DATA, 1, FLAG_REMOTE, 0, 7, seq, 0, 0, body.nbytes, body.nbytes)
    assert writer.post(header.pack(), memoryview(REMOTE_BODY.pack(cma.address_of(body), 0)))


def test_a_lent_copy_stops_between_slices_and_goes_on_where_it_stopped() -> None:
    # A lent body is copied slice by slice; the copy stops when the handler has work
    # waiting (pressing) or an urgent message behind it was handled, and the next read
    # goes on from there: nothing read twice, nothing behind it read before it but the
    # urgent message, and the acknowledgement goes out once, with the whole body.
    body = np.random.default_rng(0).integers(0, 255, (5 << 20) + 77, np.uint8)
    urgent_key = (7, 2)
    owner = _Owner(frozenset({urgent_key}), [True])
    with _lent_link(owner) as (link, writer, acks):
        _read_in_slices(link, writer, acks, owner, body)


@pytest.mark.parametrize(("mib", "calls"), [(5, 6), (40, 8)])
def test_a_lent_body_comes_in_1_mib_slices_but_in_eight_at_most(
        monkeypatch: pytest.MonkeyPatch, mib: int, calls: int) -> None:
    # Each slice is a read that pins the lender's pages afresh: a reduction's piece comes
    # in 1 MiB slices, a 2-rank gather's big lent piece in eight; the body arrives whole
    # and right either way, acknowledged once.
    body = np.random.default_rng(mib).integers(0, 255, (mib << 20) + 77, np.uint8)
    reads: list[int] = []
    read_into = cma.read_into

    def counted(pid: int, dest: memoryview, address: int) -> None:
        reads.append(dest.nbytes)
        read_into(pid, dest, address)

    monkeypatch.setattr(cma, "read_into", counted)
    owner = _Owner(None, [])
    with _lent_link(owner) as (link, writer, acks):
        _lend(writer, body, 1)
        link.read_ring()
        assert link.lent_in is None
        assert owner.events == [("whole", 1, body.tobytes())]
        # 5 MiB + 77 B: five slices of 1 MiB and one of 77 B; 40 MiB + 77 B: eight.
        assert len(reads) == calls and sum(reads) == body.nbytes, reads
        assert reads[0] == max(1 << 20, -(-body.nbytes // 8))
        record = acks.next()
        assert record is not None and record[0].kind == Kind.RING_ACK
        acks.release()
        assert acks.next() is None


def _read_in_slices(link: RingLink, writer: RingWriter, acks: RingReader, owner: _Owner,
                    body: np.ndarray) -> None:
    _lend(writer, body, 1)
    link.read_ring()  # one slice, then it stops for the pressing work
    assert link.lent_in is not None and 0 < link.lent_in.done < body.nbytes
    assert owner.events == [] and link.peek() is None
    done = link.lent_in.done
    small = np.arange(16, dtype=np.uint8)
    assert writer.post(Header(Kind.DATA, 1, 0, 0, 7, 2, 0, 0, 16, 16).pack(),
                       memoryview(small))
    assert writer.post(Header(Kind.DATA, 1, 0, 0, 7, 3, 0, 0, 16, 16).pack(),
                       memoryview(small + 1))
    link.read_ring()  # the urgent message overtakes before any more is copied
    assert owner.events == [("ahead", 2, small.tobytes())]
    assert link.lent_in is not None and link.lent_in.done == done
    assert acks.next() is None  # not acknowledged while in part
    while link.lent_in is not None:
        link.read_ring()
    link.read_ring()  # what was posted behind it
    kinds = [kind for kind, *_rest in owner.events]
    assert kinds == ["ahead", "whole", "in ring"], kinds
    assert owner.events[1] == ("whole", 1, body.tobytes())
    assert owner.events[2] == ("in ring", 3, (small + 1).tobytes())  # after the body
    record = acks.next()
    assert record is not None and record[0].kind == Kind.RING_ACK
    acks.release()
    assert acks.next() is None


@contextlib.contextmanager
def _linked_pair() -> Iterator[tuple[RingLink, _Owner, RingLink, _Owner]]:
    """Two links of this process to each other (ranks 0 and 1), each lending to the other
    and reading the other's memory, which is this process's."""
    socks = socket.socketpair()
    to_b = RingWriter(1 << 16)
    b_in = RingReader(to_b.name, 1 << 16)
    to_a = RingWriter(1 << 16)
    a_in = RingReader(to_a.name, 1 << 16)
    for w in (to_a, to_b):
        w.unlink()
        w.lend = True
    a_in.lender_pid = b_in.lender_pid = os.getpid()
    owners = _Owner(None, []), _Owner(None, [])
    a = RingLink(owners[0], 1, socks[0], to_b, a_in, 1)  # type: ignore[arg-type]
    b = RingLink(owners[1], 0, socks[1], to_a, b_in, 1)  # type: ignore[arg-type]
    try:
        yield a, owners[0], b, owners[1]
    finally:
        a.close_rings()
        b.close_rings()
        for sock in socks:
            sock.close()


def _data(seq: int, nbytes: int, flags: int = 0) -> bytes:
    return Header(Kind.DATA, 1, flags, 0, 7, seq, 0, 0, nbytes, nbytes).pack()


@contextlib.contextmanager
def _pushed_body(seed: int, nbytes: int) -> Iterator[tuple[np.ndarray, RingLink, _Owner,
                                                             RingLink, _Owner]]:
    """A linked pair (:func:`_linked_pair`) whose lender has lent a random body of
    ``nbytes`` (token "t") flagged for its reader to ask the lender for its back half."""
    body = np.random.default_rng(seed).integers(0, 255, nbytes, np.uint8)
    with _linked_pair() as (lender, lender_owner, reader, reader_owner):
        assert lender.lend_now(_data(1, body.nbytes), memoryview(body), "t", spread=True)
        yield body, lender, lender_owner, reader, reader_owner


@pytest.mark.parametrize("deferred", [False, True])
def test_an_idle_lender_copies_the_back_half_into_its_reader_when_asked(
        deferred: bool) -> None:
    # A body lent with spread=True (its lender sits idle): the reader asks for its back
    # (RING_PUSH), copies the front, and waits between turns until the lender says it
    # wrote the back (RING_PUSHED); only then is the body handed on and acknowledged.
    # The lender answers the request even behind a record it leaves unread for an op not
    # begun there (deferred).
    body = np.random.default_rng(5).integers(0, 255, (3 << 20) + 4097, np.uint8)
    with _linked_pair() as (lender, lender_owner, reader, reader_owner):
        if deferred:
            small = np.arange(8, dtype=np.uint8)
            assert reader.post_now(_data(9, 8), memoryview(small))
            lender_owner.defer = True
        assert lender.lend_now(_data(1, body.nbytes), memoryview(body), "token", spread=True)
        reader.read_ring()  # the request goes out, the front comes in, then it waits
        lent = reader.lent_in
        front = push_front(body.nbytes)
        assert lent is not None and lent.end == front and lent.done == front
        assert reader_owner.events == []
        assert bytes(reader_owner.dest[front:]) == bytes(body.nbytes - front)
        reader.read_ring()  # still nothing from the lender: it waits on
        assert reader.lent_in is lent and reader_owner.events == []
        lender.read_ring()  # the request: the lender writes the back
        assert lender.deferred is deferred
        assert lender_owner.events == []  # nothing acknowledged yet
        reader.read_ring()
        assert reader.lent_in is None
        assert reader_owner.events == [("whole", 1, body.tobytes())]
        assert reader.counters.bodies_spread == 1
        lender.deferred = False
        lender_owner.defer = False
        lender.read_ring()
        events = lender_owner.events
        if deferred:
            assert events[0] == ("in ring", 9, small.tobytes())
            events = events[1:]
        assert events == [("sent", 0, b"'token'")]
        assert lender.peek() is None and reader.peek() is None


def test_a_reader_on_a_callers_thread_waits_for_the_pushed_half() -> None:
    # take_lent (a Repeat's): the reader's thread asks for the back and waits for it while
    # the lender's loop answers on another thread.
    with _pushed_body(6, (2 << 20) + 3) as (body, lender, lender_owner, reader,
                                                  reader_owner):
        record = reader.peek()
        assert record is not None and record[0].flags & FLAG_REMOTE and record[1] is None
        stop = threading.Event()

        def answer() -> None:
            while not stop.is_set() and not lender_owner.events:
                lender.read_ring()

        helper = threading.Thread(target=answer)
        helper.start()
        dest = bytearray(body.nbytes)
        try:
            assert reader.take_lent(memoryview(dest))
        finally:
            helper.join(timeout=30)
            stop.set()
        assert not helper.is_alive() and bytes(dest) == body.tobytes()
        assert lender_owner.events == [("sent", 0, b"'t'")]
        assert reader.counters.bodies_spread == 1 and reader.peek() is None


def _refuse(pid: int, src: memoryview, address: int) -> None:
    """cma.write_from where the kernel will not write."""
    raise OSError(1, "not allowed")


def test_a_lender_that_cannot_write_says_so_and_the_reader_copies_it_all(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cma, "write_from", _refuse)
    with _pushed_body(7, (1 << 20) + 11) as (body, lender, lender_owner, reader,
                                                  reader_owner):
        reader.read_ring()
        assert reader.lent_in is not None
        lender.read_ring()
        reader.read_ring()
        assert reader.lent_in is None and reader.counters.bodies_spread == 0
        assert reader_owner.events == [("whole", 1, body.tobytes())]
        lender.read_ring()
        assert lender_owner.events == [("sent", 0, b"'t'")]


def test_a_push_of_a_body_never_lent_loses_the_link() -> None:
    with _linked_pair() as (lender, lender_owner, reader, reader_owner):
        desc = REMOTE_BODY.pack(0, 3)
        assert reader.ring_out is not None
        assert reader.ring_out.post(Header(Kind.RING_PUSH, seq=3, nbytes=len(desc)).pack(),
                                    memoryview(desc))
        with pytest.raises(AssertionError, match="push of unknown lent body 3"):
            lender.read_ring()


def test_a_reader_acknowledges_before_the_lenders_half_comes() -> None:
    # On a caller's thread (take_lent_front, then wait_pushed): the front copied, the
    # body is acknowledged at once (the lender's call may end once it has written), and
    # the wait for the lender's half follows.
    with _pushed_body(8, (1 << 20) + 8191) as (body, lender, lender_owner, reader,
                                                  reader_owner):
        assert reader.peek() is not None
        dest = bytearray(body.nbytes)
        pending = reader.take_lent_front(memoryview(dest))
        assert pending == 0 and reader.peek() is None
        front = push_front(body.nbytes)
        assert dest[:front] == body[:front].tobytes() and dest[front:] == bytes(len(dest) - front)
        lender.read_ring()  # the push, written; then the acknowledgement
        assert lender_owner.events == [("sent", 0, b"'t'")]
        assert reader.wait_pushed(pending)
        assert bytes(dest) == body.tobytes() and reader.counters.bodies_spread == 1
        assert reader.peek() is None


def test_a_lender_that_cannot_write_after_the_acknowledgement_loses_the_link(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Acknowledged early, the lender's body may be gone: the reader does not read the
    # rest itself, it loses the link (the _Owner raises what it is told).
    monkeypatch.setattr(cma, "write_from", _refuse)
    with _pushed_body(9, (2 << 20) + 1) as (body, lender, lender_owner, reader,
                                                  reader_owner):
        assert reader.peek() is not None
        pending = reader.take_lent_front(memoryview(bytearray(body.nbytes)))
        assert pending >= 0
        lender.read_ring()
        with pytest.raises(AssertionError, match="rank 0 could not copy its half"):
            reader.wait_pushed(pending)
