"""Parameter averaging (PeriodicAverager, PostLocalSGDOptimizer, totalreduce.average) on
real ranks."""

import pytest

from harness import run_ok
from shared_jobs import shared_job

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("n", [2, 4])
def test_periodic_averaging(n: int) -> None:
    pytest.importorskip("torch")
    result = shared_job(n).part("averaging")
    for r in range(n):
        got = result.report(r)
        assert got.get("ok"), result.explain()
        assert got["drift"] > 1e-3  # the period-1 equality is not a model that never moved
        assert got["steps"] == 12
        # Steps 0-2 warm up (gradients averaged); from step 3 every 4th averages.
        assert got["agree"] == [True, True, True, True, False, False, False, True,
                                False, False, False, True], got["agree"]


def test_average_arrays() -> None:
    result = run_ok(3, "workers:average_arrays", {}, timeout=60)
    assert all(result.report(r).get("ok") for r in range(3)), result.explain()
