"""The fixed-format message header that every transport carries.

A header is 64 bytes, little-endian, and self-guiding: it names the op (a hash of its name
plus the per-name call count), the step and piece of the op's schedule, the body length,
the dtype and element count the sender believes the op has, and a signature of everything
else the ranks must agree on.  The receiver routes the body with nothing but this header.
Bodies are raw array bytes or, for the few control messages that need them, UTF-8 JSON.
Nothing on the wire is ever unpickled.
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

import numpy as np

MAGIC = 0x5452  # "TR"
# 3: bool/int16/uint16, OP_FAILED, the broadcast's acknowledgement; 4: recipe and epoch
PROTOCOL_VERSION = 4

# magic, kind, dtype, flags, recipe, step, name_key, seq, sig, piece, epoch, nbytes, count,
# credit
_HEADER = struct.Struct("<HBBBBHQQQIIQQQ")
HEADER_SIZE = _HEADER.size
assert HEADER_SIZE == 64
# A header from its fields in wire order, MAGIC first (the epoch in 32 bits): for a hot
# path that packs without :func:`pack_header`'s call between.
pack_fields = _HEADER.pack

FLAG_CREDITED = 1
FLAG_CHUNKED = 2  # shared-memory ring only: the body follows in RING_CHUNK records
FLAG_READY = 4  # on DATA: the sender has submitted the op too (stands in for a READY)
# Shared-memory ring only: the body stays in the sender's memory; the record carries a
# REMOTE_BODY descriptor (address, lend id) instead and ``nbytes`` is the real length.
FLAG_REMOTE = 8
# Shared-memory ring only, with FLAG_REMOTE: the lender sits idle while the body is copied
# (a broadcast's root), so the reader may ask it to copy the body's back half into the
# reader meanwhile (RING_PUSH; ring_push.py).
FLAG_SPREAD = 16
# On DATA of an exchange sent from a Repeat (engine/repeat.py), or of a 2-rank reduction's
# piece that may be lent while the rings are slow: the sender lends such a body only where
# its peer would too (FLAG_AGREES), and would (FLAG_WOULD_LEND: for an exchange, huge pages
# back it or its ring copies slowly; for a reduction, its template may lend while slow and
# its ring copies slowly now), so that both ranks lend or neither.  A DATA without
# FLAG_AGREES comes from a sender that lends by its own rule alone (the loop's).
FLAG_WOULD_LEND = 32
FLAG_AGREES = 64
REMOTE_BODY = struct.Struct("<QQ")


# Recipe algorithms (low four bits); the op's ReduceOp code sits in the high four.
RECIPE_RING_ALLREDUCE = 1
RECIPE_DOUBLING_ALLREDUCE = 2
RECIPE_HIERARCHICAL_ALLREDUCE = 3
RECIPE_HALVING_ALLREDUCE = 4


class Kind(enum.IntEnum):
    DATA = 1       # a piece of an op's payload
    READY = 2      # "I have submitted this op: send me its pieces without credit"
    CREDIT = 3     # returns floating-buffer credit to the sender (value in .credit)
    MISMATCH = 4   # body: JSON description of the sender's view of a mismatched op
    ABORT = 5      # the job is broken; .step holds the lost rank + 1 (0: none), body: reason
    GOODBYE = 6    # orderly shutdown: EOF after this is not a failure
    RING_WRAP = 7  # shared-memory ring only: the next record is at offset 0
    RING_CHUNK = 8  # shared-memory ring only: the next piece of a FLAG_CHUNKED body
    RING_ACK = 9   # shared-memory ring only: a FLAG_REMOTE body (lend id in .seq) was read
    OP_FAILED = 10  # the op (name_key, seq) failed here because rank .step - 1 left; body:
                    # the reason.  Peers fail it too: it cannot finish without the sender.
    RING_TAKEN = 11  # shared-memory ring only: a record its reader has already handled out
                     # of order (it overtook slower ones); skipped.  Written by the reader.
    RING_PUSH = 12  # shared-memory ring only: "copy the back of FLAG_SPREAD body .seq to the
                    # address in my body (REMOTE_BODY)", from its reader to its lender
    RING_PUSHED = 13  # shared-memory ring only: the lender did (.step 0) or did not (1)


# What a lender takes from its reader, in turn, while it waits for its lent bodies to be
# copied (Transport.take_ack).
LEND_REPLIES = frozenset((Kind.RING_ACK, Kind.RING_PUSH))


# Codes are part of the wire format: never renumber.
DTYPES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int32),
    4: np.dtype(np.int64),
    5: np.dtype(np.float16),
    6: np.dtype(np.float32),
    7: np.dtype(np.float64),
    8: np.dtype(np.bool_),
    9: np.dtype(np.int16),
    10: np.dtype(np.uint16),
}
DTYPE_CODES: dict[np.dtype, int] = {dt: code for code, dt in DTYPES.items()}


def dtype_code(dtype: np.dtype) -> int:
    """Wire code of a supported dtype.

    Raises:
        TypeError: the dtype is not one totalreduce moves.
    """
    code = DTYPE_CODES.get(dtype)  # native byte order: the usual case, one lookup
    if code is not None:
        return code
    try:
        return DTYPE_CODES[np.dtype(dtype).newbyteorder("=")]
    except KeyError:
        supported = ", ".join(str(d) for d in DTYPES.values())
        raise TypeError(f"dtype {np.dtype(dtype)} is not supported; use one of {supported}") \
            from None


# Plain ints for the per-message paths: comparing a header's kind with an enum member
# looks the member up each time (83 ns against 12).
KIND_DATA = int(Kind.DATA)
KIND_RING_WRAP = int(Kind.RING_WRAP)


class Header(NamedTuple):
    kind: int
    dtype: int = 0
    flags: int = 0
    step: int = 0
    name_key: int = 0
    seq: int = 0
    sig: int = 0
    piece: int = 0
    nbytes: int = 0
    count: int = 0  # type: ignore[assignment]  # the wire's name; shadows tuple.count
    credit: int = 0
    # On DATA and READY: how a rank that never submitted the op could run its part of it
    # (a joined rank contributing the identity): ``RECIPE_*`` algorithm | op << 4; 0: it
    # cannot.
    recipe: int = 0
    # On DATA and READY: how many join() rounds the op's submitter had completed when it
    # submitted the op (a joined rank serves only ops begun before its own round ended).
    epoch: int = 0

    @property
    def op_key(self) -> tuple[int, int]:
        return (self.name_key, self.seq)

    def pack(self) -> bytes:
        return pack_header(*self)


def pack_header(kind: int, dtype: int, flags: int, step: int, name_key: int, seq: int,
                sig: int, piece: int, nbytes: int, count: int, credit: int,
                recipe: int = 0, epoch: int = 0) -> bytes:
    """``Header(...).pack()`` without building the tuple first (every DATA message)."""
    return _HEADER.pack(MAGIC, kind, dtype, flags, recipe, step, name_key, seq, sig, piece,
                        epoch & 0xFFFFFFFF, nbytes, count, credit)


_FLAGS_AT = 4


def with_flag(header: bytes, flag: int) -> bytes:
    """A packed header with one more flag set."""
    out = bytearray(header)
    out[_FLAGS_AT] |= flag
    return bytes(out)


def has_flag(header: bytes, flag: int) -> bool:
    """Whether a packed header has ``flag`` set."""
    return bool(header[_FLAGS_AT] & flag)


_OP_SIZE = struct.Struct("<xxxB44xQ8x")  # dtype and count of a packed header
_ITEMSIZE = {code: dt.itemsize for code, dt in DTYPES.items()}


def op_nbytes(header: bytes) -> int:
    """Bytes of the whole op a packed DATA header belongs to (the sender's view), read
    without unpacking the rest: a transport sizes its choices by it."""
    code, count = _OP_SIZE.unpack_from(header)
    return int(count) * _ITEMSIZE.get(code, 0)


class WireError(ValueError):
    """Bytes that are not a totalreduce header: the stream is corrupt or foreign."""


def unpack_header(buf: bytes | bytearray | memoryview, offset: int = 0) -> Header:
    """Parse one header (at ``offset`` in ``buf``).

    Raises:
        WireError: bad magic or unknown message kind.
    """
    (magic, kind, dtype, flags, recipe, step, name_key, seq, sig, piece, epoch, nbytes,
     count, credit) = _HEADER.unpack_from(buf, offset)
    if magic != MAGIC:
        raise WireError(f"bad magic 0x{magic:04x} in message header")
    if kind not in _KINDS:
        raise WireError(f"unknown message kind {kind}")
    # tuple.__new__ directly: the named tuple's own __new__ is a Python function, a
    # measurable share of a small message's handling.
    return _new_tuple(Header, (kind, dtype, flags, step, name_key, seq, sig, piece, nbytes,
                               count, credit, recipe, epoch))


_new_tuple = tuple.__new__


_KINDS = frozenset(int(k) for k in Kind)
