"""Copies in pieces (memcopy.py): the bytes that land, and where pieces are used."""

from collections.abc import Iterator

import numpy as np
import pytest

from totalreduce import memcopy
from totalreduce.config import Config, ConfigError


@pytest.fixture
def piece() -> Iterator[None]:
    before = memcopy.piece()
    memcopy.set_piece(4096)
    yield
    memcopy.set_piece(before)


class _Recorder:
    """A flat byte destination that keeps the slices written into it."""

    ndim = 1
    format = "B"

    def __init__(self, n: int) -> None:
        self.buf = bytearray(n)
        self.slices: list[tuple[int, int]] = []

    def __setitem__(self, key: slice, value: memoryview) -> None:
        lo, hi, _ = key.indices(len(self.buf))
        self.slices.append((lo, hi))
        self.buf[key] = value


@pytest.mark.parametrize("n", [0, 1, 8191, 8192, 12345, (1 << 20) + 3])
def test_copy_bytes_lands_every_byte(n: int, piece: None) -> None:
    src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, np.uint8)
    memcopy.copy_bytes(dst.data.cast("B"), src.data.cast("B"))
    assert np.array_equal(dst, src)


def test_copy_bytes_goes_in_pieces_from_twice_the_piece(piece: None) -> None:
    small = _Recorder(8191)
    memcopy.copy_bytes(small, memoryview(bytes(range(256)) * 32)[:8191])  # type: ignore[arg-type]
    assert small.slices == [(0, 8191)]
    big = _Recorder(10000)
    src = memoryview(np.arange(10000, dtype=np.uint32).astype(np.uint8).tobytes())
    memcopy.copy_bytes(big, src)  # type: ignore[arg-type]
    assert big.slices == [(0, 4096), (4096, 8192), (8192, 10000)]
    assert bytes(big.buf) == bytes(src)


def test_whole_copies_where_the_piece_is_zero() -> None:
    before = memcopy.piece()
    memcopy.set_piece(0)
    try:
        rec = _Recorder(1 << 20)
        memcopy.copy_bytes(rec, memoryview(bytes(1 << 20)))  # type: ignore[arg-type]
        assert rec.slices == [(0, 1 << 20)]
    finally:
        memcopy.set_piece(before)


def test_a_view_of_another_format_is_copied_whole_or_refused(piece: None) -> None:
    # Not a flat byte view: one slice assignment, which raises where the two differ (the
    # ring falls back to numpy then), as it did before pieces.
    floats = np.arange(5000, dtype=np.float32)
    rec = _Recorder(floats.nbytes)
    memcopy.copy_bytes(rec, floats.data)  # type: ignore[arg-type]
    assert rec.slices == [(0, floats.nbytes)]
    with pytest.raises((TypeError, ValueError)):
        memcopy.copy_bytes(np.zeros(20000, np.uint8).data, floats.data)


def test_copy_array_matches_copyto(piece: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memcopy, "PRIVATE_FROM", 1 << 14)
    rng = np.random.default_rng(3)
    src = rng.random(12347)
    dst = np.zeros_like(src)
    memcopy.copy_array(dst, src)  # contiguous, one dtype: in pieces
    assert np.array_equal(dst, src)
    strided = np.zeros(2 * src.size)[::2]
    memcopy.copy_array(strided, src)  # not contiguous: np.copyto
    assert np.array_equal(strided, src)
    as32 = np.zeros(src.size, np.float32)
    memcopy.copy_array(as32, src)  # another dtype: np.copyto casts, as before
    assert np.array_equal(as32, src.astype(np.float32))


def test_auto_piece_is_half_the_l2_on_amd_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memcopy, "_amd", lambda: True)
    monkeypatch.setattr(memcopy, "_l2_bytes", lambda: 1 << 20)
    assert memcopy.auto_piece() == 512 << 10
    monkeypatch.setattr(memcopy, "_l2_bytes", lambda: 0)  # the kernel does not say
    assert memcopy.auto_piece() == 512 << 10
    monkeypatch.setattr(memcopy, "_amd", lambda: False)
    assert memcopy.auto_piece() == 0


def test_copy_piece_setting_is_checked() -> None:
    assert Config.from_env({"TOTALREDUCE_COPY_PIECE": "65536"}).copy_piece == 65536
    with pytest.raises(ConfigError, match="TOTALREDUCE_COPY_PIECE=100: must be >= 4096"):
        Config.from_env({"TOTALREDUCE_COPY_PIECE": "100"})
