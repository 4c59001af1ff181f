"""The parameter server (totalreduce.ps): 2 servers and 3 workers on real ranks."""

import numpy as np
import pytest

from harness import launch, run_ok
from ps_workers import KILL_KEYS, SHAPES, gradients, kill_push, problem, start_weights

pytestmark = pytest.mark.multiprocess

WORKERS, SERVERS = 3, 2
SERVED = {"launcher_args": ("--servers", str(SERVERS)), "timeout": 120}


def synchronous_sgd(steps: int, lr: float) -> dict[str, np.ndarray]:
    """Every worker's gradient at the same weights, averaged: one step per iteration."""
    weights = start_weights()
    shards = [problem(w) for w in range(WORKERS)]
    for _ in range(steps):
        grads = [gradients(x, y, weights["w"], weights["b"]) for x, y in shards]
        weights["w"] = weights["w"] - lr * np.mean([g[0] for g in grads], axis=0)
        weights["b"] = weights["b"] - lr * np.mean([g[1] for g in grads], axis=0)
    return weights


def test_no_delay_is_synchronous_sgd() -> None:
    steps, lr = 12, 0.05
    result = run_ok(WORKERS + SERVERS, "ps_workers:train",
                    {"lr": lr, "max_delay": 0, "steps": steps}, **SERVED)
    expected = synchronous_sgd(steps, lr)
    for w in range(WORKERS):
        got = result.report(w)
        assert got.get("ok"), result.explain()
        assert np.array(got["started"]["w"]) == pytest.approx(start_weights()["w"])
        assert np.array(got["w"]).shape == SHAPES["w"]
        np.testing.assert_allclose(got["w"], expected["w"], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(got["b"], expected["b"], rtol=1e-9, atol=1e-12)
        assert got["leads"] == [0] * steps  # nobody ever ran ahead
    for r in range(WORKERS, WORKERS + SERVERS):
        assert result.report(r) == {}  # servers ran no training code


def test_a_delay_bound_holds_with_a_straggler() -> None:
    steps, tau = 15, 2
    result = run_ok(WORKERS + SERVERS, "ps_workers:train",
                    {"lr": 0.05, "max_delay": tau, "steps": steps, "straggler": 0}, **SERVED)
    leads = {w: result.report(w).get("leads") for w in range(WORKERS)}
    assert all(leads.values()), result.explain()
    # Iteration t starts once every worker has finished t - tau - 1: at most tau + 1
    # iterations between the fastest and the slowest, and the bound is what held the
    # fast workers back (they would otherwise have finished long before the straggler).
    assert max(max(lead) for lead in leads.values()) <= tau + 1, leads
    assert max(max(leads[1]), max(leads[2])) >= 1, leads


def test_unbounded_delay_and_top_k_pushes_still_train() -> None:
    steps = 20
    result = run_ok(WORKERS + SERVERS, "ps_workers:train",
                    {"lr": 0.05, "max_delay": None, "steps": steps,
                     "topk": 0.3}, **SERVED)
    x = np.concatenate([problem(w)[0] for w in range(WORKERS)])
    y = np.concatenate([problem(w)[1] for w in range(WORKERS)])
    start = start_weights()
    before = np.mean((x @ start["w"] + start["b"] - y) ** 2)
    for w in range(WORKERS):
        got = result.report(w)
        assert got.get("ok"), result.explain()
        after = np.mean((x @ np.array(got["w"]) + np.array(got["b"]) - y) ** 2)
        assert after < 0.8 * before, (before, after)


def test_bad_pushes_are_refused_and_change_nothing() -> None:
    result = run_ok(WORKERS + SERVERS, "ps_workers:refusals", {}, **SERVED)
    for w in range(WORKERS):
        got = result.report(w)
        assert got.get("ok"), result.explain()
        bad = got["bad"]
        assert bad["outside"] == (f"ValueError: rank {w}: ps.push('k'): elements [8, 12) "
                                  "are outside the key's [0, 10)"), bad
        assert bad["dtype"] == (f"TypeError: rank {w}: ps.push('k'): gradient dtype "
                                "float64, but the key holds float32"), bad
        assert bad["count"].startswith(f"ValueError: rank {w}: ps.push('k'): 3 values for "
                                       "elements [0, 4)"), bad
        assert bad["unknown"].startswith(f"ValueError: rank {w}: ps.push: no key named "
                                         "'nope'"), bad
        assert bad["fp16_int"].startswith(f"TypeError: rank {w}: ps.push('i'): fp16 "), bad
        assert got["k"] == list(range(10)) and got["unchanged"] == list(range(10))
        # Worker 0's range push of 2.0 x 4 at lr 0.5 over 3 workers: -1/3 on [3, 7).
        expected = np.arange(2, 8, dtype=np.float32)
        expected[1:5] -= np.float32(0.5 / 3 * 2.0)
        np.testing.assert_allclose(got["ranged"], expected, rtol=1e-6)
        assert got["workers"] == WORKERS and got["among"] == [WORKERS] * 3
    clash = result.report(1)["clash"]
    assert clash.startswith("ValueError: rank 1: ps.init('m'): server rank "), clash
    assert ("worker rank 1 has float64 x 5 elements, but worker rank 0 made key 'm' "
            "float32 x 5") in clash, clash


def test_starting_without_servers_says_how_on_every_rank() -> None:
    result = launch(3, "ps_workers:train", {"lr": 0.1, "max_delay": 0, "steps": 1},
                    timeout=60)
    assert result.returncode != 0, result.explain()
    for r in range(3):
        assert any(f"ValueError: rank {r}: ps.start: 0 servers among 3 ranks; start the job "
                   "with totalrun -np N --servers S" in line for line in result.lines(r)), \
            result.explain()


def _through_a_kill(rank: int, max_delay: int | None, steps: int = 8) -> None:
    """Every push is acknowledged before the worker goes on, so the final weights must
    hold every push of every worker exactly once, and only ``rank`` restarted."""
    result = run_ok(WORKERS + SERVERS, "ps_workers:through_a_kill",
                    {"victim": rank, "max_delay": max_delay, "steps": steps}, timeout=120,
                    launcher_args=("--servers", str(SERVERS), "--max-restarts", "1"))
    for key in KILL_KEYS:
        expected = sum(kill_push(key, w, t) for w in range(WORKERS) for t in range(steps))
        for w in range(WORKERS):
            got = result.report(w)
            assert got.get("ok"), result.explain()
            assert got[key] == expected.tolist(), (key, w, result.explain())
    for w in range(WORKERS):
        lives = ["pid0", "pid1"] if w == rank else ["pid0"]
        assert sorted(k for k in result.report(w) if k.startswith("pid")) == lives
    assert result.stderr.count(f"totalrun: rank {rank} (pid") == 1, result.explain()
    assert "job finished after 1 restart(s)" in result.stderr, result.explain()


@pytest.mark.parametrize(("victim", "max_delay"), [(0, 0), (1, None)])
def test_a_killed_server_is_replaced_and_no_acknowledged_push_is_lost(
        victim: int, max_delay: int | None) -> None:
    _through_a_kill(WORKERS + victim, max_delay)


def test_a_killed_workers_replacement_goes_on_where_it_stopped() -> None:
    # Killed between its two pushes of an iteration at max_delay 0: the push held from
    # that iteration is dropped and pushed again by the replacement.
    _through_a_kill(1, 0)
