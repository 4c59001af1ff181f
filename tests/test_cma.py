"""Cross-memory attach on its own: reading a buffer by address, the probe, the errors."""

from __future__ import annotations

import os

import numpy as np
import pytest

from totalreduce.transport import cma
from totalreduce.transport.mesh import _probe

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
