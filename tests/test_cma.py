"""Cross-memory attach: reading a buffer by address, the probe, the errors, and a ring
link copying a lent body in slices."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

import numpy as np
import pytest

from totalreduce.transport import cma, spread_copy
from totalreduce.transport.base import Counters
from totalreduce.transport.mesh import _probe
from totalreduce.transport.ring_link import RingLink
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
        return False

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


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or spread_copy._sched_getcpu is None,
                    reason="one CPU here, or no sched_getcpu")
def test_the_spread_copy_thread_keeps_off_the_cpu_of_the_thread_that_starts_it() -> None:
    # Woken by the reader, the thread would share the reader's CPU for the first copies
    # of a job; it is kept off it (wherever else the process may run), and copies right.
    cpus = os.sched_getaffinity(0)
    spread = spread_copy.SpreadCopy()
    first = min(cpus)
    os.sched_setaffinity(0, {first})  # this thread only
    try:
        src = np.random.default_rng(3).integers(0, 255, (3 << 20) + 5, np.uint8)
        dest = bytearray(src.nbytes)
        assert spread.start(os.getpid(), memoryview(dest), cma.address_of(src))
        spread.wait()
        assert bytes(dest) == src.tobytes()
        helper = spread._thread.native_id
        assert helper is not None and os.sched_getaffinity(helper) == cpus - {first}
    finally:
        os.sched_setaffinity(0, cpus)
        spread.close()
