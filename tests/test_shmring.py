"""The shared-memory ring on its own: placement, wrap-around, back-pressure, hygiene."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from totalreduce.transport.shmring import RingReader, RingWriter, shm_available
from totalreduce.transport.wire import FLAG_RING, Header, Kind, in_ring, unpack_header

pytestmark = pytest.mark.skipif(not shm_available(), reason="no writable /dev/shm")


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
        off = writer.put(memoryview(b"abc"))
        assert off == 0 and bytes(reader.body(0, 3)) == b"abc"
        reader.close()
    finally:
        writer.unlink()
        writer.close()


def test_reader_refuses_foreign_names() -> None:
    for name in ("../etc/passwd", "other-file", "totalreduce-x/../y"):
        with pytest.raises(ValueError):
            RingReader(name, 1 << 12)


def test_wraps_and_blocks_until_the_reader_releases() -> None:
    cap = 1000
    writer = RingWriter(cap)
    reader = RingReader(writer.name, cap)
    writer.unlink()
    try:
        rng = np.random.default_rng(0)
        in_flight: list[tuple[int, bytes]] = []
        received = 0
        sent = 0
        for _ in range(500):
            size = int(rng.integers(1, cap // 2 + 1))
            body = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            while (off := writer.put(memoryview(body))) is None:
                # Full: the reader must free room, oldest first, and the writer then fits.
                assert in_flight, "ring reported full with nothing in it"
                o, b = in_flight.pop(0)
                assert bytes(reader.body(o, len(b))) == b
                reader.release(o, len(b))
                received += 1
            assert off + size <= cap
            in_flight.append((off, body))
            sent += 1
            if rng.random() < 0.3:  # the reader sometimes catches up: the ring empties
                for o, b in in_flight:
                    assert bytes(reader.body(o, len(b))) == b
                    reader.release(o, len(b))
                    received += 1
                in_flight.clear()
        for o, b in in_flight:
            assert bytes(reader.body(o, len(b))) == b
            reader.release(o, len(b))
            received += 1
        assert received == sent == 500
        assert not writer.fits(cap // 2 + 1) and writer.fits(cap // 2)
    finally:
        reader.close()
        writer.close()


def test_an_empty_ring_starts_again_at_offset_zero() -> None:
    # Reusing the first slots keeps them in cache; the reader must follow the jump.
    cap = 1000
    writer = RingWriter(cap)
    reader = RingReader(writer.name, cap)
    writer.unlink()
    try:
        assert writer.put(memoryview(b"a" * 300)) == 0
        assert writer.put(memoryview(b"b" * 200)) == 300
        reader.release(0, 300)
        assert writer.put(memoryview(b"c" * 100)) == 500  # not empty yet: no jump
        reader.release(300, 200)
        reader.release(500, 100)
        assert writer.put(memoryview(b"d" * 400)) == 0
        assert bytes(reader.body(0, 400)) == b"d" * 400
        reader.release(0, 400)
        assert writer.put(memoryview(b"e" * 500)) == 0
        assert writer.put(memoryview(b"f" * 500)) == 500
        assert writer.put(memoryview(b"g" * 1)) is None  # full until the reader frees
    finally:
        reader.close()
        writer.close()


def test_ring_header_flag_and_offset() -> None:
    h = Header(Kind.DATA, 6, 1, 3, 5, 6, 7, 8, 100, 200, 300)
    u = unpack_header(in_ring(h.pack(), 123456))
    assert u.flags == 1 | FLAG_RING and u.ring_offset == 123456
    assert u._replace(flags=1, ring_offset=0) == h
