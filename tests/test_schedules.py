"""The step machines, run in one process by a message-passing simulator."""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from typing import Any

import numpy as np
import pytest

from totalreduce.engine.algorithms import (
    Algorithms,
    chain_broadcast,
    doubling_allgather,
    doubling_allgatherv,
    doubling_allreduce,
    halving_allreduce,
    halving_reducescatter,
    pairwise_alltoallv,
    ring_allgatherv,
    ring_allreduce,
    ring_reducescatter,
    scatter_allgather_broadcast,
)
from totalreduce.engine.algorithms.hierarchical import hierarchical_allreduce, host_groups
from totalreduce.engine.schedule import COPY, Schedule, even_bounds


def simulate(schedules: list[Schedule], works: list[np.ndarray],
             sources: list[np.ndarray] | None = None, seed: int = 0,
             finalize: bool = False, fresh: bool = False) -> None:
    """Run every rank's step machine with adversarial timing.

    A queued send reads its buffer only when it "leaves", at a random later moment, and
    messages arrive in a random order, honouring only the unlock rules and ``Recv.after``
    (a reduce waits until the named sends have left, as the engine holds it) and
    ``Recv.wait`` (until the named receives were applied).  A schedule that overwrote a
    region before its send of that region had left would compute garbage here.  With
    ``finalize``, a final receive negates its region (as an average divides it), so a
    region finalized twice, or before every contribution is in, comes out wrong.  With
    ``fresh`` (OpSpec.fresh), a reduce combines the source's region with the body, as
    the engine does for an op whose working buffer starts undefined.

    It also checks that every rank finishes only after hearing, through some chain of
    messages, from every other rank: that is what lets a rank that disagrees about an op
    (its header's signature) fail it everywhere before anyone returns data.
    """
    n = len(schedules)
    rng = random.Random(seed)
    queued: list[tuple[int, object, frozenset[int]]] = []
    for r, s in enumerate(schedules):
        queued += [(r, send, frozenset([r])) for send in s.first]
    inflight: list[tuple[int, object, np.ndarray, frozenset[int]]] = []
    heard = [{r} for r in range(n)]  # ranks whose messages reached r, directly or not
    got = [set() for _ in range(n)]
    left = [set() for _ in range(n)]
    held: list[list[tuple[object, np.ndarray]]] = [[] for _ in range(n)]

    sent_knows: list[dict[tuple[int, int, int], frozenset[int]]] = [{} for _ in range(n)]
    applied: list[dict[tuple[int, int, int], frozenset[int]]] = [{} for _ in range(n)]

    def ready(dst: int, recv) -> bool:
        return set(recv.after) <= left[dst] and set(recv.wait) <= applied[dst].keys()

    def apply(dst: int, key, recv, buf: np.ndarray, knows: frozenset[int]) -> None:
        if recv.mode == COPY:
            works[dst][recv.lo:recv.hi] = buf
        elif fresh:
            assert sources is not None
            works[dst][recv.lo:recv.hi] = sources[dst][recv.lo:recv.hi] + buf
        else:
            works[dst][recv.lo:recv.hi] += buf
        if finalize and recv.final:
            works[dst][recv.lo:recv.hi] *= -1
        # What this rank surely knew by now: what the message brought, and what the sends
        # and receives it had to wait for (Recv.after, Recv.wait) knew.  Sends it unlocks
        # carry that on.
        for k in recv.after:
            knows |= sent_knows[dst][k]
        for k in recv.wait:
            knows |= applied[dst][k]
        knows |= {dst}
        heard[dst] |= knows
        applied[dst][key] = knows
        queued.extend((dst, s, knows) for s in recv.then)

    def release(dst: int) -> None:
        """Apply what ``dst`` held back and may apply now, until nothing more is ready."""
        i = 0
        while i < len(held[dst]):
            if ready(dst, held[dst][i][1]):
                apply(dst, *held[dst].pop(i))
                i = 0
            else:
                i += 1

    while queued or inflight:
        if queued and (not inflight or rng.random() < 0.5):
            src, send, knows = queued.pop(rng.randrange(len(queued)))
            buf = (sources[src] if send.from_source else works[src])[send.lo:send.hi].copy()
            inflight.append((src, send, buf, knows))
            left[src].add((send.peer, send.step, send.piece))
            sent_knows[src][(send.peer, send.step, send.piece)] = knows
            release(src)
            continue
        src, send, buf, knows = inflight.pop(rng.randrange(len(inflight)))
        dst = send.peer
        key = (src, send.step, send.piece)
        recv = schedules[dst].recvs[key]
        assert key not in got[dst], f"duplicate {key}"
        got[dst].add(key)
        assert recv.hi - recv.lo == buf.size
        assert not recv.wait or recv.mode != COPY, "only reduces may wait"
        if ready(dst, recv):
            apply(dst, key, recv, buf, knows)
            release(dst)
        else:
            held[dst].append((key, recv, buf, knows))
    for r in range(n):
        assert got[r] == set(schedules[r].recvs), f"rank {r} missed messages"
        assert not held[r], f"rank {r} still holds reduces"
        assert heard[r] == set(range(n)), f"rank {r} finished without hearing from " \
            f"{sorted(set(range(n)) - heard[r])}"


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


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("count", [0, 1, 7])
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("seg", [1, 3, 100])
def test_doubling_allreduce(n: int, count: int, seed: int, seg: int) -> None:
    rng = np.random.default_rng(seed)
    inputs = [rng.integers(0, 100, count) for _ in range(n)]
    works = [x.copy() for x in inputs]
    simulate([doubling_allreduce(r, n, count, seg) for r in range(n)], works, seed=seed)
    for w in works:
        assert np.array_equal(w, sum(inputs))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 8, 11, 12, 16])
@pytest.mark.parametrize("seed", range(3))
def test_doubling_allgather(n: int, seed: int) -> None:
    # Blocks of 0-8 elements (some empty), every message in any order; then as the
    # express lane runs it.  One message a step: log2 n exchanges, plus a fold before and
    # a return after where n is not a power of two.
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 9, n) if seed else np.full(n, 3)
    bounds = tuple(np.concatenate([[0], np.cumsum(counts)]).tolist())
    full = np.arange(bounds[-1])

    def works() -> list[np.ndarray]:
        return [np.where((full >= bounds[r]) & (full < bounds[r + 1]), full, -1)
                for r in range(n)]

    scheds = [doubling_allgather(r, n, bounds) for r in range(n)]
    got = works()
    simulate(scheds, got, seed=seed)
    assert all(np.array_equal(w, full) for w in got)
    if n > 1:
        got = works()
        assert run_in_chain_order(scheds, got) == 0
        assert all(np.array_equal(w, full) for w in got)
        power = 1 << (n.bit_length() - 1)
        exchanges = power.bit_length() - 1
        steps = {k[1] for s in scheds for k in s.recvs}
        assert len(steps) == exchanges + (0 if power == n else 2)
        sent = [len(s.first) + sum(len(r.then) for r in s.recvs.values()) for s in scheds]
        assert max(sent) <= exchanges + 2


def test_doubling_takes_log_n_steps() -> None:
    # 8 ranks: 3 exchanges, each rank sends 3 messages; 6 ranks: folds add 2 steps.
    s = doubling_allreduce(5, 8, 10, 100)
    assert len(s.first) == 1 and sorted(k[1] for k in s.recvs) == [1, 2, 3]
    assert sorted(k[1] for k in doubling_allreduce(0, 6, 10, 100).recvs) == [0, 1, 2]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 8, 11])
@pytest.mark.parametrize("count", [0, 1, 7, 100])
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("seg", [1, 3, 100])
def test_halving_allreduce(n: int, count: int, seed: int, seg: int) -> None:
    # The final receives negate their region (as an average divides it): once each, after
    # every contribution is in.
    rng = np.random.default_rng(seed)
    inputs = [rng.integers(0, 100, count) for _ in range(n)]
    works = [x.copy() for x in inputs]
    simulate([halving_allreduce(r, n, count, seg) for r in range(n)], works, seed=seed,
             finalize=n > 1)
    for w in works:
        assert np.array_equal(w, sum(inputs) * (-1 if n > 1 else 1))


def test_halving_takes_2_log_n_steps_and_sends_the_rings_bytes() -> None:
    # 16 ranks, 16 blocks of 100: 4 halving steps (800, 400, 200, 100 elements sent, one
    # message each), then 4 doubling steps passing 1, 2, 4, 8 finished blocks.
    s = halving_allreduce(5, 16, 1600, 1000)
    sends = [*s.first, *(t for r in s.recvs.values() for t in r.then)]
    assert sorted({t.step for t in sends}) == list(range(1, 9))
    assert [sum(t.hi - t.lo for t in sends if t.step == k) for k in range(1, 9)] == \
        [800, 400, 200, 100, 100, 200, 400, 800]
    assert [sum(1 for t in sends if t.step == k) for k in range(1, 5)] == [1, 1, 1, 1]
    assert sum(t.hi - t.lo for t in sends) == 2 * 1600 * 15 // 16
    # 6 ranks: the folded pairs add a step before and one after.
    assert sorted({k[1] for k in halving_allreduce(0, 6, 10, 100).recvs}) == [0, 1, 2, 3, 4]
    assert sorted({k[1] for k in halving_allreduce(1, 6, 10, 100).recvs}) == [5]


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("seg", [1, 3, 100])
def test_halving_reducescatter_and_doubling_allgatherv(n: int, seed: int, seg: int) -> None:
    # Blocks of uneven sizes, empty ones included; the reduce-scatter's final receives
    # negate their block once, after every contribution.
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 9, n) if seed else np.zeros(n, int)
    bounds = tuple(np.concatenate([[0], np.cumsum(counts)]).tolist())
    inputs = [rng.integers(0, 100, bounds[-1]) for _ in range(n)]
    works = [x.copy() for x in inputs]
    simulate([halving_reducescatter(r, n, bounds, seg) for r in range(n)], works,
             seed=seed, finalize=n > 1)
    total = sum(inputs) * (-1 if n > 1 else 1)
    for r in range(n):
        assert np.array_equal(works[r][bounds[r]:bounds[r + 1]], total[bounds[r]:bounds[r + 1]])
    full = np.arange(bounds[-1])
    works = [np.where((full >= bounds[r]) & (full < bounds[r + 1]), full, -1)
             for r in range(n)]
    simulate([doubling_allgatherv(r, n, bounds, seg) for r in range(n)], works, seed=seed)
    assert all(np.array_equal(w, full) for w in works)
    if n > 1:  # log2 n steps, in the order the express lane waits for them
        works = [np.where((full >= bounds[r]) & (full < bounds[r + 1]), full, -1)
                 for r in range(n)]
        scheds = [doubling_allgatherv(r, n, bounds, seg) for r in range(n)]
        assert {k[1] for k in scheds[0].recvs} == set(range(n.bit_length() - 1))
        assert run_in_chain_order(scheds, works) == 0
        assert all(np.array_equal(w, full) for w in works)
    with pytest.raises(ValueError, match="power-of-two"):
        halving_reducescatter(0, 3, (0, 1, 2, 3), 1)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("count", [0, 1, 7, 100])
@pytest.mark.parametrize("seg", [1, 3, 100])
def test_scatter_allgather_broadcast(n: int, count: int, seg: int) -> None:
    # From every root; then as the express lane runs it, each receive waited for in order.
    full = np.arange(count) + 1
    for root in range(n):
        works = [full.copy() if r == root else np.zeros(count, int) for r in range(n)]
        scheds = [scatter_allgather_broadcast(r, n, root, count, seg) for r in range(n)]
        simulate(scheds, works, seed=root)
        assert all(np.array_equal(w, full) for w in works)
        if n > 1:
            works = [full.copy() if r == root else np.zeros(count, int) for r in range(n)]
            assert run_in_chain_order(scheds, works) == 0
            assert all(np.array_equal(w, full) for w in works)
    if n == 8:  # 3 + 3 steps; a rank other than the root receives the buffer once
        s = scatter_allgather_broadcast(3, 8, 0, 8000, 10**6)
        assert sorted({k[1] for k in s.recvs}) == [2, 3, 4, 5]
        assert sum(r.hi - r.lo for r in s.recvs.values()) == 8000


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


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_an_allgather_sends_its_own_block_from_its_source(n: int) -> None:
    """ring_allgatherv's ``own``: the working buffer starts undefined, the first sends
    read the source (the input, at its block's place: OpSpec.source_at), and the op
    copies the block in itself (local_final), here after every receive."""
    counts = [3, 0, 7, 2][:n]
    bounds = tuple(np.concatenate([[0], np.cumsum(counts)]).tolist())
    full = np.arange(bounds[-1]) + 1
    at = np.arange(bounds[-1])
    sources = [np.where((at >= bounds[r]) & (at < bounds[r + 1]), full, -7)
               for r in range(n)]
    works = [np.full(bounds[-1], -1) for _ in range(n)]
    schedules = [ring_allgatherv(r, n, bounds, 2, own=True) for r in range(n)]
    simulate(schedules, works, sources)
    for r, schedule in enumerate(schedules):
        assert all(send.from_source for send in schedule.first)
        assert schedule.local_final == ((bounds[r], bounds[r + 1]),)
        for lo, hi in schedule.local_final:
            works[r][lo:hi] = sources[r][lo:hi]
        assert np.array_equal(works[r], full), r


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


def test_simulator_catches_a_reduce_that_does_not_wait_for_its_send() -> None:
    # The same schedules without Recv.after: some timing reduces into the buffer before
    # the partner's copy left, and the sums come out wrong.
    import dataclasses

    def strip(s: Schedule) -> Schedule:
        return dataclasses.replace(s, recvs={k: dataclasses.replace(r, after=())
                                             for k, r in s.recvs.items()})

    wrong = 0
    for seed in range(20):
        inputs = [np.arange(5) + 10 * r for r in range(4)]
        works = [x.copy() for x in inputs]
        simulate([strip(doubling_allreduce(r, 4, 5, 2)) for r in range(4)], works, seed=seed)
        wrong += any(not np.array_equal(w, sum(inputs)) for w in works)
    assert wrong > 0


def _hosts(n_hosts: int, n_local: int, interleaved: bool) -> tuple[int, ...]:
    """Each rank's host: ranks of a host contiguous, or dealt round-robin."""
    n = n_hosts * n_local
    return tuple(r % n_hosts if interleaved else r // n_local for r in range(n))


@pytest.mark.parametrize(("n_hosts", "n_local"), [(2, 2), (2, 3), (3, 2), (4, 2), (2, 4)])
@pytest.mark.parametrize("count", [0, 1, 5, 37, 1000])
@pytest.mark.parametrize("seg", [1, 7, 10_000])
@pytest.mark.parametrize("interleaved", [False, True])
def test_hierarchical_allreduce(n_hosts: int, n_local: int, count: int, seg: int,
                                interleaved: bool) -> None:
    hosts = _hosts(n_hosts, n_local, interleaved)
    n = len(hosts)
    rng = np.random.default_rng(count * 31 + seg)
    inputs = [rng.integers(0, 100, count) for _ in range(n)]
    works = [x.copy() for x in inputs]
    scheds = [hierarchical_allreduce(r, hosts, count, seg) for r in range(n)]
    simulate(scheds, works, seed=count + seg, finalize=True)
    for w in works:
        assert np.array_equal(w, -sum(inputs))


def test_hierarchical_allreduce_keeps_cross_host_traffic_to_the_link_bound() -> None:
    # 2 hosts x 2 ranks: each host sends 2 (H - 1) / H = 1 buffer across, half per rank,
    # where the flat ring's rank 1 alone sends 2 (n - 1) / n = 1.5 buffers to rank 2.
    hosts, count = (0, 0, 1, 1), 1200
    for rank in range(4):
        sched = hierarchical_allreduce(rank, hosts, count, 100)
        sends = [*sched.first, *(s for r in sched.recvs.values() for s in r.then)]
        across = sum(s.hi - s.lo for s in sends if hosts[s.peer] != hosts[rank])
        assert across == count // 2


def test_hierarchical_allreduce_needs_its_waits() -> None:
    # Without Recv.wait a cross-host piece that comes before this host's own sum of its
    # region is passed on without it: the simulator must catch that, or it proves nothing.
    hosts, count = (0, 0, 1, 1), 40
    inputs = [np.arange(count) * (r + 1) for r in range(4)]
    wrong = 0
    for seed in range(20):
        scheds = []
        for r in range(4):
            s = hierarchical_allreduce(r, hosts, count, 5)
            scheds.append(Schedule(s.first, {k: dataclasses.replace(v, wait=())
                                             for k, v in s.recvs.items()}, s.local_final))
        works = [x.copy() for x in inputs]
        simulate(scheds, works, seed=seed)
        wrong += any(not np.array_equal(w, sum(inputs)) for w in works)
    assert wrong > 0


@pytest.mark.parametrize("hosts", [(0, 0, 0, 0), (0, 1, 2, 3), (0, 0, 1), (0, 0, 1, 1, 1, 0, 2)])
def test_hierarchical_layout_refuses_what_it_cannot_split(hosts: tuple[int, ...]) -> None:
    assert host_groups(hosts) is None


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("count", [0, 1, 7, 1000])
@pytest.mark.parametrize("seg", [1, 3, 10_000])
def test_ring_reads_the_source_when_its_buffer_starts_undefined(n: int, count: int,
                                                                seg: int) -> None:
    # OpSpec.fresh: no copy of the input; whatever the working buffer held must not show.
    rng = np.random.default_rng(n * 7 + count)
    inputs = [rng.integers(0, 100, count).astype(float) for _ in range(n)]
    bounds = tuple(even_bounds(count, n))
    for scheds, whole in (([ring_allreduce(r, n, count, seg, True) for r in range(n)], True),
                          ([ring_reducescatter(r, n, bounds, seg, True) for r in range(n)],
                           False)):
        works = [np.full(count, np.nan) for _ in range(n)]
        for r, s in enumerate(scheds):
            for lo, hi in s.local_final:
                works[r][lo:hi] = inputs[r][lo:hi]
        simulate(scheds, works, sources=inputs, seed=count, fresh=True)
        total = sum(inputs)
        for r in range(n):
            lo, hi = (0, count) if whole else (bounds[r], bounds[r + 1])
            assert np.array_equal(works[r][lo:hi], total[lo:hi]), (r, whole)


def run_in_chain_order(schedules: list[Schedule], works: list[np.ndarray]) -> int:
    """Every rank runs its schedule as the express lane does (engine/express.py): its
    first sends, then its receives strictly in the chain's order, each taken only from the
    head of the one pair's FIFO it comes through, posting what it unlocks (a post copies
    the body, as a ring does).  Ranks take turns; returns how many turns a receive found
    another message at the head (where the lane would hand the op to the small path)."""
    from totalreduce.engine.express import chain_of

    n = len(schedules)
    chains = [chain_of(s) for s in schedules]
    assert all(c is not None for c in chains)
    fifo: dict[tuple[int, int], deque[tuple[int, int, np.ndarray]]] = {
        (a, b): deque() for a in range(n) for b in range(n)}

    def post(rank: int, send: Any) -> None:
        fifo[(rank, send.peer)].append((send.step, send.piece,
                                        works[rank][send.lo:send.hi].copy()))

    for r, chain in enumerate(chains):
        for send in chain.first:
            post(r, send)
    pos = [0] * n
    strays = 0
    moved = True
    while moved:
        moved = False
        for r, chain in enumerate(chains):
            while pos[r] < len(chain.steps):
                peer, step, piece, recv = chain.steps[pos[r]]
                queue = fifo[(peer, r)]
                if not queue:
                    break
                if queue[0][:2] != (step, piece):
                    strays += 1
                    break
                body = queue.popleft()[2]
                if recv.mode == COPY:
                    works[r][recv.lo:recv.hi] = body
                else:
                    works[r][recv.lo:recv.hi] += body
                for send in recv.then:
                    post(r, send)
                pos[r] += 1
                moved = True
    assert pos == [len(c.steps) for c in chains], f"stuck at {pos}"
    return strays


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("count", [0, 1, 7])
@pytest.mark.parametrize("seg", [1, 100])
def test_small_schedules_run_in_chain_order(n: int, count: int, seg: int) -> None:
    # What the express lane relies on: waiting for each receive in step order never waits
    # on a message that waits on us, and the peers send in that order, so it never has to
    # hand over for want of order.
    rng = np.random.default_rng(n * 10 + count)
    inputs = [rng.integers(0, 100, count) for _ in range(n)]
    works = [x.copy() for x in inputs]
    assert run_in_chain_order([doubling_allreduce(r, n, count, seg) for r in range(n)],
                              works) == 0
    assert all(np.array_equal(w, sum(inputs)) for w in works)
    counts = [(r * 3 + count) % 4 for r in range(n)]
    bounds = tuple(np.concatenate([[0], np.cumsum(counts)]).tolist())
    full = np.arange(bounds[-1])
    works = [np.where((full >= bounds[r]) & (full < bounds[r + 1]), full, -1)
             for r in range(n)]
    assert run_in_chain_order([ring_allgatherv(r, n, bounds, seg) for r in range(n)],
                              works) == 0
    assert all(np.array_equal(w, full) for w in works)
    root = count % n
    works = [full.copy() if r == root else np.zeros_like(full) for r in range(n)]
    assert run_in_chain_order([chain_broadcast(r, n, root, full.size, seg)
                               for r in range(n)], works) == 0
    assert all(np.array_equal(w, full) for w in works)


def test_a_schedule_whose_receive_unlocks_an_earlier_step_is_no_chain() -> None:
    from totalreduce.engine.express import chain_of
    from totalreduce.engine.schedule import REDUCE, Recv, Send

    # The receive of step 1 unlocks a send of step 0: waiting in step order could wait on
    # a message that waits on us.
    first = (Send(1, 0, 0, 0, 1),)
    recvs = {(1, 1, 0): Recv(0, 1, REDUCE, True, (Send(1, 0, 1, 0, 1),))}
    assert chain_of(Schedule(first, recvs, ())) is None
    # A reduce into a region whose send of it has not been posted before it.
    recvs = {(1, 0, 0): Recv(0, 1, REDUCE, True, (), after=((1, 2, 0),))}
    assert chain_of(Schedule(first, recvs, ())) is None
    assert chain_of(doubling_allreduce(0, 4, 8, 100)) is not None


def test_log_step_algorithms_are_chosen_where_they_won() -> None:
    f32 = np.dtype(np.float32)

    def picks(size: int, nbytes: int, halving: int = -1) -> tuple[str, ...]:
        algos = Algorithms(0, size, 2 << 20, -1, halving_bytes=halving)
        count = nbytes // 4
        bounds = tuple(even_bounds(count, size))
        return (algos.allreduce(count, f32).algorithm, algos.reducescatter(bounds, f32)[1],
                algos.allgather(bounds, f32)[1], algos.broadcast(0, count, f32)[1])

    assert picks(8, 64 << 10) == ("doubling", "ring", "doubling-small", "scatter-allgather")
    assert picks(8, 4 << 20) == ("halving", "halving", "doubling", "scatter-allgather")
    assert picks(8, 64 << 20) == ("ring", "ring", "ring", "scatter-allgather")
    assert picks(16, 64 << 20) == ("halving", "ring", "ring", "scatter-allgather")
    assert picks(4, 4 << 20) == ("ring", "ring", "ring", "chain")
    assert picks(12, 4 << 20) == ("halving", "ring", "ring", "chain")  # not a power of 2
    # Set: every size up to it, from 4 ranks.
    assert picks(4, 64 << 10, 1 << 30) == ("doubling", "halving", "doubling-small",
                                           "scatter-allgather")
    assert picks(4, 4 << 20, 1 << 30) == ("halving", "halving", "doubling",
                                          "scatter-allgather")
    # Across hosts (not measured there): the ring and the chain, unless set.
    across = Algorithms(0, 8, 2 << 20, -1, hosts=(0, 0, 0, 0, 1, 1, 1, 2))
    count = (4 << 20) // 4
    assert across.allreduce(count, f32).algorithm == "ring"
    assert across.broadcast(0, count, f32)[1] == "chain"
    # The sizes exchange of an allgather (no dtype): one message a step from 4 ranks, on
    # one host or not; at 2 and 3 ranks the ring takes as many steps.
    for n, want in ((2, "ring"), (3, "ring"), (4, "doubling-small"), (12, "doubling-small")):
        assert Algorithms(0, n, 2 << 20, -1).allgather(tuple(range(n + 1)))[1] == want
    assert across.allgather(tuple(range(9)))[1] == "doubling-small"


def test_lent_pieces_at_two_ranks_are_whole_and_agreed_by_both_ranks() -> None:
    f32 = np.dtype(np.float32)
    seg = 2 << 20

    def pieces(schedule: Schedule) -> tuple[list[int], list[int]]:
        return ([s.hi - s.lo for s in schedule.first],
                [r.hi - r.lo for _k, r in sorted(schedule.recvs.items())])

    lent = [Algorithms(r, 2, seg, -1, lent_pieces=True) for r in range(2)]
    plain = Algorithms(0, 2, seg, -1)
    # A 16 MiB allgather: each rank's 8 MiB block in one piece, not four.
    bounds = (0, 2 << 20, 4 << 20)
    schedule, algorithm, _own = lent[0].allgather(bounds, f32)
    assert algorithm == "ring, lent pieces" and pieces(schedule) == ([2 << 20], [2 << 20])
    schedule, algorithm, _own = plain.allgather(bounds, f32)
    assert algorithm == "ring" and pieces(schedule) == ([seg // 4] * 4, [seg // 4] * 4)
    # Up to two segments, and past two ranks, nothing changes.
    assert lent[0].allgather((0, seg // 4, seg // 2), f32)[1] == "ring"
    assert Algorithms(0, 3, seg, -1, lent_pieces=True).allgather(
        (0, 4 << 20, 8 << 20, 12 << 20), f32)[1] == "ring"
    # A broadcast from 1 MiB (PUSH_MIN), whose root copies half of it into its peer.
    schedule, algorithm = lent[1].broadcast(0, 4 << 20, f32)
    assert algorithm == "chain, lent pieces" and pieces(schedule)[1] == [4 << 20]
    schedule, algorithm = lent[1].broadcast(0, 1 << 18, f32)
    assert algorithm == "chain, lent pieces" and pieces(schedule)[1] == [1 << 18]
    assert lent[1].broadcast(0, (1 << 18) - 1, f32)[1] == "chain"
    # An alltoall with uneven splits: each rank counts what crosses between the two
    # (not its own block), so both choose alike, and what one sends the other expects.
    sends = [(0, 100, 5_000_100), (0, 7_000_000, 7_000_050)]
    recvs = [(0, 100, 100 + 7_000_000), (0, 5_000_000, 5_000_050)]
    got = [lent[r].alltoall(sends[r], recvs[r], f32) for r in range(2)]
    assert [g[1] for g in got] == ["pairwise, lent pieces"] * 2
    assert pieces(got[0][0])[0] == pieces(got[1][0])[1] == [5_000_000]
    assert pieces(got[1][0])[0] == pieces(got[0][0])[1] == [7_000_000]
    sends = [(0, 100, 300), (0, 50, 250)]
    recvs = [(0, 100, 150), (0, 200, 400)]
    assert [lent[r].alltoall(sends[r], recvs[r], f32)[1] for r in range(2)] == \
        ["pairwise"] * 2
