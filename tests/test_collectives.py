"""Every collective, op and dtype on real ranks against a numpy reference."""

import pytest

from harness import run_ok

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("n,reduce_thread", [(1, -1), (2, -1), (3, -1), (4, -1), (3, 0)])
def test_every_collective_matches_numpy(n: int, reduce_thread: int) -> None:
    # 4 KiB segments make the larger arrays travel as many pipelined pieces; one run
    # sends every reduction through the reduce thread.
    result = run_ok(n, "workers:check_collectives", {},
                    env={"TOTALREDUCE_SEGMENT_BYTES": "4096",
                         "TOTALREDUCE_REDUCE_THREAD_BYTES": str(reduce_thread)}, timeout=150)
    for r in range(n):
        assert any(line.startswith("checked ") for line in result.lines(r)), result.explain()


@pytest.mark.parametrize("n", [3])
def test_out_of_order_async_ops(n: int) -> None:
    run_ok(n, "workers:out_of_order", {}, env={"TOTALREDUCE_SEGMENT_BYTES": "1024"},
           timeout=90)


def test_lagging_rank_stays_under_floating_cap() -> None:
    cap = 256 << 10
    result = run_ok(3, "workers:lagging_rank", {"elems": 4096},
                    env={"TOTALREDUCE_FLOATING_CAP": str(cap)}, timeout=90)
    # 200 ops x 16 KiB raced ahead: far more than the cap, so flow control had to work.
    peaks = [int(line.split()[2]) for r in range(3) for line in result.lines(r)
             if line.startswith("floating peak")]
    assert len(peaks) == 3 and max(peaks) <= cap and max(peaks) > 0, result.explain()


def test_priority_overtakes_big_op() -> None:
    result = run_ok(2, "workers:priority", {}, timeout=90)
    assert all("small first: True" in result.lines(r) for r in range(2)), result.explain()


def test_submit_while_a_floating_body_is_arriving() -> None:
    # Regression: a body routed to the floating store was orphaned when the op was
    # submitted before the body finished arriving, and the op hung.
    run_ok(4, "workers:submit_while_streaming", {"iters": 8, "elems": 4 << 20},
           timeout=120)
