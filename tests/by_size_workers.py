"""Workers for test_smallpath.py that run ops of given sizes (or the same op again and
again) and report which way each took: the caller's thread, a Repeat, the loop."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterator

import numpy as np

import totalreduce as tr
from reporting import report
from smallpath_workers import _close, _inputs
from totalreduce.bench.buffers import aligned_float32s
from totalreduce.engine.express import ONE_WAY_HUGE
from totalreduce.runtime import current
from totalreduce.transport import pages
from workers import reference_reduce


def _by_size(sizes: list[int], dtypes: tuple[type, ...],
             one: Callable[[int, list[np.ndarray]], tuple[np.ndarray, np.ndarray, str]]
             ) -> list[int]:
    """Op ``i`` of ``sizes[i]`` bytes (dtypes in turn, one rank a little late):
    ``one(i, inputs)`` runs it on every rank's inputs and returns (what this rank got,
    what it should have got, what it was); how many ops each ran on the caller's
    thread."""
    rank, n = tr.rank(), tr.size()
    ran = []
    for i, nbytes in enumerate(sizes):
        dtype = dtypes[i % len(dtypes)]
        inputs = _inputs(i, n, nbytes // np.dtype(dtype).itemsize, dtype)
        if rank == i % n:
            time.sleep(0.002)
        before = current().engine.stats()["direct_ops"]
        got, want, what = one(i, inputs)
        ran.append(current().engine.stats()["direct_ops"] - before)
        _close(got, want, what)
    return ran


def allreduces_by_size(arg: dict) -> None:
    """Blocking allreduces of ``arg["sizes"]`` bytes (odd element counts, several dtypes,
    in place and not, one rank a little late): whether each ran on the caller's thread,
    and its sum checked against numpy."""
    tr.init()
    rank = tr.rank()

    def one(i: int, inputs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, str]:
        want = np.sum(np.stack(inputs), axis=0).astype(inputs[0].dtype)
        if i % 2:
            got = tr.allreduce(inputs[rank], op=tr.Sum, name=f"ar.{i}")
        else:
            got = inputs[rank]
            tr.allreduce_(got, op=tr.Sum, name=f"ar.{i}")
        return got, want, f"allreduce of {got.size} {got.dtype}"

    ran = _by_size(arg["sizes"], (np.float64, np.float32, np.int32), one)
    tr.shutdown()
    report(direct=ran)


def broadcasts_by_size(arg: dict) -> None:
    """Blocking broadcasts of ``arg["sizes"]`` bytes (odd element counts, several dtypes
    and roots, in place and not, one rank a little late): whether each ran on the
    caller's thread, and what every rank got checked against the root's array."""
    tr.init()
    rank, n = tr.rank(), tr.size()

    def one(i: int, inputs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, str]:
        root = (i + 1) % n
        if i % 2:
            got = tr.broadcast(inputs[rank], root, name=f"bc.{i}")
        else:
            got = inputs[rank]
            tr.broadcast_(got, root, name=f"bc.{i}")
        return got, inputs[root], f"broadcast of {got.size} {got.dtype} from {root}"

    ran = _by_size(arg["sizes"], (np.float64, np.float32, np.uint8), one)
    tr.shutdown()
    report(direct=ran)


def alltoalls_by_size(arg: dict) -> None:
    """Blocking alltoalls of about ``arg["sizes"]`` bytes in all (rows split evenly, ranks
    sending different rows, several dtypes, one rank a little late), after ``arg["warm"]``
    of 1 MiB: how many of each one's two ops (splits, then data) ran on the caller's
    thread, how many bytes of peers' bodies floated here meanwhile and which ways it
    chose while the rings were slow (scheduling/slow_rings.py); the result checked
    against numpy."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    for i in range(arg["warm"]):
        part = np.full((1 << 20) // 8 // n * n, rank, np.float64)
        got, _splits = tr.alltoall(part, name=f"warm.{i}")
        _close(got, np.repeat(np.arange(n, dtype=np.float64), part.size // n), "warm-up")
    ran, floated, chose = [], [], []
    choice = current().scheduler.slow_rings
    for i, nbytes in enumerate(arg["sizes"]):
        dtype = (np.float64, np.float32, np.int32)[i % 3]
        block = nbytes // np.dtype(dtype).itemsize // n // 3
        inputs = [a.reshape(-1, 3) for a in _inputs(i, n, block * n * 3, dtype)]
        if rank == i % n:
            time.sleep(0.002)
        before = current().engine.stats()
        choices = choice.choices
        got, splits = tr.alltoall(inputs[rank], name=f"a2a.{i}")
        after = current().engine.stats()
        ran.append(after["direct_ops"] - before["direct_ops"])
        floated.append(after["floated_bytes"] - before["floated_bytes"])
        chose.append([(kind, bits, left) for (kind, bits), left
                      in choice.made_since(choices)])
        want = np.concatenate([a[rank * block:(rank + 1) * block] for a in inputs])
        _close(got, want, f"alltoall of {got.nbytes} bytes")
        assert list(splits) == [block] * n, splits
    tr.shutdown()
    report(direct=ran, floated=floated, chose=chose)


def allgathers_by_size(arg: dict) -> None:
    """Blocking allgathers of about ``arg["sizes"]`` bytes in all (each rank's rows a little
    different, several dtypes, one rank a little late), after ``arg["warm"]`` of 1 MiB:
    how many of each one's two ops (sizes, then data) ran on the caller's thread, how
    many bytes of peers' bodies floated here meanwhile and which ways it chose while the
    rings were slow (scheduling/slow_rings.py); the result checked against numpy."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    for i in range(arg["warm"]):
        part = np.full((1 << 20) // 8 // n, rank, np.float64)
        got = tr.allgather(part, name=f"warm.{i}")
        _close(got, np.repeat(np.arange(n, dtype=np.float64), part.size), "warm-up")
    ran, floated, chose = [], [], []
    choice = current().scheduler.slow_rings
    for i, nbytes in enumerate(arg["sizes"]):
        dtype = (np.float64, np.float32, np.int32)[i % 3]
        rows = nbytes // np.dtype(dtype).itemsize // n
        inputs = _inputs(i, n, rows + 1, dtype)
        parts = [a[: rows + 1 - (r % 2)] for r, a in enumerate(inputs)]
        if rank == i % n:
            time.sleep(0.002)
        before = current().engine.stats()
        choices = choice.choices
        got = tr.allgather(parts[rank], name=f"ag.{i}")
        after = current().engine.stats()
        ran.append(after["direct_ops"] - before["direct_ops"])
        floated.append(after["floated_bytes"] - before["floated_bytes"])
        chose.append([(kind, bits, left) for (kind, bits), left
                      in choice.made_since(choices)])
        _close(got, np.concatenate(parts), f"allgather of {got.nbytes} bytes")
    tr.shutdown()
    report(direct=ran, floated=floated, chose=chose)


def lent_gathers_by_bound(arg: dict) -> None:
    """Blocking same-shape allgathers and alltoalls of a little under and a little over
    ``arg["bound"]`` bytes in all (odd rows, two dtypes, new data each call, into
    ``out=`` from the second of three calls): how many of each size's calls ran on the
    caller's thread, each result against numpy and the input unchanged."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    bound = arg["bound"]
    ran = {}
    for kind in ("allgather", "alltoall"):
        for i, nbytes in enumerate((bound - 72 * n, bound + 4096 * n)):
            dtype = (np.float32, np.int16)[i]
            rows = nbytes // np.dtype(dtype).itemsize // n
            out = np.empty((rows * n, 1), dtype)
            count = 0
            for call in range(3):
                size = rows * n if kind == "alltoall" else rows
                inputs = [a.reshape(-1, 1)
                          for a in _inputs(100 * i + call, n, size, dtype)]
                kept = inputs[rank].copy()
                into = out if call else None
                before = current().engine.stats()["direct_ops"]
                if kind == "alltoall":
                    got, _splits = tr.alltoall(inputs[rank], name=f"lent.{kind}.{i}",
                                               out=into, same_shape=True)
                    want = np.concatenate([a[rank * rows:(rank + 1) * rows]
                                           for a in inputs])
                else:
                    got = tr.allgather(inputs[rank], name=f"lent.{kind}.{i}", out=into,
                                       same_shape=True)
                    want = np.concatenate(inputs)
                count += current().engine.stats()["direct_ops"] - before
                _close(got, want, f"{kind} of {got.nbytes} bytes, call {call}")
                assert np.array_equal(inputs[rank], kept), "the input changed"
            ran[f"{kind} {'under' if i == 0 else 'over'}"] = count
    tr.shutdown()
    report(direct=ran)


def same_shape_gathers_by_size(arg: dict) -> None:
    """Same_shape ``arg["kind"]``s (allgather or alltoall) of about ``arg["sizes"]`` bytes
    per rank, each size called six times under one name (the third and the sixth run from
    the plan's Repeat where it has one), blocking but every fifth call, three dtypes, new
    data each call, into ``out=`` from the fourth call, one rank late now and then; each
    result against numpy and the input unchanged.  An alltoall's op copies the rank's
    own block itself once its messages are out.  With
    ``arg["refuse"]``, every other call's second post with a body fails once, as a full
    ring would (at 3 ranks an alltoall's second first send, an allgather's first block
    passed on): the op goes on on the general path, and its own block must still be
    there."""
    from totalreduce.transport.ring_link import RingLink

    tr.init()
    rank, n = tr.rank(), tr.size()
    kind = arg["kind"]
    refuse = {"armed": False, "posts": 0, "done": 0}
    if arg.get("refuse"):
        post_now = RingLink.post_now

        def failing(self: RingLink, header: bytes, body: memoryview | None) -> bool:
            if refuse["armed"] and body is not None:
                refuse["posts"] += 1
                if refuse["posts"] == 2:
                    refuse["armed"] = False
                    refuse["done"] += 1
                    return False
            return post_now(self, header, body)
        RingLink.post_now = failing  # type: ignore[method-assign]
    mine = random.Random(50 + rank)
    before = current().engine.stats()["express_repeats"]
    calls = 0
    for i, nbytes in enumerate(arg["sizes"]):
        dtype = (np.float32, np.int64, np.uint8)[i % 3]
        rows = nbytes // np.dtype(dtype).itemsize // n
        out = np.full((rows * n, 1), 7, dtype)
        for call in range(6):
            size = rows * n if kind == "alltoall" else rows
            inputs = [a.reshape(-1, 1) for a in _inputs(10 * i + call, n, size, dtype)]
            kept = inputs[rank].copy()
            if mine.random() < 0.3:
                time.sleep(mine.random() * 0.002)
            refuse["armed"] = bool(arg.get("refuse")) and call % 2 == 1
            refuse["posts"] = 0
            into = out if call >= 3 else None
            if kind == "alltoall":
                if call == 4:
                    got, splits = tr.alltoall_async(inputs[rank], name=f"same.{i}",
                                                    out=into, same_shape=True).wait()
                else:
                    got, splits = tr.alltoall(inputs[rank], name=f"same.{i}", out=into,
                                              same_shape=True)
                want = np.concatenate([a[rank * rows:(rank + 1) * rows] for a in inputs])
                assert list(splits) == [rows] * n, splits
            else:
                if call == 4:
                    got = tr.allgather_async(inputs[rank], name=f"same.{i}", out=into,
                                             same_shape=True).wait()
                else:
                    got = tr.allgather(inputs[rank], name=f"same.{i}", out=into,
                                       same_shape=True)
                want = np.concatenate(inputs)
            refuse["armed"] = False
            assert into is None or got is into, (i, call)
            _close(got, want, f"{kind} of {got.size} {np.dtype(dtype)} call {call}")
            assert np.array_equal(inputs[rank], kept), "the input changed"
            calls += 1
    repeats = current().engine.stats()["express_repeats"] - before
    tr.shutdown()
    report(calls=calls, repeats=repeats, refused=refuse["done"])


def repeated_big_broadcasts(arg: dict) -> None:
    """Blocking broadcasts of ``arg["sizes"]`` bytes (odd element counts, three dtypes,
    each from its own root), each size called five times under one name, in place or
    not by size, new data each call, one rank late now and then; every result against
    the root's array.  Reports how many calls ran from a Repeat."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    mine = random.Random(70 + rank)
    before = current().engine.stats()["express_repeats"]
    calls = 0
    for i, nbytes in enumerate(arg["sizes"]):
        dtype = (np.float32, np.int64, np.uint8)[i % 3]
        root = i % n
        for call in range(5):
            inputs = _inputs(10 * i + call, n, nbytes // np.dtype(dtype).itemsize, dtype)
            if mine.random() < 0.3:
                time.sleep(mine.random() * 0.002)
            if i % 2:
                got = tr.broadcast(inputs[rank], root, name=f"big.{i}")
            else:
                got = inputs[rank]
                tr.broadcast_(got, root, name=f"big.{i}")
            _close(got, inputs[root], f"broadcast of {got.size} {got.dtype} call {call}")
            calls += 1
    repeats = current().engine.stats()["express_repeats"] - before
    tr.shutdown()
    report(calls=calls, repeats=repeats)


_OPS = (("Sum", tr.Sum), ("Max", tr.Max), ("Min", tr.Min))


def _reductions(arg: dict, n: int, dtypes: tuple[type, ...]
                ) -> Iterator[tuple[int, str, tr.ReduceOp, int, int, list[np.ndarray],
                                    np.ndarray]]:
    """The calls of reductions of ``arg["sizes"]`` bytes (odd element counts, ``dtypes``
    and Sum, Max, Min in turn), ``arg["calls"]`` of each with new data: (the size's index,
    the op's label, the op, the element count, the call, every rank's input, the
    reduction by numpy)."""
    for i, nbytes in enumerate(arg["sizes"]):
        dtype = dtypes[i % len(dtypes)]
        label, op = _OPS[i % len(_OPS)]
        count = nbytes // np.dtype(dtype).itemsize | 1
        for call in range(arg["calls"]):
            inputs = _inputs(100 * i + call, n, count, dtype)
            yield i, label, op, count, call, inputs, reference_reduce(inputs, label)


def repeated_big_allreduces(arg: dict) -> None:
    """Blocking allreduces of ``arg["sizes"]`` bytes (odd element counts, the dtypes in
    turn, Sum, Max or Min), each size called ``arg["calls"]`` times under one name with
    new data, in place or not by call, one rank late now and then; ``arg["async_rank"]``
    makes its calls asynchronously, so the loop runs its side of each.  Every result
    against numpy.  Reports how many calls there were and how many ran from a Repeat or
    were handed over from one."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    mine = random.Random(90 + rank)
    stats = current().engine.stats
    before = stats()
    dtypes = (np.float64, np.float32, np.int32, np.int64, np.float16, np.uint8)
    calls = 0
    for i, label, op, count, call, inputs, want in _reductions(arg, n, dtypes):
        if mine.random() < 0.3:
            time.sleep(mine.random() * 0.002)
        mine_in = inputs[rank].copy()
        if rank == arg.get("async_rank"):
            got = mine_in
            tr.allreduce_async_(got, op=op, name=f"big.{i}").wait()
        elif call % 3 == 1:
            got = tr.allreduce(mine_in, op=op, name=f"big.{i}")
            assert np.array_equal(mine_in, inputs[rank]), "the input changed"
        else:
            got = mine_in
            tr.allreduce_(got, op=op, name=f"big.{i}")
        _close(got, want, f"{label} allreduce of {count} {got.dtype}, call {call}")
        calls += 1
    after = stats()
    tr.shutdown()
    report(calls=calls, repeats=after["express_repeats"] - before["express_repeats"],
           handed_over=after["express_repeats_handed_over"]
           - before["express_repeats_handed_over"], active=after["active_ops"])


def repeated_lent_allreduces(arg: dict) -> None:
    """2-rank blocking allreduces (reducescatters where ``arg["kind"]`` says so) of
    ``arg["sizes"]`` bytes (odd element counts, the
    dtypes in turn, Sum, Max or Min), ``arg["calls"]`` of each under one name with new
    data, in place or not by call, a rank late now and then; rank r starts with
    ``cma_bytes`` at ``arg["cma"][r]`` (1 MiB: every piece of 1 MiB or more is lent, a
    Repeat's too; 1 GiB: none).  ``arg["async_rank"]`` makes its calls asynchronously.
    Right after each call a rank checks its result against numpy and scribbles over its
    input and result: one that returned before its peer had copied what it lent would
    hand the peer the scribbles.  Reports the calls, those whose Repeat lent a body (it
    may have handed the call over after), and the Repeats' hand-overs."""
    rank = int(os.environ["TOTALREDUCE_RANK"])
    tr.init(cma_bytes=arg["cma"][rank]) if arg["cma"] else tr.init()
    n = tr.size()
    mine = random.Random(110 + rank)
    stats = current().engine.stats
    before = stats()
    dtypes = (np.float64, np.float32, np.int32)
    calls = repeat_lent = 0
    for i, label, op, count, call, inputs, want in _reductions(arg, n, dtypes):
        mine_in = inputs[rank].copy()
        # Ranks start together but now and then one late: a Repeat waits for its
        # peer's messages only so long before the loop takes over.
        tr.barrier()
        if mine.random() < 0.3:
            time.sleep(mine.random() * 0.002)
        repeat_lent0 = stats()["express_repeats_lent"]
        if arg.get("kind") == "reducescatter":
            # Rows as evenly as possible, the lower ranks taking the extra ones.
            per, extra = divmod(count, n)
            lo = rank * per + min(rank, extra)
            want = want[lo:lo + per + (rank < extra)]
            got = tr.reducescatter_async(mine_in, op=op, name=f"lent.{i}").wait() \
                if rank == arg.get("async_rank") else \
                tr.reducescatter(mine_in, op=op, name=f"lent.{i}")
        elif rank == arg.get("async_rank"):
            got = mine_in
            tr.allreduce_async_(got, op=op, name=f"lent.{i}").wait()
        elif call % 3 == 1:
            got = tr.allreduce(mine_in, op=op, name=f"lent.{i}")
        else:
            got = mine_in
            tr.allreduce_(got, op=op, name=f"lent.{i}")
        repeat_lent += stats()["express_repeats_lent"] > repeat_lent0
        _close(got, want, f"{label} {arg.get('kind', 'allreduce')} of {count} "
                          f"{got.dtype}, call {call}")
        mine_in[...] = 99
        got[...] = 77
        calls += 1
    _end_repeats(stats, before, calls=calls, repeat_lent=repeat_lent)


def one_rank_lends(arg: dict) -> None:
    """2-rank same-shape allgathers and alltoalls whose blocks hold ``arg["rows"]``
    float32 rows, ``arg["calls"]`` of each, where only rank 0 lends (rank 1 starts with
    ``cma_bytes`` at 1 GiB, rank 0 at 1 MiB: lent by size, whatever backs the pages):
    rank 1 sends through the ring and takes rank 0's lent piece.
    Rank 1 calls each a millisecond after rank 0, whose piece is then there to take: a
    lane that waits longer than its spin for the peer hands the call over.  Checked
    against numpy; reports the bodies this rank lent and the calls the express lane
    handed over."""
    rank = int(os.environ["TOTALREDUCE_RANK"])
    tr.init(cma_bytes=1 << 30 if rank == 1 else 1 << 20)
    n, rows = tr.size(), arg["rows"]
    stats = current().engine.stats
    lent0, handed0 = tr.transport_stats()["bodies_lent"], stats()["express_handed_over"]
    for op in ("allgather", "alltoall"):
        count = rows if op == "allgather" else rows * n
        out = np.empty(rows * n, np.float32)
        for call in range(arg["calls"]):
            every = [np.arange(count, dtype=np.float32) * (r + 1) + call for r in range(n)]
            tr.barrier()
            if rank == 1:
                time.sleep(0.001)
            if op == "allgather":
                got = tr.allgather(every[rank], name="ag", out=out, same_shape=True)
                want = np.concatenate(every)
            else:
                got, _rows = tr.alltoall(every[rank], name="a2a", out=out,
                                         same_shape=True)
                want = np.concatenate([every[r][rank * rows:(rank + 1) * rows]
                                       for r in range(n)])
            _close(got, want, f"{op}, call {call}")
    lent = tr.transport_stats()["bodies_lent"] - lent0
    handed = stats()["express_handed_over"] - handed0
    tr.shutdown()
    report(lent=lent, handed=handed)


def _end_repeats(stats: Callable[[], dict[str, int]], before: dict[str, int],
                 **counts: int) -> None:
    """Once every rank is done: shut down and report ``counts``, the ops still active and
    the Repeats' hand-overs since ``before``."""
    tr.barrier()
    after = stats()
    tr.shutdown()
    report(active=after["active_ops"], handed_over=after["express_repeats_handed_over"]
           - before["express_repeats_handed_over"], **counts)


def _repeats(stats: dict[str, int]) -> tuple[int, int]:
    """Calls run from a Repeat so far: ended there, and handed over from there."""
    return stats["express_repeats"], stats["express_repeats_handed_over"]


def repeated_lent_gathers(arg: dict) -> None:
    """2-rank same-shape allgathers and alltoalls of about ``arg["sizes"]`` bytes (the
    result's), ``arg["calls"]`` of each under one name, into the same ``out=``, three
    dtypes, odd rows, new data each call, ranks late at random; ``arg["async_rank"]``
    makes its calls asynchronously (the loop runs its side), ``arg["plain_rank"]`` lends
    nothing (``cma_bytes`` at 1 GiB).  Right after each call a rank checks its result
    against numpy and scribbles over its input and result: one that returned before its
    peer had copied what it lent would hand the peer the scribbles.  Reports the calls,
    those that began from a Repeat and lent, and the Repeats' hand-overs."""
    rank = int(os.environ["TOTALREDUCE_RANK"])
    tr.init(cma_bytes=1 << 30) if rank == arg.get("plain_rank") else tr.init()
    n = tr.size()
    mine = random.Random(70 + rank)
    stats = current().engine.stats
    before = stats()
    calls = repeat_lent = 0
    for i, nbytes in enumerate(arg["sizes"]):
        dtype = (np.float32, np.int16, np.float64)[i % 3]
        rows = nbytes // np.dtype(dtype).itemsize // n // 3
        for kind in ("allgather", "alltoall"):
            out = np.empty((rows * n, 3), dtype)
            for call in range(arg["calls"]):
                size = rows * 3 * (n if kind == "alltoall" else 1)
                inputs = [a.reshape(-1, 3) for a in _inputs(50 * i + call, n, size, dtype)]
                if mine.random() < 0.3:
                    time.sleep(mine.random() * 0.002)
                lent0, (repeats0, handed0) = tr.transport_stats()["bodies_lent"], \
                    _repeats(stats())
                name = f"lent.{kind}.{i}"
                if kind == "allgather":
                    got = tr.allgather_async(inputs[rank], name=name, out=out,
                                             same_shape=True).wait() \
                        if rank == arg.get("async_rank") else \
                        tr.allgather(inputs[rank], name=name, out=out, same_shape=True)
                    want = np.concatenate(inputs)
                else:
                    got, _rows = tr.alltoall_async(inputs[rank], name=name, out=out,
                                                   same_shape=True).wait() \
                        if rank == arg.get("async_rank") else \
                        tr.alltoall(inputs[rank], name=name, out=out, same_shape=True)
                    want = np.concatenate([a[rank * rows:(rank + 1) * rows]
                                           for a in inputs])
                # Begun from the Repeat (ended there, or handed over to the small path
                # with its peer late) and lent: only a Repeat lends here, the express
                # lane not running beside it.
                repeats1, handed1 = _repeats(stats())
                repeat_lent += ((repeats1 > repeats0 or handed1 > handed0)
                                and tr.transport_stats()["bodies_lent"] > lent0)
                assert got is out, "the result is not in out="
                _close(got, want, f"{kind} of {got.nbytes} bytes, call {call}")
                inputs[rank][...] = 99
                got[...] = 77
                calls += 1
    _end_repeats(stats, before, calls=calls, repeat_lent=repeat_lent)


def _paged(count: int, huge: bool) -> np.ndarray:
    """``count`` float32s on a 2 MiB boundary, huge pages asked for or refused (so the
    kernel's setting does not decide it), touched."""
    return aligned_float32s(count, 0.0, huge)


def exchanges_by_pages(arg: dict) -> None:
    """2-rank same-shape allgathers and alltoalls whose blocks hold ``arg["rows"]`` float32
    rows, ``arg["calls"]`` of each under one name (the first on the express lane, the
    rest from its Repeat), out of inputs that huge pages back or that small pages must
    (a fresh 2 MiB-aligned buffer each), new data each call, checked against numpy:
    "small" on both ranks, "huge" on both, "mixed" huge on rank 0 only, "async" small on
    both with rank 1's calls async (the loop's side, which lends by size alone).
    Reports, for each way, the bodies this rank lent and its calls after the second of
    each name (the first two take the express lane; the second makes the Repeat) that
    did not run to their end from their Repeat (a peer late by 200 us, a
    Repeat that declined: the loop, which may have run such a call, lends by size alone,
    and a peer's Repeat then lends too), and whether huge pages back its huge inputs (the
    kernel may have none free)."""
    tr.init()
    rank, n, rows = tr.rank(), tr.size(), arg["rows"]
    engine = current().engine
    lent: dict[str, int] = {}
    handed: dict[str, int] = {}
    huge_inputs = True

    def repeats() -> int:  # calls that ran to their end from a Repeat
        return engine.stats()["express_repeats"]

    for way in ("small", "huge", "mixed", "async"):
        waits = way == "async" and rank == 1
        lent0 = tr.transport_stats()["bodies_lent"]
        handed[way] = 0
        huge = way == "huge" or (way == "mixed" and rank == 0)
        for op in ("allgather", "alltoall"):
            count = rows if op == "allgather" else rows * n
            x = aligned_float32s(count, 0.0, huge=huge)
            if huge:
                share = pages.huge_share(x.ctypes.data, x.nbytes)
                huge_inputs &= share is not None and share >= ONE_WAY_HUGE
            out = np.empty(rows * n, np.float32)
            for call in range(arg["calls"]):
                every = [np.arange(count, dtype=np.float32) * (r + 1) + call
                         for r in range(n)]
                x[...] = every[rank]
                repeats0 = repeats()
                if op == "allgather":
                    got = tr.allgather_async(x, name=f"ag.{way}", out=out,
                                             same_shape=True).wait() if waits else \
                        tr.allgather(x, name=f"ag.{way}", out=out, same_shape=True)
                    want = np.concatenate(every)
                else:
                    got, _rows = tr.alltoall_async(x, name=f"a2a.{way}", out=out,
                                                   same_shape=True).wait() if waits else \
                        tr.alltoall(x, name=f"a2a.{way}", out=out, same_shape=True)
                    want = np.concatenate([every[r][rank * rows:(rank + 1) * rows]
                                           for r in range(n)])
                handed[way] += call > 1 and repeats() == repeats0
                _close(got, want, f"{op} out of {way} pages, call {call}")
                x[...] = -1  # a body lent and not yet copied would carry this
        lent[way] = tr.transport_stats()["bodies_lent"] - lent0
    tr.shutdown()
    report(lent=lent, handed=handed, huge_inputs=huge_inputs)


def repeated_broadcasts(arg: dict) -> None:
    """2-rank in-place broadcasts from rank 0 of about ``arg["sizes"]`` bytes, ``arg["calls"]``
    of each under one name into the same buffer, which huge pages back or not
    (``arg["huge"]``), float32 and int32, new data each call, ranks late at random;
    ``arg["async_rank"]`` makes its calls asynchronously, ``arg["inplace"]`` False makes
    them return arrays of their own.  Right after each call the root scribbles over its
    result (a root that returned before its peer had copied what it lent would hand it the
    scribbles) and the peer checks its own against numpy.  Reports the calls, those that
    lent (and of those, the ones that ran from a Repeat to the end), the Repeats'
    hand-overs, and how many of the buffers huge pages back (the kernel may find none
    free)."""
    tr.init()
    rank = tr.rank()
    mine = random.Random(90 + rank)
    stats = current().engine.stats
    before = stats()
    calls = repeat_lent = lent_calls = huge_buffers = 0
    inplace = arg.get("inplace", True)
    for i, nbytes in enumerate(arg["sizes"]):
        buf = _paged(nbytes // 4, arg["huge"])
        share = pages.huge_share(buf.ctypes.data, buf.nbytes)
        huge_buffers += share is not None and share >= ONE_WAY_HUGE
        x = buf if i % 2 == 0 else buf.view(np.int32)
        for call in range(arg["calls"]):
            want = np.arange(x.size, dtype=x.dtype) * (call + 1) + i
            x[...] = want if rank == 0 else -1
            if mine.random() < 0.3:
                time.sleep(mine.random() * 0.002)
            lent0, repeats0 = tr.transport_stats()["bodies_lent"], stats()["express_repeats"]
            name = f"bcast.{i}"
            if not inplace:  # the result an array of its own: the root's, its working copy
                got = tr.broadcast_async(x, root_rank=0, name=name).wait() \
                    if rank == arg.get("async_rank") else \
                    tr.broadcast(x, root_rank=0, name=name)
            elif rank == arg.get("async_rank"):
                got = tr.broadcast_async_(x, root_rank=0, name=name).wait()
            else:
                got = tr.broadcast_(x, root_rank=0, name=name)
            lent = tr.transport_stats()["bodies_lent"] > lent0
            lent_calls += lent
            repeat_lent += lent and stats()["express_repeats"] > repeats0
            if rank == 0:
                got[...] = 99
            else:
                _close(got, want, f"broadcast of {x.nbytes} bytes, call {call}")
            calls += 1
    _end_repeats(stats, before, calls=calls, repeat_lent=repeat_lent,
                 huge_buffers=huge_buffers, lent_calls=lent_calls)
