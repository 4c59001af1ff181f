"""The small path (engine/smallpath.py): small blocking ops run on the caller's thread,
message for message the same as the general path, so ranks may take either path for the
same op and the two interleave."""

import os

import pytest

from harness import mpiexec, run_ok
from totalreduce.bench.buffers import float32s
from totalreduce.engine.express import ONE_WAY_HUGE
from totalreduce.scheduling.thresholds import LENT_GATHER_BYTES
from totalreduce.transport import cma, pages

pytestmark = pytest.mark.multiprocess

# The MPI transport and the sockets show a peer's messages to the caller's thread too
# (their ports: a header receive tested in place, a receive into the link's staging
# buffer): the small path, the express lane and repeats run over them as over the
# shared-memory rings.
_MPI = pytest.param("mpi", marks=pytest.mark.skipif(mpiexec() is None,
                                                    reason="needs mpi4py and mpiexec"))
TRANSPORTS = ["shm", "tcp", _MPI]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", [2, 3])
def test_small_and_general_paths_mix_rank_by_rank(n: int, transport: str) -> None:
    result = run_ok(n, "smallpath_workers:mixed_paths", {"steps": 200}, timeout=150,
                    transport=transport)
    for r in range(n):
        got = result.report(r)
        assert got["checked"] == 200, result.explain()
        # Both paths really ran on every rank: the mix is what is under test.
        assert got["direct"] > 0, got
        assert got["active"] == 0 and got["floating"] == 0, got


def test_max_and_min_reductions_warn_of_nothing() -> None:
    # numpy 2.4 deprecates a third positional argument to np.maximum and np.minimum (it
    # will not be taken for the output), which every path that reduces passed: run
    # repeated Sum, Max and Min allreduces (the Repeat, the express lane, the loop) with
    # deprecation warnings as errors.
    result = run_ok(2, "smallpath_workers:repeated_calls", {"steps": 120}, timeout=150,
                    env={"PYTHONWARNINGS": "error::DeprecationWarning"})
    for r in range(2):
        assert result.report(r)["repeats"] > 0, result.report(r)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_rank_repeats_of_one_exchange_match_numpy_and_hand_late_calls_over(
        transport: str) -> None:
    # A 2-rank allreduce of up to SMALL_BYTES, or a barrier, is one message each way: its
    # Repeat runs it without _run's loops (repeat.py, Repeat._run_single).
    result = run_ok(2, "smallpath_workers:single_exchanges", {"steps": 240}, timeout=150,
                    transport=transport)
    for r in range(2):
        got = result.report(r)
        # Every template's first call builds its Repeat; most later blocking ones run
        # from it, by this path only.
        assert got["entered"] > got["blocking"] // 2, result.explain()
        assert got["repeats"] > 0, result.explain()
    # Rank 1 came 20 ms late to some calls: rank 0's Repeat handed those over.
    assert result.report(0)["handed_over"] > 0, result.explain()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", [2, 4])
def test_repeated_small_calls_match_numpy_when_peers_run_ahead(n: int, transport: str
                                                               ) -> None:
    result = run_ok(n, "smallpath_workers:repeated_calls", {"steps": 400}, timeout=150,
                    transport=transport)
    for r in range(n):
        got = result.report(r)
        assert got["floating"] == 0 and got["plans"] > 0, got
        # Repeats took the express lane (at 4 ranks, with a READY ahead of the data),
        # blocking allreduces from their template's Repeat (engine/repeat.py).
        assert got["express"] > 0 and got["repeats"] > 0, got
    if n == 4:  # 4 ranks on 2 cores: some rank always runs ahead of another
        assert any(result.report(r)["caught_up"] > 0 for r in range(n)), result.explain()


@pytest.mark.parametrize(("kind", "n", "transport"), [
    ("allreduce", 2, "shm"), ("allreduce", 3, "shm"), ("allreduce", 4, "shm"),
    ("broadcast", 2, "shm"), ("broadcast", 3, "shm"), ("allgather", 2, "shm"),
    ("allgather", 3, "shm"), ("alltoall", 2, "shm"), ("alltoall", 3, "shm"),
    ("allgather rows", 2, "shm"), ("alltoall rows", 3, "shm"),
    ("reducescatter", 2, "shm"), ("reducescatter", 3, "shm"),
    *(pytest.param(kind, n, "mpi", marks=_MPI.marks) for kind, n in [
        ("allreduce", 2), ("broadcast", 3), ("alltoall", 3), ("reducescatter", 2)]),
    ("allreduce", 3, "tcp"), ("broadcast", 2, "tcp"), ("alltoall", 2, "tcp"),
    ("allgather rows", 3, "tcp"), ("reducescatter", 3, "tcp")])
def test_a_repeated_call_made_differently_on_one_rank_fails_on_every_rank(
        kind: str, n: int, transport: str) -> None:
    whats = {"allreduce": ["op"], "broadcast": ["root"], "reducescatter": ["op"]
             }.get(kind, []) + [
        "dtype", "shape"]
    # At 4 ranks on 2 cores a call's Repeat often declines (a peer slow to get a core):
    # beside a busy process the lowest rank began 3-6 of 10 from it, and under the whole
    # suite's load one rank once began none; twice the calls there.
    result = run_ok(n, "smallpath_workers:repeat_then_differ",
                    {"kind": kind, "whats": whats, "repeats": 20 if n >= 4 else 10},
                    timeout=150, transport=transport)
    for r in range(n):
        got = result.report(r)
        # The repeats began from the template's Repeat (at 4 ranks on 2 cores most are
        # handed over: a peer is slow to get a core).
        assert got[f"case:{whats[0]}"]["repeats_before"] > 0, got
        for what in whats:
            case = got[f"case:{what}"]
            assert "mismatch" in case, (r, what, case)
            assert "'r'" in case["mismatch"], (r, what, case)
            assert case["after_s"] < 30 and case["after_ok"], (r, what, case)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_repeats_beside_a_peer_with_an_op_in_flight_end_everywhere(n: int) -> None:
    # Sums checked in the worker; a hang is the defect (the run's timeout).
    result = run_ok(n, "smallpath_workers:repeat_beside_a_busy_peer", {"turns": 12},
                    timeout=120)
    for r in range(n):
        # Both ways ran on every rank: busy, its barriers took the urgent lane.
        got = result.report(r)
        assert got["repeats"] > 0 and got["urgent"] > 0, (r, got)


def test_a_repeat_keeps_no_calls_array_alive() -> None:
    result = run_ok(2, "smallpath_workers:repeat_keeps_no_buffer", {}, timeout=120)
    for r in range(2):
        got = result.report(r)
        assert got["repeats"] > 0 and got["alive"] == 0, (r, got)


def test_small_path_can_be_switched_off() -> None:
    result = run_ok(2, "smallpath_workers:mixed_paths", {"steps": 60}, timeout=150,
                    env={"TOTALREDUCE_DIRECT_BYTES": "0"})
    for r in range(2):
        got = result.report(r)
        assert got["checked"] == 60 and got["direct"] == 0, got


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_late_peer_hands_the_op_to_the_general_path(transport: str) -> None:
    # 0.6 s is past the small path's patience (smallpath.PROMOTE_AFTER, 0.25 s).
    result = run_ok(2, "smallpath_workers:late_peer", {"delay": 0.6}, timeout=120,
                    transport=transport)
    assert result.report(0)["handed_over"] >= 1, result.explain()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", [2, 4])
def test_the_express_lane_hands_a_late_peers_op_to_the_small_path(n: int, transport: str
                                                                  ) -> None:
    # 3 ms is past the express lane's spin (express._SPIN) and within the small path's
    # patience: the small path finishes what the lane began.  Sums checked in the worker.
    result = run_ok(n, "smallpath_workers:express_hand_over",
                    {"steps": 24, "late": n - 1, "delay": 0.003}, timeout=120,
                    transport=transport)
    waiting = 1 if n == 4 else 0  # at 4 ranks: after its first step, with rank 0
    assert result.report(waiting)["handed"] >= 1, result.explain()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_express_lane_runs_halving_allreduces_and_hands_late_ones_over(transport: str
                                                                         ) -> None:
    # Recursive halving's receives wait on others (Recv.wait), which the small path does
    # not honour: the lane, taking them in order, runs such ops from their start, and a
    # hand-over sends them to the general path.  Sums are checked in the worker; here,
    # that the lane began them (before, every one went to the general path).
    calls = 36
    result = run_ok(4, "smallpath_workers:halving_lane", {"calls": calls}, timeout=150,
                    env={"TOTALREDUCE_SEGMENT_BYTES": "4096", "TOTALREDUCE_SMALL_BYTES": "0",
                         "TOTALREDUCE_HALVING_BYTES": str(1 << 30)}, transport=transport)
    begun = [result.report(r)["express"] + result.report(r)["handed"] for r in range(4)]
    assert sum(begun) >= calls, result.explain()
    # The calls repeated under one name ran from the lane's template (repeat.py) too.
    assert sum(result.report(r)["repeats"] for r in range(4)) >= 1, result.explain()


def test_a_lent_body_meets_the_small_path() -> None:
    # Sums are checked in the worker; here, that the case under test really happened:
    # rank 1 lent its bodies (general path), rank 0 began each op on the small path and
    # handed it over.
    # CMA_BYTES set: left at auto, a reduction this small stays in the ring.
    result = run_ok(2, "smallpath_workers:lent_body", {}, timeout=120,
                    env={"TOTALREDUCE_CMA_BYTES": str(1 << 20)})
    if result.report(1)["lent"] == 0:
        pytest.skip("this host cannot lend bodies between processes (transport/cma.py)")
    assert result.report(0)["handed_over"] >= 1, result.explain()


@pytest.mark.parametrize("n", [2, 3])
def test_small_broadcasts_in_several_pieces_match_numpy(n: int) -> None:
    # With the slow-ring rule off: where this host's rings copy slowly, broadcasts this
    # big leave the caller's thread to be lent (transport/copy_pace.py).
    result = run_ok(n, "smallpath_workers:piecewise_broadcasts", {}, timeout=120,
                    env={"TOTALREDUCE_SLOW_RING_GBPS": "0"})
    for r in range(n):
        got = result.report(r)
        assert got["calls"] == 6 * n and got["direct"] > 0, result.explain()


@pytest.mark.parametrize("n", [2, 3])
def test_a_broadcasts_last_rank_acknowledges_before_it_copies(n: int) -> None:
    # The root's call waits for that acknowledgement (algorithms/chain.py): sent after the
    # copy of a 512 KiB piece, it kept the root waiting as long again.
    # Calls whose Repeat handed them over before the first body (a peer late under load,
    # or taking turns on the cores) went on the small path and are not counted; at 3 ranks
    # on 2 cores every call of a job sometimes did so (2 of about 14 runs of this file), so
    # a job with none counted runs again, up to three times.
    counted = 0
    for _attempt in range(3):
        result = run_ok(n, "smallpath_workers:acks_before_copies", {}, timeout=120,
                        env={"TOTALREDUCE_SLOW_RING_GBPS": "0"})
        last = result.report(n - 1)["order"]
        assert all(kinds == ["post", "copy"] for kinds in last), result.explain()
        for r in range(n - 1):  # the others send no empty message ahead of a copy
            assert all(kinds != ["post", "copy"] for kinds in result.report(r)["order"]), \
                result.explain()
        counted += len(last)
        if counted:
            break
    assert counted, result.explain()


@pytest.mark.parametrize("n", [2, 3])
def test_allreduces_run_on_the_callers_thread_while_their_sends_fit_the_ring(n: int) -> None:
    # DIRECT_BYTES auto: other ops up to 2 MiB, an allreduce while the 2 (n - 1) / n of it
    # that it sends one peer fits in the default ring's two 2 MiB segments.
    bound = 2 * (2 << 20) * n // (2 * (n - 1))
    sizes = [(2 << 20) + 24, bound - 8, bound + 4096, 6 << 20]
    result = run_ok(n, "by_size_workers:allreduces_by_size", {"sizes": sizes},
                    timeout=120)
    for r in range(n):
        assert result.report(r)["direct"] == [1, 1, 0, 0], result.explain()


@pytest.mark.parametrize("n", [2, 3])
def test_broadcasts_run_on_the_callers_thread_while_they_fit_the_ring(n: int) -> None:
    # While the whole buffer, which a chain sends its next peer, fits in the ring (two
    # segments: 4 MiB; the allreduce's bound at 2 ranks, above it from 3), in pieces of
    # half a segment past DIRECT_BYTES (algorithms/select.py), so that each rank copies
    # one out while the one before it copies the next in.  With the slow-ring rule off:
    # where this host's rings copy slowly, broadcasts this big may leave the caller's
    # thread to be lent.  Nothing lent (CMA_BYTES=0), as where ranks cannot read each
    # other: at 2 ranks a root that may lends these, copying half into its peer.
    bound = 2 * (2 << 20)
    sizes = [(2 << 20) + 24, bound - 8, bound + 4096, 6 << 20]
    result = run_ok(n, "by_size_workers:broadcasts_by_size", {"sizes": sizes},
                    timeout=120, env={"TOTALREDUCE_SLOW_RING_GBPS": "0",
                                      "TOTALREDUCE_CMA_BYTES": "0"})
    for r in range(n):
        assert result.report(r)["direct"] == [1, 1, 0, 0], result.explain()


@pytest.mark.skipif(not cma.cma_works(), reason="process_vm_readv not allowed")
def test_an_exchange_where_one_rank_lends_stays_on_the_express_lane() -> None:
    # Ranks may decide differently whether to lend (CMA_BYTES set higher on one rank, as
    # here): the rank that does not lend takes its peer's lent piece in place on the
    # express lane (it handed every such call over before).  Blocks of 2 MiB
    # less 5 rows: big enough to lend, small enough for the lane.  With the slow-ring
    # rule off: where this host's rings copy slowly, rank 1 lends too (3-5 of its bodies
    # in runs here).
    calls = 8
    result = run_ok(2, "by_size_workers:one_rank_lends",
                    {"rows": (2 << 20) // 4 - 5, "calls": calls}, timeout=120,
                    env={"TOTALREDUCE_SLOW_RING_GBPS": "0"})
    lender, other = result.report(0), result.report(1)
    assert lender["lent"] > 0 and other["lent"] == 0, (lender, other)
    # Some of its 2 * calls stay on the lane (its peer's piece is there when it looks;
    # before, every one was handed over): on a loaded host, or where its own body finds
    # the ring still full, a call is handed over, in one run 11 of 16.
    assert other["handed"] < 2 * calls, (lender, other)


# 64 KiB segments: rings of 256 KiB, so ops of a few MiB are many times the ring.
_SMALL_RING = {"TOTALREDUCE_SEGMENT_BYTES": "65536", "TOTALREDUCE_SLOW_RING_GBPS": "0"}


@pytest.mark.parametrize(("n", "env", "sizes"), [
    # At 2 ranks, auto: past the ring's bound (2 MiB here) up to REPEAT_ALLREDUCE_BYTES.
    (2, {}, [(2 << 20) + 8, (5 << 19) + 24, 3 << 20, (2 << 20) + 40, 4 << 20,
             (2 << 20) + 1]),
    # DIRECT_BYTES set: every allreduce up to it, recursive doubling's too (under 2 MiB
    # at 2 ranks, 1 MiB at 3), whose receives write what its waiting sends read.
    (2, {"TOTALREDUCE_DIRECT_BYTES": "4194304"}, [(300 << 10) + 8, 1 << 20,
                                                  (3 << 20) + 16]),
    (3, {"TOTALREDUCE_DIRECT_BYTES": "4194304"}, [(600 << 10) + 8, (1 << 20) + 24,
                                                  (3 << 20) + 48])])
@pytest.mark.parametrize("async_rank", [None, 1])
def test_allreduces_bigger_than_the_ring_run_from_a_repeat(
        n: int, env: dict[str, str], sizes: list[int], async_rank: int | None) -> None:
    # A repeated blocking allreduce whose sends do not fit the ring runs from its
    # Repeat all the same: a send that does not fit waits while the caller's thread reads
    # the peer's pieces (engine/repeat.py).  Odd sizes, dtypes and ops, in place and
    # not, ranks late in turn; with ``async_rank`` that rank's calls run on the loop, so
    # each op meets a peer on the general path.  Sums checked in the worker.
    calls = 10
    result = run_ok(n, "by_size_workers:repeated_big_allreduces",
                    {"sizes": sizes, "calls": calls, "async_rank": async_rank},
                    timeout=150, env={**_SMALL_RING, **env})
    reports = [result.report(r) for r in range(n)]
    assert all(got["calls"] == calls * len(sizes) and got["active"] == 0
               for got in reports), reports
    blocking = [got for r, got in enumerate(reports) if r != async_rank]
    if n == 2 and async_rank is None:
        # From each op's second call on, calls began from its Repeat on both ranks (one
        # that meets a late peer hands the rest over to the loop), and some ran to
        # their end there.
        assert all(got["repeats"] > 0 and got["repeats"] + got["handed_over"]
                   >= len(sizes) for got in blocking), reports
    else:
        assert sum(got["repeats"] + got["handed_over"] for got in blocking) > 0, reports


@pytest.mark.parametrize(("n", "gbps"), [(2, "0"), (3, "0"), (2, "1e6")])
def test_repeated_broadcasts_to_the_rings_bound_run_from_a_repeat(n: int, gbps: str) -> None:
    # A broadcast made again runs from its template's Repeat up to the ring's bound;
    # from 512 KiB only while the rings copy fast, or (every ring slow, 1e6 GB/s) where
    # that has been the faster way: each way is tried, the Repeat among them.
    sizes = [(600 << 10) + 8, (1 << 20) + 24, (3 << 20) - 8 * 3 * n]
    result = run_ok(n, "by_size_workers:repeated_big_broadcasts", {"sizes": sizes},
                    timeout=120, env={"TOTALREDUCE_SLOW_RING_GBPS": gbps})
    reports = [result.report(r) for r in range(n)]
    assert all(got["calls"] == 5 * len(sizes) for got in reports), reports
    assert sum(got["repeats"] for got in reports) > 0, reports


@pytest.mark.parametrize("kind", ["allreduces", "broadcasts", "alltoalls"])
@pytest.mark.parametrize(("n", "transport"), [pytest.param(2, "mpi", marks=_MPI.marks),
                                              pytest.param(3, "mpi", marks=_MPI.marks),
                                              (3, "tcp")])
def test_bodies_on_either_side_of_a_ports_bound_arrive_whole(kind: str, n: int,
                                                             transport: str) -> None:
    # A port sends bodies up to its bound from the caller's thread (the MPI transport's
    # inline size and a socket's post: 256 KiB at these rank counts) and leaves bigger
    # ones to the loop: odd sizes on both sides of it, several dtypes, one rank late,
    # checked against numpy; the smaller ones ran on the caller's thread (some of them on
    # some rank: under MPI a late peer's message may be taken by the loop instead).
    sizes = [(16 << 10) + 8, (64 << 10) + 24, 256 << 10, (256 << 10) + 24, 300 << 10]
    result = run_ok(n, f"by_size_workers:{kind}_by_size", {"sizes": sizes, "warm": 0},
                    timeout=120, transport=transport)
    ran = [result.report(r)["direct"] for r in range(n)]
    assert all(len(got) == len(sizes) for got in ran), ran
    assert sum(got[0] + got[1] for got in ran) > 0, ran


@pytest.mark.parametrize("kind", ["allgathers", "alltoalls"])
@pytest.mark.parametrize(("n", "gbps"), [(2, "0"), (3, "0"), (2, "1e6")])
def test_gathering_ops_run_on_the_callers_thread_while_their_sends_fit_a_fast_ring(
        kind: str, n: int, gbps: str) -> None:
    # Past DIRECT_BYTES' 2 MiB an allgather's or alltoall's data goes on the caller's
    # thread while what it sends one peer fits in the ring (as an allreduce's: an
    # allgather sends it (n - 1) / n of its result, an alltoall 1 / n).  While the ring
    # copies slowly (every ring at 1e6 GB/s, once the warm-up has copied a lap of the
    # ring and three more) it goes the way that has been faster for its size
    # (scheduling/slow_rings.py), trying each first, the loop (which lends its bodies)
    # before the caller's thread: of the two ops of 2-4 MiB here the second stays on the
    # caller's thread.  The two bigger ones pass the ring's bound: at 3 ranks they go to
    # the loop; at 2, where the piece each sends its peer is lent (up to
    # LENT_GATHER_BYTES: the next test), they stay on the caller's thread, but while the
    # rings are slow the first of them tries the loop first, as the first of 2-4 MiB
    # does.  The sizes phase is small and runs there too.
    bound = 2 * (2 << 20) * n // (2 * (n - 1))
    sizes = [(2 << 20) + 24 * n, bound - 64 * n, bound + 4096 * n, 6 << 20]
    result = run_ok(n, f"by_size_workers:{kind}_by_size", {"sizes": sizes, "warm": 12},
                    timeout=120, env={"TOTALREDUCE_SLOW_RING_GBPS": gbps})
    fast = gbps == "0" or len(os.sched_getaffinity(0)) < n  # crowded: the rule is off
    big = 2 if n == 2 and cma.cma_works() else 1
    # Where an op runs can also depend on timing: one that finds another op still in
    # flight, or whose start the caller's thread cannot make (a peer's lent body already
    # floating, copied aside, which is not taken in place; a send with no room), goes to
    # the general path; one that meets the
    # ring's periodic retry of the fast way (copy_pace.PROBE_EVERY) goes as the fast
    # state says without choosing.  On a loaded host that happens now and then, so each
    # op is held to no more than its way allows, and most to exactly that.
    for r in range(n):
        got = result.report(r)
        if fast:
            assert not any(got["chose"]), got
            pairs = list(zip(got["direct"], [2, 2, big, big], strict=True))
            assert all(ran <= w for ran, w in pairs), got
            assert sum(ran == w for ran, w in pairs) >= 3, (got, result.explain())
            continue
        # Each size class tries the loop first, then the caller's thread.  An op that
        # chose the loop ran only its sizes phase here.
        tries: dict[tuple[str, int], int] = {}
        stayed = []
        for ran, chose in zip(got["direct"], got["chose"], strict=True):
            for kind, bits, left in chose:
                if kind.endswith(" lending"):
                    continue
                assert left == (tries.get((kind, bits), 0) % 2 == 0), got
                tries[kind, bits] = tries.get((kind, bits), 0) + 1
                assert ran <= (1 if left else 2), got
                if not left:
                    stayed.append(ran == 2)
        # The first two, right after the warm-up judged the rings slow, choose.
        assert sum(tries.values()) >= 2 and any(stayed), (got, result.explain())


@pytest.mark.skipif(not cma.cma_works(), reason="process_vm_readv not allowed")
def test_two_rank_gathers_of_lent_pieces_stay_on_the_callers_thread_up_to_their_bound(
        ) -> None:
    # Every call of a size over LENT_GATHER_BYTES goes to the loop; under it, where the
    # ranks come together (no rank held back), the calls run on the caller's thread, but
    # one whose peer answers late goes on elsewhere: at least one of three, each rank.
    result = run_ok(2, "by_size_workers:lent_gathers_by_bound",
                    {"bound": LENT_GATHER_BYTES}, timeout=120,
                    env={"TOTALREDUCE_SLOW_RING_GBPS": "0"})
    for r in range(2):
        got = result.report(r)["direct"]
        for kind in ("allgather", "alltoall"):
            assert got[f"{kind} over"] == 0 and got[f"{kind} under"] >= 1, result.explain()


@pytest.mark.skipif(not cma.cma_works(), reason="process_vm_readv not allowed")
@pytest.mark.parametrize(("async_rank", "plain_rank"), [(None, None), (1, None), (None, 1)])
def test_repeated_two_rank_gathers_of_lent_pieces_run_from_their_repeat(
        async_rank: int | None, plain_rank: int | None) -> None:
    # Past DIRECT_BYTES, up to LENT_GATHER_BYTES, a repeated same-shape allgather or
    # alltoall at 2 ranks runs from its Repeat, which lends the peer its piece as the
    # express lane does and returns only once the peer has copied it (the worker
    # scribbles over both arrays right after each call).  Beside a peer whose calls are
    # async (the loop, which lends too) or that lends nothing (its pieces come through
    # the ring, and the Repeat hands those calls over), the results are the same.
    calls = 6
    sizes = [(3 << 20) + 4104, (9 << 20) + 2568, LENT_GATHER_BYTES - 8232]
    result = run_ok(2, "by_size_workers:repeated_lent_gathers",
                    {"sizes": sizes, "calls": calls, "async_rank": async_rank,
                     "plain_rank": plain_rank}, timeout=150,
                    env={"TOTALREDUCE_SLOW_RING_GBPS": "0"})
    reports = [result.report(r) for r in range(2)]
    assert all(got["calls"] == 2 * calls * len(sizes) and got["active"] == 0
               for got in reports), reports
    if async_rank is None and plain_rank is None:
        # Calls began from the Repeat and lent there, on both ranks.
        assert all(got["repeat_lent"] > 0 for got in reports), reports
    else:
        # The blocking (or lending) rank's calls began from their Repeat.
        other = reports[0]
        assert other["repeat_lent"] + other["handed_over"] > 0, reports



@pytest.mark.skipif(not cma.cma_works(), reason="process_vm_readv not allowed")
@pytest.mark.parametrize("kind", ["allreduce", "reducescatter"])
@pytest.mark.parametrize(("cma_bytes", "async_rank", "slow_gbps"), [
    ((1 << 20, 1 << 20), None, "0"), ((1 << 20, 1 << 30), None, "0"),
    ((1 << 20, 1 << 20), 1, "0"), (None, None, "1e6")])
def test_repeated_two_rank_reductions_lend_their_pieces_from_their_repeat(
        cma_bytes: tuple[int, int] | None, async_rank: int | None, slow_gbps: str,
        kind: str) -> None:
    # A repeated blocking allreduce past the ring (to REPEAT_ALLREDUCE_BYTES: 40 MB here
    # too), or reducescatter past DIRECT_BYTES, runs from its Repeat, which lends its
    # pieces where the loop would (by size, CMA_BYTES; or while the rings copy slowly,
    # every ring here with the bar at 1e6 GB/s, out of huge pages where the kernel gives
    # them), sums the peer's lent pieces and returns only once the peer has copied what
    # it lent (the worker scribbles over both arrays right after each call).  Beside a
    # peer that lends nothing (its pieces come through the ring) or whose calls are
    # async (the loop), the results are the same.
    calls = 6
    sizes = [(5 << 20) + 24, (9 << 20) + 8, (13 << 20) + 40, (40 << 20) + 24]
    result = run_ok(2, "by_size_workers:repeated_lent_allreduces",
                    {"sizes": sizes, "calls": calls, "cma": cma_bytes,
                     "async_rank": async_rank, "kind": kind}, timeout=150,
                    env={"TOTALREDUCE_SLOW_RING_GBPS": slow_gbps})
    reports = [result.report(r) for r in range(2)]
    assert all(got["calls"] == calls * len(sizes) and got["active"] == 0
               for got in reports), reports
    if async_rank is None and cma_bytes is not None and cma_bytes[1] < 1 << 30:
        # Calls lent from their Repeat, on both ranks.
        assert all(got["repeat_lent"] > 0 for got in reports), reports
    else:
        # Rank 0's calls began from their Repeat: beside a peer on the loop, or one that
        # copies its pieces into the ring (slower than the Repeat waits, where the ring
        # copies slowly), they may go on there.
        assert reports[0]["repeat_lent"] + reports[0]["handed_over"] > 0, reports


def _huge_pages_here() -> bool:
    """Whether this host backs an array that asks for them with huge pages, as far as the
    kernel can say (transport/pages.py)."""
    x = float32s(1 << 20, "huge")
    share = pages.huge_share(x.ctypes.data, x.nbytes)
    return share is not None and share >= ONE_WAY_HUGE


@pytest.mark.skipif(not cma.cma_works(), reason="process_vm_readv not allowed")
@pytest.mark.parametrize("cma_bytes", [None, 1 << 20])
def test_an_exchanges_body_the_ring_holds_is_lent_only_out_of_huge_pages(
        cma_bytes: int | None) -> None:
    # Blocks of 1.5 MiB less 3 rows: big enough to lend, and the ring holds them whole.
    # Out of small pages the ring's two copies beat the peer's kernel pinning each page,
    # so they go through the ring (the slow-ring rule off: the ring is taken as fast);
    # out of huge pages on both ranks they are lent, from a Repeat's second call on
    # (once each rank has heard that its peer would); huge on one rank only, neither
    # lends.  Beside a peer whose calls are async (the loop lends by size alone), a
    # Repeat lends too.  TOTALREDUCE_CMA_BYTES set lends by size alone.
    calls = 6
    env = {"TOTALREDUCE_SLOW_RING_GBPS": "0"}
    if cma_bytes is not None:
        env["TOTALREDUCE_CMA_BYTES"] = str(cma_bytes)
    result = run_ok(2, "by_size_workers:exchanges_by_pages",
                    {"rows": (3 << 19) // 4 - 3, "calls": calls}, timeout=120, env=env)
    for r in range(2):
        got = result.report(r)
        if cma_bytes is None:
            # None but where a call went elsewhere than its Repeat on a rank (the loop,
            # which lends by size alone: a peer late by 200 us on a busy host, or a
            # Repeat that declined), and then its peer's Repeat, told so: a body each
            # at most.
            for way in ("small", "mixed"):
                went = sum(result.report(q)["handed"][way] for q in range(2))
                assert got["lent"][way] <= went, result.explain()
        else:
            assert got["lent"]["small"] > 0 and got["lent"]["mixed"] > 0, \
                result.explain()
    # Beside the async rank's calls on the loop, which lend by size alone, a blocking
    # Repeat told so lends too; how many calls each rank lends depends on where each
    # call ran, so on a loaded host one rank may lend none (seen once in a full run with
    # two busy processes beside it).  Between them they lend.
    assert sum(result.report(r)["lent"]["async"] for r in range(2)) > 0, result.explain()
    if all(result.report(r)["huge_inputs"] for r in range(2)):
        assert all(result.report(r)["lent"]["huge"] > 0 for r in range(2)), \
            result.explain()


@pytest.mark.skipif(not cma.cma_works(), reason="process_vm_readv not allowed")
@pytest.mark.parametrize(("async_rank", "huge", "inplace"),
                         [(None, True, True), (1, True, True), (None, False, True),
                          (None, True, False)])
def test_a_two_rank_broadcasts_root_lends_its_pieces_out_of_huge_pages(
        async_rank: int | None, huge: bool, inplace: bool) -> None:
    # From its Repeat a 2-rank broadcast's root lends its body of PUSH_MIN (1 MiB) or
    # more and copies the back half into its peer (the two copying side by side), or,
    # where ranks outnumber cores, lends each piece of ONE_WAY_FROM (640 KiB) or more that
    # huge pages back (out of small pages they go through the ring).  It returns only
    # once the peer has the body: the root scribbles over its result right after each
    # call, the peer checks its own against numpy.  The peer blocking, late at random,
    # or async (the loop's side); in place, or not (the root's working copy, new each
    # call, is what it lends where its pages are huge: the results are checked, not
    # whether it lent).
    if huge and not _huge_pages_here():
        pytest.skip("the kernel backs no array with huge pages here, or cannot say")
    calls = 6
    sizes = [(2 << 20) + 12, (4 << 20) - 20]
    result = run_ok(2, "by_size_workers:repeated_broadcasts",
                    {"sizes": sizes, "calls": calls, "async_rank": async_rank,
                     "huge": huge, "inplace": inplace}, timeout=120,
                    env={"TOTALREDUCE_SLOW_RING_GBPS": "0"})
    root, peer = (result.report(r) for r in range(2))
    assert root["calls"] == peer["calls"] == calls * len(sizes), (root, peer)
    assert root["active"] == peer["active"] == 0, (root, peer)
    if cma.cma_works() and len(os.sched_getaffinity(0)) >= 2:
        assert inplace is False or root["lent_calls"] > 0, root
    elif not huge:
        assert root["lent_calls"] == 0, root
    elif not inplace:
        pass
    elif root["huge_buffers"]:
        # Lent from the Repeat, whether the call then ended there or, its peer late,
        # on the small path.
        assert root["lent_calls"] > 0, root
    else:
        pytest.skip("the kernel had no huge pages for the root's buffers this time")

@pytest.mark.parametrize("kind", ["alltoall", "allgather"])
@pytest.mark.parametrize("n", [2, 3])
def test_same_shape_gathers_by_size_blocking_async_and_repeated(kind: str, n: int) -> None:
    # An alltoall's op copies the rank's own block once its messages are out.  Up to
    # DIRECT_BYTES same-shape alltoalls and allgathers run from their plan's Repeat while
    # the rings copy fast; smaller and bigger ones (the loop, lent pieces at 2 ranks),
    # odd sizes, empty blocks, an async call among them.
    sizes = [0, 40 * n + 8, (1 << 18) + 24 * n, (1 << 20) + 56 * n, (3 << 20) + 8 * n]
    result = run_ok(n, "by_size_workers:same_shape_gathers_by_size",
                    {"kind": kind, "sizes": sizes}, timeout=120,
                    env={"TOTALREDUCE_SLOW_RING_GBPS": "0"})
    reports = [result.report(r) for r in range(n)]
    assert all(got["calls"] == 6 * len(sizes) for got in reports), reports
    # A Repeat runs a call where no peer ahead has sent its bodies already (the usual
    # way takes those): on some rank or other, some calls.
    assert sum(got["repeats"] for got in reports) > 0, reports


@pytest.mark.parametrize("kind", ["alltoall", "allgather"])
def test_a_gather_whose_second_post_cannot_go_finishes_on_the_general_path(
        kind: str) -> None:
    # At 3 ranks an alltoall's first messages go to two peers, and an allgather passes
    # the first block it gets on: the second post refused (a full ring) hands the op to
    # the general path, for an alltoall past where the op copies its own block, which
    # must be copied all the same.
    sizes = [48, (1 << 18) + 72, (1 << 20) + 168]
    result = run_ok(3, "by_size_workers:same_shape_gathers_by_size",
                    {"kind": kind, "sizes": sizes, "refuse": True}, timeout=120,
                    env={"TOTALREDUCE_SLOW_RING_GBPS": "0"})
    for r in range(3):
        got = result.report(r)
        assert got["calls"] == 6 * len(sizes), got
        assert got["refused"] == 3 * len(sizes), got


def test_a_set_direct_bytes_bounds_allreduces_too() -> None:
    result = run_ok(2, "by_size_workers:allreduces_by_size",
                    {"sizes": [(2 << 20) - 8, (3 << 20) + 8]}, timeout=120,
                    env={"TOTALREDUCE_DIRECT_BYTES": str(2 << 20)})
    for r in range(2):
        assert result.report(r)["direct"] == [1, 0], result.explain()


@pytest.mark.parametrize("root", [0, 1])
def test_a_repeated_broadcast_runs_from_its_repeat_on_the_root_too(root: int) -> None:
    # At 2 ranks the root's call is one exchange (its data out, the peer's bodiless
    # acknowledgement in) and the peer's READY comes first: the root's Repeat takes it
    # and goes on, where handing every call over would still give right values.
    result = run_ok(2, "smallpath_workers:repeated_broadcasts", {"steps": 200, "root": root},
                    timeout=120)
    assert result.report(root)["repeats"] > 0, result.explain()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", [2, 3])
def test_repeated_gathers_and_broadcasts_reuse_plans_and_still_refuse_bad_calls(
        n: int, transport: str) -> None:
    result = run_ok(n, "smallpath_workers:repeated_gathers", {"steps": 300}, timeout=150,
                    transport=transport)
    for r in range(n):
        got = result.report(r)
        assert got["floating"] == 0, got
        # Sixty calls of one allgather, alltoall and broadcast made a plan each.
        assert got["gather_plans"] == 2 and got["broadcast_plans"] == 1, got
    # The gathers (both phases) and the broadcasts ran from their templates' Repeats, on
    # some rank: one behind its peers at every call runs none that way (their bodies
    # float in first; at 3 ranks on two cores a rank did in about one run in three).
    for kind in ("gather_repeats", "broadcast_repeats"):
        assert sum(result.report(r)[kind] for r in range(n)) > 0, (kind, result.explain())
    assert result.report(0)["refused"] > 0, result.explain()


@pytest.mark.parametrize(("n", "async_rank", "transport"), [
    (2, None, "shm"), (3, None, "shm"), (2, 1, "shm"), (3, 0, "shm"), (2, None, "tcp")])
def test_gathers_of_two_phases_run_each_phase_from_its_repeat(
        n: int, async_rank: int | None, transport: str) -> None:
    # Without same_shape an allgather or alltoall learns its peers' rows first (its sizes
    # phase), then moves its data: a repeated blocking call runs each phase from its
    # template's Repeat, the data's by the rows the sizes brought (a template each).  Beside
    # a rank whose calls are async (the loop) the Repeats hand their calls over; the results
    # are the same (checked against numpy in the worker).
    steps = 160
    result = run_ok(n, "smallpath_workers:two_phase_gathers",
                    {"steps": steps, "async_rank": async_rank}, timeout=150,
                    transport=transport)
    reports = [result.report(r) for r in range(n)]
    assert all(got["calls"] == steps and got["floating"] == 0 for got in reports), reports
    if async_rank is None and transport == "shm":
        # Most of them on an idle host; a rank descheduled past its peers' patience sends
        # a call to the general path, so a loaded one runs fewer this way.
        assert sum(got["repeats"] for got in reports) > 0, reports
    if async_rank is None:
        # A rank pausing for up to 2 ms now and then: its peers' Repeats, whose spin is
        # 200 us, handed some calls over mid-phase (their message out, the own block in
        # place), and those ended right too.
        assert sum(got["handed"] for got in reports) > 0, reports


@pytest.mark.parametrize(("n", "transport"), [(2, "shm"), (3, "shm"), (2, "tcp")])
def test_object_collectives_of_varying_sizes_run_from_repeats(n: int, transport: str
                                                              ) -> None:
    # Each pickle goes padded to a power of two up to 64 KiB: a few sizes, so repeated
    # calls find their templates and run from their Repeats, however the pickles' sizes
    # vary (objects compared in the worker).
    steps = 120
    result = run_ok(n, "smallpath_workers:object_collectives", {"steps": steps},
                    timeout=150, transport=transport)
    reports = [result.report(r) for r in range(n)]
    assert all(got["calls"] == steps for got in reports), reports
    if transport == "shm":
        # More than one a call on an idle host (two ops each); fewer on a loaded one
        # (91 of 240 at 3 ranks with four busy processes beside the job).
        assert sum(got["repeats"] for got in reports) > 0, reports


@pytest.mark.parametrize(("late", "pause"), [(0, 0.002), (1, 0.4)])
def test_an_exchange_on_the_callers_thread_lends_its_big_pieces(late: int, pause: float
                                                                 ) -> None:
    # A 2-rank allgather or alltoall of 2 MiB or more, on the caller's thread, lends the
    # peer its piece (the peer's kernel copies it straight into place) and returns only
    # once the peer has: the ranks scribble over their arrays right after each call.  The
    # ranks take turns to be late: by 2 ms, the early one hands its op to the small path
    # (the lane waits 200 us), which takes the late one's lent piece; by 0.4 s, the early
    # one hands an op of one phase (same_shape) to the general path with its piece lent
    # and not yet copied, and that op ends only once it has been.  CMA_BYTES set: lent
    # by size alone (auto, pieces the ring holds whole go through it out of small pages).
    result = run_ok(2, "smallpath_workers:lent_exchanges",
                    {"ops": 8, "late": late, "pause": pause}, timeout=120,
                    env={"TOTALREDUCE_CMA_BYTES": str(1 << 20)})
    for r in range(2):
        got = result.report(r)
        # An op that finds its peer's piece already copied aside (it came while the loop
        # ran something else) runs on the small path, which sends through the ring.
        assert sum(got["lent"]) >= 6, result.explain()
        if pause < 0.25:  # a peer that answers in time: every op on the caller's thread
            assert all(d >= 1 for d in got["direct"]), result.explain()
        else:
            handed = [(got["direct"][i], got["lent"][i]) for i in range(8)
                      if i % 4 < 2 and (1 + i) % 2 != r]
            assert handed == [(0, True), (0, True)], result.explain()


@pytest.mark.parametrize("n", [2, 3])
def test_repeated_reducescatters_reuse_plans_and_still_refuse_bad_calls(n: int) -> None:
    result = run_ok(n, "smallpath_workers:repeated_scatters", {"steps": 150}, timeout=150)
    for r in range(n):
        got = result.report(r)
        # Sixty calls of one reducescatter made one plan.
        assert got["after"] == got["before"] + 1, got
    assert result.report(0)["refused"] > 0, result.explain()


@pytest.mark.parametrize("n", [2, 3])
def test_blocking_grouped_allreduces_run_their_parts_here_and_fail_alike(n: int) -> None:
    result = run_ok(n, "smallpath_workers:grouped_here", {}, timeout=150)
    for r in range(n):
        got = result.report(r)
        # Blocking calls ran some parts on the caller's thread (two of three steps).
        assert got["direct"] > 0, result.explain()
        assert "bad" in got["error"], result.explain()
