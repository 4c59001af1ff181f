"""Workers for the async calls of repeated reductions, which wait in the loop's queue and
run from their Repeats, one after another, on whichever thread drives (engine/loop.py:
Loop.queued), and peers that take them in other orders."""

from __future__ import annotations

import time

import numpy as np

import totalreduce as tr
from reporting import report
from totalreduce.exceptions import TotalReduceError
from totalreduce.runtime import current
from workers import OPS, assert_same, data, reference_reduce

# (dtype, count, op, in place): odd sizes from an empty array to past the ring's size.
CALLS = [
    (np.float32, 1001, "Sum", True),
    (np.float64, 0, "Sum", False),
    (np.int32, 70_001, "Max", True),
    (np.float32, (1 << 20) // 4 + 3, "Average", False),
    (np.float16, 4097, "Sum", True),
    (np.int64, 33_333, "Min", False),
    (np.float32, (5 << 20) // 4 + 1, "Sum", True),
    (np.uint8, 999, "Sum", True),
    (np.float64, 250_001, "Product", False),
    (np.float32, 17, "Sum", True),
]
GROUP = [(np.float32, 40_001), (np.float32, 3), (np.float32, 90_007), (np.float64, 12_345),
         (np.float32, 1)]


def _ins(seed: int, n: int, shape: tuple[int, ...], dtype: type, op: str
         ) -> list[np.ndarray]:
    ins = [data(seed, r, shape, dtype) for r in range(n)]
    if op == "Product" and np.dtype(dtype).kind == "f":
        ins = [1 + (a - 1) / 64 for a in ins]  # near 1: the product neither under- nor overflows
    return ins


def queued_bursts(arg: dict) -> None:
    """Rounds of async allreduces (CALLS) and a grouped one (GROUP), each under the same
    name every round, submitted at once and then waited for; a blocking allreduce amid the
    burst (the calls queued before it then go to the general path); then a grouped call
    blocking on every rank, or async on rank 0 in odd rounds.  In some rounds the odd
    ranks submit and wait in the reverse order, in others a rank is late.  Each result
    against numpy.  Reports how many calls ran from a Repeat in the rounds after the first
    where every rank took them in one order, none late."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    engine = current().engine
    repeats = 0
    for rnd in range(12):
        turned = rnd % 4 == 1 and rank % 2 == 1
        before = engine.stats()["queued_ran"]
        order = list(range(len(CALLS)))[::-1] if turned else list(range(len(CALLS)))
        # Every input first: the burst goes out at once, as a training step's does.
        inputs = {j: _ins(100 * rnd + j, n, (CALLS[j][1],), CALLS[j][0], CALLS[j][2])
                  for j in order}
        amid = _ins(7000 + rnd, n, (5,), np.float64, "Sum")
        group = [_ins(9000 + 10 * rnd + k, n, (count,), dtype, "Sum")
                 for k, (dtype, count) in enumerate(GROUP)]
        mine_group = [g[rank].copy() for g in group]
        mines = {j: inputs[j][rank].copy() for j in order}
        tr.barrier()  # every rank's burst at once, as a training step's
        if rnd % 4 == 3 and rank == rnd % n:
            time.sleep(0.003)
        calls = []
        for j in order:
            dtype, count, op, inplace = CALLS[j]
            mine = mines[j]
            call = tr.allreduce_async_ if inplace else tr.allreduce_async
            handle = call(mine, op=OPS[op], name=f"burst.{j}")
            calls.append((handle, inputs[j], op, mine if inplace else None,
                          f"round {rnd}: {op} of {count} {np.dtype(dtype)}"))
            if j == 4:
                got = tr.allreduce(amid[rank], op=tr.Sum, name="amid")
                assert_same(got, reference_reduce(amid, "Sum"), f"round {rnd}: amid a burst")
        grouped = tr.grouped_allreduce_async_(mine_group, op=tr.Sum, name="burst.group")
        # Every result first, then the checks: a caller that computes between its waits
        # has the progress thread start its calls on the general path meanwhile.
        results = [(handle.wait(), ins, op, buffer, what)
                   for handle, ins, op, buffer, what in (calls[::-1] if turned else calls)]
        group_results = grouped.wait()
        if rnd and rnd % 2 == 0:  # in one order, none late
            repeats += engine.stats()["queued_ran"] - before
        for got, ins, op, buffer, what in results:
            assert_same(got, reference_reduce(ins, op), what)
            if buffer is not None:
                assert got is buffer, what
        for k, got in enumerate(group_results):
            assert got is mine_group[k]
            assert_same(got, reference_reduce(group[k], "Sum"), f"round {rnd}: group {k}")
        # The same grouped call blocking on one rank and async on the other, then both
        # blocking: its parts line up either way.
        again = [_ins(9500 + 10 * rnd + k, n, (count,), dtype, "Max")
                 for k, (dtype, count) in enumerate(GROUP)]
        mine_again = [g[rank].copy() for g in again]
        if rnd % 2 and rank == 0:
            got_again = tr.grouped_allreduce_async(mine_again, op=tr.Max,
                                                   name="burst.again").wait()
        else:
            got_again = tr.grouped_allreduce(mine_again, op=tr.Max, name="burst.again")
        for k, got in enumerate(got_again):
            assert_same(got, reference_reduce(again[k], "Max"), f"round {rnd}: again {k}")
    tr.barrier()
    stats = engine.stats()
    report(repeats=repeats, active=stats["active_ops"], general=stats["queued_general"])
    tr.shutdown()


def queued_at_shutdown(arg: dict) -> None:
    """Async allreduces queued and never waited for when shutdown() comes (rank 1 submits
    fewer, so some can never finish): shutdown returns, and each handle either has its
    result or raises a totalreduce error, on every rank, soon."""
    tr.init()
    rank = tr.rank()
    x = np.ones(4099, np.float32)
    for _ in range(2):  # the second call of each name is queued
        tr.allreduce_async_(x.copy(), op=tr.Sum, name="early").wait()
    handles = [tr.allreduce_async_(np.ones(4099, np.float32), op=tr.Sum, name="early")
               for _ in range(3 if rank == 0 else 1)]
    start = time.monotonic()
    tr.shutdown()
    outcomes = []
    for h in handles:
        try:
            outcomes.append(float(h.wait()[0]))
        except TotalReduceError as exc:
            outcomes.append(type(exc).__name__)
    report(outcomes=outcomes, seconds=time.monotonic() - start)


def agreed_slow_lending(arg: dict) -> None:
    """With every ring taken for slow (TOTALREDUCE_SLOW_RING_GBPS huge): rounds of async
    in-place allreduces of 9 MiB and a little more, each name's calls on the same buffer
    (as a training loop's gradients), queued for their Repeats.  Under one name rank 0's
    buffer is small-paged and rank 1's huge-paged, so that only rank 1 would lend while
    slow (HUGE_LEND_SHARE); under another both are huge-paged.  Values refilled each
    round; each result against numpy.  Reports the bodies this rank's Repeats lent under
    each name (the general path's first call lends by the loop's own rule), the share huge
    pages back of its buffers, and whether the rings were judged slow."""
    from totalreduce.bench.buffers import aligned_float32s
    from totalreduce.transport import pages
    from workers import _judge_rings

    tr.init()
    rank, n = tr.rank(), tr.size()
    engine = current().engine
    slow = _judge_rings(rank, n)
    count = (9 << 20) // 4 + 13
    lent: dict[str, int] = {}
    shares: dict[str, float | None] = {}
    for name, huge in (("split", rank == 1), ("both", True)):
        buf = aligned_float32s(count, 0.0, huge=huge)
        shares[name] = pages.huge_share(buf.ctypes.data, buf.nbytes)
        before = engine.stats()["express_repeats_lent"]
        for i in range(8):
            ins = [data(40 * i + len(name), r, (count,), np.float32) for r in range(n)]
            buf[:] = ins[rank]
            tr.barrier()
            got = tr.allreduce_async_(buf, op=tr.Sum, name=name).wait()
            assert got is buf
            assert_same(got, reference_reduce(ins, "Sum"), f"{name} round {i}")
        lent[name] = engine.stats()["express_repeats_lent"] - before
    tr.barrier()
    tr.shutdown()
    report(lent=lent, shares=shares, slow=slow)


def grouped_with_slow_parts(arg: dict) -> None:
    """A grouped async allreduce of four parts whose caller spends 2 ms before each part
    (as fusing many small arrays can), its second call queued, while the peer, ahead by
    20 ms, already runs the same call and its records lie in this rank's ring.  Reports
    how many parts were still queued as each part began (the progress thread must hold
    them until the call returns: a gap inside one call ends no burst) and how many turns
    the progress thread took inside the call (it must wait out the grace, not spin on the
    records meant for those parts).  Results against numpy."""
    import threading

    from totalreduce.engine import loop as loop_module
    from totalreduce.scheduling.selfguided import SelfGuided

    counts = [300_001, 200_003, 250_007, 400_009]  # float32: each part an op of its own
    held: list[int] = []
    turns = [0]
    slow = [False]
    working_copy = SelfGuided._working_copy
    step = loop_module.Loop.step

    def slow_copy(self: SelfGuided, arr: np.ndarray, inplace: bool) -> tuple[np.ndarray,
                                                                              bool]:
        if slow[0]:
            held.append(len(loop.queued))
            time.sleep(0.002)
        return working_copy(self, arr, inplace)

    def counted_step(self: loop_module.Loop, timeout: float | None, until: object = None,
                     top: bool = False) -> None:
        if slow[0] and threading.current_thread().name == "totalreduce-progress":
            turns[0] += 1
        step(self, timeout, until, top)  # type: ignore[arg-type]

    SelfGuided._working_copy = slow_copy  # type: ignore[method-assign]
    loop_module.Loop.step = counted_step  # type: ignore[method-assign]  # before init binds it
    tr.init()
    rank, n = tr.rank(), tr.size()
    loop = current().engine.loop
    for rnd in range(2):
        ins = [[data(50 * rnd + k, r, (c,), np.float32) for r in range(n)]
               for k, c in enumerate(counts)]
        mine = [x[rank].copy() for x in ins]
        tr.barrier()
        if rnd and rank == 0:
            time.sleep(0.02)  # the peer's records for these parts come first
        slow[0] = bool(rnd) and rank == 0
        handle = tr.grouped_allreduce_async_(mine, op=tr.Sum, name="slow.parts")
        slow[0] = False
        for k, got in enumerate(handle.wait()):
            assert_same(got, reference_reduce(ins[k], "Sum"), f"round {rnd}: part {k}")
    tr.barrier()
    tr.shutdown()
    report(held=held, turns=turns[0])


def copying_calls_in_a_burst(arg: dict) -> None:
    """Async allreduces, not in place, their second calls queued: each call's own work
    before it queues (the copy of its input) takes 2 ms here, past the 200 us grace.
    Reports how many calls were still queued as each queued (the progress thread must
    hold them: the work inside a call is no gap in the burst).  Results against numpy."""
    from totalreduce.scheduling.queued_calls import QueuedCalls

    queue = QueuedCalls._queued
    held: list[int] = []
    slow = [False]

    def slow_queue(self: QueuedCalls, plan: object, work: np.ndarray, kind: str,
                   name: str | None) -> object:
        if slow[0]:
            held.append(len(current().engine.loop.queued))
            time.sleep(0.002)
        return queue(self, plan, work, kind, name)  # type: ignore[arg-type]

    QueuedCalls._queued = slow_queue  # type: ignore[method-assign,assignment]
    tr.init()
    rank, n = tr.rank(), tr.size()
    counts = [30_001, 5, 70_003, 1_001]
    for rnd in range(2):
        ins = [[data(70 * rnd + k, r, (c,), np.float64) for r in range(n)]
               for k, c in enumerate(counts)]
        tr.barrier()
        slow[0] = bool(rnd) and rank == 0
        handles = [tr.allreduce_async(x[rank], op=tr.Sum, name=f"copying.{k}")
                   for k, x in enumerate(ins)]
        slow[0] = False
        for k, handle in enumerate(handles):
            assert_same(handle.wait(), reference_reduce(ins[k], "Sum"), f"round {rnd}: {k}")
    tr.barrier()
    tr.shutdown()
    report(held=held)
