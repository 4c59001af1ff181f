"""Bad input, lost peers, strangers and stalls: every rank fails loudly and quickly."""

import re

import pytest

from harness import JOB_ENDS, PROMPTLY, TRANSPORTS, Result, launch, mpiexec, run_ok

pytestmark = pytest.mark.multiprocess


MISMATCHES = {
    "shape": ("(4,)", "(5,)"),
    "dtype": ("float32", "float64"),
    "layout": ("(3, 2)", "(2, 3)"),
    "op": ("op=Average", "op=Max"),
}


@pytest.fixture(scope="module", params=TRANSPORTS)
def mismatch_job(request: pytest.FixtureRequest) -> Result:
    """One 3-rank job per transport runs every mismatch in turn (the job must go on after
    each, which the worker checks); each case is still judged by a test of its own."""
    if request.param == "mpi" and mpiexec() is None:
        pytest.skip("mpi transport: mpi4py/mpiexec not installed (pip install '.[mpi]')")
    return run_ok(3, "workers:mismatch", {"whats": list(MISMATCHES)}, timeout=90,
                  transport=request.param)


@pytest.mark.parametrize("what", list(MISMATCHES))
def test_mismatch_raises_on_every_rank(what: str, mismatch_job: Result) -> None:
    result, values = mismatch_job, MISMATCHES[what]
    for r in range(3):
        got = result.report(r).get(f"case:{what}", {})
        assert "mismatch" in got, result.explain()
        msg = got["mismatch"]
        assert got["after_s"] < PROMPTLY, got
        assert "'grad.w'" in msg and what.replace("layout", "shape") in msg, msg
        assert values[0] in msg and values[1] in msg, msg
        assert "rank 1:" in msg and "rank 0:" in msg, msg
        assert got["after_ok"], got  # the job went on


def test_ranks_that_choose_different_algorithms_fail_every_rank_saying_so() -> None:
    # Rank 0's TOTALREDUCE_HALVING_BYTES puts it on recursive halving/doubling (and the
    # scatter-allgather broadcast), the others on the ring and the chain.
    result = run_ok(4, "workers:algorithm_mismatch", {}, timeout=90)
    for what, mine in (("allreduce", "halving"), ("broadcast", "scatter-allgather"),
                       ("allgather", "doubling"), ("reducescatter", "halving")):
        for r in range(4):
            got = result.report(r).get(f"case:{what}", {})
            assert "mismatch" in got, result.explain()
            msg = got["mismatch"]
            assert "(differs: algorithm)" in msg and "HALVING_BYTES" in msg, msg
            assert f"algorithm={mine}" in msg, msg
            assert got["after_s"] < PROMPTLY and got["after_ok"], got


def test_killed_worker_fails_every_rank_and_launcher() -> None:
    n = 3
    result = launch(n, "workers:killed_peer", {"victim": 1}, timeout=60)
    assert result.returncode != 0, result.explain()
    assert result.elapsed < JOB_ENDS, result.explain()
    assert "rank 1" in result.stderr and "SIGKILL" in result.stderr, result.explain()
    assert re.search(r"rank 1 \(pid \d+\) failed: killed by SIGKILL", result.stderr)
    assert re.search(r"1\s+\d+\s+killed by SIGKILL\s+<- first failure", result.stderr)
    for r in (0, 2):
        got = result.report(r)
        assert got.get("caught_rank") == 1, result.explain()
        assert got["after_s"] < PROMPTLY, got


def test_strangers_are_refused_and_job_finishes() -> None:
    result = run_ok(2, "workers:strangers", {}, timeout=60)
    text = result.stdout + result.stderr
    assert text.count("wrong secret refused") == 2, result.explain()
    assert "rendezvous: refused connection" in text, result.explain()
    assert "rank 1: refused connection" in text, result.explain()
    assert all(result.report(r).get("finished") for r in range(2)), result.explain()


def test_op_timeout_fails_instead_of_hanging() -> None:
    result = run_ok(2, "workers:op_timeout", {"late": 0.5},
                    env={"TOTALREDUCE_OP_TIMEOUT": "1.5"}, timeout=60)
    for r in range(2):
        got = result.report(r)
        assert f"'late{r}'" in got.get("timeout", ""), result.explain()
        assert "TOTALREDUCE_OP_TIMEOUT" in got["timeout"]
        assert got["after_s"] >= 1.5, got  # not before the limit
        assert got["after_s"] < 1.5 + PROMPTLY, got


def test_stall_warning_names_op_and_rank() -> None:
    result = run_ok(2, "workers:stall", {}, env={"TOTALREDUCE_STALL_CHECK_TIME": "1"},
                    timeout=60)
    warnings = [ln for ln in result.lines(0) if "has waited" in ln]
    assert warnings, result.explain()
    assert "'slowpoke'" in warnings[0], warnings
    assert "submitted by rank(s) [0], not (yet) by rank(s) [1]" in warnings[0], warnings


def test_stall_shutdown_time_fails_the_waiting_ranks() -> None:
    result = run_ok(3, "workers:stall_shutdown", {"hold": 40.0},
                    env={"TOTALREDUCE_STALL_SHUTDOWN_TIME": "1"}, timeout=60)
    for r in (0, 1):
        got = result.report(r)
        assert got.get("kind") == "OpTimeoutError", result.explain()
        assert "'ghost'" in got["error"] and "not (yet) by rank(s) [2]" in got["error"], got
        assert "TOTALREDUCE_STALL_SHUTDOWN_TIME=1" in got["error"], got
        assert got["after_s"] >= 1.0, got  # not before the limit
        assert got["after_s"] < 1.0 + PROMPTLY, got
    assert result.report(2)["outlasted"] is True, result.explain()
