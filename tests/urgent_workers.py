"""Workers for test_urgent.py: small blocking ops of raised priority, which run on the
caller's thread through the lanes (engine/urgent.py) while the loop may be busy with a
big op, and peers that run the same ops other ways."""

from __future__ import annotations

import random
import time

import numpy as np

import totalreduce as tr
from reporting import report
from smallpath_workers import DTYPES, _close, _inputs
from totalreduce.exceptions import MismatchError
from totalreduce.runtime import current

URGENT = 5


def _report_and_leave(checked: int) -> None:
    """Report the calls checked and how the lane ran them, then shut down."""
    stats = current().engine.stats()
    report(checked=checked, urgent=stats["urgent_ops"], handed=stats["urgent_handed_over"],
           active=stats["active_ops"], floating=stats["floating_bytes"])
    tr.shutdown()


def _call(kind: str, i: int, inputs: list[np.ndarray], common: random.Random,
          way: str) -> tuple[np.ndarray, np.ndarray]:
    """One op of ``kind`` on this rank's input, run ``way`` ("lane": blocking and
    urgent; "async": urgent, through a handle; "plain": blocking, no priority): what it
    returned, and what numpy says it should."""
    rank, n = tr.rank(), tr.size()
    dtype = inputs[0].dtype
    prio = 0 if way == "plain" else URGENT
    wait = way == "async"
    if kind == "allreduce":
        op = common.choice([tr.Sum, tr.Max, tr.Min])
        want = {tr.Sum: np.sum, tr.Max: np.max, tr.Min: np.min}[op](
            np.stack(inputs), axis=0).astype(dtype)
        if wait:
            return tr.allreduce_async(inputs[rank], op=op, name=f"ar.{i}",
                                      priority=prio).wait(), want
        return tr.allreduce(inputs[rank], op=op, name=f"ar.{i}", priority=prio), want
    if kind == "broadcast":
        root = common.randrange(n)
        if wait:
            return tr.broadcast_async(inputs[rank], root, name=f"bc.{i}",
                                      priority=prio).wait(), inputs[root]
        return tr.broadcast(inputs[rank], root, name=f"bc.{i}", priority=prio), inputs[root]
    if kind == "allgather":
        # First dimensions differ by rank (some empty): the sizes phase matters.
        blocks = [a[:(i + r) % 3 * (a.size // 3)] for r, a in enumerate(inputs)]
        if wait:
            got = tr.allgather_async(blocks[rank], name=f"ag.{i}", priority=prio).wait()
        else:
            got = tr.allgather(blocks[rank], name=f"ag.{i}", priority=prio)
        return got, np.concatenate(blocks)
    # alltoall: rank r sends (r + d) % 3 rows of its input to rank d.
    rows = [[(r + d) % 3 for d in range(n)] for r in range(n)]
    sent = [np.resize(a, sum(rows[r])) if a.size else np.zeros(sum(rows[r]), dtype)
            for r, a in enumerate(inputs)]
    if wait:
        got, _splits = tr.alltoall_async(sent[rank], rows[rank], name=f"a2a.{i}",
                                         priority=prio).wait()
    else:
        got, _splits = tr.alltoall(sent[rank], rows[rank], name=f"a2a.{i}", priority=prio)
    want = [sent[r][sum(rows[r][:rank]):sum(rows[r][:rank + 1])] for r in range(n)]
    return got, np.concatenate(want)


def urgent_calls(arg: dict) -> None:
    """Urgent blocking ops of every kind, odd sizes and dtypes, every other one while a
    big allreduce is in flight, ranks coming to each at different times; each result, the
    big ones' too, against numpy."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    common = random.Random(11)  # what to call: the same on every rank
    mine = random.Random(200 + rank)  # when: rank by rank
    big = np.arange(arg["big"], dtype=np.float32) % 1000
    checked = 0
    for i in range(arg["steps"]):
        size = common.choice([0, 1, 3, 17, 255, 1001])
        dtype = common.choice(DTYPES)
        kind = common.choice(["allreduce", "allreduce", "broadcast", "allgather", "alltoall"])
        inputs = _inputs(i, n, size, dtype)
        busy = tr.allreduce_async(big * (rank + 1), op=tr.Sum, name="big") if i % 2 else None
        time.sleep(mine.random() * 0.0015)
        got, want = _call(kind, i, inputs, common, "lane")
        _close(got, want, f"step {i}: {kind} {np.dtype(dtype)} x{size}")
        if busy is not None:
            assert np.array_equal(busy.wait(), big * (n * (n + 1) // 2)), f"step {i}: big"
        checked += 1
    _report_and_leave(checked)


def mixed_ways(arg: dict) -> None:
    """Rank 0 makes every call urgent and blocking; the others pick their way per call:
    the same, or urgent through a handle (the loop runs it), or with no priority (the
    express lane or the loop), or urgent but past the lane's patience (urgent._WAIT), so
    rank 0's thread hands its op to the loop.  Half the calls run during a big op."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    common = random.Random(5)
    mine = random.Random(300 + rank)
    big = np.ones(arg["big"], np.float32)
    ways = ["lane", "async", "plain", "late"]
    checked = 0
    for i in range(arg["steps"]):
        size = common.choice([1, 7, 64, 333])
        dtype = common.choice(DTYPES)
        kind = common.choice(["allreduce", "allreduce", "broadcast", "allgather", "alltoall"])
        inputs = _inputs(i, n, size, dtype)
        way = "lane" if rank == 0 else ways[(i + rank) % len(ways)]
        busy = tr.allreduce_async(big, op=tr.Sum, name="big") if i % 2 else None
        if way == "late":
            time.sleep(0.01)
        elif mine.random() < 0.5:
            time.sleep(mine.random() * 0.001)
        got, want = _call(kind, i, inputs, common, "lane" if way == "late" else way)
        _close(got, want, f"step {i}: {kind} {np.dtype(dtype)} x{size} ({way})")
        if busy is not None:
            assert np.array_equal(busy.wait(), np.full(big.size, n, np.float32))
        checked += 1
    _report_and_leave(checked)


def urgent_mismatch(arg: dict) -> None:
    """An urgent allreduce whose shape differs on the last rank, during a big op: every
    rank must get a MismatchError naming the op and the shapes; the job then goes on."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    big = np.ones(arg["big"], np.float32)
    busy = tr.allreduce_async(big, op=tr.Sum, name="big")
    x = np.ones(6 if rank == n - 1 else 5, np.float32)
    t = time.monotonic()
    try:
        tr.allreduce(x, op=tr.Sum, name="odd", priority=URGENT)
        error = ""
    except MismatchError as exc:
        error = str(exc)
    took = time.monotonic() - t
    assert np.array_equal(busy.wait(), np.full(big.size, n, np.float32))
    after = tr.allreduce(np.ones(3, np.float32), op=tr.Sum, name="after", priority=URGENT)
    report(error=error, took=took, after=after.tolist())
    tr.shutdown()


def urgent_with_a_joined_rank(arg: dict) -> None:
    """Rank 0 makes urgent calls while the last rank has called join(): that rank's loop
    serves them from the lane, with zeros (Horovod's join)."""
    tr.init()
    rank, n = tr.rank(), tr.size()
    sums = []
    if rank != n - 1:
        for i in range(arg["steps"]):
            x = np.full(9, rank + 1.0, np.float32)
            sums.append(float(tr.allreduce(x, op=tr.Sum, name=f"j.{i}", priority=URGENT)[0]))
    last = tr.join()
    report(sums=sums, last=last)
    tr.shutdown()


def urgent_in_another_order(arg: dict) -> None:
    """Rank 1 runs urgent allreduces "a" and "b" at once on two threads; rank 0 calls "b",
    then "a", on one: "a"'s message comes first in rank 0's lane, and "b" must get past it
    (it floats) rather than wait for a call that comes only after "b" ends."""
    import threading

    tr.init()
    rank, n = tr.rank(), tr.size()
    results: dict[str, float] = {}

    def call(name: str) -> None:
        x = np.full(3, rank + 1.0, np.float32)
        results[name] = float(tr.allreduce(x, op=tr.Sum, name=name, priority=URGENT)[0])

    for rep in range(arg["reps"]):
        a, b = f"a.{rep}", f"b.{rep}"
        if rank == 0:
            call(b)
            call(a)
        else:
            threads = [threading.Thread(target=call, args=(name,)) for name in (a, b)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        tr.barrier()
    report(results=results, want=float(n * (n + 1) // 2))
    tr.shutdown()


def lane_rings(arg: dict) -> None:
    """Under mpiexec, no engine: the shared-memory lane rings the MPI transport sets up
    with peers on its host (transport/mpi.py _share_lanes), with rank ``arg["none"]``
    asking for none.  Each rank posts a message to every peer it has rings with and reads
    theirs back; the ring files must be gone from /dev/shm once set up."""
    import os

    from totalreduce.transport.mpi import _share_lanes, import_mpi
    from totalreduce.transport.ring_lane import RingLane
    from totalreduce.transport.shmring import _SHM_DIR
    from totalreduce.transport.wire import Header, Kind

    mpi = import_mpi()
    comm = mpi.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    wants = [] if rank == arg["none"] else [p for p in range(n) if p != rank]
    pairs = _share_lanes(comm, mpi, wants)
    comm.Barrier()  # every rank past its set-up
    left = sorted(f for f in os.listdir(_SHM_DIR) if f.startswith("totalreduce-"))
    lanes = {p: RingLane(p, w, r, lambda: None) for p, (w, r) in pairs.items()}
    for p, lane in lanes.items():
        body = np.full(3, 10 * rank + p, np.int64)
        header = Header(Kind.DATA, nbytes=body.nbytes, seq=rank).pack()
        assert lane.lane_post(header, memoryview(body).cast("B"))
    comm.Barrier()
    got = {}
    for p, lane in lanes.items():
        with lane.lane_lock:
            record = lane.lane_peek()
            assert record is not None, f"rank {rank}: nothing from rank {p}"
            header, body = record
            got[str(p)] = [header.seq, *np.frombuffer(body, np.int64).tolist()]
            lane.lane_take(header)
            assert lane.lane_peek() is None
        lane.close()
    report(peers=sorted(lanes), got=got, left=left)
