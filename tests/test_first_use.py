"""What a new user trips on (issue 24), each run as a user runs it: real ranks through
totalrun (or as srun starts them), the public API, the launcher's own output."""

from __future__ import annotations

import pytest

from harness import run_ok

pytestmark = pytest.mark.multiprocess


def test_init_again_after_shutdown_with_one_rank_late() -> None:
    # (Under srun and torchrun rank 0 serves a new store for each init(): test_units has
    # a client following its store to the new one.)
    late = 1.0
    result = run_ok(2, "workers:reinit_late", {"late": late}, timeout=90)
    for r in range(2):
        worlds = result.report(r).get("worlds")
        assert worlds is not None, result.explain()
        assert [w["sum"] for w in worlds] == [[0.0, 3.0, 6.0]] * 3, result.explain()
    # The rank that was on time waited for the late one, which did not have to wait.
    assert result.report(1)["worlds"][1]["init_s"] >= late * 0.8, result.explain()
    assert result.report(0)["worlds"][2]["init_s"] >= late * 0.8, result.explain()
    assert result.report(0).get("stale_refused") is True, result.explain()
    assert "refused" not in result.stderr, result.explain()


def test_allgather_mismatch_shows_the_shapes_passed() -> None:
    result = run_ok(2, "workers:ragged_mismatch", {}, timeout=60)
    for r in range(2):
        errors = result.report(r).get("errors", {})
        assert sorted(errors) == ["a2a", "flat", "rows", "rows_and_dtype"], result.explain()
        for text in errors.values():
            assert "Only the first dimension may differ between ranks." in text
        rows = errors["rows"]
        assert "(differs: shape)" in rows, rows
        assert "rank 0: kind=allgather, dtype=float64, shape=(2, 3)" in rows, rows
        assert "rank 1: kind=allgather, dtype=float64, shape=(2, 4)" in rows, rows
        flat = errors["flat"]
        assert "(differs: dtype)" in flat and "shape=(5,)" in flat and "shape=()" not in flat
        both = errors["rows_and_dtype"]
        assert "(differs: dtype)" in both, both  # the first dimensions may differ
        assert "shape=(2, 3)" in both and "shape=(3, 3)" in both, both
        assert "shape=(4, 2)" in errors["a2a"] and "shape=(4, 3)" in errors["a2a"]


def test_connect_timeout_0_waits_and_a_timeline_folder_is_made(tmp_path) -> None:
    timeline = tmp_path / "traces" / "run1" / "t.json"
    run_ok(2, "workers:timeline_run", {}, timeout=60,
           env={"TOTALREDUCE_CONNECT_TIMEOUT": "0", "TOTALREDUCE_TIMELINE": str(timeline)})
    assert timeline.exists() and (timeline.parent / "t.json.1").exists()
