"""Worker functions run on every rank by the multi-process tests (see harness.py).

Each rank derives every other rank's input from a shared seed, so it computes the numpy
reference for the whole job locally and compares its own result with it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import signal
import socket
import sys
import time

import numpy as np

import totalreduce as tr
from reporting import report, wait_for_report
from totalreduce import memcopy

DTYPES = [np.bool_, np.uint8, np.int8, np.uint16, np.int16, np.int32, np.int64, np.float16,
          np.float32, np.float64]
# A dtype of each width and kind, where the dtype is not what a test is about.
WIDTHS = ["bool", "float16", "int32", "float32", "int64", "float64"]
OPS = {"Sum": tr.Sum, "Average": tr.Average, "Min": tr.Min, "Max": tr.Max,
       "Product": tr.Product}
TOL = {np.dtype(np.float16): 2e-2, np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12}
_SLICE = 1 << 16  # values compared at a time within a tolerance (assert_same)


def data(seed: int, rank: int, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    rng = np.random.default_rng([seed, rank])
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return np.array(rng.random(shape) < 0.5)
    if dt.kind == "f":
        values = rng.random(shape)
        values += 0.5  # in place: a second float64 array of millions of values is slow
        return values.astype(dt)
    info = np.iinfo(dt)
    # Values spread over the whole range, so sums and products overflow and wrap.
    return np.array(rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True))


def reference_reduce(arrays: list[np.ndarray], op: str) -> np.ndarray:
    fn = {"Sum": np.add, "Average": np.add, "Min": np.minimum, "Max": np.maximum,
          "Product": np.multiply}[op]
    with np.errstate(over="ignore"):
        out = functools.reduce(lambda a, b: fn(a, b, dtype=a.dtype), arrays)
        if op == "Average":
            # Integers: truncated toward zero, as in Horovod.
            out = (out - np.fmod(out, len(arrays))) // len(arrays) \
                if out.dtype.kind in "iu" else \
                (out / np.array(len(arrays), out.dtype)).astype(out.dtype)
    return out


def assert_same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    tol = TOL.get(got.dtype)
    if tol is None:
        assert np.array_equal(got, want), f"{what}: values differ\n{got}\n{want}"
    elif not np.array_equal(got, want):
        # Equal values are within any tolerance: only values that differ are compared in
        # float64 (most of a soak's checking, its sums of small integers being exact),
        # and a slice at a time: float64 copies of arrays of millions of values cost more
        # in fresh pages than the comparison.
        flat_got, flat_want = got.reshape(-1), want.reshape(-1)
        with np.errstate(over="ignore", invalid="ignore"):
            ok = all(np.allclose(flat_got[i:i + _SLICE].astype(np.float64),
                                 flat_want[i:i + _SLICE].astype(np.float64), rtol=tol,
                                 atol=tol, equal_nan=True)
                     for i in range(0, flat_got.size, _SLICE))
        assert ok, f"{what}: values differ beyond {tol}\n{got}\n{want}"


SHAPES = [(0,), (1,), (), (7,), (3, 5), (1031,), (4099, 3)]


def check_collectives(arg: dict) -> None:
    """Every collective, op and dtype against numpy, sizes 0/1/0-d/prime/multi-segment.
    ``arg["dtypes"]``: names of the dtypes to take (all of DTYPES by default)."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    seed = 11
    checked = 0
    dtypes = [np.dtype(d).type for d in arg["dtypes"]] if "dtypes" in arg else DTYPES
    for dtype in DTYPES:
        if dtype not in dtypes:
            seed += len(SHAPES)  # the same inputs as in a run of every dtype
            continue
        for shape in SHAPES:
            seed += 1
            inputs = [data(seed, r, shape, dtype) for r in range(n)]
            mine = inputs[rank]
            for opname, op in OPS.items():
                if opname == "Average" and dtype == np.bool_:
                    continue  # a TypeError (test_units): bools have no average
                if opname == "Product" and shape == (4099, 3) and dtype != np.float64:
                    continue  # products of 4 random floats in (0.5, 1.5): fine, just slow
                want = reference_reduce(inputs, opname)
                got = tr.allreduce(mine, op=op, name=f"ar.{dtype.__name__}.{shape}.{opname}")
                assert_same(got, want, f"allreduce {opname} {np.dtype(dtype)} {shape}")
                inplace = mine.copy()
                assert tr.allreduce_(inplace, op=op) is inplace
                assert_same(inplace, want, f"allreduce_ {opname} {np.dtype(dtype)} {shape}")
                checked += 2
            # Non-contiguous input (a transposed or strided view) is copied.
            if len(shape) == 2:
                view = np.asfortranarray(mine).T
                want_t = reference_reduce([a.T for a in inputs], "Sum")
                assert_same(tr.allreduce(view, op=tr.Sum), want_t, "allreduce transposed")
                strided = np.ascontiguousarray(inputs[rank])[:, ::2]
                buf = np.array(mine)
                target = buf[:, ::2]
                tr.allreduce_(target, op=tr.Max)
                assert_same(buf[:, ::2], reference_reduce([a[:, ::2] for a in inputs], "Max"),
                            "allreduce_ strided")
                assert_same(strided, inputs[rank][:, ::2], "input untouched")
            if shape == ():
                continue
            # allgather: first dimensions differ per rank (rank 1 contributes none).
            rows = [(r * 3 + shape[0]) % 5 if r != 1 else 0 for r in range(n)]
            parts = [data(seed, r, (rows[r], *shape[1:]), dtype) for r in range(n)]
            assert_same(tr.allgather(parts[rank]), np.concatenate(parts), "allgather")
            # broadcast from every root
            for root in range(n):
                got = tr.broadcast(mine, root_rank=root)
                assert_same(got, inputs[root], f"broadcast root {root}")
                buf = mine.copy()
                tr.broadcast_(buf, root_rank=root)
                assert_same(buf, inputs[root], f"broadcast_ root {root}")
            # reducescatter: lower ranks take the extra rows
            before = mine.copy()
            for opname in ("Sum", "Max") if dtype == np.bool_ else ("Sum", "Average", "Max"):
                full = reference_reduce(inputs, opname)
                b = [0]
                for r in range(n):
                    b.append(b[-1] + shape[0] // n + (1 if r < shape[0] % n else 0))
                got = tr.reducescatter(mine, op=OPS[opname])
                assert_same(got, full[b[rank]:b[rank + 1]], f"reducescatter {opname}")
                # A blocking reducescatter reads the caller's array in place: never into it.
                assert_same(mine, before, f"reducescatter {opname} input untouched")
            # alltoall: default even splits, and random splits known to every rank
            rng = np.random.default_rng(seed)
            splits = [rng.multinomial(shape[0], [1 / n] * n) for _ in range(n)]
            for use_splits in (False, True):
                if use_splits:
                    sp = splits
                else:
                    b = [shape[0] // n + (1 if r < shape[0] % n else 0) for r in range(n)]
                    sp = [np.array(b) for _ in range(n)]
                out, recv = tr.alltoall(mine, splits=splits[rank] if use_splits else None)
                offs = [np.concatenate([[0], np.cumsum(s)]) for s in sp]
                want = np.concatenate([inputs[src][offs[src][rank]:offs[src][rank + 1]]
                                       for src in range(n)])
                assert_same(out, want, f"alltoall splits={use_splits}")
                assert recv.tolist() == [int(sp[src][rank]) for src in range(n)]
            checked += 4 + 2 * n + 3
    # grouped allreduce with mixed dtypes, an empty member, and members big enough to go
    # as ops of their own
    arrays = [data(5, rank, s, d) for s, d in (((3,), np.float32), ((0,), np.float32),
                                               ((2, 2), np.int64), ((40001,), np.float32),
                                               ((9,), np.float32), ((200, 101), np.float64))]
    want = [reference_reduce([data(5, r, a.shape, a.dtype.type) for r in range(n)], "Sum")
            for a in arrays]
    for got, w in zip(tr.grouped_allreduce(arrays, op=tr.Sum), want, strict=True):
        assert_same(got, w, "grouped_allreduce")
    inplace = [a.copy() for a in arrays]
    out = tr.grouped_allreduce_async_(inplace, op=tr.Sum, name="grouped-inplace").wait()
    for got, mine, w in zip(out, inplace, want, strict=True):
        assert got is mine
        assert_same(mine, w, "grouped_allreduce_async_")
    from totalreduce.runtime import current

    # Read before the barrier: a peer that leaves after it closes its link at once.
    transport = current().transport
    rings = transport.ring_peers() if hasattr(transport, "ring_peers") else []
    tr.barrier()
    tr.shutdown()
    report(checked=checked, rings=rings, copy_piece=memcopy.piece())


def out_of_order(arg: dict) -> None:
    """50 async ops, each rank submitting them in its own random order at random times."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    rng = random.Random(1000 + rank)
    specs = list(range(50))
    rng.shuffle(specs)
    handles = {}
    for i in specs:
        time.sleep(rng.uniform(0, 0.02))
        kind = i % 5
        x = data(i, rank, (i * 37 % 200 + 1, 3), np.float32 if i % 2 else np.int32)
        name = f"op{i}"
        if kind == 0:
            handles[i] = tr.allreduce_async(x, op=tr.Sum, name=name, priority=i % 3)
        elif kind == 1:
            handles[i] = tr.allgather_async(x[: rank + i % 4], name=name)
        elif kind == 2:
            handles[i] = tr.broadcast_async(x, root_rank=i % n, name=name)
        elif kind == 3:
            handles[i] = tr.alltoall_async(x, name=name)
        else:
            handles[i] = tr.reducescatter_async(x, op=tr.Max, name=name)
    for i in sorted(handles):
        got = handles[i].wait(timeout=60)
        kind = i % 5
        ins = [data(i, r, (i * 37 % 200 + 1, 3), np.float32 if i % 2 else np.int32)
               for r in range(n)]
        if kind == 0:
            assert_same(got, reference_reduce(ins, "Sum"), f"op{i}")
        elif kind == 1:
            assert_same(got, np.concatenate([a[: r + i % 4] for r, a in enumerate(ins)]),
                        f"op{i}")
        elif kind == 2:
            assert_same(got, ins[i % n], f"op{i}")
        elif kind == 3:
            rows = ins[0].shape[0]
            b = np.cumsum([0] + [rows // n + (1 if r < rows % n else 0) for r in range(n)])
            assert_same(got[0], np.concatenate([a[b[rank]:b[rank + 1]] for a in ins]), f"op{i}")
        else:
            full = reference_reduce(ins, "Max")
            rows = full.shape[0]
            b = np.cumsum([0] + [rows // n + (1 if r < rows % n else 0) for r in range(n)])
            assert_same(got, full[b[rank]:b[rank + 1]], f"op{i}")
    tr.shutdown()
    print("out-of-order ok")


def lent_bodies(arg: dict) -> None:
    """Large ops whose pieces are lent (read by the receiver out of the sender's memory):
    every collective and dtype against numpy, async, each rank submitting in its own order
    at its own times; prints how many bodies this rank lent."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    rng = random.Random(77 + rank)
    jobs = [(i, dtype) for i, dtype in enumerate([np.float32, np.float64, np.int32,
                                                  np.uint8, np.float16, np.int64] * 2)]
    rng.shuffle(jobs)
    handles = {}
    for i, dtype in jobs:
        time.sleep(rng.uniform(0, 0.01))
        shape = (30011 + 977 * i, 3)  # odd row counts; pieces of at least 64 KiB
        x = data(i, rank, shape, dtype)
        kind = i % 5
        name = f"big{i}"
        if kind == 0:
            handles[i] = tr.allreduce_async(x, op=tr.Sum, name=name)
        elif kind == 1:
            handles[i] = tr.allgather_async(x[: shape[0] - 5 * rank], name=name)
        elif kind == 2:
            handles[i] = tr.broadcast_async(x, root_rank=i % n, name=name)
        elif kind == 3:
            handles[i] = tr.alltoall_async(x, name=name)
        else:
            handles[i] = tr.reducescatter_async(x, op=tr.Max, name=name)
    for i, dtype in sorted(jobs):
        got = handles[i].wait(timeout=120)
        shape = (30011 + 977 * i, 3)
        ins = [data(i, r, shape, dtype) for r in range(n)]
        rows = shape[0]
        b = np.cumsum([0] + [rows // n + (1 if r < rows % n else 0) for r in range(n)])
        kind = i % 5
        what = f"big{i} {np.dtype(dtype)}"
        if kind == 0:
            assert_same(got, reference_reduce(ins, "Sum"), what)
        elif kind == 1:
            assert_same(got, np.concatenate([a[: rows - 5 * r] for r, a in enumerate(ins)]),
                        what)
        elif kind == 2:
            assert_same(got, ins[i % n], what)
        elif kind == 3:
            assert_same(got[0], np.concatenate([a[b[rank]:b[rank + 1]] for a in ins]), what)
        else:
            assert_same(got, reference_reduce(ins, "Max")[b[rank]:b[rank + 1]], what)
    tr.barrier()
    lent = tr.transport_stats()["bodies_lent"]
    tr.shutdown()
    report(lent=lent)


def slow_ring(arg: dict) -> None:
    """After a warm-up, blocking ops of 0.8-1 MiB (under CMA_BYTES: lent only while a ring is slow),
    every kind, odd sizes, several dtypes, rotating roots and a rank a little late, each
    against numpy; reports how many bodies this rank lent and how many ops of its 3
    broadcasts and 3 alltoalls (sizes, then data) ran on its own thread."""
    from totalreduce.runtime import current

    tr.init()
    rank, n = tr.rank(), tr.size()
    stats = current().engine.stats
    for i in range(12):  # a lap of each ring and more, for the copies to be judged
        got = tr.allreduce(np.full((960 << 10) // 4, rank, np.float32), op=tr.Sum,
                           name=f"warm.{i}")
        assert np.all(got == n * (n - 1) / 2), "warm-up"
    direct = 0
    for i in range(15):
        dtype = (np.float32, np.float64, np.int32)[i % 3]
        count = ((800 << 10) + (37 << 10) * (i % 5)) // np.dtype(dtype).itemsize + 2 * i + 1
        rows = count // n * n  # alltoall and reducescatter: rows split evenly
        ins = [data(i, r, (count,), dtype) for r in range(n)]
        if rank == i % n:
            time.sleep(0.002)
        kind = i % 5
        what = f"op {i} ({kind}) of {count} {np.dtype(dtype)}"
        if kind == 0:
            before = stats()["direct_ops"]
            assert_same(tr.broadcast(ins[rank], root_rank=i % n, name=f"b{i}"), ins[i % n],
                        what)
            direct += stats()["direct_ops"] - before
        elif kind == 1:
            part = count // n
            assert_same(tr.allgather(ins[rank][:part - rank], name=f"g{i}"),
                        np.concatenate([a[:part - r] for r, a in enumerate(ins)]), what)
        elif kind == 2:
            before = stats()["direct_ops"]
            got, _ = tr.alltoall(ins[rank][:rows], name=f"a{i}")
            direct += stats()["direct_ops"] - before
            b = rows // n
            assert_same(got, np.concatenate([a[rank * b:(rank + 1) * b] for a in ins]), what)
        elif kind == 3:
            b = rows // n
            assert_same(tr.reducescatter(ins[rank][:rows], op=tr.Sum, name=f"r{i}"),
                        reference_reduce([a[:rows] for a in ins], "Sum")[rank * b:(rank + 1) * b],
                        what)
        else:
            assert_same(tr.allreduce(ins[rank], op=tr.Sum, name=f"s{i}"),
                        reference_reduce(ins, "Sum"), what)
    tr.barrier()
    lent = tr.transport_stats()["bodies_lent"]
    # Broadcasts of 5 MiB from rank 0: at 2 ranks lent, the root copying half; else, too
    # big for the caller's thread, while the rings are slow each either lends its bodies
    # or copies them through the ring, whichever has been faster, trying each twice
    # first (scheduling/slow_rings.py).
    ways = []
    for i in range(4):
        count = (5 << 20) // 8 + 3 * i + 1
        ins = [data(100 + i, r, (count,), np.float64) for r in range(n)]
        before = tr.transport_stats()["bodies_lent"]
        assert_same(tr.broadcast(ins[rank], root_rank=0, name=f"big{i}"), ins[0],
                    f"big broadcast {i}")
        ways.append(tr.transport_stats()["bodies_lent"] > before)
        tr.barrier()
    tr.shutdown()
    report(lent=lent, direct=direct, big_lent=ways)


def _judge_rings(rank: int, n: int) -> bool:
    """Blocking allreduces of 960 KiB, a lap of each ring and more, for the copies to be
    judged (transport/copy_pace.py); returns whether most rings are now taken for slow."""
    from totalreduce.runtime import current

    for i in range(12):
        got = tr.allreduce(np.full((960 << 10) // 4, rank, np.float32), op=tr.Sum,
                           name=f"warm.{i}")
        assert np.all(got == n * (n - 1) / 2), "warm-up"
    return current().engine.lends([p for p in range(n) if p != rank])


def slow_ring_reductions(arg: dict) -> None:
    """With every ring taken for slow (TOTALREDUCE_SLOW_RING_GBPS huge): async allreduces
    of 0.75-3 MiB, repeated under one name (a template's) and named anew each call, in
    place and not, and async reducescatters, several dtypes, odd sizes, submitted in a
    different order on each rank, a rank a little late now and then; each against numpy.
    Reports the bodies this rank lent meanwhile, and whether its rings were judged slow."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    slow = _judge_rings(rank, n)
    before = tr.transport_stats()["bodies_lent"]
    for i in range(6):
        if rank == i % n:
            time.sleep(0.002)
        calls = []
        for j in range(4):
            dtype = (np.float32, np.float64, np.int32)[(i + j) % 3]
            count = ((768 << 10) + (701 << 10) * j) // np.dtype(dtype).itemsize + 2 * j + 1
            rows = count // n * n
            ins = [data(10 * i + j, r, (count,), dtype) for r in range(n)]
            mine = ins[rank].copy()
            name = f"same.{j}" if j % 2 else f"new.{i}.{j}"
            if j == 3:
                b = rows // n
                want = reference_reduce([a[:rows] for a in ins], "Sum")[rank * b:(rank + 1) * b]
                handle = tr.reducescatter_async(mine[:rows], op=tr.Sum, name=name)
            elif j == 1:
                want = reference_reduce(ins, "Sum")
                handle = tr.allreduce_async_(mine, op=tr.Sum, name=name)
            else:
                want = reference_reduce(ins, "Sum")
                handle = tr.allreduce_async(mine, op=tr.Sum, name=name)
            calls.append((handle, want, f"call {i}.{j} of {count} {np.dtype(dtype)}"))
        order = calls if rank % 2 == 0 else calls[::-1]
        for handle, want, what in order:
            assert_same(handle.wait(), want, what)
    lent = tr.transport_stats()["bodies_lent"] - before
    tr.barrier()
    tr.shutdown()
    report(lent=lent, slow=slow)


def async_mid_reductions(arg: dict) -> None:
    """With every ring taken for slow (TOTALREDUCE_SLOW_RING_GBPS huge): rounds of async
    allreduces of 9-13 MiB, each name called once a round (so a template's Repeat may run
    the later calls, queued), several dtypes, odd sizes, in place and not, submitted back
    to back in one order (as a training loop does), but for a round in a different order
    on each rank and one with a rank late; each against numpy.  Reports the calls that
    were queued (run from their Repeats or, failing that, on the general path) and
    whether the rings were judged slow."""
    from totalreduce.runtime import current

    tr.init()
    rank, n = tr.rank(), tr.size()
    engine = current().engine
    slow = _judge_rings(rank, n)
    sizes = ((9 << 20) + 24, (13 << 20) + 40, (9 << 20) + 8)
    dtypes = (np.float32, np.float64, np.int32)
    before = engine.stats()
    for i in range(6):
        # Inputs first: a call more than a couple of milliseconds after the one before
        # is not queued (loop.py).
        work = []
        for j, nbytes in enumerate(sizes):
            dtype = dtypes[j]
            count = nbytes // np.dtype(dtype).itemsize + 2 * j + 1
            ins = [data(20 * i + j, r, (count,), dtype) for r in range(n)]
            work.append((j, ins[rank].copy(), reference_reduce(ins, "Sum"),
                         f"call {i}.{j} of {count} {np.dtype(dtype)}"))
        tr.barrier()
        if i == 3 and rank == 1:
            time.sleep(0.003)
        calls = []
        for j, mine, want, what in (work[::-1] if i == 4 and rank % 2 else work):
            # The third not in place: the result is a new array.
            submit = tr.allreduce_async if j == 2 else tr.allreduce_async_
            calls.append((submit(mine, op=tr.Sum, name=f"mid.{j}"), want, what))
        for handle, want, what in calls:
            assert_same(handle.wait(), want, what)
    after = engine.stats()
    tr.barrier()
    tr.shutdown()
    report(queued=sum(after[k] - before[k] for k in ("queued_ran", "queued_general")),
           slow=slow)


def spread_broadcasts(arg: dict) -> None:
    """Blocking broadcasts of 1-11 MiB from rank 0 (lent bodies whose root copies half of
    each into the receiver: transport/ring_link.py), into new arrays and in place,
    several dtypes, odd sizes, each name twice (the second call from its Repeat), the
    receiver a little late now and then; each against numpy.  Reports how many bodies
    this rank lent and copied half of."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    for i in range(12):
        k = i // 2
        dtype = (np.float32, np.float64, np.int16)[k % 3]
        count = ((1 << 20) + (2 << 20) * k) // np.dtype(dtype).itemsize + 2 * k + 1
        ins = [data(300 + i, r, (count,), dtype) for r in range(n)]
        if rank and k % 2:
            time.sleep(0.003)
        what = f"broadcast {i} of {count} {np.dtype(dtype)}"
        if k % 3 == 2:
            buf = ins[rank].copy()
            tr.broadcast_(buf, root_rank=0, name=f"spread{k}")
            assert_same(buf, ins[0], what)
        else:
            assert_same(tr.broadcast(ins[rank], root_rank=0, name=f"spread{k}"), ins[0],
                        what)
            assert_same(ins[rank], data(300 + i, rank, (count,), dtype), what + " (input)")
    stats = tr.transport_stats()
    tr.shutdown()
    report(spread=stats["bodies_spread"], lent=stats["bodies_lent"])


def lent_pieces_in_slices(arg: dict) -> None:
    """Allreduces and a reducescatter whose lent pieces (2 MiB) are copied in several
    slices: blocking ones reading the caller's array (OpSpec.fresh) and async in-place
    ones, several dtypes and ops, odd sizes, values that differ by position, ranks
    starting at their own times; each against numpy.  Reports how many bodies this rank
    lent."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    count = (5 << 20) // 4 + 13
    cases = [(np.float32, "Sum", True), (np.float64, "Average", True),
             (np.int32, "Max", False), (np.float16, "Sum", False), (np.int64, "Sum", True)]
    for i, (dtype, op, blocking) in enumerate(cases):
        time.sleep(0.003 * ((rank + i) % n))
        x = data(40 + i, rank, (count,), dtype)
        want = reference_reduce([data(40 + i, r, (count,), dtype) for r in range(n)], op)
        if blocking:
            got = tr.allreduce(x, op=getattr(tr, op), name=f"sliced.{i}")
        else:
            tr.allreduce_async_(x, op=getattr(tr, op), name=f"sliced.{i}").wait(timeout=120)
            got = x
        assert_same(got, want, f"allreduce {i} ({np.dtype(dtype).name}, {op})")
    rows = data(50, rank, (count // 3 + 7, 3), np.float32)
    got = tr.reducescatter(rows, op=tr.Sum, name="sliced.rs")
    total = reference_reduce([data(50, r, rows.shape, np.float32) for r in range(n)], "Sum")
    sizes = [rows.shape[0] // n + (r < rows.shape[0] % n) for r in range(n)]
    start = sum(sizes[:rank])
    assert_same(got, total[start:start + sizes[rank]], "reducescatter")
    lent = tr.transport_stats()["bodies_lent"]
    tr.barrier()
    tr.shutdown()
    report(lent=lent)


def broadcast_root_copies(arg: dict) -> None:
    """A broadcast (its root lends it only where it copies half into its receiver), then
    an allgather and an alltoall that lend; reports what each rank lent during each, and
    the lent bodies it copied half of in the broadcast."""
    tr.init()
    rank = tr.rank()
    count = (3 << 20) // 8 + 5  # several 128 KiB pieces and an odd tail
    want = np.arange(count, dtype=np.float64) * 0.5
    x = want.copy() if rank == 0 else np.zeros(count)
    tr.barrier()
    before = tr.transport_stats()
    got = tr.broadcast(x, root_rank=0, name="params")
    assert np.array_equal(got, want), "broadcast"
    tr.barrier()
    stats = tr.transport_stats()
    mid = stats["bodies_lent"]
    spread = stats["bodies_spread"] - before["bodies_spread"]
    before = before["bodies_lent"]
    n, half = tr.size(), count // 2
    rows = tr.allgather(np.full((half, 2), rank, np.float64), name="rows")
    for r in range(n):
        assert np.array_equal(rows[r * half:(r + 1) * half], np.full((half, 2), r)), \
            "allgather"
    tr.barrier()
    after = tr.transport_stats()["bodies_lent"]
    mine = np.arange(n * count, dtype=np.float64) + 10 * rank
    got, splits = tr.alltoall(mine, name="swap")
    want = np.concatenate([(np.arange(n * count, dtype=np.float64) + 10 * r)
                           [rank * count:(rank + 1) * count] for r in range(n)])
    assert np.array_equal(got, want) and list(splits) == [count] * n, "alltoall"
    tr.barrier()
    last = tr.transport_stats()["bodies_lent"]
    tr.shutdown()
    report(broadcast=mid - before, spread=spread, allgather=after - mid,
           alltoall=last - after)


def urgent_overtakes(arg: dict) -> None:
    """A big allreduce in many lent pieces, then at once a more urgent small op of each
    kind whose pieces the peer posts behind them; every result against numpy; reports how
    many messages were read ahead of slower ones.  The urgent ops are async, so the loop
    runs them (a blocking one would take the urgent lane, engine/urgent.py)."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    count = (8 << 20) // 4 + 3
    # Whether an urgent piece lands behind lent ones is up to timing: every kind of op
    # once, then more rounds until the peers have read one ahead (every rank stops at
    # the same round: the count is summed over them).
    for rep in range(16):
        if rep >= 4 and tr.allreduce(np.array([tr.transport_stats()["overtaken"]]),
                                     op=tr.Sum, name=f"seen.{rep}")[0] > 0:
            break
        big = data(60 + rep, rank, (count,), np.float32)
        h = tr.allreduce_async_(big, op=tr.Sum, name=f"big.{rep}", priority=0)
        dtype = [np.float64, np.int32, np.float16, np.uint8][rep % 4]
        small = (np.arange(1000 + rep, dtype=np.int64) % 7 + rank).astype(dtype)
        want = sum((np.arange(1000 + rep, dtype=np.int64) % 7 + r).astype(dtype)
                   for r in range(n))
        got = tr.allreduce_async(small, op=tr.Sum, name=f"urgent.{rep}",
                                 priority=5).wait()
        assert_same(got, want.astype(dtype), f"urgent {rep}")
        rows = tr.allgather_async(np.full((rep + 1, 2), rank, np.int32),
                                  name=f"rows.{rep}", priority=5).wait()
        assert_same(rows, np.concatenate([np.full((rep + 1, 2), r, np.int32)
                                          for r in range(n)]), f"rows {rep}")
        h.wait(timeout=120)
        assert_same(big, reference_reduce([data(60 + rep, r, (count,), np.float32)
                                           for r in range(n)], "Sum"), f"big {rep}")
    tr.barrier()
    stats = tr.transport_stats()
    tr.shutdown()
    report(overtaken=stats["overtaken"], lent=stats["bodies_lent"])


def results_into_out(arg: dict) -> None:
    """allgather and alltoall with out=: every dtype, odd and empty blocks, sync and async,
    against numpy, the result in the caller's array; then the mistakes: a wrong dtype or
    an overlapping out raises at once on that rank; out with the wrong rows (rank 1 only)
    lets every rank's call finish and raises on rank 1 alone."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    checked = 0
    for i, dtype in enumerate([np.float32, np.float64, np.int32, np.uint8, np.float16,
                               np.int64, np.bool_]):
        rows = [(3 * r + i) % 5 for r in range(n)]  # some ranks send no rows
        blocks = [data(i, r, (rows[r], 3), dtype) for r in range(n)]
        out = np.full((sum(rows), 3), 7, dtype)
        if i % 2:
            got = tr.allgather_async(blocks[rank], name=f"ag.{i}", out=out).wait()
        else:
            got = tr.allgather(blocks[rank], name=f"ag.{i}", out=out)
        assert got is out, "allgather out"
        assert_same(out, np.concatenate(blocks), f"allgather out {np.dtype(dtype)}")
        splits = [[(r + d + i) % 3 for d in range(n)] for r in range(n)]
        sent = [data(100 + i, r, (sum(splits[r]), 2), dtype) for r in range(n)]
        back = np.empty((sum(splits[r][rank] for r in range(n)), 2), dtype)
        got, recv = tr.alltoall(sent[rank], splits[rank], name=f"a2a.{i}", out=back)
        want = [sent[r][sum(splits[r][:rank]):sum(splits[r][:rank + 1])] for r in range(n)]
        assert got is back and list(recv) == [splits[r][rank] for r in range(n)]
        assert_same(back, np.concatenate(want), f"alltoall out {np.dtype(dtype)}")
        checked += 2
    checked += same_shape_gathers(rank, n)
    x = np.ones((2, 3), np.float32)
    errors = same_shape_mistakes(rank, n)
    for what, call in (("dtype", lambda: tr.allgather(x, name="bad", out=np.empty((2 * n, 3)))),
                       ("overlap", lambda: tr.alltoall(x, name="bad2", out=x))):
        try:
            call()
        except (TypeError, ValueError) as exc:
            errors[what] = str(exc)
    short = np.empty((2 * n - (1 if rank == 1 else 0), 3), np.float32)
    try:
        tr.allgather(x, name="rows", out=short)
        errors["rows"] = ""
    except ValueError as exc:
        errors["rows"] = str(exc)
    assert_same(tr.allreduce(np.ones(1), op=tr.Sum, name="after"), np.full(1, float(n)), "after")
    tr.shutdown()
    report(checked=checked, errors=errors)


# (same_shape, blocking) of each call: a plan made, then run again (a blocking same-shape
# call from its Repeat), the two phases, and each kind async.
_GATHER_CALLS = ((True, True), (True, True), (False, True), (True, False), (False, False))


def gathers_from_their_input(arg: dict) -> None:
    """Allgathers whose sends read the caller's input while the result fills ``out``
    (ring_allgatherv's ``own``), against numpy: sizes from empty to past two segments
    (the caller's thread, the express lane lending its block, the loop lending whole
    blocks), each in the calls of _GATHER_CALLS; the input apart from ``out``, as
    ``out``'s own block (in place) or as a peer's block of it, each rank calling at its
    own moment; and the input changed after every call, which must not change what the
    call gathered."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    rng = random.Random(5 + rank)
    checked = 0
    for i, rows in enumerate(arg["rows"]):
        dtype = [np.float32, np.float64, np.int16][i % 3]
        for where in ("apart", "own", "peer's"):
            for call, (same, wait) in enumerate(_GATHER_CALLS):
                seed = 1000 * i + 10 * call + len(where)
                blocks = [data(seed, r, (rows, 3), dtype) for r in range(n)]
                out = np.zeros((rows * n, 3), dtype)
                at = {"apart": None, "own": rank, "peer's": (rank + 1) % n}[where]
                if at is None:
                    x = blocks[rank].copy()
                else:
                    x = out[at * rows:(at + 1) * rows]
                    x[:] = blocks[rank]
                time.sleep(rng.uniform(0, 0.005))
                name = f"own.{i}.{where}"
                if wait:
                    got = tr.allgather(x, name=name, out=out, same_shape=same)
                else:
                    got = tr.allgather_async(x, name=name, out=out, same_shape=same).wait()
                if at is None:
                    x += 1  # the call has ended: nothing may read its input any more
                assert got is out, name
                assert_same(out, np.concatenate(blocks), f"{name} call {call} rows {rows}")
                checked += 1
    lent = tr.transport_stats()["bodies_lent"]
    tr.shutdown()
    report(checked=checked, lent=lent)


def same_shape_gathers(rank: int, n: int) -> int:
    """allgather and alltoall with same_shape=True (no size exchange) against numpy:
    every dtype, empty and odd blocks, uneven splits, into out= or not; even ranks submit
    the allgather first, odd ranks the alltoall, and wait for both."""
    checked = 0
    for i, dtype in enumerate(DTYPES):
        rows = (3 * i) % 7  # 0 first: an empty block
        blocks = [data(200 + i, r, (rows, 3), dtype) for r in range(n)]
        m = 2 * i + 1  # odd: the even split gives the lower ranks a row more
        sent = [data(300 + i, r, (m, 2), dtype) for r in range(n)]
        counts = [m // n + (1 if d < m % n else 0) for d in range(n)]
        cut = [0, *np.cumsum(counts).tolist()]
        mine = cut[rank + 1] - cut[rank]
        gathered = np.full((rows * n, 3), 7, dtype) if i % 2 else None
        back = np.full((mine * n, 2), 7, dtype) if i % 3 else None

        h_swap = None
        if rank % 2:
            h_swap = tr.alltoall_async(sent[rank], name=f"same.a2a.{i}", out=back,
                                       same_shape=True)
        h_gather = tr.allgather_async(blocks[rank], name=f"same.ag.{i}", out=gathered,
                                      same_shape=True)
        if h_swap is None:
            h_swap = tr.alltoall_async(sent[rank], name=f"same.a2a.{i}", out=back,
                                       same_shape=True)
        got = h_gather.wait()
        assert gathered is None or got is gathered, "same_shape allgather out"
        assert_same(got, np.concatenate(blocks), f"same_shape allgather {np.dtype(dtype)}")
        got, recv = h_swap.wait()
        assert back is None or got is back, "same_shape alltoall out"
        assert list(recv) == [mine] * n, (list(recv), mine)
        assert_same(got, np.concatenate([s[cut[rank]:cut[rank + 1]] for s in sent]),
                     f"same_shape alltoall {np.dtype(dtype)}")
        # Blocking, and again (a repeat runs from the kept plan).
        for rep in range(2):
            assert_same(tr.allgather(blocks[rank], name="same.ag", same_shape=True),
                        np.concatenate(blocks), f"same_shape allgather blocking {rep}")
        checked += 2
    return checked


def same_shape_mistakes(rank: int, n: int) -> dict[str, str]:
    """What each rank gets when rank 1 alone leaves same_shape off, when rank 1 alone
    passes another shape with it, and when every rank gives an alltoall splits too."""
    errors: dict[str, str] = {}
    cases = (("flag", np.ones((2, 3), np.float32), rank != 1),
             ("shape", np.ones((3 if rank == 1 else 2, 3), np.float32), True))
    for what, x, same in cases:
        try:
            tr.allgather(x, name=f"mixed.{what}", same_shape=same)
            errors[what] = ""
        except tr.MismatchError as exc:
            errors[what] = str(exc)
    try:
        tr.alltoall(np.ones((n, 2)), splits=[1] * n, name="mixed.splits", same_shape=True)
        errors["splits"] = ""
    except ValueError as exc:
        errors["splits"] = str(exc)
    return errors


def ready_messages(arg: dict) -> None:
    """Allreduces submitted by both ranks at once; prints how many READY messages went."""
    from totalreduce.runtime import current

    tr.init()
    rank, n = tr.rank(), tr.size()
    tr.barrier()
    before = current().engine.stats()["ready_sent"]
    for i in range(20):
        x = data(i, rank, (arg["elems"],), np.float32)
        want = reference_reduce([data(i, r, (arg["elems"],), np.float32) for r in range(n)],
                                "Sum")
        assert_same(tr.allreduce(x, op=tr.Sum, name=f"r{i}"), want, f"r{i}")
    report(ready_sent=current().engine.stats()["ready_sent"] - before)


def lagging_rank(arg: dict) -> None:
    """Rank 0 starts a second late while the others race 200 ops ahead."""
    from totalreduce.runtime import current

    tr.init()
    rank, n = tr.rank(), tr.size()
    if rank == 0:
        time.sleep(1.0)
    handles = []
    for i in range(200):
        x = data(i, rank, (arg["elems"],), np.float32)
        handles.append(tr.allreduce_async(x, op=tr.Sum, name=f"lag{i}"))
    for i, h in enumerate(handles):
        want = reference_reduce([data(i, r, (arg["elems"],), np.float32) for r in range(n)],
                                "Sum")
        assert_same(h.wait(timeout=60), want, f"lag{i}")
    stats = current().engine.stats()
    assert stats["floating_peak"] <= stats["floating_cap"], stats
    report(floating_peak=stats["floating_peak"], floating_cap=stats["floating_cap"])
    tr.shutdown()


def mismatch(arg: dict) -> None:
    """Each case of ``arg["whats"]`` in turn: an allreduce the ranks disagree on, then one
    they agree on (the job goes on after a mismatch).  One job runs every case, so each
    case's outcome is reported under ``case:<what>`` and a case that does not raise is
    reported, not raised: the other cases still run and the test names the one that
    failed."""
    tr.init()
    rank = tr.rank()
    for what in arg["whats"]:
        if what == "shape":
            x = np.ones(5 if rank == 1 else 4, np.float32)
        elif what == "dtype":
            x = np.ones(4, np.float64 if rank == 1 else np.float32)
        elif what == "layout":  # same element count, different shape
            x = np.ones((2, 3) if rank == 1 else (3, 2), np.float32)
        else:  # the op
            x = np.ones(4, np.float32)
        op = tr.Max if what == "op" and rank == 1 else tr.Average
        start = time.monotonic()
        try:
            tr.allreduce(x, op=op, name="grad.w")
        except tr.MismatchError as exc:
            got: dict = {"mismatch": str(exc), "after_s": time.monotonic() - start}
        else:
            got = {"returned_data": True}
        # The job goes on after a mismatch.
        y = tr.allreduce(np.full(3, rank, np.int64), op=tr.Sum, name="after")
        got["after_ok"] = y.tolist() == [sum(range(tr.size()))] * 3
        report(**{f"case:{what}": got})
    tr.shutdown()


def algorithm_mismatch(arg: dict) -> None:
    """Rank 0 sets TOTALREDUCE_HALVING_BYTES so that it takes the log-step algorithms and
    the others do not: each op must fail on every rank, saying the algorithms differ, and
    the job must go on."""
    if os.environ["TOTALREDUCE_RANK"] == "0":
        os.environ["TOTALREDUCE_HALVING_BYTES"] = str(1 << 30)
    tr.init()
    n = tr.size()
    x = np.ones((1 << 17, 4), np.float32)  # 2 MiB: past SMALL_BYTES, where doubling runs
    for what, call in (("allreduce", lambda: tr.allreduce(x, op=tr.Sum, name="a")),
                       ("broadcast", lambda: tr.broadcast(x, root_rank=1, name="b")),
                       ("allgather", lambda: tr.allgather(x, name="g")),
                       ("reducescatter", lambda: tr.reducescatter(x, op=tr.Sum, name="r"))):
        start = time.monotonic()
        try:
            call()
        except tr.MismatchError as exc:
            got: dict = {"mismatch": str(exc), "after_s": time.monotonic() - start}
        else:
            got = {"returned_data": True}
        y = tr.allreduce(np.full(3, 1, np.int64), op=tr.Sum, name=f"after.{what}")
        got["after_ok"] = y.tolist() == [n] * 3
        report(**{f"case:{what}": got})
    tr.shutdown()


def killed_peer(arg: dict) -> None:
    tr.init()
    rank = tr.rank()
    x = np.ones(1 << 16, np.float32)
    for _ in range(5):
        tr.allreduce(x)
    if rank == arg["victim"]:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        while True:
            tr.allreduce(x)
    except tr.PeerFailureError as exc:
        report(caught_rank=exc.rank, after_s=time.monotonic() - start, caught=str(exc))
        sys.exit(3)


def strangers(arg: dict) -> None:
    from totalreduce.exceptions import AuthenticationError
    from totalreduce.rendezvous.auth import client_handshake
    from totalreduce.rendezvous.kvstore import KVClient

    env = os.environ
    rdv = env["TOTALREDUCE_RENDEZVOUS"]

    def poke(address: str) -> None:
        host, _, port = address.rpartition(":")
        with socket.create_connection((host, int(port))) as s:
            s.settimeout(15)
            s.sendall(b"GET / HTTP/1.0\r\n\r\n" + os.urandom(200))
            try:
                while s.recv(4096):
                    pass
            except OSError:
                pass
        with socket.create_connection((host, int(port))) as s:
            try:
                client_handshake(s, b"not the secret", {"rank": 0, "job": "x"}, 15)
            except (AuthenticationError, OSError) as exc:
                print(f"wrong secret refused at {address}: {type(exc).__name__}")
            else:
                raise AssertionError("a wrong secret was accepted")

    if tr_rank() == 0:
        poke(rdv)
    tr.init()
    if tr.rank() == 0:
        kv = KVClient(rdv, env["TOTALREDUCE_SECRET"].encode(), env["TOTALREDUCE_JOB_ID"], 10)
        poke(kv.get(f"{env['TOTALREDUCE_JOB_ID']}/addr/1", 10).decode())
        kv.close()
    tr.barrier()
    got = tr.allreduce(np.arange(10, dtype=np.float64) * (tr.rank() + 1), op=tr.Sum)
    assert np.array_equal(got, np.arange(10) * sum(range(1, tr.size() + 1)))
    tr.shutdown()
    report(finished=True)


def tr_rank() -> int:
    return int(os.environ["TOTALREDUCE_RANK"])


def priority(arg: dict) -> None:
    tr.init()
    big = np.ones(16 << 20, np.float32)          # 64 MB
    small = np.ones(10, np.float32)
    hbig = tr.allreduce_async(big, op=tr.Sum, name="big", priority=0)
    hsmall = tr.allreduce_async(small, op=tr.Sum, name="small", priority=10)
    hsmall.wait(timeout=60)
    big_done_first = hbig.done()
    assert hbig.wait(timeout=60)[0] == tr.size()
    assert hsmall.wait()[0] == tr.size()
    report(small_first=not big_done_first)
    assert not big_done_first, "the 64 MB op finished before the urgent small one"
    tr.shutdown()


def op_timeout(arg: dict) -> None:
    tr.init()
    if tr.rank() == 1:
        time.sleep(arg["late"])
    start = time.monotonic()
    try:
        tr.allreduce(np.ones(3), name=f"late{tr.rank()}")
    except tr.OpTimeoutError as exc:
        report(timeout=str(exc), after_s=time.monotonic() - start)
    else:
        raise AssertionError("no OpTimeoutError")
    # Leaving now would fail the late rank's op (PeerFailureError) before it times out:
    # each rank leaves once every other rank's op has timed out too.
    for r in range(tr.size()):
        wait_for_report(r, "timeout", 30.0)
    tr.shutdown()


def stall(arg: dict) -> None:
    """Rank 1 submits 'slowpoke' 2.5 s late, or as soon as rank 0 has logged a stall
    warning (its logger calls report ``warned``; the warning is logged as before)."""
    tr.init()
    if tr.rank() == 0:
        import logging

        def warned(record: logging.LogRecord) -> bool:
            if "has waited" in record.getMessage():
                report(warned=True)
            return True  # a filter that lets everything through

        for logger in list(logging.Logger.manager.loggerDict.values()):
            if isinstance(logger, logging.Logger) and logger.name.startswith("totalreduce"):
                logger.addFilter(warned)
    else:
        wait_for_report(0, "warned", 2.5)
    tr.allreduce(np.ones(3), name="slowpoke")
    tr.shutdown()


def stall_shutdown(arg: dict) -> None:
    """Rank 2 never submits 'ghost'; with a stall shutdown time the others fail it.  It
    stays (busy elsewhere: leaving would be another error) until both have."""
    tr.init()
    tr.allreduce(np.ones(3), name="before")
    start = time.monotonic()
    if tr.rank() == 2:
        report(outlasted=all(wait_for_report(r, "kind", arg["hold"]) for r in (0, 1)))
    else:
        try:
            tr.allreduce(np.ones(3), name="ghost")
        except tr.TotalReduceError as exc:
            report(error=str(exc), kind=type(exc).__name__, after_s=time.monotonic() - start)
        else:
            report(returned=True, kind=None)
        # Each waiting rank times out by its own clock (up to a housekeeping tick apart in
        # self-guided mode): leaving at once would fail a peer's copy of the op as "rank
        # shut down while needed" before its own timeout said why.
        wait_for_report(1 - tr.rank(), "kind", arg["hold"])
    tr.shutdown()


def sleep_forever(arg: dict) -> None:
    print(f"PID {os.getpid()} NOTES {os.environ.get('TOTALREDUCE_FAILURE_DIR', '')}",
          flush=True)
    if arg and arg.get("ignore_term"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(300)


def exit_with(arg: dict) -> None:
    rank = tr_rank()
    report(env_rank=rank, env_size=int(os.environ["TOTALREDUCE_SIZE"]))
    if rank == arg["rank"]:
        sys.exit(arg["code"])
    time.sleep(arg.get("others_sleep", 0))


def die_on_early_lives(arg: dict) -> None:
    """Rank ``victim`` kills itself in its first ``deaths`` lives; every life reports its
    attempt and pid, and the others stay until the victim's last life has reported."""
    rank = tr_rank()
    attempt = int(os.environ["TOTALREDUCE_ATTEMPT"])
    report(**{f"life{attempt}": os.getpid()})
    if rank == arg["victim"]:
        if attempt < arg["deaths"]:
            os.kill(os.getpid(), signal.SIGKILL)
        return
    wait_for_report(arg["victim"], f"life{arg['deaths']}", 30.0)


def submit_while_streaming(arg: dict) -> None:
    """Large ops submitted at jittered times, so a piece's body is often still arriving
    (as a floating message) at the moment the local rank submits its op."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    rng = random.Random(rank)
    for i in range(arg["iters"]):
        x = data(i, rank, (arg["elems"],), np.float32)
        tr.barrier()
        time.sleep(rng.uniform(0, 0.002))
        got = tr.allreduce(x, op=tr.Sum, name=f"s{i}")
        want = reference_reduce([data(i, r, (arg["elems"],), np.float32) for r in range(n)],
                                "Sum")
        assert_same(got, want, f"s{i}")
    tr.shutdown()
    print("streaming ok")


def early_data(arg: dict) -> None:
    """Rank 0's pieces reach rank 1 while rank 1 has nothing in flight: over the rings they
    wait there for rank 1's op (nothing copied aside), yet never block what is behind."""
    from totalreduce.runtime import current

    tr.init(shutdown_timeout=0.3)
    rank, n = tr.rank(), tr.size()
    engine = current().engine
    count = 250_001  # about 1 MB, odd
    ins = [data(1, r, (count,), np.float32) for r in range(n)]
    if rank:
        time.sleep(0.3)  # rank 0's piece is in our ring, unread, before we submit
    assert_same(tr.allreduce(ins[rank], op=tr.Sum, name="early"), reference_reduce(ins, "Sum"),
                "early")
    report(floating_after_early_op=engine.stats()["floating_peak"])
    # Rank 1 submits y before x, rank 0 x before y: with y running, the x piece in front
    # of y's in the ring must be read (and floated), or rank 1 would wait forever.
    xs = [data(2, r, (1001,), np.float64) for r in range(n)]
    ys = [data(3, r, (777,), np.int32) for r in range(n)]
    if rank == 0:
        hx = tr.allreduce_async(xs[0], op=tr.Sum, name="x")
        hy = tr.allreduce_async(ys[0], op=tr.Max, name="y")
    else:
        time.sleep(0.3)
        hy = tr.allreduce_async(ys[1], op=tr.Max, name="y")
        time.sleep(0.1)
        hx = tr.allreduce_async(xs[1], op=tr.Sum, name="x")
    assert_same(hx.wait(timeout=30), reference_reduce(xs, "Sum"), "x")
    assert_same(hy.wait(timeout=30), reference_reduce(ys, "Max"), "y")
    # Rank 0 starts a broadcast, shuts down (which fails it) and is gone while its piece
    # sits unread in rank 1's ring: rank 1 must still see an orderly goodbye.
    b = data(4, 0, (513,), np.float32)
    if rank == 0:
        tr.broadcast_async(b, root_rank=0, name="bye")
        tr.shutdown()
    else:
        time.sleep(1.5)
        assert engine.broken is None, engine.broken
        tr.shutdown()
    report(early_data_ok=True)


# --- defects: memory, mismatched broadcasts, failures, interrupts -----------------------


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# The soak's inputs are slices of one pattern per dtype, shifted: built from scratch each
# time, they took a third of the soak's time (an int64 arange, its modulo and a cast, for
# every rank's input of every op).
_SOAK_PATTERNS: dict[type, np.ndarray] = {}


def _soak_input(i: int, rank: int, size: int, dtype: type) -> np.ndarray:
    pattern = _SOAK_PATTERNS.get(dtype)
    if pattern is None or pattern.size < size:
        pattern = _SOAK_PATTERNS[dtype] = (np.arange(max(size, 300_000)) % 7).astype(dtype)
    return pattern[:size] + dtype(rank + i % 3)


def _sum(arrays: list[np.ndarray]) -> np.ndarray:
    """A new array: the sum of the ranks' arrays in their dtype, added one rank after
    another (what np.sum over a stacked copy of them computes, without the copy)."""
    total = np.add(arrays[0], arrays[1]) if len(arrays) > 1 else arrays[0].copy()
    for a in arrays[2:]:
        np.add(total, a, out=total)
    return total


def _soak_op(i: int, ops: random.Random, rank: int, n: int,
             unique: bool = False) -> tuple[object, object]:
    """Submit op ``i`` of the soak; returns its handle and the check of its result.  (A
    function of its own, so its inputs die with it: what stays alive is only what the
    pending checks need, and RSS samples see no leftover inputs.)"""
    size = ops.choice([0, 1, 7, ops.randint(2, 2000), ops.randint(2000, 300_000)])
    dtype = ops.choice([np.float32, np.float64, np.int32, np.uint8])
    kind = ops.choice(["allreduce", "allgather", "broadcast", "reducescatter", "alltoall",
                       "grouped"])
    name = ops.choice([None, "fixed", f"{kind}.{dtype.__name__}", f"fresh.{i}"])
    if unique and name is not None and not name.startswith("fresh"):
        # Negotiated mode, as Horovod, refuses a name already in flight: reuse each name
        # only after more ops than can be in flight, with its shape changing meanwhile.
        name = f"{name}.{i % 8}"
    if kind == "allgather":  # inputs of sizes of their own
        rows = [(size + 3 * r) % 1000 for r in range(n)]
        h = tr.allgather_async(_soak_input(i, rank, rows[rank], dtype), name=name)
        want = np.concatenate([_soak_input(i, r, rows[r], dtype) for r in range(n)])
        return h, functools.partial(assert_same, want=want, what=f"#{i} {kind}")
    x = _soak_input(i, rank, size, dtype)
    if kind == "broadcast":  # only the root's input besides this rank's
        root = ops.randrange(n)
        h = tr.broadcast_async(x, root_rank=root, name=name)
        want = x if root == rank else _soak_input(i, root, size, dtype)
        return h, functools.partial(assert_same, want=want, what=f"#{i} {kind}")
    xs = [x if r == rank else _soak_input(i, r, size, dtype) for r in range(n)]
    if kind == "allreduce":
        want = _sum(xs)
        h = tr.allreduce_async(x, op=tr.Sum, name=name)
        return h, functools.partial(assert_same, want=want, what=f"#{i} {kind}")
    if kind == "grouped":
        parts = [xs[rank][: size // 2], xs[rank][size // 2:].astype(np.float64)]
        want_g = [_sum([a[: size // 2] for a in xs]),
                  _sum([a[size // 2:].astype(np.float64) for a in xs])]
        h = tr.grouped_allreduce_async(parts, op=tr.Sum, name=name)

        def check_grouped(got: list) -> None:
            for g, w in zip(got, want_g, strict=True):
                assert_same(g, w, f"#{i} grouped")
        return h, check_grouped
    if kind == "reducescatter":
        b = [0]
        for r in range(n):
            b.append(b[-1] + size // n + (1 if r < size % n else 0))
        want = _sum([a[b[rank]:b[rank + 1]] for a in xs])
        h = tr.reducescatter_async(x, op=tr.Sum, name=name)
        return h, functools.partial(assert_same, want=want, what=f"#{i} {kind}")
    splits = [np.random.default_rng([i, r]).multinomial(size, [1 / n] * n) for r in range(n)]
    offs = [np.concatenate([[0], np.cumsum(s)]) for s in splits]
    want = np.concatenate([xs[s][offs[s][rank]:offs[s][rank + 1]] for s in range(n)])
    h = tr.alltoall_async(x, splits=splits[rank], name=name)

    def check_alltoall(got: tuple) -> None:
        assert_same(got[0], want, f"#{i} alltoall")
    return h, check_alltoall


def soak(arg: dict) -> None:
    """Thousands of async collectives of random sizes, kinds, dtypes and names (fixed,
    unnamed and ever new), each checked against numpy; RSS after warm-up and at the end.

    Every rank draws the same sequence of ops (seeded), keeps up to 6 in flight and waits
    for them in its own random order, after its own random pauses."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    ops = random.Random(arg["seed"])
    mine = random.Random(1000 + rank)
    pending: list[tuple[object, object]] = []
    rss = {}

    def settle(item: tuple[object, object]) -> None:
        handle, check = item
        check(handle.wait(timeout=60))

    for i in range(arg["ops"]):
        if i == arg["warmup"]:
            while pending:
                settle(pending.pop())
            rss["warm"] = _rss_mb()
        pending.append(_soak_op(i, ops, rank, n, arg.get("unique_names", False)))
        if len(pending) > 6 or mine.random() < 0.3:
            settle(pending.pop(mine.randrange(len(pending))))
        if mine.random() < 0.01:
            time.sleep(mine.uniform(0, 0.003))
    while pending:
        settle(pending.pop())
    report(rss_warm_mb=rss["warm"], rss_end_mb=_rss_mb(), ops=arg["ops"])
    tr.shutdown()


def broadcast_mismatch(arg: dict) -> None:
    """Ranks that disagree about a broadcast: every rank must raise, none return data.
    Each variant of ``arg["variants"]`` in turn, reported under ``case:<variant>``, with
    an allreduce the ranks agree on after each (the job goes on after a mismatch)."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    x = np.full(1000, float(rank), np.float32)
    for variant in arg["variants"]:
        start = time.monotonic()
        try:
            if variant == "every_rank_its_own_root":  # the root_rank=rank() typo
                tr.broadcast(x, root_rank=rank, name="weights")
            elif variant == "last_rank_other_root":
                tr.broadcast(x, root_rank=n - 1 if rank == n - 1 else 0, name="weights")
            else:  # rank 0 broadcasts what the others allreduce
                if rank == 0:
                    tr.broadcast(x, root_rank=0, name="weights")
                else:
                    tr.allreduce(x, name="weights")
        except tr.MismatchError as exc:
            got: dict = {"mismatch": str(exc), "after_s": time.monotonic() - start}
        else:
            got = {"returned_data": True}
        y = tr.allreduce(np.full(3, rank, np.int64), op=tr.Sum, name="after")
        got["after_ok"] = y.tolist() == [sum(range(n))] * 3
        report(**{f"case:{variant}": got})
    tr.shutdown()


def raise_midloop(arg: dict) -> None:
    """Rank ``victim`` raises a plain Python exception mid-loop and does not catch it."""
    tr.init()
    rank = tr.rank()
    try:
        for i in range(1_000_000):
            if rank == arg["victim"] and i == 30:
                report(raising_at=time.time())
                raise RuntimeError(f"boom on rank {rank}")
            tr.allreduce(np.ones(1000), name="step")
    except tr.PeerFailureError as exc:
        report(caught_rank=exc.rank, caught_at=time.time(), caught=str(exc))
        raise


def leave_midop(arg: dict) -> None:
    """Rank 1 shuts down while the others wait for an op it will never submit."""
    tr.init()
    rank = tr.rank()
    for _ in range(5):
        tr.allreduce(np.ones(10), name="warm")
    if rank == 1:
        time.sleep(0.3)
        tr.shutdown()
        return
    start = time.monotonic()
    try:
        tr.allreduce(np.ones(10), name="never")
    except tr.PeerFailureError as exc:
        report(caught_rank=exc.rank, after_s=time.monotonic() - start, caught=str(exc))
    else:
        raise AssertionError("the op finished without rank 1")
    tr.shutdown()


def slow_to_shutdown(arg: dict) -> None:
    """Rank 1 'saves a checkpoint' before shutdown(), and takes as long as rank 0's
    shutdown does: rank 0 must leave without waiting for it."""
    tr.init()
    rank = tr.rank()
    tr.allreduce(np.ones(10), name="last")
    if rank == 1:
        report(peer_left_first=wait_for_report(0, "shut_down", arg["checkpoint"]))
    tr.shutdown()
    report(shut_down=True)


def interruptible_loop(arg: dict) -> None:
    """Collectives (blocking and async) until Ctrl-C; the application's handler must run."""
    tr.init()
    rank = tr.rank()
    i = 0
    try:
        while True:
            tr.allreduce(np.ones(50_000), name="grad")
            h = tr.allgather_async(np.ones((rank + 1, 3)), name="rows")
            tr.broadcast(np.ones(10), root_rank=0, name="w")
            h.wait()
            i += 1
            if i == 20:
                print("READY", flush=True)
    except KeyboardInterrupt:
        print(f"INTERRUPTED after {i} steps", flush=True)


def fuzz_acceptor(arg: dict) -> None:
    """Rank 0 throws seeded random bytes at rank 1's listener while both allreduce."""
    import threading

    from harness import send_and_drain
    from totalreduce.rendezvous.kvstore import KVClient

    env = os.environ
    tr.init()
    rank, n = tr.rank(), tr.size()
    tried = [0]
    if rank == 0:
        kv = KVClient(env["TOTALREDUCE_RENDEZVOUS"], env["TOTALREDUCE_SECRET"].encode(),
                      env["TOTALREDUCE_JOB_ID"], 10)
        host, _, port = kv.get(f"{env['TOTALREDUCE_JOB_ID']}/addr/1", 10).decode() \
            .rpartition(":")
        kv.close()
        rng = random.Random(arg["seed"])

        def throw() -> None:
            for _ in range(arg["inputs"]):
                noise = rng.randbytes(rng.randrange(0, 300))
                if rng.random() < 0.5:
                    noise = b"TRAUTH1\n" + noise
                with socket.create_connection((host, int(port)), timeout=5) as s:
                    send_and_drain(s, noise, 5.0)
                tried[0] += 1

        thrower = threading.Thread(target=throw)
        thrower.start()
    for i in range(200):
        x = data(i, rank, (1001,), np.float32)
        want = reference_reduce([data(i, r, (1001,), np.float32) for r in range(n)], "Sum")
        assert_same(tr.allreduce(x, op=tr.Sum, name=f"fz{i}"), want, f"fz{i}")
    if rank == 0:
        thrower.join(60)
        report(fuzzed=tried[0])
    tr.barrier()
    report(finished=True)


def transport_contract(arg: dict) -> None:
    """contract.py on this rank, over the transport the environment names."""
    from contract import check_rank
    from totalreduce.config import Config
    from totalreduce.transport.registry import connect

    _scheme, connected = connect(Config.from_env())
    stats = check_rank(connected.transport)
    if connected.close is not None:
        connected.close()
    report(contract_kept=stats)


def negotiated_cache(arg: dict) -> None:
    """A repeated set of tensors: after the first step nothing goes to the coordinator;
    then one name changes shape on every rank and is renegotiated."""
    from totalreduce.runtime import current

    tr.init()
    rank, n = tr.rank(), tr.size()
    names = [f"w{i}" for i in range(20)]

    def step(shapes: list[tuple[int, ...]]) -> None:
        handles = [tr.allreduce_async(np.full(shapes[i], rank + i, np.float32), op=tr.Sum,
                                      name=name) for i, name in enumerate(names)]
        for i, h in enumerate(handles):
            got = h.wait()
            assert got.shape == shapes[i] and np.all(got == sum(r + i for r in range(n))), \
                (names[i], got)

    shapes = [(3,)] * len(names)
    step(shapes)
    first = current().collectives.stats()
    for _ in range(10):
        step(shapes)
    steady = current().collectives.stats()
    shapes[5] = (7,)
    step(shapes)
    step(shapes)
    changed = current().collectives.stats()
    tr.shutdown()
    report(first=first, steady=steady, changed=changed)


def checks_teardown(arg: dict) -> None:
    """Four checks of collectives; rank ``victim`` fails check ``fail_at``, after its
    collective (a wrong value) or before it (the others wait in it): every rank must stop
    there (checks.run_checks), and the report must name that check and that rank."""
    from checks import run_checks

    tr.init()
    r, n = tr.rank(), tr.size()

    def check(i: int) -> None:
        if r == arg["victim"] and i == arg["fail_at"] and arg["when"] == "before":
            raise RuntimeError(f"rank {r} gives up before check {i}'s collective")
        got = tr.allreduce(np.full(3, float(r)), op=tr.Sum, name=f"teardown{i}")
        # Unnamed: matched by call order, so a rank that went on into the next check after
        # a failure here would pair this with another rank's next op and fail there too,
        # for no reason of its own.
        tr.allreduce(np.ones(i + 1))
        expected = float(sum(range(n)))
        if r == arg["victim"] and i == arg["fail_at"]:
            expected += 1  # this rank expects a wrong value
        assert_same(got, np.full(3, expected), f"check {i} sum")

    run_checks([(f"sum {i}", lambda i=i: check(i)) for i in range(4)],
               agree_timeout=arg.get("agree_timeout", 20.0), prefix="teardown")


def negotiated_lone_ops(arg: dict) -> None:
    """Blocking ops one at a time, each after a pause (so every rank's cycle thread is
    idle when it comes), the ranks reaching each at different times: small and big
    allreduces (named and not), a broadcast and a barrier, each against numpy.  Reports
    how many cycles ran and how many calls were made."""
    from totalreduce.runtime import current

    tr.init()
    rank, n = tr.rank(), tr.size()
    calls = 0

    def pause(i: int) -> None:
        time.sleep(0.01 + 0.01 * ((rank + i) % n))  # another rank arrives last each time

    for i in range(arg["rounds"]):
        pause(i)
        small = np.arange(5, dtype=np.float64) + rank + i
        got = tr.allreduce(small, op=tr.Sum, name="lone.small")
        assert_same(got, sum(np.arange(5, dtype=np.float64) + r + i for r in range(n)),
                    f"round {i} small")
        pause(i + 1)
        big = np.full(100_003, rank + i, np.float32)  # past what the cycle runs itself
        got = tr.allreduce(big, op=tr.Sum)
        assert_same(got, np.full(100_003, sum(r + i for r in range(n)), np.float32),
                    f"round {i} big")
        pause(i + 2)
        root = i % n
        got = tr.broadcast(np.full(3, rank * 10 + i, np.int32), root_rank=root,
                           name="lone.bcast")
        assert_same(got, np.full(3, root * 10 + i, np.int32), f"round {i} broadcast")
        pause(i + 3)
        tr.barrier()
        calls += 4
    cycles = current().collectives.stats()["cycles"]
    tr.shutdown()
    report(cycles=cycles, calls=calls, ok=True)


def negotiated_fusion(arg: dict) -> None:
    """100 small tensors submitted at once travel as a few fused engine ops."""
    from totalreduce.runtime import current

    tr.init()
    rank, n = tr.rank(), tr.size()
    tr.barrier()
    before = current().collectives.stats()
    inputs = [np.arange(i % 7 + 1, dtype=np.float64) * (rank + 1) + i for i in range(100)]
    handles = [tr.allreduce_async(x, op=tr.Sum, name=f"small.{i}")
               for i, x in enumerate(inputs)]
    for i, h in enumerate(handles):
        want = sum(np.arange(i % 7 + 1, dtype=np.float64) * (r + 1) + i for r in range(n))
        assert_same(h.wait(), want, f"fused small.{i}")
    after = current().collectives.stats()
    tr.shutdown()
    report(engine_ops=after["engine_ops"] - before["engine_ops"],
           fused_ops=after["fused_ops"] - before["fused_ops"],
           tensors=after["tensors"] - before["tensors"])


def negotiated_fused_steps(arg: dict) -> None:
    """Steps of the same small tensors, fused: in place and not, of several shapes (0-d,
    2-d, a strided view), a barrier between steps, new values every step, and one
    tensor whose shape changes midway.  Reports how many cycles ran a kept layout."""
    from totalreduce.runtime import current

    tr.init()
    rank, n = tr.rank(), tr.size()
    shapes = [(), (3,), (2, 3), (5,), (1,), (4, 2), (7,), (3,)]

    def value(i: int, step: int, r: int, shape: tuple[int, ...]) -> np.ndarray:
        size = int(np.prod(shape))
        return (np.arange(size, dtype=np.float64).reshape(shape) + i * 10 + step) * (r + 1)

    before = current().collectives.stats()
    for step in range(8):
        steps = list(shapes)
        if step >= 5:
            steps[3] = (6,)  # renegotiated, then repeated again
        arrays = [np.zeros(s, np.float64) for s in steps]
        arrays[7] = np.zeros(6, np.float64)[::2]  # in place: written through its strides
        handles = []
        for i, (arr, shape) in enumerate(zip(arrays, steps, strict=True)):
            arr[...] = value(i, step, rank, shape)
            if i % 2:
                handles.append(tr.allreduce_async_(arr, op=tr.Sum, name=f"fs.{i}"))
            else:
                handles.append(tr.allreduce_async(arr, op=tr.Sum, name=f"fs.{i}"))
        for i, (h, shape) in enumerate(zip(handles, steps, strict=True)):
            want = sum(value(i, step, r, shape) for r in range(n))
            got = h.wait()
            assert_same(np.asarray(got), want, f"step {step} fs.{i}")
            if i % 2:
                assert got is arrays[i]
        tr.barrier()
    after = current().collectives.stats()
    tr.shutdown()
    report(repeated=after["cycles_repeated"] - before["cycles_repeated"],
           fused_ops=after["fused_ops"] - before["fused_ops"])


def timeline_run(arg: dict) -> None:
    """A few steps of small fused tensors and a bigger one, with the timeline on."""
    tr.init()
    for _step in range(5):
        handles = [tr.allreduce_async(np.ones(10, np.float32) * i, name=f"g{i}")
                   for i in range(8)]
        for h in handles:
            h.wait()
        tr.allreduce(np.ones(100_000, np.float32), name="big")
        time.sleep(0.03)
    if arg.get("kill_rank") == tr.rank():
        os.kill(os.getpid(), signal.SIGKILL)
    tr.shutdown()


def stall_cached(arg: dict) -> None:
    """'step' runs three times everywhere (cached); then rank 1 stops submitting it, and
    stays (leaving would be another error) until rank 0's op has failed."""
    tr.init()
    for _ in range(3):
        tr.allreduce(np.ones(3), name="step")
    start = time.monotonic()
    if tr.rank() == 0:
        try:
            tr.allreduce(np.ones(3), name="step")
        except tr.TotalReduceError as exc:
            report(error=str(exc), kind=type(exc).__name__, after_s=time.monotonic() - start)
        else:
            report(returned=True, kind=None)
    else:
        wait_for_report(0, "kind", 40.0)
    tr.shutdown()


def big_then_leave(arg: dict) -> None:
    """Big blocking allreduces, then every rank leaves at once: a rank whose last op is
    still receiving when the others have gone must finish it (or fail), never hang."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    x = np.full(4 << 20, rank + 1.0, np.float32)
    for i in range(arg["ops"]):
        got = tr.allreduce(x, op=tr.Sum, name=f"big.{i % 2}")
        assert got[0] == got[-1] == n * (n + 1) / 2, got[:3]
    tr.shutdown()
    report(done=True)


def negotiated_checks_after_a_first_call(arg: dict) -> None:
    """Negotiated mode remembers which (dtype, op) pairs it accepted, to skip the checks
    for a training step's repeated tensors; bad calls after a good one must still fail."""
    tr.init()
    x = np.arange(5, dtype=np.float32)
    assert_same(tr.allreduce(x, op=tr.Sum, name="good"), x * tr.size(), "good")
    refused = {}
    for what, call in {
        "bool average": lambda: tr.allreduce(np.ones(3, np.bool_), op=tr.Average, name="b"),
        "read-only in place": lambda: tr.allreduce_(np.frombuffer(b"\0" * 20, np.float32),
                                                    op=tr.Sum, name="c"),
        "int name": lambda: tr.allreduce(x, op=tr.Sum, name=123),
        "op True": lambda: tr.allreduce(x, op=True, name="d"),
    }.items():
        try:
            call()
        except (TypeError, ValueError) as exc:
            refused[what] = f"{type(exc).__name__}: {exc}"
    again = tr.allreduce_(x.copy(), op=tr.Sum, name="good")
    assert_same(again, x * tr.size(), "good again")
    tr.shutdown()
    report(refused=refused)


def late_ctrl_c(arg: dict) -> None:
    """Ctrl-C reaches the last rank ``arg['late']`` s after the others (as when a launcher
    forwards it to every rank but one is scheduled late): the others handle it and shut
    down while the last still needs them; the last must still see KeyboardInterrupt."""
    import threading

    tr.init()
    rank, n = tr.rank(), tr.size()
    at = float(tr.broadcast(np.array([time.time() + 1.0]), root_rank=0, name="t")[0])
    delay = at - time.time() + (arg["late"] if rank == n - 1 else 0.0)
    threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT)).start()
    i = 0
    try:
        while True:
            tr.allreduce(np.ones(1000), name="grad")
            i += 1
    except KeyboardInterrupt:
        report(interrupted=True, steps=i)
    except tr.PeerFailureError as exc:
        report(interrupted=False, error=str(exc))
    tr.shutdown()


# --- what a new user trips on (issue 24) ------------------------------------------------


def reinit_late(arg: dict) -> None:
    """shutdown() and init() again, twice, one rank ``arg['late']`` s late to the new
    init() each time: rank 0 (which serves the store under srun), then the last rank.
    In the last world rank 0 also knocks at the last rank's listener as a member of the
    first world, which must be turned away without a word while the job goes on."""
    from totalreduce.rendezvous import KVClient, detect_launch
    from totalreduce.rendezvous.auth import client_handshake
    from totalreduce.transport.connect import world_keys
    from totalreduce.transport.wire import PROTOCOL_VERSION
    from totalreduce.version import __version__

    sums = []
    rank = n = -1
    for world, late in enumerate((None, 0, -1)):
        if world:
            tr.shutdown()
            if late is not None and rank == late % n:
                time.sleep(arg["late"])
        start = time.monotonic()
        tr.init()
        rank, n = tr.rank(), tr.size()
        got = tr.allreduce(np.arange(3.0) * (rank + 1), op=tr.Sum, name="w")
        sums.append({"sum": got.tolist(), "init_s": time.monotonic() - start})
    if rank == 0:
        launch = detect_launch()
        assert launch.rendezvous is not None
        kv = KVClient(launch.rendezvous, launch.secret, launch.job_id, 10)
        address = kv.get(f"{world_keys(launch.job_id, 2)}/addr/{n - 1}", 10).decode()
        kv.close()
        host, _, port = address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            old = {"protocol": PROTOCOL_VERSION, "version": __version__,
                   "job": launch.job_id, "rank": 0, "size": n, "world": 0}
            client_handshake(s, launch.secret, old, 10)
            s.settimeout(10)
            report(stale_refused=s.recv(1) == b"")
    tr.barrier()
    got = tr.allreduce(np.ones(2), op=tr.Sum, name="after")
    assert got.tolist() == [n, n], got
    tr.shutdown()
    report(worlds=sums)


# --- recovery (totalrun --max-restarts) ----------------------------------------------------

RECOVERY_N = 10_000
RECOVERY_VERSIONS = 10


def recovery_grad(w: np.ndarray, version: int, i: int, rank: int) -> np.ndarray:
    """A gradient that depends on the weights: a wrong or missed step changes every later
    one.  Small integers in float32, so every sum is exact whatever the order."""
    idx = np.arange(w.size, dtype=np.float32)
    return np.mod(w + idx * (version + 1) + i * 7 + rank, 13).astype(np.float32)


def recovery_matrix(arg: dict) -> None:
    """Rabit's test at the numpy API: 10 checkpointed versions of a 10,000-float model,
    each with three allreduces, an allgather (into out= in odd versions), an alltoall into
    out= and a broadcast whose root changes; every result is checked against what this
    rank computes alone."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    attempt = int(os.environ.get("TOTALREDUCE_ATTEMPT", "0"))
    report(**{f"pid{attempt}": os.getpid()})
    version, state = tr.load_checkpoint()
    w = state["w"] if state is not None else np.zeros(RECOVERY_N, np.float32)
    assert version == tr.version_number() and (state is None) == (version == 0)
    if state is not None:
        assert state["version"] == version - 1, state["version"]
    for v in range(version, RECOVERY_VERSIONS):
        for i in range(3):
            got = tr.allreduce(recovery_grad(w, v, i, rank), op=tr.Sum, name=f"g{i}")
            want = sum(recovery_grad(w, v, i, r) for r in range(n))
            assert np.array_equal(got, want), f"rank {rank}: allreduce g{i} at {v} differs"
            w = np.mod(w + got, 1000).astype(np.float32)
        # Odd versions gather into out=: a result the log replays must land there too.
        into = np.zeros((n * (n + 1) // 2, 3), np.int64) if v % 2 else None
        rows = tr.allgather(np.full((rank + 1, 3), v * 10 + rank, np.int64), name="rows",
                            out=into)
        want_rows = np.concatenate([np.full((r + 1, 3), v * 10 + r, np.int64)
                                    for r in range(n)])
        assert np.array_equal(rows, want_rows), f"rank {rank}: allgather at {v} differs"
        assert into is None or rows is into, f"rank {rank}: allgather at {v} not into out"
        back = np.zeros((n, 2), np.float32)
        swapped, _ = tr.alltoall(np.full((n, 2), v + rank, np.float32), name="swap", out=back)
        assert swapped is back and np.array_equal(
            back, np.repeat(np.arange(n, dtype=np.float32)[:, None] + v, 2, axis=1)), \
            f"rank {rank}: alltoall at {v} differs"
        root = v % n
        mine = w + (100 if rank == root else -1)
        got = tr.broadcast(mine, root_rank=root, name="w")
        assert np.array_equal(got, w + 100), f"rank {rank}: broadcast at {v} differs"
        tr.checkpoint({"w": w, "version": v})
    report(digest=hashlib.sha256(w.tobytes()).hexdigest(), version=tr.version_number(),
           attempt=attempt)
    tr.shutdown()


def recovery_timeout(arg: dict) -> None:
    """Rank 1 dies and its replacement is slow to start: the survivors give up after
    TOTALREDUCE_RECOVERY_TIMEOUT with an error naming it, on every rank."""
    attempt = int(os.environ.get("TOTALREDUCE_ATTEMPT", "0"))
    if attempt:
        wait_for_report(0, "error", 60.0)  # until the survivors have given up
        return
    tr.init()
    tr.load_checkpoint()
    try:
        for i in range(20):
            tr.allreduce(np.ones(10), name="x")
            if i == 5 and tr.rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
    except tr.PeerFailureError as exc:
        report(error=str(exc), rank_lost=exc.rank)
    tr.shutdown()


def ragged_mismatch(arg: dict) -> None:
    """allgather and alltoall calls the ranks disagree on: each rank reports the error."""
    tr.init()
    rank = tr.rank()
    cases = {
        "rows": np.ones((2, 3)) if rank == 0 else np.ones((2, 4)),
        "flat": np.ones(5, np.float32) if rank == 0 else np.ones(5, np.float64),
        "rows_and_dtype": np.ones((2, 3), np.float32) if rank == 0 else np.ones((3, 3)),
    }
    errors = {}
    for name, x in cases.items():
        try:
            tr.allgather(x, name=name)
        except tr.MismatchError as exc:
            errors[name] = str(exc)
    try:
        tr.alltoall(np.ones((4, 2)) if rank == 0 else np.ones((4, 3)), name="a2a")
    except tr.MismatchError as exc:
        errors["a2a"] = str(exc)
    tr.allgather(np.ones((rank + 1, 3)), name="fine")  # first dims may differ
    tr.shutdown()
    report(errors=errors)


def hosts_allreduce(arg: dict) -> None:
    """Allreduce on ranks that play hosts of their own (``arg["hosts"][rank]`` names each
    rank's host through TOTALREDUCE_HOST_ID; without it, the ranks' own hosts tell):
    every dtype and op at odd sizes against
    numpy, async ops each rank submits in its own order, and how much of a large op went
    over sockets rather than shared memory."""
    hosts = arg.get("hosts")
    tr.init(**({"host_id": f"host-{hosts[tr_rank()]}"} if hosts else {}))
    rank, n = tr.rank(), tr.size()
    from totalreduce.runtime import current

    transport = current().transport
    checked = 0
    seed = 3
    for dtype in DTYPES:
        for shape in ((0,), (1,), (7,), (1031,), (3, 4099)):
            seed += 1
            inputs = [data(seed, r, shape, dtype) for r in range(n)]
            for opname, op in OPS.items():
                if opname == "Average" and dtype == np.bool_:
                    continue
                if opname == "Product" and shape == (3, 4099) and dtype != np.float64:
                    continue
                got = tr.allreduce(inputs[rank], op=op)
                assert_same(got, reference_reduce(inputs, opname),
                            f"allreduce {opname} {np.dtype(dtype)} {shape}")
                checked += 1
    order = list(range(12))
    random.Random(rank).shuffle(order)
    sizes = [0, 1, 5, 4097, 100_003, 3, 65_537, 2, 17, 250_001, 9, 31]
    handles = {}
    for i in order:
        time.sleep(random.Random(rank * 100 + i).random() * 0.01)
        handles[i] = tr.allreduce_async(data(i, rank, (sizes[i],), np.float32), name=f"h{i}",
                                        op=tr.Sum)
    for i, h in handles.items():
        want = reference_reduce([data(i, r, (sizes[i],), np.float32) for r in range(n)], "Sum")
        assert_same(tr.synchronize(h), want, f"async allreduce {i}")
        checked += 1
    big = data(99, rank, (1 << 20,), np.float32)
    before = tr.transport_stats()
    got = tr.allreduce(big, name="big", op=tr.Sum)
    after = tr.transport_stats()
    assert_same(got, reference_reduce([data(99, r, (1 << 20,), np.float32)
                                       for r in range(n)], "Sum"), "big allreduce")
    moved = {k: after[k] - before[k] for k in ("tcp_bytes_sent", "shm_bytes_sent")}
    layout = transport.hosts
    rings = transport.ring_peers()
    tr.barrier()
    tr.shutdown()
    report(checked=checked, hosts=list(layout), rings=rings, moved=moved,
           nbytes=big.nbytes)


def process_sets(arg: dict) -> None:
    """Process sets at 4 ranks: two disjoint pairs allreducing at once, a set of 3 running
    every collective, a rank outside a set, a mismatch inside one, ranks that ask for
    different sets, and a removed set."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    assert n == 4
    pairs = [tr.add_process_set([0, 1]), tr.add_process_set(tr.ProcessSet([2, 3]))]
    trio = tr.add_process_set([0, 1, 2])
    pair = pairs[rank // 2]
    out: dict[str, object] = {"ids": [p.process_set_id for p in (*pairs, trio)]}
    # Each pair's ops, async and in a per-rank random order, between global ones.
    sizes = [1, 7, 4099, 300_001, 0, 33]
    order = list(range(len(sizes)))
    random.Random(rank).shuffle(order)
    handles = {}
    for k, i in enumerate(order):
        handles[i] = tr.allreduce_async(data(i, rank, (sizes[i],), np.float32), op=tr.Sum,
                                        name=f"p{i}", process_set=pair)
        glob = tr.allreduce(np.full(3, rank, np.int64), op=tr.Sum, name=f"g{k}")
        assert glob.tolist() == [6, 6, 6], glob
    for i, h in handles.items():
        want = reference_reduce([data(i, q, (sizes[i],), np.float32) for q in pair.ranks],
                                "Sum")
        assert_same(h.wait(), want, f"pair allreduce {i}")
    if trio.included():
        me = trio.rank()
        inputs = [data(50, q, (5, 3), np.int32) for q in trio.ranks]
        for root in trio.ranks:
            got = tr.broadcast(inputs[me], root_rank=root, process_set=trio)
            assert_same(got, inputs[trio.ranks.index(root)], f"trio broadcast from {root}")
        parts = [data(51, q, (q + 1, 2), np.float64) for q in trio.ranks]
        assert_same(tr.allgather(parts[me], process_set=trio), np.concatenate(parts),
                    "trio allgather")
        total = reference_reduce(inputs, "Sum")
        b = [0, 2, 4, 5]  # 5 rows over 3 ranks: the lower ranks take the extra rows
        assert_same(tr.reducescatter(inputs[me], op=tr.Sum, process_set=trio),
                    total[b[me]:b[me + 1]], "trio reducescatter")
        got, splits = tr.alltoall(np.arange(3) + 10 * rank, process_set=trio)
        assert got.tolist() == [10 * q + me for q in trio.ranks], got
        assert_same(tr.allreduce(inputs[me], op=tr.Average, process_set=trio),
                    reference_reduce(inputs, "Average"), "trio average")
        grouped = tr.grouped_allreduce([inputs[me], inputs[me][0]], op=tr.Max,
                                       process_set=trio)
        assert_same(grouped[1], reference_reduce([x[0] for x in inputs], "Max"), "grouped")
        assert tr.allgather_object({"r": rank}, process_set=trio) == [
            {"r": q} for q in trio.ranks]
        tr.barrier(process_set=trio)
        try:
            tr.allreduce(np.ones(3 + (rank == 1)), name="bad", process_set=trio)
            out["mismatch"] = "none"
        except tr.MismatchError as exc:
            out["mismatch"] = str(exc)
    else:
        try:
            tr.allreduce(np.ones(3), process_set=trio)
            out["outside"] = "accepted"
        except ValueError as exc:
            out["outside"] = str(exc)
    try:
        tr.add_process_set([0, 1, 3] if rank == 0 else [0, 2, 3])
        out["disagree"] = "accepted"
    except ValueError as exc:
        out["disagree"] = str(exc)
    out["removed"] = tr.remove_process_set(pairs[0])
    try:
        tr.allreduce(np.ones(2), process_set=pairs[0])
        out["after_remove"] = "accepted"
    except ValueError as exc:
        out["after_remove"] = str(exc)
    tr.barrier()
    tr.shutdown()
    report(**out)


def average_arrays(arg: dict) -> None:
    """totalreduce.average: a list of arrays averaged in place, every rank's result
    checked against the numpy reference; a single array too."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    shapes = [((7,), np.float32), ((3, 5), np.float64), ((0,), np.float32),
              ((1031,), np.int32)]
    mine = [data(5, rank * 10 + i, s, d) for i, (s, d) in enumerate(shapes)]
    got = tr.average(mine, name="params")
    assert got is mine
    for i, (s, d) in enumerate(shapes):
        want = reference_reduce([data(5, r * 10 + i, s, d) for r in range(n)], "Average")
        assert_same(mine[i], want, f"average {s} {np.dtype(d)}")
    one = np.full(4, float(rank))
    assert tr.average(one) is one
    assert_same(one, np.full(4, (n - 1) / 2), "average of one array")
    report(ok=True)
    tr.shutdown()
