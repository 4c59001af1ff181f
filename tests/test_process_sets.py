"""Process sets (Horovod's add_process_set) on 4 real ranks: numpy and torch."""

import pytest

from harness import run_ok
from shared_jobs import shared_job

pytestmark = pytest.mark.multiprocess


def test_process_sets_run_their_own_collectives_and_refuse_outsiders() -> None:
    result = run_ok(4, "workers:process_sets", {}, timeout=120,
                    env={"TOTALREDUCE_SEGMENT_BYTES": "65536"})
    for r in range(4):
        got = result.report(r)
        assert got["ids"] == [1, 2, 3], result.explain()
        if r < 3:
            # Named by the set, with the three members' views and nobody else's.
            text = got["mismatch"]
            assert "in process set 3 (ranks [0, 1, 2])" in text, text
            assert "differs: shape" in text and "rank 3" not in text, text
        else:
            assert got["outside"] == ("rank 3: allreduce: this rank is not in process set "
                                      "3 (ranks [0, 1, 2])"), got
        assert "rank 0: [0, 1, 3]; rank 1: [0, 2, 3]" in got["disagree"], got
        assert got["removed"] is True
        assert "is not registered in this job" in got["after_remove"], got


def test_distributed_optimizer_on_process_sets() -> None:
    pytest.importorskip("torch")
    result = shared_job(4).part("process_sets")
    assert all(result.report(r).get("ok") for r in range(4)), result.explain()
