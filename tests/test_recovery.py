"""Recovery from a killed worker (totalrun --max-restarts), Rabit's test matrix at 4 ranks:
each death is a SIGKILL at a chosen collective (TOTALREDUCE_MOCK_DEATH), every collective's
result is checked on every rank against its own computation, and every run must end with
the state of a run without failures, bit for bit, with the survivors' processes kept."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from harness import launch, run_ok
from workers import RECOVERY_N, RECOVERY_VERSIONS, recovery_grad

pytestmark = pytest.mark.multiprocess

N = 4


def _expected_digest(n: int) -> str:
    w = np.zeros(RECOVERY_N, np.float32)
    for v in range(RECOVERY_VERSIONS):
        for i in range(3):
            total = sum(recovery_grad(w, v, i, r) for r in range(n))
            w = np.mod(w + total, 1000).astype(np.float32)
    return hashlib.sha256(w.tobytes()).hexdigest()


# rank, version, collective within the version (0-based), life (0: first).  Two jobs run
# Rabit's matrix between them, each death in a version of its own.
CASES = {
    # one death (v2); rank 0 (v5); a death right after a checkpoint (v7, its first op)
    "one death, rank 0, right after a checkpoint": "1,2,2,0;0,5,1,0;2,7,0,0",
    # two ranks at the same point (v2); rank 1's replacement dies again while it is still
    # catching up (v2, op 1 < 2); the same rank dying twice (rank 3 at v5 and at v7)
    "two at once, during its own recovery, the same rank twice":
        "1,2,2,0;2,2,2,0;1,2,1,1;3,5,1,0;3,7,2,1",
    # at the broadcast (op 5) of an odd version: the replacement takes the allgather and
    # the alltoall before it from its peers' logs, into its out= arrays
    "after the gathers into out=": "2,3,5,0",
}


def _check_recovered(result, deaths: str) -> None:  # type: ignore[no-untyped-def]
    want = _expected_digest(N)
    lives: dict[int, int] = {}
    for part in deaths.split(";"):
        rank = int(part.split(",")[0])
        lives[rank] = lives.get(rank, 0) + 1
    for r in range(N):
        got = result.report(r)
        assert got.get("digest") == want, result.explain()
        assert got["version"] == RECOVERY_VERSIONS
        pids = sorted(k for k in got if k.startswith("pid"))
        # A survivor keeps its one process; a victim has one process per life.
        assert pids == [f"pid{a}" for a in range(lives.get(r, 0) + 1)], (r, got)
    for rank, n in lives.items():
        assert result.stderr.count(f"totalrun: rank {rank} (pid") == n, result.explain()
    assert f"job finished after {sum(lives.values())} restart(s)" in result.stderr


@pytest.mark.parametrize("case", list(CASES))
def test_killed_workers_catch_up_from_their_peers(case: str) -> None:
    deaths = CASES[case]
    result = run_ok(N, "workers:recovery_matrix", {}, timeout=120,
                    env={"TOTALREDUCE_MOCK_DEATH": deaths},
                    launcher_args=("--max-restarts", "2"))
    _check_recovered(result, deaths)


def test_recovery_in_negotiated_mode() -> None:
    deaths = "1,3,2,0;1,3,1,1"
    result = run_ok(N, "workers:recovery_matrix", {}, timeout=120,
                    env={"TOTALREDUCE_MOCK_DEATH": deaths,
                         "TOTALREDUCE_COORDINATION": "negotiated"},
                    launcher_args=("--max-restarts", "2"))
    _check_recovered(result, deaths)


def test_recovery_over_tcp_only() -> None:
    deaths = "1,3,2,0;2,3,2,0"  # two at once
    result = run_ok(N, "workers:recovery_matrix", {}, timeout=120, transport="tcp",
                    env={"TOTALREDUCE_MOCK_DEATH": deaths},
                    launcher_args=("--max-restarts", "2"))
    _check_recovered(result, deaths)


def test_no_replacement_in_time_is_an_error_on_every_survivor() -> None:
    result = run_ok(3, "workers:recovery_timeout", {}, timeout=120,
                    env={"TOTALREDUCE_RECOVERY_TIMEOUT": "2"},
                    launcher_args=("--max-restarts", "1"))
    for r in (0, 2):
        got = result.report(r)
        assert got.get("rank_lost") == 1, result.explain()
        assert "no replacement joined within TOTALREDUCE_RECOVERY_TIMEOUT=2 s" in got["error"]


def test_restarts_asked_of_a_launcher_that_cannot_restart_one_rank() -> None:
    result = launch(2, "workers:recovery_matrix", {}, timeout=60, transport="srun",
                    env={"TOTALREDUCE_MAX_RESTARTS": "1"})
    assert result.returncode != 0, result.explain()
    assert "cannot restart one rank while the others wait" in result.stderr, result.explain()
    assert "totalrun -np N --max-restarts K" in result.stderr
