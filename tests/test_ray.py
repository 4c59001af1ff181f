"""RayExecutor on a local Ray instance: ranks in order, one rank's failure named, never a
hang, and the digits example under Ray."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install '.[ray]')")

import totalreduce as tr  # noqa: E402
from totalreduce.ray import RayExecutor, WorkerFailedError  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    # The actors unpickle this module's functions by reference, so they need this folder
    # on their path.  Ray's own processes outlive each test, so they must not carry the
    # conftest's leak mark (they are ended with the cluster at the end of the module).
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "TRTEST_SESSION")}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, saved["PYTHONPATH"]) if p)
    os.environ.pop("TRTEST_SESSION", None)
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
        # The driver's threads that Ray starts lazily, started before the leak check
        # takes its census.
        with RayExecutor(num_workers=1) as executor:
            executor.run(int)
    finally:
        for k, v in saved.items():
            if v is not None:
                os.environ[k] = v
    yield
    ray.shutdown()


def _data(rank: int) -> np.ndarray:
    return np.arange(6, dtype=np.float64).reshape(2, 3) * (rank + 1) + rank


def allreduce_rank_data() -> tuple[int, int, int, int, np.ndarray]:
    tr.init()
    try:
        result = tr.allreduce(_data(tr.rank()), op=tr.Sum, name="data")
        return tr.rank(), tr.size(), tr.local_rank(), tr.local_size(), result
    finally:
        tr.shutdown()


def fail_on_rank_1(how: str) -> str:
    tr.init()
    try:
        if tr.rank() == 1:
            if how == "exit":
                os._exit(3)
            if how == "sys.exit":
                sys.exit(3)
            raise ValueError("rank 1 gives up")
        for _ in range(100):
            tr.allreduce(np.ones(1000), name="step")
        return "rank 0 finished without rank 1"
    finally:
        tr.shutdown()


def train_digits(argv: list[str]) -> float:
    sys.path.insert(0, EXAMPLES)
    import train_digits as example

    return example.main(argv)


@pytest.mark.timeout(120)
def test_ranks_allreduce_and_results_come_in_rank_order(cluster: None) -> None:
    with RayExecutor(num_workers=2) as executor:
        results = executor.run(allreduce_rank_data)
        assert executor.execute(lambda worker: worker.env["TOTALREDUCE_RAY_RANK"]) == \
            ["0", "1"]
    expected = _data(0) + _data(1)
    assert [r[:4] for r in results] == [(0, 2, 0, 2), (1, 2, 1, 2)]
    for r in results:
        np.testing.assert_array_equal(r[4], expected)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["raise", "exit", "sys.exit"])
def test_one_rank_failing_names_it_and_the_other_gets_peer_failure(cluster: None,
                                                                   how: str) -> None:
    executor = RayExecutor(num_workers=2, failure_grace=60)
    executor.start()
    start = time.monotonic()
    with pytest.raises(WorkerFailedError) as caught:
        executor.run(fail_on_rank_1, args=(how,))
    # Well inside the grace: rank 0 raised by itself, it was not killed.
    assert time.monotonic() - start < 30
    error = caught.value
    assert error.rank == 1 and str(error).startswith("rank 1 of 2 failed")
    assert isinstance(error.errors[0], tr.PeerFailureError), error.errors[0]
    assert error.errors[0].rank == 1
    if how == "raise":
        assert isinstance(error.errors[1], ValueError)
        assert "rank 1 gives up" in str(error)
    elif how == "sys.exit":  # not the actor's death, which would hide the code
        assert "SystemExit: 3" in str(error), error
    else:
        assert isinstance(error.errors[1], ray.exceptions.RayActorError)
    with pytest.raises(RuntimeError, match="start"):
        executor.run(int)  # a failed run ends the job
    executor.shutdown()


@pytest.mark.timeout(120)
def test_a_rank_that_never_joins_is_killed_after_the_grace(cluster: None) -> None:
    """Rank 0 waits to meet rank 1, which failed before init(): nothing tells rank 0, so
    the grace period is what ends it."""
    def rank_1_fails_before_init() -> None:
        if os.environ["TOTALREDUCE_RAY_RANK"] == "1":
            raise KeyError("no data for rank 1")
        tr.init()

    with RayExecutor(num_workers=2, failure_grace=2) as executor, \
            pytest.raises(WorkerFailedError) as caught:
        executor.run(rank_1_fails_before_init)
    assert caught.value.rank == 1
    assert isinstance(caught.value.errors[0], TimeoutError)


class _Holder:
    def ready(self) -> None:
        pass


@pytest.mark.timeout(120)
def test_start_says_what_it_waits_for(cluster: None, monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
    """Ray says nothing while actors wait for CPUs: start() does, then goes on waiting
    until they are free."""
    from totalreduce.ray import executor as module

    monkeypatch.setattr(module, "PLACEMENT_NOTICE", 1.0)
    holder = ray.remote(num_cpus=2)(_Holder).remote()  # every CPU of the cluster
    ray.get(holder.ready.remote())
    freed = threading.Timer(2.5, ray.kill, (holder,))
    freed.start()
    try:
        with caplog.at_level("WARNING", logger=module.__name__), \
                RayExecutor(num_workers=2) as executor:
            assert executor.run(int) == [0, 0]
    finally:
        freed.join()
    notices = [r.getMessage() for r in caplog.records if r.name == module.__name__]
    assert notices and notices[0].startswith("RayExecutor: 0 of 2 workers placed after 1 s")
    assert "each needs {'CPU': 1}, the cluster has {'CPU': 2.0, 'GPU': 0.0}" in notices[0]


@pytest.mark.timeout(120)
def test_digits_under_ray(cluster: None) -> None:
    """The digits example on 2 Ray workers, as test_examples runs it under totalrun -np
    2: the first 10 epochs reach 95% (the same weights as totalrun's, bit for bit: the
    shards and seeds do not depend on the launcher)."""
    pytest.importorskip("torch", reason="the torch extra is not installed")
    pytest.importorskip("sklearn", reason="scikit-learn (the examples extra) is not installed")
    with RayExecutor(num_workers=2) as executor:
        accuracies = executor.run(train_digits, args=(["--epochs", "10"],))
    assert accuracies[0] == accuracies[1]
    assert accuracies[0] >= 0.95, accuracies
