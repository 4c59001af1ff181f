"""Workers for test_smallpath.py: small blocking ops on the caller's thread (the small
path) mixed with ops on the general path, rank by rank differently."""

from __future__ import annotations

import random
import time

import numpy as np

import totalreduce as tr
from reporting import report
from totalreduce.runtime import current
from workers import reference_reduce

DTYPES = [np.float32, np.float64, np.int32, np.int64, np.uint8, np.float16]


def _inputs(seed: int, n: int, size: int, dtype: type) -> list[np.ndarray]:
    out = []
    for r in range(n):
        rng = np.random.default_rng([seed, r])
        if np.issubdtype(dtype, np.floating):
            out.append(rng.uniform(-4, 4, size).astype(dtype))
        else:
            out.append(rng.integers(0, 50, size).astype(dtype))
    return out


def _close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    if got.dtype.kind == "f":
        tol = 1e-2 if got.dtype == np.float16 else 1e-5
        assert np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol,
                           atol=tol), f"{what}: {got} != {want}"
    else:
        assert np.array_equal(got, want), f"{what}: {got} != {want}"


def mixed_paths(arg: dict) -> None:
    """Every rank makes the same calls, but each picks its own way per call: blocking
    (the small path when nothing else is in flight), blocking while another op is in
    flight (the general path; every rank submits that other op each step, some before
    and some after the op under test), or async and waited at once; with pauses that
    differ by rank, so peers' messages come before, during and after the op here."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    common = random.Random(7)  # what to call: the same on every rank
    mine = random.Random(100 + rank)  # how to call it: rank by rank
    checked = 0
    for i in range(arg.get("steps", 300)):
        size = common.choice([0, 1, 3, 17, 255, 1000])
        dtype = common.choice(DTYPES)
        kind = common.choice(["allreduce", "allreduce", "barrier", "broadcast",
                              "reducescatter", "allgather", "alltoall"])
        inputs = _inputs(i, n, size, dtype)
        way = mine.choice(["blocking", "blocking", "beside", "async"])
        if mine.random() < 0.2:
            time.sleep(mine.random() * 0.003)
        def other(step: int = i) -> tr.Handle:
            return tr.allreduce_async(np.full(5, rank, np.float64), op=tr.Sum,
                                      name=f"other.{step}")

        beside = other() if way == "beside" else None
        what = f"step {i}: {kind} {np.dtype(dtype)} x{size} ({way})"
        if kind == "allreduce":
            op = common.choice([tr.Sum, tr.Max, tr.Min])
            want = {tr.Sum: np.sum, tr.Max: np.max, tr.Min: np.min}[op](
                np.stack(inputs), axis=0).astype(dtype)
            x = inputs[rank]
            if way == "async":
                got = tr.allreduce_async(x, op=op, name=f"ar.{i}").wait()
            else:
                got = tr.allreduce(x, op=op, name=f"ar.{i}")
            _close(got, want, what)
        elif kind == "barrier":
            tr.barrier()
        elif kind == "allgather":
            # First dimensions differ by rank (some empty): the sizes phase matters.
            blocks = [a[:(i + r) % 3 * (size // 3)] for r, a in enumerate(inputs)]
            if way == "async":
                got = tr.allgather_async(blocks[rank], name=f"ag.{i}").wait()
            else:
                got = tr.allgather(blocks[rank], name=f"ag.{i}")
            _close(got, np.concatenate(blocks), what)
        elif kind == "alltoall":
            # Rank r sends (r + d) % 2 rows of its input to rank d.
            rows = [[(r + d) % 2 for d in range(n)] for r in range(n)]
            sent = [np.resize(a, sum(rows[r])) if a.size else np.zeros(sum(rows[r]), dtype)
                    for r, a in enumerate(inputs)]
            if way == "async":
                got, splits = tr.alltoall_async(sent[rank], rows[rank],
                                                name=f"a2a.{i}").wait()
            else:
                got, splits = tr.alltoall(sent[rank], rows[rank], name=f"a2a.{i}")
            want = [sent[r][sum(rows[r][:rank]):sum(rows[r][:rank + 1])] for r in range(n)]
            _close(got, np.concatenate(want), what)
            assert list(splits) == [rows[r][rank] for r in range(n)], (what, splits)
        elif kind == "broadcast":
            root = common.randrange(n)
            if way == "async":
                got = tr.broadcast_async(inputs[rank], root, name=f"bc.{i}").wait()
            else:
                got = tr.broadcast(inputs[rank], root, name=f"bc.{i}")
            _close(got, inputs[root], what)
        else:
            rows = np.stack(inputs).reshape(n, -1)[:, :max(1, size)] if size else None
            x = inputs[rank][:max(n, size)] if size >= n else np.arange(n, dtype=dtype)
            if rows is None or size < n:
                x = np.arange(n, dtype=dtype) + rank
                total = sum(np.arange(n, dtype=np.int64) + r for r in range(n))
            else:
                total = np.sum(np.stack([a[:size] for a in inputs]), axis=0)
            got = tr.reducescatter(x, op=tr.Sum, name=f"rs.{i}")
            bounds = np.linspace(0, len(x), n + 1).astype(int)  # even split, first longer
            base, extra = divmod(len(x), n)
            lo = rank * base + min(rank, extra)
            hi = lo + base + (1 if rank < extra else 0)
            _close(got, np.asarray(total, dtype=np.float64).astype(dtype)[lo:hi], what)
            del bounds
        got = (beside if beside is not None else other()).wait()
        assert np.array_equal(got, np.full(5, n * (n - 1) / 2)), f"{what}: other {got}"
        checked += 1
    stats = current().engine.stats()
    report(checked=checked, direct=stats["direct_ops"],
           handed_over=stats["direct_handed_over"], active=stats["active_ops"],
           floating=stats["floating_bytes"])
    tr.shutdown()


def repeated_calls(arg: dict) -> None:
    """Blocking allreduces and barriers under a few names, dtypes, shapes and ops, each
    repeated (a repeat reuses what its first call worked out), with ranks pausing at
    random: a peer ahead sends its next op's messages while this rank still runs the one
    before, so they float in before their op starts here."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    common = random.Random(11)
    mine = random.Random(200 + rank)
    ops = {tr.Sum: np.sum, tr.Max: np.max, tr.Min: np.min, tr.Average: np.mean}
    for i in range(arg["steps"]):
        name = common.choice(["loss", "accuracy", None])
        shape = common.choice([(), (1,), (3,), (2, 5), (0,)])
        dtype = common.choice(DTYPES)
        op = common.choice(list(ops) if np.issubdtype(dtype, np.floating) else
                           [tr.Sum, tr.Max, tr.Min])
        if mine.random() < 0.1:
            time.sleep(mine.random() * 0.002)
        if common.random() < 0.2:
            tr.barrier()
            continue
        inputs = [a.reshape(shape) for a in _inputs(i, n, int(np.prod(shape)), dtype)]
        if common.random() < 0.5:
            mine_copy = inputs[rank].copy()
            got = tr.allreduce_(mine_copy, op=op, name=name)
            assert got is mine_copy, i
        else:
            got = tr.allreduce(inputs[rank], op=op, name=name)
            assert not np.shares_memory(got, inputs[rank]), i
        want = ops[op](np.stack(inputs).astype(np.float64), axis=0)
        if op is tr.Average:
            want = want.astype(dtype)
        assert got.shape == shape and got.dtype == dtype, (i, got.shape, got.dtype)
        _close(got, np.asarray(want).astype(dtype), f"step {i}: {name} {dtype} {shape}")
    # A kept template's dtype, shape, op and name on arrays it cannot run in place: a
    # strided view (the general path, still right, its gaps untouched), a read-only array
    # (refused before anything is sent) and a name that is not a string (likewise).
    for _ in range(3):
        tr.allreduce_(np.full(3, rank + 1.0, np.float32), op=tr.Sum, name="tail")
    spaced = np.full(6, rank + 1.0, np.float32)
    got = tr.allreduce_(spaced[::2], op=tr.Sum, name="tail")
    assert np.array_equal(got, np.full(3, n * (n + 1) / 2)), got
    assert np.array_equal(spaced[::2], got) and np.all(spaced[1::2] == rank + 1), spaced
    frozen = np.full(3, 1.0, np.float32)
    frozen.flags.writeable = False
    before = current().engine.stats()["direct_ops"]
    for bad, kwargs, says in (
            (frozen, {"name": "tail"}, "in-place collective on a read-only array"),
            (np.ones(3, np.float32), {"name": ["tail"]}, "name must be a str or None")):
        try:
            tr.allreduce_(bad, op=tr.Sum, **kwargs)
        except (TypeError, ValueError) as exc:
            assert says in str(exc), exc
        else:
            raise AssertionError(f"allreduce_ took {kwargs} on a bad call")
    assert current().engine.stats()["direct_ops"] == before  # nothing ran for them
    got = tr.allreduce_(np.full(3, rank + 1.0, np.float32), op=tr.Sum, name="tail")
    assert np.array_equal(got, np.full(3, n * (n + 1) / 2)), got
    stats = current().engine.stats()
    report(direct=stats["direct_ops"], caught_up=stats["direct_caught_up"],
           handed_over=stats["direct_handed_over"], floating=stats["floating_bytes"],
           plans=current().collectives.stats()["small_plans"],
           express=stats["express_ops"],
           repeats=stats["express_repeats"] + stats["express_repeats_handed_over"])
    tr.shutdown()


def late_peer(arg: dict) -> None:
    """Rank 1 comes to each small allreduce late: rank 0's op goes on on the general path
    once it has waited past the small path's patience, and still adds up."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    for i in range(3):
        if rank == 1:
            time.sleep(arg["delay"])
        got = tr.allreduce(np.array([rank + i, 1.0]), op=tr.Sum)
        want = np.array([n * (n - 1) / 2 + n * i, n])
        assert np.array_equal(got, want), (i, got, want)
    stats = current().engine.stats()
    report(direct=stats["direct_ops"], handed_over=stats["direct_handed_over"])
    tr.shutdown()


def express_hand_over(arg: dict) -> None:
    """Rank ``late`` comes to each small allreduce ``delay`` seconds late: a peer's express
    lane waits past its spin at whatever step it has reached (at 4 ranks rank 1 meets
    rank 3 only at the second), and the small path goes on from there."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    calls = [(np.float32, tr.Sum, np.sum), (np.int64, tr.Max, np.max),
             (np.float16, tr.Average, np.mean), (np.uint8, tr.Min, np.min)]
    for i in range(arg["steps"]):
        dtype, op, ref = calls[i % len(calls)]
        inputs = _inputs(i, n, 5, dtype)
        want = ref(np.stack(inputs).astype(np.float64), axis=0).astype(dtype)
        if rank == arg["late"]:
            time.sleep(arg["delay"])
        got = tr.allreduce(inputs[rank], op=op, name="late")
        _close(got, want, f"step {i}: {op} {np.dtype(dtype)}")
    stats = current().engine.stats()
    report(express=stats["express_ops"], handed=stats["express_handed_over"])
    tr.shutdown()


def halving_lane(arg: dict) -> None:
    """Blocking allreduces by recursive halving and doubling (the env forces it), whose
    receives wait on others: the express lane runs them, and where a rank comes late
    (3 ms, past the lane's spin) hands them to the general path mid-op.  Odd sizes, an
    empty array, several dtypes and ops, then one call repeated (the lane's Repeat)."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    calls = [(np.float32, tr.Sum, np.sum), (np.int64, tr.Max, np.max),
             (np.float64, tr.Average, np.mean), (np.int32, tr.Min, np.min),
             (np.float16, tr.Sum, np.sum), (np.uint8, tr.Max, np.max)]
    sizes = [4099, 0, 1, 50001, 777, 12345, n * 1024 + 3]
    for i in range(arg["calls"]):
        dtype, op, ref = calls[i % len(calls)]
        size = sizes[i % len(sizes)] if i < arg["calls"] // 2 else 6001
        inputs = _inputs(i, n, size, dtype)
        want = ref(np.stack(inputs).astype(np.float64), axis=0).astype(dtype)
        if i % 3 == 1 and rank == i % n:
            time.sleep(0.003)
        name = f"odd.{i}" if i < arg["calls"] // 2 else f"same.{i % len(calls)}"
        got = tr.allreduce(inputs[rank], op=op, name=name)
        _close(got, want, f"call {i}: {op} {np.dtype(dtype)} x {size}")
    stats = current().engine.stats()
    report(express=stats["express_ops"], handed=stats["express_handed_over"],
           repeats=stats["express_repeats"] + stats["express_repeats_handed_over"])
    tr.shutdown()


def lent_body(arg: dict) -> None:
    """A 1.5 MB blocking allreduce: rank 0 runs it on the small path, rank 1 (another
    op in flight) on the general path, which lends its body: the small path cannot take
    a lent body and hands the op over at once; the sum is right either way."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    count = 3 * (1 << 17)  # 1.5 MiB of float32
    for i in range(3):
        other = tr.allreduce_async(np.ones(4), op=tr.Sum, name=f"other.{i}") \
            if rank == 1 else None
        got = tr.allreduce(np.full(count, rank + i, np.float32), op=tr.Sum, name=f"big.{i}")
        assert np.array_equal(got, np.full(count, n * (n - 1) / 2 + n * i, np.float32)), i
        if rank != 1:
            other = tr.allreduce_async(np.ones(4), op=tr.Sum, name=f"other.{i}")
        assert other is not None and np.array_equal(other.wait(), np.full(4, n))
    stats = current().engine.stats()
    report(direct=stats["direct_ops"], handed_over=stats["direct_handed_over"],
           lent=tr.transport_stats()["bodies_lent"])
    tr.shutdown()


def piecewise_broadcasts(arg: dict) -> None:
    """Blocking broadcasts under the small-broadcast threshold but cut into several pieces
    (algorithms/select.py), from every root, in odd sizes and several dtypes."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    before = current().engine.stats()["direct_ops"]
    calls = 0
    for root in range(n):
        for dtype in (np.float64, np.float16, np.uint8):
            itemsize = np.dtype(dtype).itemsize
            for nbytes in (900 << 10, (1 << 20) - 64):
                count = nbytes // itemsize + 7
                inputs = _inputs(calls, n, count, dtype)
                got = tr.broadcast(inputs[rank], root, name=f"bc.{root}.{calls}")
                _close(got, inputs[root], f"broadcast of {count} {np.dtype(dtype)} from {root}")
                calls += 1
    direct = current().engine.stats()["direct_ops"] - before
    tr.shutdown()
    report(calls=calls, direct=direct)


def acks_before_copies(arg: dict) -> None:
    """Repeated blocking broadcasts of 960 KiB (two pieces, under PUSH_MIN: at 2 ranks
    through the ring, not lent) from one root: the chain's last rank
    (algorithms/chain.py) posts its empty acknowledgement of piece 0 before it copies that
    piece's body out of the ring (repeat.py), and every result matches the root's."""
    from totalreduce.engine import repeat

    tr.init()
    rank, n = tr.rank(), tr.size()
    events: list[tuple[str, int]] = []
    post, copy = repeat.Repeat._post, repeat.copy_bytes

    def posting(self: repeat.Repeat, work: np.ndarray, source: np.ndarray | None,
                send: tuple, *rest: object) -> bool:
        events.append(("post", send[6]))
        return post(self, work, source, send, *rest)

    def copying(dst: memoryview, src: memoryview) -> None:
        events.append(("copy", src.nbytes))
        copy(dst, src)

    repeat.Repeat._post = posting  # type: ignore[method-assign]
    repeat.copy_bytes = copying
    try:
        for dtype in (np.float32, np.uint8):
            count = (960 << 10) // np.dtype(dtype).itemsize + 5
            for call in range(8):
                inputs = _inputs(call, n, count, dtype)
                events.append(("call", call))
                got = tr.broadcast_(inputs[rank].copy(), root_rank=0, name=f"acks.{dtype}")
                _close(got, inputs[0], f"broadcast {call} of {count} {np.dtype(dtype)}")
    finally:
        repeat.Repeat._post = post  # type: ignore[method-assign]
        repeat.copy_bytes = copy
    calls: list[list[tuple[str, int]]] = []
    for event in events:
        if event[0] == "call":
            calls.append([])
        else:
            calls[-1].append(event)
    # Per call from a Repeat: whether an empty post came before the first body copy.
    order = [[kind for kind, nbytes in call if kind == "copy" or nbytes == 0][:2]
             for call in calls if call]
    tr.shutdown()
    report(order=order)


def single_exchanges(arg: dict) -> None:
    """Repeated blocking 2-rank allreduces and barriers, each a Repeat's one exchange
    (repeat.py: Repeat._run_single), on every dtype and op, empty arrays too.  Rank 1
    makes some calls of the same templates async (the loop's messages, not a Repeat's)
    and comes late to others, past the Repeat's patience, which hands rank 0's call
    over; every result matches numpy's."""
    from totalreduce.engine import repeat

    tr.init()
    rank, n = tr.rank(), tr.size()
    entered = [0]
    single = repeat.Repeat._run_single

    def counting(self: repeat.Repeat, work: np.ndarray, key: tuple[int, int]) -> object:
        entered[0] += 1
        return single(self, work, key)

    repeat.Repeat._run_single = counting  # type: ignore[method-assign]
    stats = current().engine.stats
    before = stats()
    common = random.Random(31)
    mine = random.Random(600 + rank)
    templates = [(dtype, op, count) for dtype in DTYPES
                 for op, count in (("Sum", 7), ("Average", 1), ("Max", 0), ("Min", 1001),
                                   ("Product", 3))]
    blocking = 0
    try:
        for i in range(arg["steps"]):
            if common.random() < 0.1:
                tr.barrier()
                continue
            dtype, op, count = common.choice(templates)
            inputs = _inputs(i, n, count, dtype)
            if op == "Product":  # small factors: no overflow in any dtype
                inputs = [(a % 3).astype(dtype) for a in inputs]
            late = common.random() < 0.1  # drawn on every rank: the same calls
            if rank == 1 and late:
                time.sleep(0.02)  # rank 0's call hands over, then ends on the loop
            x = inputs[rank].copy()
            if rank == 1 and mine.random() < 0.2:
                tr.synchronize(tr.allreduce_async_(x, op=getattr(tr, op)))
            else:
                blocking += 1
                assert tr.allreduce_(x, op=getattr(tr, op)) is x
            _close(x, reference_reduce(inputs, op), f"step {i}: {op} of {count} {dtype}")
    finally:
        repeat.Repeat._run_single = single  # type: ignore[method-assign]
    after = stats()
    report(blocking=blocking, entered=entered[0],
           repeats=after["express_repeats"] - before["express_repeats"],
           handed_over=after["express_repeats_handed_over"]
           - before["express_repeats_handed_over"])
    tr.shutdown()


def repeated_broadcasts(arg: dict) -> None:
    """One blocking broadcast from ``arg["root"]``, repeated: odd sizes, the values
    changing every call, checked on every rank."""
    tr.init()
    rank = tr.rank()
    root = arg["root"]
    stats = current().engine.stats
    before = stats()["express_repeats"]
    for i in range(arg["steps"]):
        want = np.arange(7, dtype=np.float64) * (i + 1)
        mine = want.copy() if rank == root else np.zeros(7)
        got = tr.broadcast(mine, root_rank=root, name="repeated")
        assert np.array_equal(got, want), (i, got, want)
    report(repeats=stats()["express_repeats"] - before)
    tr.shutdown()


def repeated_gathers(arg: dict) -> None:
    """Allgathers, alltoalls and broadcasts under a few names, dtypes and shapes, each
    repeated (a repeat reuses the plan its first call made), with each rank's rows and
    splits changing from call to call, blocking and async, into ``out=`` or not, ranks
    pausing at random; and, on one rank, calls the checks must refuse though a good call
    of the same shapes came before (a refused call must not count: the next ones match)."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    common = random.Random(23)
    mine = random.Random(300 + rank)
    refused = 0
    for i in range(arg["steps"]):
        kind = common.choice(["allgather", "alltoall", "broadcast"])
        name = common.choice(["a", "b", None])
        dtype = common.choice([np.float32, np.int64, np.uint8])
        tail = common.choice([(), (3,)])
        blocking = common.random() < 0.7
        if mine.random() < 0.1:
            time.sleep(mine.random() * 0.002)
        width = int(np.prod(tail))
        if kind == "allgather":
            rows = [common.choice([0, 1, 2, 5]) for _ in range(n)]
            parts = [a.reshape(-1, *tail) for a in
                     _inputs(i, n, max(rows) * width, dtype)]
            parts = [p[:r] for p, r in zip(parts, rows, strict=True)]
            want = np.concatenate(parts)
            out = np.empty_like(want) if common.random() < 0.5 else None
            if blocking:
                got = tr.allgather(parts[rank], name=name, out=out)
            else:
                got = tr.allgather_async(parts[rank], name=name, out=out).wait()
            assert out is None or got is out, i
        elif kind == "alltoall":
            splits = [[common.choice([0, 1, 3]) for _ in range(n)] for _ in range(n)]
            sends = [a.reshape(-1, *tail)[:sum(s)] for a, s in
                     zip(_inputs(i, n, 3 * n * width, dtype), splits, strict=True)]
            starts = [np.cumsum([0, *s]) for s in splits]
            want = np.concatenate([sends[r][starts[r][rank]:starts[r][rank + 1]]
                                   for r in range(n)])
            form = common.choice(["list", "array", "even"])
            if form == "even":
                rows_each = common.choice([0, 1, 2])
                sends = [a.reshape(-1, *tail)[:rows_each * n] for a in
                         _inputs(i, n, 2 * n * width, dtype)]
                want = np.concatenate([s[rank * rows_each:(rank + 1) * rows_each]
                                       for s in sends])
                mine_splits = None
            else:
                mine_splits = splits[rank] if form == "list" else np.array(splits[rank])
            out = np.empty_like(want) if common.random() < 0.5 else None
            if rank == 0 and isinstance(mine_splits, list) and mine.random() < 0.3:
                try:
                    tr.alltoall(sends[0], splits=[float(s) for s in mine_splits], name=name)
                except ValueError as exc:
                    assert "splits" in str(exc), exc
                    refused += 1
                else:
                    raise AssertionError("float splits were let through")
            if blocking:
                got, got_splits = tr.alltoall(sends[rank], splits=mine_splits, name=name,
                                              out=out)
            else:
                got, got_splits = tr.alltoall_async(sends[rank], splits=mine_splits,
                                                    name=name, out=out).wait()
            assert out is None or got is out, i
            if form != "even":
                assert got_splits.tolist() == [s[rank] for s in splits], (i, got_splits)
        else:
            root = common.randrange(n)
            values = [a.reshape(-1, *tail) for a in _inputs(i, n, 4 * width, dtype)]
            want = values[root]
            if rank == 0 and mine.random() < 0.2:
                try:
                    tr.broadcast(values[0], root_rank=bool(root), name=name)
                except ValueError as exc:
                    assert "root_rank" in str(exc), exc
                    refused += 1
                else:
                    raise AssertionError("a bool root was let through")
            mine_copy = values[rank].copy()
            if blocking:
                got = tr.broadcast_(mine_copy, root_rank=root, name=name)
                assert got is mine_copy, i
            else:
                got = tr.broadcast_async(mine_copy, root_rank=root, name=name).wait()
        assert got.dtype == want.dtype and got.shape == want.shape, (i, kind, got.shape)
        _close(got, want, f"step {i}: {kind} {name} {dtype} {tail}")
    # The same calls again and again: one plan each, however many calls.
    before = current().collectives.stats()
    engine_stats = current().engine.stats
    engine_before = engine_stats()
    x = np.arange(2 * n, dtype=np.float32) + rank
    for _ in range(20):
        assert tr.allgather(x, name="same").tolist() == np.concatenate(
            [np.arange(2 * n, dtype=np.float32) + r for r in range(n)]).tolist()
        got, _ = tr.alltoall(x, name="same")
        assert got.tolist() == [2 * rank + k + r for r in range(n) for k in range(2)]
    engine_between = engine_stats()
    for _ in range(20):
        assert tr.broadcast(x, root_rank=n - 1, name="same").tolist() == \
            (np.arange(2 * n) + n - 1).tolist()
    after = current().collectives.stats()
    engine_after = engine_stats()
    # An out= of the same shape as a good call's, overlapping the input, finds that call's
    # plan: it must be refused all the same.
    into = np.empty_like(x)
    for _ in range(2):
        tr.alltoall(x, name="into", out=into)
        if rank == 0:
            try:
                tr.alltoall(x, name="into", out=x)
            except ValueError as exc:
                assert "overlap" in str(exc), exc
                refused += 1
            else:
                raise AssertionError("an alltoall into its own input was let through")
    report(gather_plans=after["gather_plans"] - before["gather_plans"],
           broadcast_plans=after["broadcast_plans"] - before["broadcast_plans"],
           gather_repeats=sum(engine_between[k] - engine_before[k] for k in (
               "express_repeats", "express_repeats_handed_over")),
           broadcast_repeats=sum(engine_after[k] - engine_between[k] for k in (
               "express_repeats", "express_repeats_handed_over")),
           refused=refused, floating=current().engine.stats()["floating_bytes"])
    tr.shutdown()


def two_phase_gathers(arg: dict) -> None:
    """Allgathers and alltoalls of two phases (no ``same_shape``), each name repeated: rows
    that differ by rank and, among four patterns (one all empty), from call to call,
    several dtypes, a trailing dimension or none, into ``out=`` or not; blocking, but
    ``arg["async_rank"]``'s calls, which are async; ranks pausing now and then.  From a
    plan's second call on, a blocking call runs each phase from its template's Repeat
    where the peers are there in time.  Results against numpy, inputs unchanged."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    common = random.Random(31)
    mine = random.Random(400 + rank)
    stats = current().engine.stats
    before = stats()["express_repeats"]
    blocking = rank != arg.get("async_rank")
    for i in range(arg["steps"]):
        kind = common.choice(["allgather", "alltoall"])
        dtype = common.choice([np.float32, np.int64, np.uint8, np.float16])
        tail = common.choice([(), (3,)])
        width = int(np.prod(tail))
        name = f"{kind}.{np.dtype(dtype).name}.{len(tail)}"
        pattern = common.randrange(4)
        into = common.random() < 0.5
        if mine.random() < 0.1:
            time.sleep(mine.random() * 0.002)
        what = f"step {i}: {name} pattern {pattern}"
        if kind == "allgather":
            rows = [(r + 1, 2 * (n - r) + 1, 0 if r == 0 else 5, 0)[pattern]
                    for r in range(n)]
            parts = [a.reshape(-1, *tail)[:rows[r]] for r, a in
                     enumerate(_inputs(i, n, (2 * n + 1) * width, dtype))]
            want = np.concatenate(parts)
            kept = parts[rank].copy()
            out = np.empty_like(want) if into else None
            got = tr.allgather(parts[rank], name=name, out=out) if blocking else \
                tr.allgather_async(parts[rank], name=name, out=out).wait()
        else:
            splits = [[0 if pattern == 3 else (r + k + pattern) % 3 for k in range(n)]
                      for r in range(n)]
            parts = [a.reshape(-1, *tail)[:sum(s)] for a, s in
                     zip(_inputs(i, n, 2 * n * width, dtype), splits, strict=True)]
            starts = [np.cumsum([0, *s]) for s in splits]
            want = np.concatenate([parts[r][starts[r][rank]:starts[r][rank + 1]]
                                   for r in range(n)])
            kept = parts[rank].copy()
            out = np.empty_like(want) if into else None
            got, got_rows = tr.alltoall(parts[rank], splits=splits[rank], name=name,
                                        out=out) if blocking else \
                tr.alltoall_async(parts[rank], splits=splits[rank], name=name,
                                  out=out).wait()
            assert got_rows.tolist() == [splits[r][rank] for r in range(n)], (what, got_rows)
        assert out is None or got is out, what
        assert got.dtype == want.dtype and got.shape == want.shape, (what, got.shape)
        _close(got, want, what)
        _close(parts[rank], kept, f"{what} (input)")
    report(calls=arg["steps"], repeats=stats()["express_repeats"] - before,
           handed=stats()["express_repeats_handed_over"], floating=stats()["floating_bytes"])
    tr.shutdown()


def object_collectives(arg: dict) -> None:
    """broadcast_object and allgather_object, repeated under a few names and unnamed, of
    objects whose pickles differ in size from call to call and rank to rank (a few bytes
    to past 64 KiB, padded to a few sizes up to there, sent as they are past it: on one
    rank only, now and then), random roots, ranks pausing now and then: every rank gets
    every object back equal."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    common = random.Random(77)
    mine = random.Random(700 + rank)
    stats = current().engine.stats
    before = stats()["express_repeats"]

    def thing(step: int, owner: int, big: bool) -> object:
        rng = random.Random(1000 * step + owner)
        if big:
            return {"owner": owner, "blob": rng.randbytes(70_000 + rng.randrange(5000))}
        size = rng.choice([0, 1, 7, 100, 1000])
        return (owner, step, np.arange(size, dtype=np.int32) * owner, "x" * rng.randrange(90))

    for i in range(arg["steps"]):
        name = common.choice(["a", "b", None])
        big = common.random() < 0.1
        big_rank = common.randrange(n) if big else -1
        if mine.random() < 0.1:
            time.sleep(mine.random() * 0.002)
        if common.random() < 0.5:
            root = common.randrange(n)
            got = tr.broadcast_object(thing(i, rank, rank == big_rank), root_rank=root,
                                      name=name)
            want = [thing(i, root, root == big_rank)]
            got = [got]
        else:
            got = tr.allgather_object(thing(i, rank, rank == big_rank), name=name)
            want = [thing(i, r, r == big_rank) for r in range(n)]
        assert len(got) == len(want), (i, len(got))
        for g, w in zip(got, want, strict=True):
            if isinstance(w, tuple):
                assert g[:2] == w[:2] and g[3] == w[3], (i, g, w)
                assert g[2].dtype == w[2].dtype and np.array_equal(g[2], w[2]), (i, g, w)
            else:
                assert g == w, (i, len(g["blob"]), len(w["blob"]))
    report(calls=arg["steps"], repeats=stats()["express_repeats"] - before)
    tr.shutdown()


def lent_exchanges(arg: dict) -> None:
    """Blocking allgathers and alltoalls whose pieces to each peer are 1 MiB or more (the
    express lane lends those of an exchange), several dtypes, odd rows, ``same_shape``
    and ``out=`` or not; one rank starts each op late, by ``arg["pause"]`` seconds: the
    rank ``arg["late"]`` names for the first, the ranks in turn after it.  Right after
    each call every rank checks its result against numpy and then scribbles over its
    input and result: a rank that returned before its peers had copied what it lent them
    would hand them the scribbles.  Reports, per op, whether this rank lent bodies and
    whether it ran the op on its own thread."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    stats = current().engine.stats
    lent, direct = [], []
    for i in range(arg["ops"]):
        dtype = (np.float64, np.float32, np.int32, np.float16)[i % 4]
        rows = ((1 << 20) + (40 << 10) * (i % 3 + 1)) // np.dtype(dtype).itemsize // 3 + i
        kind = ("allgather", "alltoall")[i % 2]
        same = i % 4 < 2
        late = (arg["late"] + i) % n
        if rank == late:
            time.sleep(arg["pause"])
        lent0, direct0 = tr.transport_stats()["bodies_lent"], stats()["direct_ops"]
        if kind == "allgather":
            mine = [a.reshape(-1, 3) for a in _inputs(i, n, rows * 3, dtype)]
            out = np.empty((rows * n, 3), dtype) if i % 3 else None
            got = tr.allgather(mine[rank], name=f"lag.{i}", out=out, same_shape=same)
            want = np.concatenate(mine)
        else:
            block = rows
            mine = [a.reshape(-1, 3) for a in _inputs(i, n, block * n * 3, dtype)]
            out = np.empty((block * n, 3), dtype) if i % 3 else None
            got, splits = tr.alltoall(mine[rank], name=f"la2a.{i}", out=out,
                                      same_shape=same)
            assert list(splits) == [block] * n, splits
            want = np.concatenate([a[rank * block:(rank + 1) * block] for a in mine])
        lent.append(tr.transport_stats()["bodies_lent"] > lent0)
        direct.append(stats()["direct_ops"] - direct0)
        if out is not None:
            assert got is out, "the result is not in out="
        _close(got, want, f"{kind} {i} of {got.nbytes} bytes ({np.dtype(dtype).name})")
        mine[rank][...] = 99
        got[...] = 77
    tr.barrier()
    tr.shutdown()
    report(lent=lent, direct=direct)


def repeated_scatters(arg: dict) -> None:
    """Reducescatters under a few names, dtypes, shapes and ops, each repeated (a repeat
    reuses the plan its first call made), blocking and async, contiguous or not, ranks
    pausing at random, each against numpy; on rank 0 now and then a call the checks must
    refuse (a 0-d array of a good call's dtype, op and name) between two good ones.
    Reports how many calls were refused and how many plans were kept, before and after
    60 calls of one."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    common = random.Random(31)
    mine = random.Random(400 + rank)
    refused = 0
    for i in range(arg["steps"]):
        name = common.choice(["s", "t", None])
        dtype = common.choice([np.float32, np.float64, np.int32])
        op = common.choice(["Sum", "Max", "Average"] if dtype != np.int32 else ["Sum", "Max"])
        rows = common.choice([n, 2 * n + 1, 5 * n - 1])
        tail = common.choice([(), (3,)])
        strided = common.random() < 0.3
        blocking = common.random() < 0.7
        if mine.random() < 0.1:
            time.sleep(mine.random() * 0.002)
        width = int(np.prod(tail))
        # Strided: every other row of a bigger array (not contiguous: read through a copy).
        ins = [a.reshape(rows, 2, *tail)[:, 0] if strided
               else a[:rows * width].reshape(rows, *tail)
               for a in _inputs(i, n, rows * width * 2, dtype)]
        total = reference_reduce(ins, op)
        b = np.cumsum([0] + [rows // n + (1 if r < rows % n else 0) for r in range(n)])
        want = total[b[rank]:b[rank + 1]]
        if rank == 0 and mine.random() < 0.15:
            try:
                tr.reducescatter(np.zeros((), dtype), op=getattr(tr, op), name=name)
            except ValueError as exc:
                assert "reducescatter" in str(exc), exc
                refused += 1
            else:
                raise AssertionError("a 0-d array was let through")
        if blocking:
            got = tr.reducescatter(ins[rank], op=getattr(tr, op), name=name)
        else:
            got = tr.reducescatter_async(ins[rank], op=getattr(tr, op), name=name).wait()
        assert got.dtype == want.dtype and got.shape == want.shape, (i, got.shape, want.shape)
        _close(got, want, f"step {i}: {op} {name} {np.dtype(dtype).name} {rows} {tail}")
    before = current().collectives.stats()["scatter_plans"]
    x = np.arange(4 * n, dtype=np.float32) + rank
    for _ in range(60):
        got = tr.reducescatter(x, op=tr.Sum, name="same")
        _close(got, (n * np.arange(4 * n, dtype=np.float32) + n * (n - 1) / 2)[
            4 * rank:4 * rank + 4], "repeat")
    after = current().collectives.stats()["scatter_plans"]
    tr.shutdown()
    report(refused=refused, before=before, after=after)


def repeat_then_differ(arg: dict) -> None:
    """Ranks repeat one small blocking allreduce, broadcast, reducescatter, or allgather or
    alltoall of the same shape or of rows by rank (``arg["kind"]``; from the second call
    on, each runs it from the template's Repeat, engine/repeat.py, a call of rows each of
    its two phases), then rank 1 makes it differently (the op or
    the root, the dtype, the shape) while the others repeat it: every rank must raise a
    MismatchError, and the job and the template go on.  Results checked against numpy."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    stats = current().engine.stats
    kind = arg["kind"]
    for what in arg["whats"]:
        for i in range(arg["repeats"]):
            inputs = _inputs(i, n, 3, np.float32)
            mine = inputs[rank].copy()
            if kind == "allreduce":
                assert tr.allreduce_(mine, op=tr.Sum, name="r") is mine
                _close(mine, np.sum(np.stack(inputs), axis=0), f"{what} repeat {i}")
            elif kind == "allgather":
                # Into out= or a new array, every other call: from the third call of
                # each form on, the calls run from its Repeat where the engine is idle.
                out = np.full((3 * n,), np.nan, np.float32) if i % 2 else None
                got = tr.allgather(mine, name="r", out=out, same_shape=True)
                assert out is None or got is out, i
                _close(got, np.concatenate(inputs), f"{what} repeat {i}")
                _close(mine, inputs[rank], f"{what} repeat {i} input")
            elif kind == "reducescatter":
                # Odd rows (the lower ranks take one more), read in place or, every
                # other call, copied (a strided input): a template each.
                rows = 2 * n + 1
                full = _inputs(i, n, 2 * rows, np.float32)
                mine = full[rank][::2] if i % 2 else full[rank][:rows].copy()
                got = tr.reducescatter(mine, op=tr.Average, name="r")
                base, extra = divmod(rows, n)
                lo = rank * base + min(rank, extra)
                hi = lo + base + (rank < extra)
                want = np.mean(np.stack([f[::2] if i % 2 else f[:rows] for f in full]),
                               axis=0)
                _close(got, want[lo:hi], f"{what} repeat {i}")
            elif kind == "allgather rows":
                # Rows by rank (the sizes phase tells them): from the second call on,
                # each phase runs from its Repeat where the engine is idle.
                parts = [a.reshape(-1, 2)[:r + 1] for r, a in
                         enumerate(_inputs(i, n, 2 * n, np.float32))]
                got = tr.allgather(parts[rank], name="r")
                _close(got, np.concatenate(parts), f"{what} repeat {i}")
            elif kind == "alltoall rows":
                splits = [[(r + k) % 3 for k in range(n)] for r in range(n)]
                parts = [a.reshape(-1, 2)[:sum(s)] for a, s in
                         zip(_inputs(i, n, 4 * n, np.float32), splits, strict=True)]
                starts = [np.cumsum([0, *s]) for s in splits]
                got, got_rows = tr.alltoall(parts[rank], splits=splits[rank], name="r")
                assert got_rows.tolist() == [splits[r][rank] for r in range(n)], got_rows
                _close(got, np.concatenate([parts[r][starts[r][rank]:starts[r][rank + 1]]
                                            for r in range(n)]), f"{what} repeat {i}")
            elif kind == "alltoall":
                blocks = _inputs(i, n, 2 * n, np.float32)
                out = np.full((2 * n,), np.nan, np.float32) if i % 2 else None
                got, got_rows = tr.alltoall(blocks[rank], name="r", out=out,
                                            same_shape=True)
                assert out is None or got is out, i
                assert got_rows.tolist() == [2] * n, got_rows
                _close(got, np.concatenate([b[2 * rank:2 * rank + 2] for b in blocks]),
                       f"{what} repeat {i}")
                _close(blocks[rank], _inputs(i, n, 2 * n, np.float32)[rank],
                       f"{what} repeat {i} input")
            else:
                # Two roots, each called every other time: from the third call of each
                # on, the calls run from its Repeat where the engine is idle.
                assert tr.broadcast_(mine, root_rank=i % 2, name="r") is mine
                _close(mine, inputs[i % 2], f"{what} repeat {i}")
                root = (i + 1) % n  # broadcast(): a new array, the input unchanged
                got = tr.broadcast(inputs[rank], root_rank=root, name="r2")
                _close(got, inputs[root], f"{what} repeat {i} (broadcast)")
        before = stats()
        before = before["express_repeats"] + before["express_repeats_handed_over"]
        x, op, root = np.ones(3, np.float32), tr.Sum, 0
        if rank == 1 and what in ("op", "root"):
            op, root = tr.Max, 1
        elif rank == 1 and what == "dtype":
            x = np.ones(3, np.float64)
        elif rank == 1 and what == "shape":
            x = np.ones(4, np.float32)
        start = time.monotonic()
        try:
            if kind == "allreduce":
                tr.allreduce_(x, op=op, name="r")
            elif kind == "allgather":
                tr.allgather(x, name="r", same_shape=True)
            elif kind == "reducescatter":
                x = np.ones(2 * n + (2 if rank == 1 and what == "shape" else 1),
                            np.float64 if rank == 1 and what == "dtype" else np.float32)
                tr.reducescatter(x, op=tr.Max if rank == 1 and what == "op" else tr.Average,
                                 name="r")
            elif kind == "alltoall":
                x = np.ones(2 * n + (2 if rank == 1 and what == "shape" else 0),
                            np.float64 if rank == 1 and what == "dtype" else np.float32)
                tr.alltoall(x, name="r", same_shape=True)
            elif kind in ("allgather rows", "alltoall rows"):
                # The repeated calls' rows and splits (their plans here), but rank 1's
                # dtype or trailing shape (its rows may differ: an exchange's sizes).
                splits = [(rank + k) % 3 for k in range(n)]
                rows = rank + 1 if kind == "allgather rows" else sum(splits)
                x = np.ones((rows, 3 if rank == 1 and what == "shape" else 2),
                            np.float64 if rank == 1 and what == "dtype" else np.float32)
                if kind == "allgather rows":
                    tr.allgather(x, name="r")
                else:
                    tr.alltoall(x, splits=splits, name="r")
            else:
                tr.broadcast_(x, root_rank=root, name="r")
        except tr.MismatchError as exc:
            got_: dict = {"mismatch": str(exc), "after_s": time.monotonic() - start}
        else:
            got_ = {"returned": x.tolist()}
        got_["repeats_before"] = before
        y = tr.allreduce(np.full(3, rank, np.int64), op=tr.Sum, name="after")
        got_["after_ok"] = y.tolist() == [sum(range(n))] * 3
        report(**{f"case:{what}": got_})
    report(repeats=stats()["express_repeats"],
           repeats_handed_over=stats()["express_repeats_handed_over"])
    tr.shutdown()


def repeat_beside_a_busy_peer(arg: dict) -> None:
    """Barriers and small allreduces repeated while one rank at a time (``busy`` by turn)
    has an async op in flight that its peers submit only after: the busy rank runs its
    call on the urgent lane or the general path, the idle ones from the template's Repeat
    (engine/repeat.py) through the rings.  Each call must end on every rank, and every
    sum match numpy."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    for _ in range(3):  # templates, then Repeats
        tr.barrier()
        tr.allreduce_(np.ones(2, np.float32), op=tr.Sum, name="small")
    for turn in range(arg["turns"]):
        busy = turn % n
        inputs = _inputs(turn, n, 1000, np.float64)
        pending = None
        if rank == busy:
            pending = tr.allreduce_async(inputs[rank], op=tr.Sum, name="pending")
        tr.barrier()
        small = _inputs(10_000 + turn, n, 2, np.float32)
        mine = small[rank].copy()
        tr.allreduce_(mine, op=tr.Sum, name="small")
        _close(mine, np.sum(np.stack(small), axis=0), f"turn {turn}: small")
        if rank != busy:
            pending = tr.allreduce_async(inputs[rank], op=tr.Sum, name="pending")
        assert pending is not None
        _close(tr.synchronize(pending), np.sum(np.stack(inputs), axis=0),
               f"turn {turn}: pending")
    stats = current().engine.stats()
    report(repeats=stats["express_repeats"] + stats["express_repeats_handed_over"],
           urgent=stats["urgent_ops"] + stats["urgent_handed_over"])
    tr.shutdown()


def repeat_keeps_no_buffer(arg: dict) -> None:
    """Blocking 1 MiB allreduces of arrays made afresh each call: the template's Repeat
    (engine/repeat.py), made from one call's spec, must keep no call's array alive (a
    thousand templates of a few MiB each would pin gigabytes)."""
    import weakref

    tr.init()
    rank, n = tr.rank(), tr.size()
    refs = []
    for i in range(4):
        x = np.full(1 << 18, rank + i, np.float32)
        tr.allreduce_(x, op=tr.Sum, name="fresh")
        assert np.all(x == sum(range(n)) + n * i), i
        refs.append(weakref.ref(x))
        del x
    stats = current().engine.stats()
    report(alive=sum(ref() is not None for ref in refs),
           repeats=stats["express_repeats"] + stats["express_repeats_handed_over"])
    tr.shutdown()


def grouped_here(arg: dict) -> None:
    """Blocking grouped allreduces (each small part to its end on the caller's thread)
    beside ranks that call the async form, checked against numpy step by step; then one
    whose big member differs on the last rank, which must fail on every rank at wait()
    without leaving any rank waiting for the parts after it."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    shapes = [(3,), (0,), (70001,), (5, 7), (300, 300), (1,)]
    before = current().engine.stats().get("direct_ops", 0)
    for step in range(6):
        per_rank = [[_inputs(100 * step + i, n, int(np.prod(s)), DTYPES[i % 4])[r]
                     .reshape(s) for i, s in enumerate(shapes)] for r in range(n)]
        mine = [a.copy() for a in per_rank[rank]]
        # Rank by rank differently: blocking in place, blocking new, async in place.
        way = (step + rank) % 3
        if way == 0:
            got = tr.grouped_allreduce_(mine, op=tr.Sum, name="g")
            assert all(g is m for g, m in zip(got, mine, strict=True))
        elif way == 1:
            got = tr.grouped_allreduce(mine, op=tr.Sum, name="g")
        else:
            got = tr.grouped_allreduce_async_(mine, op=tr.Sum, name="g").wait()
        for i, g in enumerate(got):
            want = reference_reduce([per_rank[r][i] for r in range(n)], "Sum")
            _close(g, want.astype(g.dtype), f"step {step} member {i}")
    direct = current().engine.stats().get("direct_ops", 0) - before
    def grouped(members: list[np.ndarray]) -> list[np.ndarray]:
        if rank % 2 == 0:
            return tr.grouped_allreduce_(members, op=tr.Sum, name="bad")
        return tr.grouped_allreduce_async_(members, op=tr.Sum, name="bad").wait()

    # The first member is a part of its own (over 128 KiB) and differs on one rank.
    error = ""
    try:
        grouped([np.ones(40000 + (rank == n - 1), np.float32), np.ones(3, np.float32),
                 np.ones(70001, np.float32)])
    except tr.MismatchError as exc:
        error = str(exc)
    # The same call again, alike everywhere: every rank's parts after the failed one ran
    # too, so each part's calls still line up rank by rank.
    for member in grouped([np.ones(40000, np.float32), np.ones(3, np.float32),
                           np.ones(70001, np.float32)]):
        assert np.all(member == n), member[:4]
    again = tr.allreduce(np.ones(2, np.float32), op=tr.Sum, name="after")
    assert again.tolist() == [n, n], again
    tr.shutdown()
    report(direct=direct, error=error)
