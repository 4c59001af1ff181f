"""The pieces of negotiated mode on their own: the response cache's bits, the
coordinator's message table, fusion groups, request params, and Horovod's setting names."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from totalreduce.config import Config, horovod_notices
from totalreduce.scheduling.coordinator import STALLED, Coordinator
from totalreduce.scheduling.fusion import FusionBuffers, groups
from totalreduce.scheduling.requests import (
    ParamsTable,
    Request,
    Response,
    decode_requests,
    decode_responses,
    encode,
    params_of,
)
from totalreduce.scheduling.response_cache import ResponseCache


def _resp(name: str, shape: tuple[int, ...] = (3,), dtype: str = "float32") -> Response:
    return Response(name, ("allreduce", dtype, shape, 1, -1))


def _lookup(cache: ResponseCache, name: str, params: tuple) -> tuple[str, int]:
    hit_bits, _hits, invalid, misses = cache.classify([Request(name, params, None, False, 0)])
    if misses:
        return "miss", -1
    return ("hit", hit_bits[0]) if hit_bits else ("invalid", invalid[0])


def test_cache_positions_are_the_same_for_the_same_sequence_of_changes() -> None:
    def replay(seed: int) -> list[str | None]:
        cache = ResponseCache(8)
        rng = np.random.default_rng(seed)
        for step in range(300):
            name = f"t{rng.integers(20)}"
            status, bit = _lookup(cache, name, _resp(name).params)
            if status == "miss":
                cache.put(_resp(name))
            elif step % 7 == 0:
                cache.evict(bit)
            else:
                cache.ready(np.array([bit]))
        return [None if (r := cache.at(b)) is None else r.name for b in range(8)]

    assert replay(1) == replay(1)  # every rank makes the same changes: same bits
    cache = ResponseCache(2)
    for name in ("a", "b", "c"):  # full: the least recently used goes, its bit reused
        cache.put(_resp(name))
    assert _lookup(cache, "a", _resp("a").params) == ("miss", -1)
    assert _lookup(cache, "c", _resp("c").params)[0] == "hit"
    assert _lookup(cache, "b", _resp("b", (4,)).params)[0] == "invalid"
    assert len(cache) == 2 and cache.evictions == 1


def test_cache_ready_touches_and_gives_a_repeated_set_the_same_list() -> None:
    cache = ResponseCache(3)
    for name in ("a", "b", "c"):
        cache.put(_resp(name))
    a, b, c = (_lookup(cache, n, _resp(n).params)[1] for n in "abc")
    first = cache.ready(np.array(sorted([a, c])))
    assert [r.name for r in first] == ["a", "c"]
    assert cache.ready(np.array([b])) is not first
    assert cache.ready(np.array(sorted([a, c]))) is first  # nothing put or evicted between
    # The repeated set was touched again: b, not a, is the least recently used.
    cache.put(_resp("d"))
    assert _lookup(cache, "b", _resp("b").params) == ("miss", -1)
    assert _lookup(cache, "a", _resp("a").params)[0] == "hit"
    d = _lookup(cache, "d", _resp("d").params)[1]
    again = cache.ready(np.array(sorted([c, d])))
    assert [r.name for r in again] == ["d", "c"]  # d has b's bit: in bit order
    cache.evict(c)  # an eviction: the set's list is made afresh
    assert [r.name for r in cache.ready(np.array(sorted([c, d])))] == ["d"]
    assert cache.ready(np.array([], np.int64)) == []


def test_cache_of_capacity_zero_keeps_nothing() -> None:
    cache = ResponseCache(0)
    cache.put(_resp("a"))
    assert len(cache) == 0 and _lookup(cache, "a", _resp("a").params) == ("miss", -1)


def test_coordinator_answers_when_every_rank_asked_and_names_differences() -> None:
    coord = Coordinator(3, 0, 0)
    ok, bad = _resp("ok").params, _resp("bad").params
    coord.add(0, [("ok", ok), ("bad", bad)])
    coord.add(1, [("ok", ok), ("bad", _resp("bad", (5,)).params)])
    assert not coord.due()
    coord.add(2, [("bad", bad), ("ok", ok)])
    out = coord.responses()
    assert [r.name for r in out] == ["bad", "ok"]  # in the order they became ready
    assert out[1].error == "" and out[1].params == ok
    assert "differs: shape" in out[0].error and "rank 1: kind=allreduce, dtype=float32, " \
        "shape=(5,)" in out[0].error
    assert coord.stats() == {"coordinator_received": 6, "coordinator_table": 0}


def test_coordinator_stall_warning_then_error(caplog: pytest.LogCaptureFixture) -> None:
    coord = Coordinator(3, 1e-9, 0)
    coord.add(0, [("late", _resp("late").params)])
    coord.add(2, [("late", _resp("late").params)])
    with caplog.at_level(logging.WARNING):
        coord.check()
        coord.check()  # once only
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "submitted by rank(s) [0, 2], not (yet) by rank(s) [1]" \
        in warned[0]
    coord = Coordinator(2, 0, 1e-9)
    coord.add(1, [("late", _resp("late").params)])
    coord.check()
    (out,) = coord.responses()
    assert out.error.startswith(STALLED) and "not (yet) by rank(s) [0]" in out.error


def test_requests_and_responses_round_trip_as_json_only() -> None:
    arr = np.zeros((5, 3), np.int16)
    req = Request("x", params_of("allgather", arr, -1, -1), arr, False, 0)
    assert req.params == ("allgather", "int16", (3,), -1, -1)  # first dimension free
    assert decode_requests(encode([req.wire()])) == [("x", req.params)]
    resp = Response("x", req.params, "oops")
    (back,) = decode_responses(encode([resp.wire()]))
    assert (back.name, back.params, back.error) == ("x", req.params, "oops")
    with pytest.raises(ValueError):
        decode_requests(encode([["x", "allreduce"]]))


def test_fusion_groups_adjacent_allreduces_of_one_dtype_and_op_within_threshold() -> None:
    def request(name: str, n: int, dtype: str = "float32", op: int = 1,
                kind: str = "allreduce") -> Request:
        arr = np.zeros(n, dtype)
        return Request(name, params_of(kind, arr, op, -1), arr, False, 0)

    requests = [request("a", 10), request("b", 10), request("c", 10, "float64"),
                request("d", 10), request("e", 10, op=4), request("f", 1000),
                request("g", 10, kind="broadcast"), request("h", 10)]
    got = [([r.name for r in run], nbytes) for run, nbytes in groups(requests, threshold=200)]
    assert got == [(["a", "b"], 80), (["c"], 80), (["d"], 40), (["e"], 40), (["f"], 4000),
                   (["g"], 40), (["h"], 40)]
    assert [len(run) for run, _ in groups(requests, threshold=0)] == [1] * 8


def test_checked_params_are_bounded_first_in_first_out() -> None:
    table = ParamsTable(3)
    f32 = np.dtype(np.float32)
    for n in range(5):
        table.add((f32, 1, (n,)), params_of("allreduce", np.zeros(n, f32), 1, -1))
    assert len(table) == 3
    assert table.get((f32, 1, (1,))) is None  # the first ones went
    assert table.get((f32, 1, (4,))) == ("allreduce", "float32", (4,), 1, -1)


def test_fusion_buffers_are_reused_and_bounded() -> None:
    buffers = FusionBuffers(idle_bytes=1000)
    a = buffers.take(np.dtype(np.float32), 100)
    buffers.give(a)
    b = buffers.take(np.dtype(np.float32), 50)
    assert np.shares_memory(a, b)  # reused
    buffers.give(b)
    buffers.give(buffers.take(np.dtype(np.float32), 300))  # 1200 bytes: over the bound
    assert buffers.idle_bytes() <= 1000


def test_horovod_settings_are_read_when_ours_are_unset() -> None:
    env = {"HOROVOD_FUSION_THRESHOLD": "1048576", "HOROVOD_CYCLE_TIME": "5",
           "HOROVOD_CACHE_CAPACITY": "0", "HOROVOD_TIMELINE": "/tmp/t.json",
           "HOROVOD_STALL_CHECK_TIME_SECONDS": "30",
           "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "90",
           "TOTALREDUCE_CYCLE_TIME_MS": "2"}
    cfg = Config.from_env(env)
    assert (cfg.fusion_threshold, cfg.cycle_time_ms, cfg.cache_capacity, cfg.timeline,
            cfg.stall_check_time, cfg.stall_shutdown_time) == \
        (1 << 20, 2.0, 0, "/tmp/t.json", 30.0, 90.0)  # ours wins where both are set
    notes = horovod_notices(env)
    assert len(notes) == 5 and not any("CYCLE" in n for n in notes)
    assert "totalreduce: TOTALREDUCE_FUSION_THRESHOLD is unset; using " \
        "HOROVOD_FUSION_THRESHOLD=1048576" \
        in notes


def test_coordination_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="coordination"):
        Config(coordination="central")
    with pytest.raises(ValueError):
        Config(cache_capacity=-1)
