"""Negotiated coordination (TOTALREDUCE_COORDINATION=negotiated): the same results as
self-guided mode, the response cache, fusion, and the timeline of both modes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import PROMPTLY, Result, launch, run_ok
from shared_jobs import NEGOTIATED_CASES, shared_job

pytestmark = pytest.mark.multiprocess

NEGOTIATED = {"TOTALREDUCE_COORDINATION": "negotiated"}


# 1 rank (no peers to negotiate with), 2 (the coordinator and one worker, a power of
# two) and 3 (several workers, not a power of two) take every path of the coordination
# this matrix checks.  Four ranks add nothing the coordinator does differently, but cost
# the most time in the suite: the engine's data paths at 4 ranks are checked by
# test_collectives over every transport, and negotiated mode at 4 ranks by the fusion,
# big-op and recovery tests below and in test_recovery (results checked there too).
@pytest.mark.parametrize("n", [1, 2, 3])
def test_core_matrix_matches_numpy(n: int) -> None:
    result = run_ok(n, "workers:check_collectives", {}, env=NEGOTIATED, timeout=240)
    for r in range(n):
        assert result.report(r).get("checked", 0) > 0, result.explain()


@pytest.mark.parametrize("n", [2, 3])
def test_a_blocking_op_begins_a_cycle_at_once_rather_than_at_the_tick(n: int) -> None:
    # A ten-minute cycle: no op could end by a tick within the timeout, so each was begun
    # by its own request.  No cycle ran but those, the one after each renegotiation (the
    # broadcast's root moves every round after the first: its cache entry is evicted and
    # every rank begins the next cycle at once), the first, and the one agreeing to stop.
    rounds = 4
    env = dict(NEGOTIATED, TOTALREDUCE_CYCLE_TIME_MS="600000")
    result = run_ok(n, "workers:negotiated_lone_ops", {"rounds": rounds}, env=env,
                    timeout=60)
    for r in range(n):
        got = result.report(r)
        assert got.get("ok"), result.explain()
        assert got["calls"] <= got["cycles"] <= got["calls"] + (rounds - 1) + 2, got


@pytest.mark.parametrize("n", [2, 3])
def test_repeated_tensors_skip_the_coordinator_and_a_changed_shape_is_renegotiated(
        n: int) -> None:
    result = run_ok(n, "workers:negotiated_cache", {}, env=NEGOTIATED, timeout=90)
    for r in range(n):
        got = result.report(r)
        first, steady, changed = got["first"], got["steady"], got["changed"]
        assert first["requests_sent"] == 20, got
        # Ten more steps of the same 20 tensors: nothing sent, every request a cache hit.
        assert steady["requests_sent"] == first["requests_sent"], got
        assert steady["cache_hits"] - first["cache_hits"] >= 200, got
        # w5 changed shape on every rank: evicted once, negotiated once, cached again.
        # (The eviction is counted from "first": a faster peer's changed request can make
        # this rank's cycle evict before this rank takes its "steady" snapshot.)
        assert changed["requests_sent"] - steady["requests_sent"] == 1, got
        assert changed["cache_evictions"] - first["cache_evictions"] == 1, got
    coordinator = result.report(0)
    assert coordinator["steady"]["coordinator_received"] == \
        coordinator["first"]["coordinator_received"] == 20 * n, coordinator
    assert coordinator["changed"]["coordinator_received"] == 21 * n, coordinator


@pytest.mark.parametrize("n", [2, 4])
def test_small_tensors_are_fused(n: int) -> None:
    result = run_ok(n, "workers:negotiated_fusion", {}, env=NEGOTIATED, timeout=90)
    for r in range(n):
        got = result.report(r)
        assert got["tensors"] == 100 and got["engine_ops"] <= 5, got
        assert got["fused_ops"] >= 1, got


def test_repeated_fused_steps_reuse_their_layout_and_stay_right() -> None:
    # A ten-second cycle: each step's tensors are taken together, in the cycle its first
    # wait begins, so every step is one fused cycle.
    env = dict(NEGOTIATED, TOTALREDUCE_CYCLE_TIME_MS="10000")
    result = run_ok(2, "workers:negotiated_fused_steps", {}, env=env, timeout=90)
    for r in range(2):
        got = result.report(r)
        # 8 steps, the first and the one after the shape change laid out afresh.
        assert got["fused_ops"] >= 8 and got["repeated"] >= 4, got


def _load_trace(path: Path) -> list[dict]:
    text = path.read_text()
    if not text.rstrip().endswith("]"):
        # Cut off: as trace viewers do, close the array after the last whole event.
        text = text[:text.rstrip().rfind("}") + 1] + "]"
    return json.loads(text)


@pytest.mark.parametrize("mode", ["negotiated", "selfguided"])
def test_timeline_holds_every_phase(tmp_path: Path, mode: str) -> None:
    trace = tmp_path / "trace.json"
    run_ok(2, "workers:timeline_run", {}, timeout=60,
           env={"TOTALREDUCE_COORDINATION": mode, "TOTALREDUCE_TIMELINE": str(trace)})
    for path in (trace, Path(f"{trace}.1")):
        events = json.loads(path.read_text())  # closed at shutdown: plain JSON
        phases = {e["name"] for e in events if e["ph"] == "X"}
        rows = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
        assert {"g0", "g7", "big"} <= rows, rows
        if mode == "negotiated":
            assert {"NEGOTIATE", "QUEUE", "MEMCPY_IN_FUSION_BUFFER", "ALLREDUCE",
                    "MEMCPY_OUT_FUSION_BUFFER"} <= phases, phases
        else:
            assert {"ALLREDUCE", "WAIT_FOR_PEER"} <= phases, phases
        assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")


def test_timeline_of_a_killed_rank_still_loads(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    result = launch(2, "workers:timeline_run", {"kill_rank": 1}, timeout=60,
                    env=dict(NEGOTIATED, TOTALREDUCE_TIMELINE=str(trace)))
    assert result.returncode != 0, result.explain()
    killed = Path(f"{trace}.1")
    assert not killed.read_text().rstrip().endswith("]")
    events = _load_trace(killed)
    assert any(e["name"] == "NEGOTIATE" for e in events), events[:5]


MISMATCHES = {
    "shape": ("(4,)", "(5,)"),
    "dtype": ("float32", "float64"),
    "layout": ("(3, 2)", "(2, 3)"),
    "op": ("op=Average", "op=Max"),
}


@pytest.fixture(scope="module")
def mismatch_job() -> Result:
    """One 3-rank job runs every mismatch in turn (the job must go on after each, which the
    worker checks); each case is still judged by a test of its own."""
    return run_ok(3, "workers:mismatch", {"whats": list(MISMATCHES)}, env=NEGOTIATED,
                  timeout=90)


@pytest.mark.parametrize("what", list(MISMATCHES))
def test_mismatch_raises_on_every_rank(what: str, mismatch_job: Result) -> None:
    result, values = mismatch_job, MISMATCHES[what]
    for r in range(3):
        got = result.report(r).get(f"case:{what}", {})
        msg = got.get("mismatch", "")
        assert msg.startswith(f"rank {r}: ranks disagree on allreduce 'grad.w'"), \
            result.explain()
        assert f"differs: {what.replace('layout', 'shape')}" in msg, msg
        assert values[0] in msg and values[1] in msg, msg
        assert all(f"rank {q}: kind=allreduce" in msg for q in range(3)), msg
        assert got["after_s"] < PROMPTLY, got
        assert got["after_ok"], got  # the job went on


BROADCAST_VARIANTS = ["every_rank_its_own_root", "last_rank_other_root",
                      "broadcast_against_allreduce"]


@pytest.fixture(scope="module")
def broadcast_mismatch_job() -> Result:
    """One 3-rank job runs every disagreeing broadcast in turn (see mismatch_job)."""
    return run_ok(3, "workers:broadcast_mismatch", {"variants": BROADCAST_VARIANTS},
                  env=NEGOTIATED, timeout=90)


@pytest.mark.parametrize("variant", BROADCAST_VARIANTS)
def test_disagreeing_broadcast_raises_on_every_rank(variant: str,
                                                    broadcast_mismatch_job: Result) -> None:
    result = broadcast_mismatch_job
    differs = "kind" if variant == "broadcast_against_allreduce" else "root"
    for r in range(3):
        got = result.report(r).get(f"case:{variant}", {})
        assert not got.get("returned_data") and "mismatch" in got, result.explain()
        assert f"differs: {differs}" in got["mismatch"], got
        assert got["after_ok"], got  # the job went on


def test_stall_warning_names_tensor_and_missing_rank() -> None:
    result = run_ok(2, "workers:stall", {}, timeout=60,
                    env=dict(NEGOTIATED, TOTALREDUCE_STALL_CHECK_TIME="1"))
    warnings = [ln for ln in result.lines(0) if "has waited" in ln]
    assert warnings, result.explain()
    assert "allreduce 'slowpoke'" in warnings[0], warnings
    assert "submitted by rank(s) [0], not (yet) by rank(s) [1]" in warnings[0], warnings


def test_stall_shutdown_time_fails_the_waiting_ranks() -> None:
    result = run_ok(3, "workers:stall_shutdown", {"hold": 40.0}, timeout=60,
                    env=dict(NEGOTIATED, TOTALREDUCE_STALL_SHUTDOWN_TIME="1"))
    for r in (0, 1):
        got = result.report(r)
        assert got.get("kind") == "OpTimeoutError", result.explain()
        assert "'ghost'" in got["error"] and "not (yet) by rank(s) [2]" in got["error"], got
        assert got["after_s"] >= 1.0, got  # not before the limit
        assert got["after_s"] < 1.0 + PROMPTLY, got
    assert result.report(2)["outlasted"] is True, result.explain()


def test_stalled_cached_tensor_is_reported_too() -> None:
    # A tensor every rank has run before is a cache hit; when one rank stops submitting
    # it, the others' requests leave the cache for the coordinator, which names who is
    # missing.
    result = run_ok(2, "workers:stall_cached", {}, timeout=60,
                    env=dict(NEGOTIATED, TOTALREDUCE_STALL_CHECK_TIME="1",
                             TOTALREDUCE_STALL_SHUTDOWN_TIME="2"))
    got = result.report(0)
    assert got.get("kind") == "OpTimeoutError", result.explain()
    assert "not (yet) by rank(s) [1]" in got["error"], got


@pytest.fixture(scope="module")
def torch_job() -> Result:
    """The 2-rank torch checks in negotiated mode: parts of the 2-rank torch job
    (shared_jobs.py) that run in a world started in negotiated mode; a torch job's start
    is most of its cost.  Named as their parts, less ``neg_``."""
    pytest.importorskip("torch")
    return shared_job(2)


def _part(job: Result, name: str) -> Result:
    return job.part(f"neg_{name}")


def test_torch_training_matches_one_process_in_negotiated_mode(torch_job: Result) -> None:
    result = _part(torch_job, "equivalence")
    for r in range(2):
        done = [k for k in result.report(r) if k.startswith("equivalent")]
        assert len(done) == len(NEGOTIATED_CASES), result.explain()


def test_horovod_script_runs_in_negotiated_mode(torch_job: Result) -> None:
    result = _part(torch_job, "script")
    for r in range(2):
        assert result.report(r).get("script_ranks") == 2, result.explain()
        assert result.report(r).get("coordination") == "negotiated", result.explain()


@pytest.mark.parametrize("n", [2, 3])
def test_uneven_join_in_negotiated_mode(n: int) -> None:
    pytest.importorskip("torch")
    result = _part(shared_job(n), "unused_and_join")
    for r in range(n):
        assert result.report(r).get("unused_and_join_ok") == n - 2, result.explain()


def test_broadcast_after_join_fails_loudly_in_negotiated_mode(torch_job: Result) -> None:
    result = _part(torch_job, "joined")
    assert "join()" in result.report(1).get("refused", ""), result.explain()


def test_memory_stays_flat_in_negotiated_mode() -> None:
    # Random sizes, kinds and names (a quarter never seen before, others reused with a
    # new shape: cache evictions and renegotiation all the time), a cache of 64 entries
    # and 128 remembered names, so every bound is reached during the warm-up (which is
    # long for the fixed-size caches too: see test_defects' soak).  1500 ops after it
    # show a leak: with the scratch pool's eviction switched off the ranks grew 6.2-7.0
    # MB, without a leak 1.7-2.9 MB (at 3 ranks 8.5 and 1.0-2.9 MB, in 42 s against 23:
    # the world of 3 is test_defects' soak's).
    ops, warmup, n = 3000, 1500, 2
    result = run_ok(n, "workers:soak", {"seed": 7, "ops": ops, "warmup": warmup,
                                        "unique_names": True},
                    env=dict(NEGOTIATED, TOTALREDUCE_SCRATCH_BYTES=str(4 << 20),
                             TOTALREDUCE_NAME_CAPACITY="128",
                             TOTALREDUCE_CACHE_CAPACITY="64",
                             MALLOC_MMAP_THRESHOLD_=str(64 << 10)), timeout=240)
    for r in range(n):
        got = result.report(r)
        grew = got["rss_end_mb"] - got["rss_warm_mb"]
        assert grew < 5, f"rank {r} grew {grew:.1f} MB over {ops - warmup} ops: {got}"


def test_blocking_big_ops_finish_when_the_other_ranks_have_left() -> None:
    # A thread blocked in a negotiated call sleeps while the cycle and progress threads
    # work; counting it as the engine's driver once left nobody to drive between cycles,
    # and, after the others shut down, nobody at all.
    for _ in range(3):
        result = run_ok(4, "workers:big_then_leave", {"ops": 6}, env=NEGOTIATED, timeout=60)
        assert all(result.report(r).get("done") for r in range(4)), result.explain()


def test_bad_calls_after_good_ones_are_still_refused() -> None:
    result = run_ok(2, "workers:negotiated_checks_after_a_first_call", {}, env=NEGOTIATED,
                    timeout=60)
    for r in range(2):
        refused = result.report(r)["refused"]
        # Each refused with the argument checks' own message.
        assert refused.get("bool average", "").startswith("TypeError: allreduce 'b': "
                                                          "Average of a bool"), refused
        assert refused.get("read-only in place") == \
            "ValueError: in-place collective on a read-only array", refused
        assert refused.get("int name", "").startswith("TypeError: allreduce: name must "
                                                      "be a str"), refused
        assert refused.get("op True", "").startswith("TypeError: op must be one of"), \
            refused
