"""Async calls of repeated reductions, queued for the loop's driver (engine/loop.py:
Loop.queued), on real multi-process runs."""

from __future__ import annotations

import os

import pytest

from harness import run_ok
from totalreduce.scheduling.thresholds import HUGE_LEND_SHARE
from totalreduce.transport.cma import cma_works


@pytest.mark.parametrize(("n", "transport"), [(2, "shm"), (3, "shm"), (2, "tcp")])
def test_queued_async_reductions_match_numpy_in_any_order(n: int, transport: str) -> None:
    result = run_ok(n, "queued_workers:queued_bursts", {}, timeout=120, transport=transport)
    for r in range(n):
        got = result.report(r)
        assert got["active"] == 0, result.explain()
        if transport == "shm" and n == 2:
            # Where every rank took them in one order, none late, the calls after the
            # blocking one may run from their Repeats (five allreduces and the group's
            # four parts in each of five rounds): most on an idle 2-core host, but a
            # caller descheduled for QUEUED_GRACE sends a round's rest to the general
            # path, so a loaded host runs few that way (4-32 of 45 with two to four
            # busy processes beside the job).  Some must have: the queued path works.
            assert got["repeats"] >= 1, result.explain()


def test_a_grouped_calls_own_work_between_parts_ends_no_burst() -> None:
    result = run_ok(2, "queued_workers:grouped_with_slow_parts", {}, timeout=60)
    got = result.report(0)
    # Each part found every part before it still queued: no grace ran out inside the
    # call, though 2 ms passed before each part (QUEUED_GRACE is 200 us).
    assert got["held"] == [0, 1, 2, 3], result.explain()
    # About 8 ms inside the call: a turn per grace is 40; spinning on the peer's records
    # took thousands.
    assert got["turns"] < 400, result.explain()


def test_an_async_calls_copy_of_its_input_ends_no_burst() -> None:
    result = run_ok(2, "queued_workers:copying_calls_in_a_burst", {}, timeout=60)
    # Each call found the ones before it still queued, though each spent 2 ms first.
    assert result.report(0)["held"] == [0, 1, 2, 3], result.explain()


def test_queued_calls_never_waited_for_end_at_shutdown() -> None:
    result = run_ok(2, "queued_workers:queued_at_shutdown", {}, timeout=60)
    for r in range(2):
        got = result.report(r)
        assert got["seconds"] < 20, result.explain()
        for outcome in got["outcomes"]:
            assert outcome == 2.0 or outcome in ("TransportClosedError", "ShutdownError",
                                                 "PeerFailureError"), result.explain()
    # Rank 0's last two calls have no partner: they cannot have a result.
    assert 2.0 not in result.report(0)["outcomes"][1:], result.explain()


def test_a_two_rank_reduction_lends_while_slow_only_where_both_ranks_would() -> None:
    # Every ring copies slower than 1e6 GB/s, so from 8 MiB a reduction's pieces may be
    # lent out of a buffer huge pages back (thresholds.HUGE_LEND_SHARE).  Where only rank
    # 1's is, rank 0's Repeat says it would not and neither lends: lent one way only, one
    # rank copies into the ring, out of its peer and sums while the other only sums.
    # Where both are, both lend.  Results against numpy.
    result = run_ok(2, "queued_workers:agreed_slow_lending", {},
                    env={"TOTALREDUCE_SLOW_RING_GBPS": "1e6"}, timeout=120)
    reports = [result.report(r) for r in range(2)]
    for got in reports:
        assert got["lent"]["split"] == 0, result.explain()
    shares = [got["shares"] for got in reports]
    if (not cma_works() or len(os.sched_getaffinity(0)) < 2
            or not all(got["slow"] for got in reports)
            or any(share is None or share < HUGE_LEND_SHARE for share in
                   (shares[1]["split"], shares[0]["both"], shares[1]["both"]))):
        return  # no lending here, or no huge pages: nothing would have been lent
    assert shares[0]["split"] < HUGE_LEND_SHARE, result.explain()
    for got in reports:
        assert got["lent"]["both"] > 0, result.explain()
