"""A lent body's back half, copied into its reader by its idle lender: the records of
RING_PUSH and RING_PUSHED in a pair of rings (ring_link.py keeps the state).

A lender that sits idle while its body is copied (a broadcast's root, FLAG_SPREAD) copies
the body's back half into the reader meanwhile, when the reader asks (RING_PUSH, with the
address of the reader's buffer; then RING_PUSHED once written): both cores copy, where
the reader alone would copy all of it while the lender's core idles.  Two processes on an
Intel VM, the lender spinning: 1 MiB in 20 us against 72-88 read whole, 4 MiB in 220
against 400-417, 16 MiB in 0.82-0.87 ms against 1.68, 64 MiB in 4.7-4.9 against 11.5-12.0
ms.  The lender answers a RING_PUSH wherever it reads its ring, so it spins while it waits
for the body's acknowledgement; the reader finds the answer behind whatever else the
lender posted meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from . import cma
from .shmring import RingReader, RingWriter
from .wire import REMOTE_BODY, Header, Kind

# The smallest lent body whose idle lender copies half of it: the smallest lent by
# default (config.lend_bytes).
PUSH_MIN = 1 << 20
# How often a reader waiting for the lender's answer checks that the lender is still
# there (on a caller's thread, the socket is the loop's to watch).
_PROBE = 0.05


def push_front(n: int) -> int:
    """Where the lender's part of a pushed body of ``n`` bytes begins (both ends compute
    it): about half, on a page boundary."""
    return (n // 2) & ~4095


def ask(ring: RingWriter, lend: int, dest: memoryview) -> bool:
    """The reader's request that the lender copy the back of its body ``lend`` into
    ``dest``, where the whole body goes; False, nothing posted, where the body has no
    back to copy or the ring is full."""
    if not push_front(dest.nbytes):
        return False
    desc = REMOTE_BODY.pack(cma.address_of(dest), lend)
    return ring.post(Header(Kind.RING_PUSH, seq=lend, nbytes=len(desc)).pack(),
                     memoryview(desc))


def asked_at(request: memoryview) -> int:
    """The reader's address a RING_PUSH's body names."""
    address: int = REMOTE_BODY.unpack_from(request)[0]
    return address


def write_back(pid: int | None, body: memoryview, address: int, lend: int) -> bytes:
    """Copy the back of ``body`` (lent under ``lend``) to ``address`` in ``pid``, where
    its reader keeps the whole body: the RING_PUSHED record to answer with, step 1 where
    the copy failed."""
    front = push_front(body.nbytes)
    failed = 1
    if pid is not None:
        try:
            cma.write_from(pid, body[front:], address + front)
            failed = 0
        except OSError:
            pass
    return Header(Kind.RING_PUSHED, seq=lend, step=failed).pack()


def answer_behind(ring: RingReader, push: Callable[[int, int], None], lend: int = -1
                  ) -> bool | None:
    """Answer the requests standing behind ``ring``'s next record (``push(lend,
    address)``; each then marked taken); and whether the lender said it copied the back
    of its body ``lend`` (RING_PUSHED, marked taken; None: it has not said)."""
    for where, kind, _flags, _name, seq, _after in ring.glance(ring.behind()):
        if kind == Kind.RING_PUSH:
            header, body = ring.record_at(where)
            push(seq, asked_at(body))
            ring.mark_taken(where, header)
        elif kind == Kind.RING_PUSHED and seq == lend:
            header = ring.record_at(where)[0]
            ring.mark_taken(where, header)
            return header.step == 0
    return None


def asks_behind(ring: RingReader) -> bool:
    """Whether a request stands behind ``ring``'s next record."""
    return any(kind == Kind.RING_PUSH for _w, kind, *_rest in ring.glance(ring.behind()))


def pushed(ring: RingReader, push: Callable[[int, int], None], lend: int, pid: int,
           address: int, wait: bool) -> bool | None:
    """:func:`answer_behind` for body ``lend``, lent by ``pid`` at ``address``.
    ``wait``: look until the lender says, checking now and then that it is still there
    (a byte of the lent body, which it keeps until it has said so).

    Raises:
        OSError: the lender is gone.
    """
    check = time.monotonic() + _PROBE
    while True:
        said = answer_behind(ring, push, lend)
        if said is not None or not wait:
            return said
        if time.monotonic() >= check:
            try:
                cma.read_into(pid, memoryview(bytearray(1)), address)
            except OSError:
                # It may have said so and moved on since the look above.
                said = answer_behind(ring, push, lend)
                if said is None:
                    raise
                return said
            check = time.monotonic() + _PROBE
