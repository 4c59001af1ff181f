"""The harness's own guarantees: its leak check sees what it must, and a check that fails on
one rank of a many-check job (checks.py) stops every rank there."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from conftest import _our_processes
from harness import launch


def test_leak_check_sees_a_process_started_by_a_test_even_below_a_shell() -> None:
    proc = subprocess.Popen(["bash", "-c", f"{sys.executable} -c 'import time; "
                             "time.sleep(60)' & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(_our_processes()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        found = _our_processes()
        assert proc.pid in found and len(found) >= 2, found
    finally:
        subprocess.run(["pkill", "-KILL", "-P", str(proc.pid)], check=False)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while _our_processes() and time.monotonic() < deadline:
            time.sleep(0.05)


@pytest.mark.multiprocess
@pytest.mark.parametrize("when", ["after", "before"])
def test_a_check_failing_on_one_rank_stops_every_rank_there(when: str) -> None:
    """Rank 1 fails check #1 of 4 (a wrong value after the collective, or an error before
    it while the others wait in it): the report names check #1 and rank 1, and no rank
    starts check #2."""
    # "before" waits out the victim's agree_timeout, which no load can shorten (the others
    # wait in a collective it never joins); "after" never does (the others reach the
    # agreement), so it keeps the generous default for a loaded machine.
    result = launch(3, "workers:checks_teardown",
                    {"victim": 1, "fail_at": 1, "when": when,
                     "agree_timeout": 2.0 if when == "before" else 20.0}, timeout=60)
    assert result.returncode != 0, result.explain()
    failed = result.report(1).get("failed_check")
    assert failed and failed["index"] == 1 and failed["check"] == "sum 1", result.explain()
    assert list(failed["errors"]) == ["1"], result.explain()
    assert ("check 1 sum" if when == "after" else "gives up before check 1") \
        in failed["errors"]["1"], result.explain()
    for r in range(3):
        assert result.report(r).get("checks_started") == ["sum 0", "sum 1"], result.explain()
        if when == "after":  # every rank learned of it at the agreement
            assert result.report(r).get("failed_check") == failed, result.explain()
    assert "check #1 'sum 1' failed on rank(s) 1" in result.stdout + result.stderr, \
        result.explain()
