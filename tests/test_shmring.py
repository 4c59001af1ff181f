"""The shared-memory message ring on its own: records, wrap-around, back-pressure, the
doorbell flags, hygiene."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

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


def test_an_empty_ring_starts_again_at_offset_zero() -> None:
    # Reusing the first slots keeps them in cache; the reader follows the WRAP header.
    writer, reader = _pair(4096)
    try:
        assert writer.post(_data(0, 1000), memoryview(b"a" * 1000))
        assert writer.post(_data(1, 1000), memoryview(b"b" * 1000))
        body = reader.next()[1]
        base = _address(body)
        body.release()
        reader.release()
        body = reader.next()[1]
        assert _address(body) == base + 1088  # 64 + 1000 bytes, padded to 64
        body.release()
        reader.release()
        # Caught up: the next record goes to offset 0 again, not behind the last one.
        assert writer.post(_data(2, 900), memoryview(b"c" * 900))
        assert writer.post(_data(3, 10), memoryview(b"d" * 10))  # not caught up: behind
        for step, want, at in ((2, b"c" * 900, base), (3, b"d" * 10, base + 1024)):
            header, body = reader.next()
            assert header.step == step and bytes(body) == want and _address(body) == at
            body.release()
            reader.release()
    finally:
        reader.close()
        writer.close()


def test_writer_starts_again_at_zero_once_the_first_bytes_are_free() -> None:
    # The reader need not have caught up: once it is past the first record of the lap,
    # a record that fits below it goes to offset 0, so the ring's footprint stays at what
    # is in flight rather than the whole capacity.
    writer, reader = _pair(8192)
    try:
        for step in range(3):
            assert writer.post(_data(step, 2100), memoryview(bytes([65 + step]) * 2100))
        header, body = reader.next()
        base = _address(body)
        body.release()
        reader.release()  # records 1 and 2 are still unread
        assert writer.post(_data(3, 2100), memoryview(b"D" * 2100))  # fits in 2176 bytes
        # Behind it, this one would overwrite records 1 and 2: the ring is full for now.
        assert not writer.post(_data(4, 2100), memoryview(b"E" * 2100))
        seen = []

        def drain() -> None:
            while (record := reader.next()) is not None:
                header, body = record
                seen.append((header.step, bytes(body[:1]), _address(body) - base))
                body.release()
                reader.release()

        drain()
        assert writer.post(_data(4, 2100), memoryview(b"E" * 2100))
        drain()
        # Caught up, the reader frees the whole lap: E goes to 0 again.
        assert seen == [(1, b"B", 2176), (2, b"C", 4352), (3, b"D", 0), (4, b"E", 0)]
    finally:
        reader.close()
        writer.close()


def test_small_records_do_not_restart_into_a_window_of_one() -> None:
    # A reader busy elsewhere has taken one small record of three.  Starting again at 0
    # would leave room for one more record until it reaches the WRAP; carrying on along
    # the lap leaves the rest of the ring.
    writer, reader = _pair(8192)
    try:
        for step in range(3):
            assert writer.post(_data(step, 16), memoryview(b"x" * 16))
        reader.next()
        reader.release()
        for step in range(3, 40):
            assert writer.post(_data(step, 16), memoryview(b"y" * 16)), step
        steps = []
        while (record := reader.next()) is not None:
            steps.append(record[0].step)
            record[1].release()
            reader.release()
        assert steps == list(range(1, 40))
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
