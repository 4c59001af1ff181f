"""Async calls of repeated reductions, queued for the loop's driver (engine/loop.py:
Loop.queued), on real multi-process runs."""

from __future__ import annotations

import pytest

from harness import run_ok


@pytest.mark.parametrize(("n", "transport"), [(2, "shm"), (3, "shm"), (2, "tcp")])
def test_queued_async_reductions_match_numpy_in_any_order(n: int, transport: str) -> None:
    result = run_ok(n, "queued_workers:queued_bursts", {}, timeout=120, transport=transport)
    for r in range(n):
        got = result.report(r)
        assert got["active"] == 0, result.explain()
        if transport == "shm" and n == 2:
            # Where every rank took them in one order, none late, the calls after the
            # blocking one ran from their Repeats (five allreduces and the group's four
            # parts in each of five rounds): most on an idle 2-core host, 13-30 with a
            # third process busy (a peer late by 200 us sends a round's rest to the
            # general path); at least a round's worth.
            assert got["repeats"] >= 5, result.explain()


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
