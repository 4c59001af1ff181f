"""The engine's parts under exact, replayable interleavings: whole jobs in one process
(inproc_world.py), every rank's loop turned by a seeded scheduler that also picks which
link delivers next.  No timing: each case either completes with numpy's answer, or fails
the way it must, for every seed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import totalreduce as tr
from inproc_world import Job, Plan
from totalreduce.exceptions import MismatchError, PeerFailureError

SEEDS = range(12)


def _inputs(n: int, size: int, dtype: type, salt: int) -> list[np.ndarray]:
    rng = np.random.default_rng([salt, size])
    if np.dtype(dtype).kind == "f":
        return [rng.standard_normal(size).astype(dtype) for _ in range(n)]
    return [rng.integers(-100, 100, size).astype(dtype) for _ in range(n)]


def _mixed_plan(n: int, rank: int, seed: int) -> tuple[Plan, list[Any]]:
    """A dozen ops of every kind and odd sizes; the expected result of each."""
    plan: Plan = []
    want: list[Any] = []
    sizes = [0, 1, 7, 1000, 4097, 30_001]
    for i, size in enumerate(sizes):
        dtype = (np.float32, np.int32, np.float64)[i % 3]
        ins = _inputs(n, size, dtype, seed * 100 + i)
        plan.append(lambda ops, x=ins[rank], i=i: ops.allreduce(
            x, tr.Sum, f"ar{i}", 0, inplace=False))
        want.append(np.sum(ins, axis=0, dtype=dtype) if size else np.zeros(0, dtype))
        root = i % n
        plan.append(lambda ops, x=ins[rank], i=i, root=root: ops.broadcast(
            x, root, f"bc{i}", 0, inplace=False))
        want.append(ins[root])
    rows = [np.arange(3 * r + 1, dtype=np.int64) + 10 * r for r in range(n)]
    plan.append(lambda ops: ops.allgather(rows[rank], "ag", 0))
    want.append(np.concatenate(rows))
    return plan, want


def _check(handles: list[Any], want: list[Any]) -> None:
    for h, w in zip(handles, want, strict=True):
        got = h.wait()
        if w.dtype.kind == "f":
            np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize("seed", SEEDS)
def test_every_arrival_order_gives_numpy_results(seed: int) -> None:
    n = 2 + seed % 3
    job = Job(n, seed, segment_bytes=4096)
    try:
        plans, wants = zip(*(_mixed_plan(n, r, seed) for r in range(n)), strict=True)
        handles = job.run(list(plans))
        for r in range(n):
            _check(handles[r], wants[r])
        for engine in job.engines:
            stats = engine.stats()
            assert stats["active_ops"] == 0 and stats["floating_bytes"] == 0, stats
    finally:
        job.close()


def test_some_orders_float_messages() -> None:
    """The interleavings really do send data ahead of its op (else the test above would
    prove little about floating messages)."""
    floated = 0
    for seed in SEEDS:
        job = Job(3, seed, segment_bytes=4096)
        plans, _ = zip(*(_mixed_plan(3, r, seed) for r in range(3)), strict=True)
        job.run(list(plans))
        floated += sum(e.stats()["floating_peak"] > 0 for e in job.engines)
        job.close()
    assert floated >= len(SEEDS)


@pytest.mark.parametrize("seed", SEEDS)
def test_ranks_submitting_in_different_orders(seed: int) -> None:
    n = 3
    job = Job(n, seed, segment_bytes=2048)
    try:
        ins = {i: _inputs(n, 3001 + i, np.float64, seed * 7 + i) for i in range(8)}
        plans, orders = [], []
        for r in range(n):
            order = list(range(8))
            job.rng.shuffle(order)
            orders.append(order)
            plans.append([lambda ops, i=i, r=r: ops.allreduce(ins[i][r], tr.Sum, f"x{i}", 0,
                                                               inplace=False)
                          for i in order])
        handles = job.run(plans)
        for r in range(n):
            for i, h in zip(orders[r], handles[r], strict=True):
                np.testing.assert_allclose(h.wait(), np.sum(ins[i], axis=0), rtol=1e-12)
    finally:
        job.close()


@pytest.mark.parametrize("seed", SEEDS)
def test_credit_caps_floating_memory_and_parks_the_rest(seed: int) -> None:
    """With a floating budget far below the data sent ahead, a rank racing ahead parks
    its pieces instead; no rank ever holds more than the cap, and everything arrives."""
    n, cap = 3, 8192
    job = Job(n, seed, segment_bytes=2048, floating_cap=cap, small_bytes=0)  # ring

    def watch(j: Job) -> None:
        for r, engine in enumerate(j.engines):
            assert engine.stats()["floating_bytes"] <= cap, r

    try:
        ins = [_inputs(n, 5000, np.float32, seed * 11 + i) for i in range(6)]
        plans = [[lambda ops, i=i, r=r: ops.allreduce(ins[i][r], tr.Sum, f"c{i}", 0,
                                                      inplace=False) for i in range(6)]
                 for r in range(n)]
        # Rank 0 submits everything at once; the others trickle in.
        handles = job.run(plans, submit_chance=[1.0] + [0.02] * (n - 1), watch=watch)
        for r in range(n):
            for i, h in enumerate(handles[r]):
                np.testing.assert_allclose(h.wait(), np.sum(ins[i], axis=0), rtol=1e-5,
                                           atol=1e-5)
        stats = [e.stats() for e in job.engines]
        assert max(s["floating_peak"] for s in stats) > 0, stats
        assert stats[0]["parks"] > 0, stats  # the rest waited in rank 0's own memory
    finally:
        job.close()


@pytest.mark.parametrize("seed", SEEDS)
def test_small_urgent_op_overtakes_a_big_one(seed: int) -> None:
    """Priority preemption: a small high-priority op submitted after a big one finishes
    first, while most of the big one is still queued."""
    job = Job(2, seed, link_messages=2, segment_bytes=1024)
    try:
        big = [np.full(200_000, r + 1.0, np.float32) for r in range(2)]
        small = [np.full(3, 10.0 * (r + 1), np.float32) for r in range(2)]
        hb = [job.ops[r].allreduce(big[r], tr.Sum, "big", 0, inplace=False) for r in range(2)]
        for _ in range(4):
            job.turn(0)
            job.turn(1)
        hs = [job.ops[r].allreduce(small[r], tr.Sum, "small", 10, inplace=False)
              for r in range(2)]
        job.settle(lambda: all(h.done() for h in hs))
        assert not any(h.done() for h in hb), "the big op finished first"
        job.settle(lambda: all(h.done() for h in hb))
        for r in range(2):
            np.testing.assert_array_equal(hs[r].wait(), np.full(3, 30.0, np.float32))
            np.testing.assert_array_equal(hb[r].wait(), np.full(200_000, 3.0, np.float32))
    finally:
        job.close()


@pytest.mark.parametrize("seed", SEEDS)
def test_mismatch_raises_on_every_rank(seed: int) -> None:
    n = 3
    job = Job(n, seed, segment_bytes=4096)
    try:
        shapes = [5, 5, 6]
        plans = [[lambda ops, r=r: ops.allreduce(np.ones(shapes[r], np.float32), tr.Sum, "m",
                                                 0, inplace=False)] for r in range(n)]
        handles = job.run(plans)
        for r in range(n):
            with pytest.raises(MismatchError) as info:
                handles[r][0].wait()
            text = str(info.value)
            assert f"rank {r}:" in text and "'m'" in text, text
            for other in range(n):
                assert f"rank {other}: " in text, text
    finally:
        job.close()


@pytest.mark.parametrize("seed", SEEDS)
def test_lost_peer_mid_op_fails_the_others(seed: int) -> None:
    n = 3
    job = Job(n, seed, segment_bytes=1024)
    try:
        hs = [job.ops[r].allreduce(np.ones(50_000, np.float32), tr.Sum, "lost", 0,
                                   inplace=False) for r in range(n)]
        for _ in range(job.rng.randrange(1, 6)):
            for r in range(n):
                job.turn(r)
        job.world.kill(2)
        job.settle(lambda: hs[0].done() and hs[1].done())
        for r in (0, 1):
            with pytest.raises(PeerFailureError) as info:
                hs[r].wait()
            # Told by the link's end, or by the other survivor's ABORT: either names rank 2.
            assert info.value.rank == 2, info.value
            assert str(info.value).startswith(f"rank {r}: ") and "rank 2" in str(info.value)
        # Every later op fails at once, naming the lost rank.
        h = job.ops[0].allreduce(np.ones(3), tr.Sum, "after", 0, inplace=False)
        job.turn(0)
        assert isinstance(h.error(), PeerFailureError)
    finally:
        job.close()


@pytest.mark.parametrize("seed", SEEDS)
def test_peer_that_shuts_down_mid_op_fails_only_ops_that_need_it(seed: int) -> None:
    n = 3
    job = Job(n, seed, segment_bytes=1024)
    try:
        pair = [job.ops[r].allreduce(np.ones(1000, np.float32), tr.Sum, "needs2", 0,
                                     inplace=False) for r in (0, 1)]
        for _ in range(3):
            job.turn(0)
            job.turn(1)
        job.engines[2].shutdown()
        job.settle(lambda: all(h.done() for h in pair))
        for r in (0, 1):
            # error(), not wait(): wait() gives an orderly departure a second for a Ctrl-C
            # of this rank's own before it raises.
            error = pair[r].error()
            assert isinstance(error, PeerFailureError), error
            assert "rank 2 shut down" in str(error), str(error)
            # Orderly whether this rank saw rank 2 leave or heard it from the other.
            assert error.orderly, str(error)
    finally:
        job.close()


@pytest.mark.parametrize("seed", range(6))
def test_a_name_forgotten_and_reused_while_a_slow_peer_still_remembers_it(seed: int) -> None:
    """Two names' room: x is forgotten (y and z came after it) and used again at once.
    A fast rank's call of the new x reaches a slow rank that still counts the old x's
    call as finished; it must wait there for the slow rank's new x, not be dropped."""
    n = 3
    job = Job(n, seed, name_capacity=2)
    try:
        names = ["x", "y", "z", "x", "y", "z", "x"]
        ins = [_inputs(n, 5 + i, np.float32, seed * 11 + i) for i in range(len(names))]
        plans = [[lambda ops, i=i, r=r, name=name: ops.allreduce(
            ins[i][r], tr.Sum, name, 0, inplace=False) for i, name in enumerate(names)]
            for r in range(n)]
        handles = job.run(plans, submit_chance=[1.0, 0.02, 0.3], max_turns=50_000)
        for r in range(n):
            for i, h in enumerate(handles[r]):
                np.testing.assert_allclose(h.wait(), np.sum(ins[i], axis=0), rtol=1e-5)
    finally:
        job.close()


@pytest.mark.parametrize("seed", range(4))
def test_a_name_forgotten_while_its_op_runs_leaves_no_finished_record(seed: int) -> None:
    """x is forgotten on the fast rank (y and z came after it) while its op still waits
    for the slow rank; when it ends, it must not be recorded as finished, or that record
    would outlive the forgetting (and swallow a later call 0 of the same identity)."""
    job = Job(2, seed, name_capacity=2)
    try:
        ins = [_inputs(2, 9, np.float64, seed * 5 + i) for i in range(3)]
        plans = [[lambda ops, i=i, r=r, name=name: ops.allreduce(
            ins[i][r], tr.Sum, name, 0, inplace=False) for i, name in enumerate("xyz")]
            for r in range(2)]
        handles = job.run(plans, submit_chance=[1.0, 0.01])
        for r in range(2):
            for i, h in enumerate(handles[r]):
                np.testing.assert_allclose(h.wait(), np.sum(ins[i], axis=0), rtol=1e-12)
        # Only y and z, the names still remembered, have finished calls on record.
        assert job.engines[0].stats()["done_names"] == 2, job.engines[0].stats()
    finally:
        job.close()
