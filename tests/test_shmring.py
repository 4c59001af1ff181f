"""The shared-memory message ring on its own: records, wrap-around, back-pressure, the
doorbell flags, hygiene."""

from __future__ import annotations

import errno
import os
import resource
import stat

import numpy as np
import pytest

from totalreduce import memcopy
from totalreduce.transport import shmring
from totalreduce.transport.copy_pace import PACE_MIN, PROBE_EVERY, CopyPace
from totalreduce.transport.shmring import RingReader, RingWriter, shm_available
from totalreduce.transport.wire import (
    FLAG_CHUNKED,
    FLAG_CREDITED,
    Header,
    Kind,
    WireError,
    unpack_header,
    with_flag,
)

pytestmark = pytest.mark.skipif(not shm_available(), reason="no writable /dev/shm on x86-64")


def _pair(cap: int) -> tuple[RingWriter, RingReader]:
    writer = RingWriter(cap)
    reader = RingReader(writer.name, cap)
    writer.unlink()
    return writer, reader


def _data(step: int, n: int) -> bytes:
    return Header(Kind.DATA, 6, 0, step, 1, 2, 3, 0, n, n // 4).pack()


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if view.nbytes else 0


def _drain(reader: RingReader) -> list[tuple[int, bytes, int]]:
    """Take every waiting record: (step, first body byte, body address) each."""
    seen = []
    while (record := reader.next()) is not None:
        header, body = record
        seen.append((header.step, bytes(body[:1]), _address(body)))
        body.release()
        reader.release()
    return seen


def test_ring_file_is_private_and_gone_after_unlink() -> None:
    writer = RingWriter(1 << 12)
    try:
        mode = os.stat(writer.path).st_mode
        assert stat.S_IMODE(mode) == 0o600
        assert len(writer.name) > 30  # 128 random bits: not guessable
        reader = RingReader(writer.name, 1 << 12)
        writer.unlink()
        assert not os.path.exists(writer.path)
        # Both ends still share the mapping after the name is gone.
        assert reader.next() is None and not reader.ready()
        assert writer.post(_data(5, 3), memoryview(b"abc"))
        assert reader.ready()
        header, body = reader.next()
        assert header.step == 5 and bytes(body) == b"abc"
        reader.release()
        assert reader.next() is None
        reader.close()
    finally:
        writer.unlink()
        writer.close()


@pytest.mark.parametrize("close_lane_first", [True, False])
def test_a_lane_is_a_ring_of_its_own_in_the_same_file(close_lane_first: bool) -> None:
    writer = RingWriter(1 << 12, lane=1 << 12)
    try:
        with pytest.raises(ValueError, match="wrong size"):
            RingReader(writer.name, 1 << 12)  # a reader that expects no lane
        reader = RingReader(writer.name, 1 << 12, lane=1 << 12)
        writer.unlink()
        assert writer.lane is not None and reader.lane is not None
        # A full ring does not hold the lane up, nor the other way round.
        while writer.post(_data(1, 1000), memoryview(b"r" * 1000)):
            pass
        assert writer.lane.post(_data(2, 3), memoryview(b"abc"))
        assert reader.lane.ready() and reader.lane.head() > 0
        header, body = reader.lane.next()
        assert header.step == 2 and bytes(body) == b"abc"
        body.release()
        reader.lane.release()
        assert reader.lane.next() is None
        assert _drain(reader)[0][:2] == (1, b"r")  # the ring's records, untouched
        for end in (writer, reader):
            lane = end.lane
            assert lane is not None
            if close_lane_first:
                lane.close()
                end.close()
            else:
                end.close()
                lane.close()
    finally:
        writer.unlink()


def test_reader_refuses_foreign_names() -> None:
    for name in ("../etc/passwd", "other-file", "totalreduce-x/../y"):
        with pytest.raises(ValueError):
            RingReader(name, 1 << 12)


@pytest.mark.parametrize("cap", [4096, 8192, 65536])
def test_records_come_out_whole_and_in_order(cap: int) -> None:
    # Random sizes up to the largest record, the reader sometimes catching up (the writer
    # then starts again at 0) and sometimes lagging until the ring is full (wrap-around).
    writer, reader = _pair(cap)
    try:
        rng = np.random.default_rng(cap)
        in_flight: list[tuple[int, bytes]] = []
        received = 0

        def take() -> None:
            nonlocal received
            record = reader.next()
            assert record is not None
            header, body = record
            step, want = in_flight.pop(0)
            assert header.step == step and bytes(body) == want
            reader.release()
            received += 1

        for step in range(3000):
            body = rng.integers(0, 256, int(rng.integers(0, writer.max_body + 1)),
                                dtype=np.uint8).tobytes()
            while not writer.post(_data(step, len(body)), memoryview(body)):
                assert in_flight, "ring reported full with nothing in it"
                take()
            in_flight.append((step, body))
            if rng.random() < 0.3:
                while in_flight:
                    take()
        while in_flight:
            take()
        assert received == 3000 and reader.next() is None
    finally:
        reader.close()
        writer.close()


def test_records_go_on_along_the_ring_and_wrap_at_the_end() -> None:
    # A record goes right behind the last one even when the reader has caught up; one that
    # would straddle the end goes to offset 0, and the reader follows the WRAP header.
    writer, reader = _pair(4096)
    try:
        assert writer.post(_data(0, 1000), memoryview(b"a" * 1000))
        seen = _drain(reader)
        base = seen[0][2]
        assert writer.post(_data(1, 1000), memoryview(b"b" * 1000))  # caught up: behind
        assert writer.post(_data(2, 1000), memoryview(b"c" * 1000))
        seen += _drain(reader)
        assert writer.post(_data(3, 1000), memoryview(b"d" * 1000))  # 3264 + 1088 > 4096
        seen += _drain(reader)
        # 64 + 1000 bytes, padded to 64, is 1088 per record.
        assert [(st, b, at - base) for st, b, at in seen] == [
            (0, b"a", 0), (1, b"b", 1088), (2, b"c", 2176), (3, b"d", 0)]
    finally:
        reader.close()
        writer.close()


def test_a_full_ring_takes_a_record_once_the_reader_frees_its_bytes() -> None:
    writer, reader = _pair(8192)
    try:
        for step in range(3):
            assert writer.post(_data(step, 2100), memoryview(bytes([65 + step]) * 2100))
        # 3 x 2176 bytes are in; the fourth would cover the unread first record.
        assert not writer.post(_data(3, 2100), memoryview(b"D" * 2100))
        assert not writer.room_changed()
        header, body = reader.next()
        assert header.step == 0 and bytes(body[:1]) == b"A"
        body.release()
        assert not writer.post(_data(3, 2100), memoryview(b"D" * 2100))  # not released yet
        reader.release()
        assert writer.room_changed()
        assert writer.post(_data(3, 2100), memoryview(b"D" * 2100))
        steps = [(step, first) for step, first, _ in _drain(reader)]
        assert steps == [(1, b"B"), (2, b"C"), (3, b"D")]
    finally:
        reader.close()
        writer.close()


def test_a_busy_reader_leaves_the_writer_the_rest_of_the_ring() -> None:
    # The reader has taken one small record of three; the writer fills the rest.
    writer, reader = _pair(8192)
    try:
        for step in range(3):
            assert writer.post(_data(step, 16), memoryview(b"x" * 16))
        reader.next()
        reader.release()
        for step in range(3, 40):
            assert writer.post(_data(step, 16), memoryview(b"y" * 16)), step
        assert [step for step, _, _ in _drain(reader)] == list(range(1, 40))
    finally:
        reader.close()
        writer.close()


def test_full_ring_flags_the_writer_and_sleeping_flags_the_reader() -> None:
    writer, reader = _pair(4096)
    try:
        assert not writer.reader_sleeping()
        for slot in (0, 1):
            reader.set_sleeping(slot, True)
            assert writer.reader_sleeping()
            reader.set_sleeping(slot, False)
            assert not writer.reader_sleeping()
        body = memoryview(b"x" * writer.max_body)
        assert writer.post(_data(0, body.nbytes), body)
        assert writer.post(_data(1, body.nbytes), body)
        assert not writer.post(_data(2, body.nbytes), body)  # full
        assert not writer.room_changed()
        reader.next()
        assert reader.release() is False  # a spinning writer sees the tail move by itself
        assert writer.room_changed()
        assert writer.post(_data(2, body.nbytes), body)
        assert not writer.post(_data(3, body.nbytes), body)  # full again
        writer.set_waiting(True)  # about to block: asks for a doorbell
        assert not writer.room_changed()
        reader.next()
        assert reader.release() is True  # so the reader rings the writer's doorbell
        assert writer.room_changed()
        reader.next()
        assert reader.release() is False  # the flag was cleared with that doorbell
    finally:
        reader.close()
        writer.close()


def test_garbage_in_the_ring_is_a_wire_error() -> None:
    writer, reader = _pair(4096)
    try:
        assert writer.post(_data(0, 8), memoryview(b"12345678"))
        writer._m.data[:2] = 0  # the magic
        with pytest.raises(WireError):
            reader.next()
    finally:
        reader.close()
        writer.close()


def test_chunked_flag_and_empty_body() -> None:
    writer, reader = _pair(4096)
    try:
        packed = with_flag(_data(7, 10000), FLAG_CHUNKED)
        assert unpack_header(packed).flags == FLAG_CHUNKED
        assert unpack_header(with_flag(packed, FLAG_CREDITED)).flags == FLAG_CHUNKED | 1
        assert writer.post(packed)
        header, body = reader.next()
        assert header.nbytes == 10000 and body.nbytes == 0  # chunks follow separately
        reader.release()
    finally:
        reader.close()
        writer.close()


def test_records_read_ahead_and_taken_are_skipped_in_order() -> None:
    # A reader may handle records behind the one it holds (a slow, lent body) and mark
    # them taken; reading on in order then shows each taken one as RING_TAKEN, of its own
    # size, and the rest as posted, across a wrap-around.
    writer, reader = _pair(4096)
    assert writer.post(_data(0, 1500), memoryview(b"x" * 1500))
    assert _drain(reader)[0][0] == 0  # moves the ring's start near its end
    for step, n in enumerate([512, 64, 900, 8, 700], start=1):
        assert writer.post(_data(step, n), memoryview(bytes([step]) * n))
    front = reader.next()
    assert front is not None and front[0].step == 1
    ahead = [(where, *reader.record_at(where)) for where, *_rest in
             reader.glance(reader.behind())]
    assert [(h.step, bytes(b[:1]), b.nbytes) for _, h, b in ahead] == \
        [(2, b"\x02", 64), (3, b"\x03", 900), (4, b"\x04", 8), (5, b"\x05", 700)]
    for where, header, body in ahead:
        if header.step in (3, 5):
            body.release()
            reader.mark_taken(where, header)
    del ahead, front
    reader.release()
    kinds = []
    while (record := reader.next()) is not None:
        header, body = record
        kinds.append((header.kind, header.step, body.nbytes))
        body.release()
        reader.release()
    assert kinds == [(Kind.DATA, 2, 64), (Kind.RING_TAKEN, 0, 900), (Kind.DATA, 4, 8),
                     (Kind.RING_TAKEN, 0, 700)]
    # Everything was freed: the writer has the whole ring again.
    assert writer.post(_data(9, 2000), memoryview(b"y" * 2000))


def test_a_ring_is_mapped_whole_at_set_up_not_page_by_page_on_its_first_lap() -> None:
    # Faulting the pages in on the first lap made a job's first 1 MiB allreduces ~1 ms
    # each; both ends map every page when they open the ring.
    cap = 1 << 20
    body = memoryview(b"z" * 8000)
    header = _data(0, body.nbytes)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    writer, reader = _pair(cap)
    mapped = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    try:
        for _ in range(2 * cap // body.nbytes):  # two laps, writer and reader
            assert writer.post(header, body)
            record = reader.next()
            assert record is not None and record[1].nbytes == body.nbytes
            record[1].release()
            reader.release()
        used = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - mapped
    finally:
        reader.close()
        writer.close()
    pages = 2 * cap // 4096  # one mapping at each end
    assert mapped - before >= pages // 2, (mapped - before, pages)  # faulted in up front
    assert used < pages // 8, (used, pages)  # and not again while in use


def test_a_ring_that_does_not_fit_in_dev_shm_is_refused_at_set_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Memory the ring cannot have must fail its creation (the pair then keeps to its
    # socket), not a write into it later (SIGBUS); nothing is left in /dev/shm.
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    before = set(os.listdir("/dev/shm"))
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match="No space left"):
        RingWriter(1 << 16)
    assert set(os.listdir("/dev/shm")) - before == set()


def test_copy_pace_lends_while_every_recent_copy_is_slow() -> None:
    now = [0.0]
    pace = CopyPace(10e9, lap=2 << 20, clock=lambda: now[0])
    for _ in range(2):
        pace.timed(1 << 20, 1e-3)  # 1 GB/s, but a cold ring's first lap: not judged
    assert pace.cold == 0 and not pace.far
    for _ in range(2):
        pace.timed(1 << 20, 1e-3)  # too few copies to judge
    assert not pace.far and not pace.lend()
    pace.timed(1 << 20, 1e-3)
    assert pace.far and pace.lend()
    now[0] += PROBE_EVERY  # lent for a while: the ring is tried again, a lap unjudged
    assert not pace.lend() and not pace.far and pace.cold == 2 << 20
    for _ in range(5):
        pace.timed(1 << 20, 1e-3)
    assert pace.far  # still slow after the lap
    pace.timed(1 << 20, 1e-5)  # one fast copy (100 GB/s): fast again at once
    assert not pace.far and not pace.lend()
    for _ in range(2):  # slow copies after it: not while it is one of the last three
        pace.timed(1 << 20, 1e-3)
        assert not pace.far
    pace.timed(1 << 20, 1e-3)
    assert pace.far
    # Where the ring is fast, a copy now and then is slow (the scheduler cut it, its
    # source was cold): two in three do not make the ring slow.
    fast = CopyPace(10e9)
    for seconds in (1e-3, 1e-5, 1e-3, 1e-3, 1e-5, 1e-3):
        fast.timed(1 << 20, seconds)
        assert not fast.far
    off = CopyPace(0.0)  # TOTALREDUCE_SLOW_RING_GBPS=0
    for _ in range(3):
        off.timed(1 << 20, 1.0)
    assert not off.far and not off.lend()


def test_copy_pace_says_the_ring_beats_lending_small_pages_by_its_median_pace() -> None:
    # 10 GB/s lent: the ring beats it while the median of its recent copies runs at 20
    # GB/s or more, and it is tried again (True) once nothing has been timed for a while.
    now = [0.0]
    pace = CopyPace(10e9, clock=lambda: now[0])
    assert pace.beats_lending()  # nothing timed yet: try the ring
    for seconds in (1e-4, 1e-4, 1e-4, 1e-4):  # 10.5 GB/s
        pace.timed(1 << 20, seconds)
        now[0] += 0.01
    assert not pace.beats_lending()
    for _ in range(3):  # 105 GB/s: the median is still a slow copy
        pace.timed(1 << 20, 1e-5)
    assert not pace.beats_lending()
    pace.timed(1 << 20, 1e-5)  # now most of them are fast
    assert pace.beats_lending()
    for _ in range(20):  # a long slow spell fills the window
        pace.timed(1 << 20, 1e-4)
    assert not pace.beats_lending()
    now[0] += 2 * PROBE_EVERY  # nothing timed since: the ring is tried again
    assert pace.beats_lending()
    pace.timed(1 << 20, 1e-4)  # and its copy, slow too, says lend again
    assert not pace.beats_lending()
    off = CopyPace(0.0)  # TOTALREDUCE_SLOW_RING_GBPS=0, or no lending: never lend
    for _ in range(5):
        off.timed(1 << 20, 1.0)
    assert off.beats_lending()


def test_a_writer_times_its_big_copies_only() -> None:
    writer, reader = _pair(4 << 20)
    assert writer.pace.cold == 4 << 20  # a lap of a new ring is not judged
    writer.pace = CopyPace(1e18)  # no lap to wait for; any copy is slower than that
    for size in (PACE_MIN - 64, PACE_MIN):
        for step in range(3):
            assert writer.post(_data(step, size), memoryview(bytes(size)))
            assert [s for s, _, _ in _drain(reader)] == [step]
        assert writer.pace.far is (size >= PACE_MIN)


@pytest.mark.parametrize("n", [8191, 8192, 12345, 65536])
def test_a_big_body_goes_into_the_ring_in_pieces_and_comes_out_whole(
        n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    cuts: list[int] = []

    def spy(dst: memoryview, src: memoryview) -> None:
        cuts.append(src.nbytes)
        memcopy.copy_bytes(dst, src)

    before = memcopy.piece()
    memcopy.set_piece(4096)
    monkeypatch.setattr(shmring, "copy_bytes", spy)
    writer, reader = _pair(1 << 20)
    try:
        body = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
        assert writer.post(_data(1, n), body.data.cast("B"))
        header, got = reader.next()
        assert header.nbytes == n and bytes(got) == body.tobytes()
        got.release()
        reader.release()
        # Bodies of twice the smallest piece or more go through copy_bytes, which cuts them.
        assert cuts == ([] if n < 2 * memcopy.MIN_PIECE else [n])
    finally:
        memcopy.set_piece(before)
        reader.close()
        writer.close()
