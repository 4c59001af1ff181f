"""Every collective, op and dtype on real ranks against a numpy reference."""

import os

import pytest

from harness import mpiexec, run_ok
from totalreduce.transport.cma import cma_works
from workers import WIDTHS

pytestmark = pytest.mark.multiprocess


def _check(result, n: int, transport: str = "") -> None:
    for r in range(n):
        got = result.report(r)
        assert got.get("checked", 0) > 0, result.explain()
        # The shm runs really used rings with every other rank; the others used none.
        want = [p for p in range(n) if p != r] if transport == "shm" else []
        assert got["rings"] == want, got


def _shm_files() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("totalreduce-")} \
        if os.path.isdir("/dev/shm") else set()


def test_single_rank_matches_numpy() -> None:
    _check(run_ok(1, "workers:check_collectives", {}), 1)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_collective_matches_numpy(n: int, transport: str) -> None:
    # 4 KiB segments make the larger arrays travel as many pipelined pieces.  Over plain
    # TCP every allreduce takes the ring; elsewhere the small ones take recursive doubling.
    before = _shm_files()
    env = {"TOTALREDUCE_SEGMENT_BYTES": "4096"}
    if transport == "tcp":
        env["TOTALREDUCE_SMALL_BYTES"] = "0"
    # Every dtype over shared memory; sockets and MPI move bytes alike whatever they hold,
    # so there one dtype of each width and kind.
    arg = {} if transport == "shm" else {"dtypes": WIDTHS}
    result = run_ok(n, "workers:check_collectives", arg, env=env, timeout=150,
                    transport=transport)
    _check(result, n, transport)
    assert _shm_files() <= before, "shared-memory files were left in /dev/shm"


def test_collectives_match_numpy_with_big_copies_in_pieces() -> None:
    # 4 KiB pieces (memcopy.py): every ring body of 8 KiB or more (64 KiB segments) goes in
    # and out of the ring in pieces, the last one short where the body's size is odd.
    result = run_ok(3, "workers:check_collectives", {"dtypes": WIDTHS},
                    env={"TOTALREDUCE_SEGMENT_BYTES": str(64 << 10),
                         "TOTALREDUCE_COPY_PIECE": "4096"}, timeout=150)
    _check(result, 3, "shm")
    assert all(result.report(r)["copy_piece"] == 4096 for r in range(3)), result.explain()


@pytest.mark.parametrize("n", [3, 4])
def test_halving_allreduce_matches_numpy(n: int) -> None:
    # Every allreduce takes recursive halving then doubling, in 4 KiB pieces; at 3 ranks
    # ranks 0 and 1 fold into one first.  At 4 ranks reducescatter takes recursive halving
    # and allgather (both phases) recursive doubling too.
    result = run_ok(n, "workers:check_collectives", {},
                    env={"TOTALREDUCE_SEGMENT_BYTES": "4096", "TOTALREDUCE_SMALL_BYTES": "0",
                         "TOTALREDUCE_HALVING_BYTES": str(1 << 30)}, timeout=150)
    _check(result, n, "shm")


def test_six_ranks_fold_pairs_and_match_numpy() -> None:
    # Not a power of two: the small allgathers (every size exchange among them) and the
    # doubling allreduces fold ranks 0-3 into pairs first and hand them the result after.
    result = run_ok(6, "workers:check_collectives", {},
                    env={"TOTALREDUCE_SEGMENT_BYTES": "4096"}, timeout=300)
    _check(result, 6, "shm")


def test_reduce_thread_matches_numpy() -> None:
    # Every reduction goes through the reduce thread (and so never out of a ring slot).
    result = run_ok(3, "workers:check_collectives", {},
                    env={"TOTALREDUCE_SEGMENT_BYTES": "4096",
                         "TOTALREDUCE_REDUCE_THREAD_BYTES": "0"}, timeout=150)
    _check(result, 3, "shm")


@pytest.mark.parametrize(("n", "segment"), [(2, 4096), (3, 4096), (2, 40000)])
def test_tiny_shared_memory_ring_wraps_and_fills(n: int, segment: int) -> None:
    # A 16 KiB ring holds at most two or three 4 KiB bodies: writers keep finding it full
    # and wrapping around, while every result must still match numpy.  Every allreduce
    # takes the ring algorithm here (the shm variant of the test above covers doubling).
    # 40000-byte pieces do not fit in one record: they travel as chunks.
    result = run_ok(n, "workers:check_collectives", {},
                    env={"TOTALREDUCE_SEGMENT_BYTES": str(segment),
                         "TOTALREDUCE_SMALL_BYTES": "0",
                         "TOTALREDUCE_SHM_BYTES": str(16 << 10)}, timeout=150)
    _check(result, n, "shm")


@pytest.mark.parametrize("n", [2, 3])
def test_lent_bodies_match_numpy(n: int) -> None:
    # Every op lends its pieces (CMA_BYTES=1): the receivers copy them out of the senders'
    # memory with process_vm_readv, in 128 KiB pieces, async and out of order.
    result = run_ok(n, "workers:lent_bodies", {},
                    env={"TOTALREDUCE_CMA_BYTES": "1",
                         "TOTALREDUCE_SEGMENT_BYTES": str(128 << 10)}, timeout=150)
    for r in range(n):
        lent = result.report(r)["lent"]
        if cma_works():
            assert lent > 10, lent


@pytest.mark.parametrize("n", [2, 3])
def test_chunked_bodies_are_never_interrupted(n: int) -> None:
    # Pieces of 256 KiB in a 64 KiB ring go as chunks, while lent bodies come back with
    # acknowledgements on the same ring, and a ring judged slow (any ring is, at 1e6
    # GB/s) starts lending bodies it was copying: no record may land between a body's
    # chunks, not an acknowledgement and not the rest of that body lent instead.
    result = run_ok(n, "workers:lent_bodies", {},
                    env={"TOTALREDUCE_CMA_BYTES": "1", "TOTALREDUCE_SLOW_RING_GBPS": "1e6",
                         "TOTALREDUCE_SHM_BYTES": str(64 << 10),
                         "TOTALREDUCE_SEGMENT_BYTES": str(256 << 10)}, timeout=150)
    for r in range(n):
        if cma_works():
            assert result.report(r)["lent"] > 10, result.explain()


@pytest.mark.parametrize("n", [2, 3])
def test_a_broadcast_root_lends_only_what_it_copies_half_of(n: int) -> None:
    # The root's core has nothing else to do.  At 2 ranks, one core each, it lends its
    # body and copies the back half into the receiver while the receiver copies the
    # front (RING_PUSH); elsewhere (3 ranks on this host's cores, a chain of small
    # pieces) a memcpy on each side beats one kernel copy on the receiver's (OpSpec.lend)
    # while the ring copies as fast as it can (the slow-ring rule is off: it would lend
    # wherever this host's rings were slow).  Gathers lend either way.  Results against
    # numpy.
    result = run_ok(n, "workers:broadcast_root_copies", {},
                    env={"TOTALREDUCE_CMA_BYTES": "1", "TOTALREDUCE_SLOW_RING_GBPS": "0",
                         "TOTALREDUCE_SEGMENT_BYTES": str(128 << 10)}, timeout=90)
    pushes = n == 2 and cma_works() and len(os.sched_getaffinity(0)) >= 2
    for r in range(n):
        got = result.report(r)
        if r == 0:  # (at 3 ranks the middle rank lends what it passes on)
            assert got["broadcast"] == (1 if pushes else 0), result.explain()
        assert got["spread"] == (1 if pushes and r == 1 else 0), result.explain()
        if cma_works() and n == 2:  # an alltoall's header names no op size: its count
            assert got["allgather"] > 0 and got["alltoall"] > 0, result.explain()


@pytest.mark.parametrize(("n", "gbps"), [(2, "1e6"), (3, "1e6"), (2, "0")])
def test_a_slow_ring_lends_what_it_would_copy(n: int, gbps: str) -> None:
    # Every ring copies slower than 1e6 GB/s: once three big copies have been timed,
    # bodies of ops under CMA_BYTES are lent too, and the data of blocking broadcasts and
    # alltoalls leaves the caller's thread for the loop, which lends; at 0 the rule is
    # off, such ops never lend, and the 3 broadcasts and both phases of the 3 alltoalls
    # run on the caller's thread; so too where ranks outnumber cores (the copies' times
    # say more about the scheduler there).  Results against numpy.
    result = run_ok(n, "workers:slow_ring", {}, env={"TOTALREDUCE_SLOW_RING_GBPS": gbps},
                    timeout=120)
    for r in range(n):
        got = result.report(r)
        if gbps == "0" or len(os.sched_getaffinity(0)) < n:
            assert got["lent"] == 0 and got["direct"] == 9, result.explain()
        elif cma_works():
            assert got["lent"] > 0 and got["direct"] < 9, result.explain()
    # Big broadcasts: at 2 ranks with a core each the root lends every one, copying half
    # of it into the receiver (ring_link.py), slow rings or not.  Elsewhere, while the
    # rings are slow, the root lends their bodies and copies them through the ring in
    # turn until each way has two times (lent, copied, lent, copied; a ring tried again
    # after 0.25 s of lending is fast until a lap and three copies say otherwise, and its
    # broadcasts are copied).
    root = result.report(0)["big_lent"]
    if n == 2 and cma_works() and len(os.sched_getaffinity(0)) >= n:
        assert root == [True] * 4, result.explain()
    elif gbps == "0" or len(os.sched_getaffinity(0)) < n:
        assert root == [False] * 4, result.explain()
    elif cma_works():
        assert True in root and False in root, result.explain()


def test_reductions_under_8_mib_are_not_lent_while_the_rings_are_slow() -> None:
    # Every ring copies slower than 1e6 GB/s, so the loop lends what it may; a reduction
    # under 8 MiB may not: through the ring it went 1.1-1.9x faster than lent on the
    # machines measured (thresholds.CROWDED_REDUCE_LEND_BYTES).  Async allreduces and
    # reducescatters of 0.75-3 MiB, results against numpy.
    result = run_ok(2, "workers:slow_ring_reductions", {},
                    env={"TOTALREDUCE_SLOW_RING_GBPS": "1e6"}, timeout=120)
    for r in range(2):
        got = result.report(r)
        assert got["lent"] == 0, result.explain()
        if cma_works() and len(os.sched_getaffinity(0)) >= 2:
            assert got["slow"], result.explain()  # the rule had something to refuse


def test_async_allreduces_past_8_mib_queue_while_the_rings_are_slow() -> None:
    # Every ring copies slower than 1e6 GB/s.  At 2 ranks, each with a core, an async
    # allreduce like one made before waits in the loop's queue to run from its Repeat,
    # which lends its pieces where the loop would, so from 8 MiB too (queued_calls.py).
    # Results against numpy.
    result = run_ok(2, "workers:async_mid_reductions", {},
                    env={"TOTALREDUCE_SLOW_RING_GBPS": "1e6"}, timeout=180)
    if len(os.sched_getaffinity(0)) >= 2:
        for r in range(2):
            got = result.report(r)
            assert got["queued"] > 0, result.explain()
            # What makes it a test of slow rings: where lending works, they are.
            assert got["slow"] or not cma_works(), result.explain()


def test_broadcasts_are_copied_half_by_the_receiver_half_by_the_root() -> None:
    # At 2 ranks a broadcast of 1-12 MiB goes in one piece, which its root lends, copying
    # the back half into the receiver as the receiver copies the front: from the loop
    # (a first call), and from the caller's thread (a Repeat: repeated calls).  Results
    # against numpy.
    result = run_ok(2, "workers:spread_broadcasts", {}, timeout=120)
    root, receiver = result.report(0), result.report(1)
    assert root["spread"] == 0 and receiver["lent"] == 0, result.explain()
    if cma_works() and len(os.sched_getaffinity(0)) >= 2:
        assert receiver["spread"] == root["lent"] == 12, result.explain()


@pytest.mark.parametrize("segment", [256 << 10, 1 << 20])
def test_urgent_ops_overtake_the_lent_pieces_of_a_big_one(segment: int) -> None:
    # The big op's lent pieces are read in order, each a copy out of the peer's memory;
    # the urgent ops' pieces, posted behind many of them, are handled first
    # (ring_link._overtake): between two pieces, and with 1 MiB pieces also between the
    # slices of one piece's copy.
    result = run_ok(2, "workers:urgent_overtakes", {},
                    env={"TOTALREDUCE_CMA_BYTES": "1",
                         "TOTALREDUCE_SEGMENT_BYTES": str(segment)}, timeout=120)
    if cma_works():
        assert sum(result.report(r)["overtaken"] for r in range(2)) > 0, result.explain()


@pytest.mark.parametrize("n", [2, 3])
def test_lent_pieces_copied_in_slices_are_reduced_right(n: int) -> None:
    # Every body of 1 byte or more is lent; 2 MiB pieces are copied in 1 MiB slices and
    # reduced into place once whole, into a buffer that held the input or none (fresh).
    result = run_ok(n, "workers:lent_pieces_in_slices", {},
                    env={"TOTALREDUCE_CMA_BYTES": "1"}, timeout=150)
    if cma_works():
        assert all(result.report(r)["lent"] > 0 for r in range(n)), result.explain()


@pytest.mark.parametrize("mode", ["selfguided", "negotiated"])
def test_gathering_ops_write_into_out(mode: str) -> None:
    result = run_ok(3, "workers:results_into_out", {}, timeout=120,
                    env={"TOTALREDUCE_COORDINATION": mode})
    for r in range(3):
        got = result.report(r)
        assert got["checked"] == 14 + 20, result.explain()
        errors = got["errors"]
        # same_shape=True on some ranks only, or with another shape: every rank fails
        # the op, naming what differs; splits with it fail at once.
        assert "differs: same_shape" in errors["flag"], errors
        assert "differs: shape" in errors["shape"], errors
        assert "rank 1: kind=allgather, dtype=float32, shape=(3, 3)" in errors["shape"], errors
        assert "takes no splits" in errors["splits"], errors
        assert "out must be a float32 array" in errors["dtype"], errors
        assert "must not overlap" in errors["overlap"], errors
        if r == 1:
            assert "rank 1: allgather 'rows': out has 5 rows, the result has 6" \
                in errors["rows"], errors
        else:
            assert errors["rows"] == "", errors


_MPI = pytest.mark.skipif(mpiexec() is None, reason="needs mpi4py and mpiexec")


@pytest.mark.parametrize(("n", "transport"), [(2, "shm"), (3, "shm"), (2, "tcp"),
                                              pytest.param(2, "mpi", marks=_MPI)])
def test_allgathers_send_from_their_input_into_out(n: int, transport: str) -> None:
    rows = [0, 7, 30001, 100003, 400009]  # up to 9.6 MB a rank: past two segments
    result = run_ok(n, "workers:gathers_from_their_input", {"rows": rows}, timeout=240,
                    transport=transport)
    for r in range(n):
        assert result.report(r)["checked"] == len(rows) * 3 * 5, result.explain()
    if transport == "shm" and cma_works():  # the input itself was lent, on some rank
        assert sum(result.report(r)["lent"] for r in range(n)) > 0, result.explain()


def test_large_bodies_are_copied_when_lending_is_off() -> None:
    result = run_ok(2, "workers:lent_bodies", {},
                    env={"TOTALREDUCE_CMA_BYTES": "0",
                         "TOTALREDUCE_SEGMENT_BYTES": str(128 << 10)}, timeout=150)
    for r in range(2):
        assert result.report(r)["lent"] == 0, result.explain()


def test_out_of_order_async_ops(transport: str) -> None:
    run_ok(3, "workers:out_of_order", {}, env={"TOTALREDUCE_SEGMENT_BYTES": "1024"},
           timeout=90, transport=transport)


def test_lagging_rank_stays_under_floating_cap(transport: str) -> None:
    cap = 256 << 10
    result = run_ok(3, "workers:lagging_rank", {"elems": 4096},
                    env={"TOTALREDUCE_FLOATING_CAP": str(cap)}, timeout=90,
                    transport=transport)
    # 200 ops x 16 KiB raced ahead: far more than the cap, so flow control had to work.
    # Over TCP early data must be read off the socket, so some of it floats; over the
    # rings it may all wait in the ring until its op is submitted (peak 0).
    peaks = [result.report(r)["floating_peak"] for r in range(3)]
    assert len(peaks) == 3 and max(peaks) <= cap, result.explain()
    if transport == "tcp":
        assert max(peaks) > 0, result.explain()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_data_before_the_op_waits_in_the_ring_but_never_blocks(transport: str) -> None:
    result = run_ok(2, "workers:early_data", {}, timeout=60, transport=transport)
    for r in range(2):
        assert result.report(r)["early_data_ok"], result.explain()
    floated = [result.report(1)["floating_after_early_op"]]
    # Over the rings the early piece is reduced straight out of the ring; over TCP it
    # must be read off the socket, so it floats.
    assert floated == ([0] if transport == "shm" else [1_000_004]), result.explain()


@pytest.mark.parametrize("cap", [64 << 20, 4096])
def test_ready_rides_on_data_unless_credit_runs_out(cap: int) -> None:
    # With room to float, each rank's first DATA tells the peer it is ready: no READY
    # messages at all.  With a 4 KiB cap every 40 KB body waits for the peer's READY, so
    # whichever rank reaches an op first must send one, or both would wait for each other
    # forever; the later rank may already hold its peer's READY and let its DATA say it.
    result = run_ok(2, "workers:ready_messages", {"elems": 10001},
                    env={"TOTALREDUCE_FLOATING_CAP": str(cap)}, timeout=60)
    sent = [result.report(r)["ready_sent"] for r in range(2)]
    if cap > 4096:
        assert sent == [0, 0], result.explain()
    else:
        assert all(s <= 20 for s in sent) and sum(sent) >= 20, result.explain()


def test_priority_overtakes_big_op(transport: str) -> None:
    result = run_ok(2, "workers:priority", {}, timeout=90, transport=transport)
    assert all(result.report(r)["small_first"] for r in range(2)), result.explain()


def test_submit_while_a_floating_body_is_arriving() -> None:
    # Regression: a body routed to the floating store was orphaned when the op was
    # submitted before the body finished arriving, and the op hung.
    run_ok(4, "workers:submit_while_streaming", {"iters": 8, "elems": 4 << 20},
           timeout=120)


@pytest.mark.parametrize("reduce_thread", ["-1", "0"])
def test_ops_that_read_their_input_instead_of_a_copy_match_numpy(reduce_thread: str) -> None:
    # Blocking allreduces and reducescatters above TOTALREDUCE_DIRECT_BYTES reduce straight
    # from the caller's array into an undefined result buffer (OpSpec.fresh); 1 KiB puts
    # every multi-piece array of the matrix on that path, on the ring, inline and on the
    # reduce thread.
    result = run_ok(3, "workers:check_collectives", {},
                    env={"TOTALREDUCE_SEGMENT_BYTES": "4096", "TOTALREDUCE_SMALL_BYTES": "0",
                         "TOTALREDUCE_DIRECT_BYTES": "1024",
                         "TOTALREDUCE_REDUCE_THREAD_BYTES": reduce_thread}, timeout=150)
    _check(result, 3, "shm")
