"""The step machines, run in one process by a message-passing simulator."""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest

from totalreduce.engine.algorithms import (
    chain_broadcast,
    pairwise_alltoallv,
    ring_allgatherv,
    ring_allreduce,
    ring_reducescatter,
)
from totalreduce.engine.schedule import COPY, Schedule, even_bounds


def simulate(schedules: list[Schedule], works: list[np.ndarray],
             sources: list[np.ndarray] | None = None, seed: int = 0) -> None:
    """Deliver every message in a random order, honouring only the unlock rules."""
    n = len(schedules)
    rng = random.Random(seed)
    inflight: list[tuple[int, object]] = []
    for r, s in enumerate(schedules):
        inflight += [(r, send) for send in s.first]
    got = [set() for _ in range(n)]
    while inflight:
        src, send = inflight.pop(rng.randrange(len(inflight)))
        buf = (sources[src] if send.from_source else works[src])[send.lo:send.hi].copy()
        dst = send.peer
        key = (src, send.step, send.piece)
        recv = schedules[dst].recvs[key]
        assert key not in got[dst], f"duplicate {key}"
        got[dst].add(key)
        assert recv.hi - recv.lo == buf.size
        if recv.mode == COPY:
            works[dst][recv.lo:recv.hi] = buf
        else:
            works[dst][recv.lo:recv.hi] += buf
        inflight += [(dst, s) for s in recv.then]
    for r in range(n):
        assert got[r] == set(schedules[r].recvs), f"rank {r} missed messages"


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("count", [0, 1, 2, 7, 31, 1000])
@pytest.mark.parametrize("seg", [1, 3, 64, 10_000])
def test_ring_allreduce(n: int, count: int, seg: int) -> None:
    rng = np.random.default_rng(n * 1000 + count)
    inputs = [rng.integers(0, 100, count) for _ in range(n)]
    works = [x.copy() for x in inputs]
    simulate([ring_allreduce(r, n, count, seg) for r in range(n)], works, seed=count)
    for w in works:
        assert np.array_equal(w, sum(inputs))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("rows", [0, 1, 5, 13])
def test_ring_reducescatter(n: int, rows: int) -> None:
    rng = np.random.default_rng(rows)
    inputs = [rng.integers(0, 100, rows * 2) for _ in range(n)]
    bounds = tuple(b * 2 for b in even_bounds(rows, n))
    works = [x.copy() for x in inputs]
    scheds = [ring_reducescatter(r, n, bounds, 3) for r in range(n)]
    simulate(scheds, works)
    total = sum(inputs)
    for r in range(n):
        assert np.array_equal(works[r][bounds[r]:bounds[r + 1]], total[bounds[r]:bounds[r + 1]])


@pytest.mark.parametrize("n", [2, 3, 4])
def test_allgatherv_and_broadcast_and_alltoallv(n: int) -> None:
    counts = [0, 5, 1, 9][:n]
    bounds = tuple(np.concatenate([[0], np.cumsum(counts)]).tolist())
    full = np.arange(bounds[-1])
    works = [np.where((np.arange(bounds[-1]) >= bounds[r]) & (np.arange(bounds[-1]) <
                                                                bounds[r + 1]), full, -1)
             for r in range(n)]
    simulate([ring_allgatherv(r, n, bounds, 2) for r in range(n)], works)
    assert all(np.array_equal(w, full) for w in works)
    for root in range(n):
        works = [full.copy() if r == root else np.zeros_like(full) for r in range(n)]
        simulate([chain_broadcast(r, n, root, full.size, 4) for r in range(n)], works)
        assert all(np.array_equal(w, full) for w in works)
    send = [[(r + p) % 3 for p in range(n)] for r in range(n)]
    srcs = [np.arange(sum(send[r])) + 100 * r for r in range(n)]
    sb = [tuple(np.concatenate([[0], np.cumsum(send[r])]).tolist()) for r in range(n)]
    rb = [tuple(np.concatenate([[0], np.cumsum([send[s][r] for s in range(n)])]).tolist())
          for r in range(n)]
    outs = [np.full(rb[r][-1], -1) for r in range(n)]
    for r in range(n):
        outs[r][rb[r][r]:rb[r][r + 1]] = srcs[r][sb[r][r]:sb[r][r + 1]]
    simulate([pairwise_alltoallv(r, n, sb[r], rb[r], 2) for r in range(n)], outs, srcs)
    for r in range(n):
        want = np.concatenate([srcs[s][sb[s][r]:sb[s][r + 1]] for s in range(n)])
        assert np.array_equal(outs[r], want)


def test_ring_sends_two_n_minus_one_over_n_of_the_buffer() -> None:
    n, count = 4, 4000
    s = ring_allreduce(0, n, count, 100)
    sent = sum(x.hi - x.lo for x in s.first) + sum(
        x.hi - x.lo for r in s.recvs.values() for x in r.then)
    assert sent == 2 * (n - 1) * count // n
    assert deque(s.expected_from().keys()) == deque([n - 1])
