"""Worker functions for the point-to-point tests (send / recv): each rank derives what
every peer sends from a shared seed and checks what it received against it."""

from __future__ import annotations

import numpy as np

import totalreduce as tr
from reporting import report
from workers import DTYPES, assert_same, data

# Empty, one element, odd, and several pieces at a 64 KiB segment size.
SIZES = [(0,), (1,), (7,), (3, 5), (1031,), (40_000, 3)]


def _failure(fn) -> str:  # type: ignore[no-untyped-def]
    try:
        fn()
    except (ValueError, TypeError, tr.TotalReduceError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def messages(arg: dict) -> None:
    tr.init()
    rank, n = tr.rank(), tr.size()
    right, left = (rank + 1) % n, (rank - 1) % n
    seed = 11

    # A ring: every dtype and size; sends started first so no rank waits on a receive
    # before its own message is out.  Receives into an array, or allocated.
    for i, dtype in enumerate(DTYPES):
        for j, shape in enumerate(SIZES):
            mine = data(seed + i, rank * 100 + j, shape, dtype)
            sent = tr.send_async(mine, right, tag=j)
            if j % 2:
                got = tr.recv((shape, dtype), source=left, tag=j)
            else:
                got = tr.recv(np.empty(shape, dtype), left, j)
            sent.wait()
            assert_same(got, data(seed + i, left * 100 + j, shape, dtype),
                        f"{np.dtype(dtype)} {shape} from {left}")

    # Posted before the message arrives, and after it has: rank 0 receives from rank 1.
    x = np.arange(5000, dtype=np.float32)
    if rank == 0:
        early = tr.recv_async(np.empty(5000, np.float32), 1, tag=1)
        tr.barrier()
        assert_same(early.wait(), x, "posted before")
        tr.barrier()  # rank 1 has sent meanwhile
        assert_same(tr.recv(np.empty(5000, np.float32), 1, tag=2), x + 1, "posted after")
    elif rank == 1:
        tr.barrier()
        tr.send(x, 0, tag=1)
        tr.send(x + 1, 0, tag=2)
        tr.barrier()
    else:
        tr.barrier()
        tr.barrier()

    # One tag keeps its order; tags are independent of each other.
    if rank == 1:
        for k in range(3):
            tr.send(np.full(4, k, np.int64), 0, tag=5)
        tr.send(np.full(2, 70, np.int16), 0, tag=7)
    elif rank == 0:
        seventy = tr.recv(np.empty(2, np.int16), 1, tag=7)
        in_order = [int(tr.recv(((4,), np.int64), 1, tag=5)[0]) for _ in range(3)]
        report(tag_order=in_order, other_tag=seventy.tolist())

    # From any source: rank 0 hears from every other rank, in whatever order they come;
    # into a non-contiguous buffer (filled through a copy).
    if rank == 0:
        sources = []
        for _ in range(n - 1):
            buf = np.zeros((6, 2), np.float64)[:, 0]
            got, src = tr.recv(buf, tag=3)
            assert got is buf
            assert_same(got, np.full(6, src, np.float64), f"any source (from {src})")
            sources.append(src)
        report(any_sources=sorted(sources))
        handle = tr.recv_async(((3,), np.int32), None, tag=4)
        got, src = handle.wait()
        report(any_async=[got.tolist(), src])
    else:
        tr.send(np.full(6, rank, np.float64), 0, tag=3)
        if rank == n - 1:
            tr.send(np.arange(3, dtype=np.int32), 0, tag=4)

    # Bad arguments fail at once, on the calling rank.
    report(bad={
        "self": _failure(lambda: tr.send(np.ones(2), rank)),
        "dest": _failure(lambda: tr.send(np.ones(2), n)),
        "tag": _failure(lambda: tr.send(np.ones(2), right, tag=-1)),
        "buf": _failure(lambda: tr.recv([1, 2], left)),
    })

    # A receive of another size: the receiver is told, naming both ranks; the send
    # succeeds (its bytes left); the job goes on.
    if rank in (0, 1):
        peer = 1 - rank
        if rank == 0:
            text = _failure(lambda: tr.send(np.ones(10, np.float32), peer, tag=9))
        else:
            text = _failure(lambda: tr.recv(np.empty(11, np.float32), peer, tag=9))
        report(mismatch=text)
    total = tr.allreduce(np.ones(3), op=tr.Sum, name="after")
    report(after=total.tolist(), ok=True)
    tr.shutdown()


def departed(arg: dict) -> None:
    """Rank 1 shuts down without sending: rank 0's receives from it, named or from any
    source, fail naming it instead of waiting forever."""
    tr.init()
    if tr.rank() == 1:
        tr.shutdown()
        return
    named = _failure(lambda: tr.recv(np.empty(3), 1))
    anyone = _failure(lambda: tr.recv(np.empty(3)))
    report(named=named, anyone=anyone)
    tr.shutdown()
