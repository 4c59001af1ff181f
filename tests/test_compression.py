"""Sparse allreduce (totalreduce.compression) on real ranks: identical outputs, the
conservation identity on every call (published gTopk, which does not conserve: its output,
residuals and loss against a numpy tree merge instead), dense warm-up, measured volume,
and edge cases."""

from __future__ import annotations

import numpy as np
import pytest

from harness import Result, launch
from shared_jobs import SPARSE_OPTIMIZER_ALGS, shared_job

pytestmark = pytest.mark.multiprocess

WORD = 4
# "gtopk" is the published algorithm, "gtopk-exact" GTopk(exact_sums=True).
ALGS = ["oktopk", "topka", "gtopk", "gtopk-exact"]

# Cases that differ only in the algorithm and the input run in one job per world size
# (sparse_workers:sparse_allreduce_cases, each case its own algorithm object and tensor
# name, in the order of _cases), started by the first test that needs it; each case is
# still judged by its own test.  A job's start took longer than most cases.  The long
# buffers' cases have a job of their own.
_JOBS: dict[str, Result] = {}


def _job(group: str, n_ranks: int, cases: dict[str, dict], timeout: float) -> Result:
    if group not in _JOBS:
        _JOBS[group] = launch(n_ranks, "sparse_workers:sparse_allreduce_cases",
                              {"cases": cases}, timeout=timeout)
    return _JOBS[group]


def _sized_job(n_ranks: int) -> Result:
    """The job of every case at ``n_ranks`` ranks (``_cases``) but the long buffers'."""
    return _job(f"{n_ranks} ranks", n_ranks, _cases(n_ranks), timeout=240)


def _cases(n_ranks: int) -> dict[str, dict]:
    """Every case run at ``n_ranks`` ranks but the long buffers', keyed by test.  The
    volume cases run first, as each did in a job of its own: TopkA's every call is
    measured (Ok-Topk's from its third)."""
    cases = {"topka-volume": _topka_volume_case()} if n_ranks in (2, 4) else {}
    cases["oktopk-volume"] = _oktopk_volume_case()
    cases.update({f"identity:{a}": _identity_case(a) for a in ALGS})
    cases.update({f"gtopk:{c}": case for c, case in _gtopk_cases().items()})
    if n_ranks == 2:
        cases.update({f"k1:{a}": _k_of_one_case(a) for a in ALGS})
    if n_ranks == 3:
        cases["oktopk-one-alltoall"] = _one_alltoall_case()
        cases.update({f"edge:{a}-{c}": _edge_case(a, c) for a in ALGS for c in EDGE_CASES})
        cases.update({f"momentum:{a}": _momentum_case(a) for a in ALGS})
    return cases


def _case(result: Result, key: str, n_ranks: int) -> list[dict]:
    """Every rank's report of case ``key``; fails naming the case if it failed or was not
    reached, or if the job failed after it."""
    got = [result.report(r).get(f"case:{key}") for r in range(n_ranks)]
    assert all(g is not None and "error" not in g for g in got), \
        f"case {key}: {got}\n" + result.explain()
    assert result.returncode == 0, result.explain()
    return got  # type: ignore[return-value]


def _words(v: dict) -> float:
    """Payload words a rank sent in one call: bytes less the 64-byte message headers."""
    return (v["bytes_sent"] - 64 * v["messages_sent"]) / WORD


def _recv_words(v: dict) -> float:
    """Payload words a rank received in one call, headers aside as in ``_words``."""
    return (v["bytes_received"] - 64 * v["messages_received"]) / WORD


def _identity_case(alg: str) -> dict:
    kwargs = {"warmup": 2, "tau_local": 4, "tau_global": 4, "tau_region": 8} \
        if alg == "oktopk" else {}
    return {"alg": alg, "n": 20_011, "calls": 12, "density": 0.01, "seed": 3,
            "kwargs": kwargs}


@pytest.mark.parametrize("n_ranks", [2, 3, 4])
@pytest.mark.parametrize("alg", ALGS)
def test_identity_and_identical_outputs(alg: str, n_ranks: int) -> None:
    result = _sized_job(n_ranks)
    for got in _case(result, f"identity:{alg}", n_ranks):
        assert got["worst"] < 1e-5, result.explain()


def _one_alltoall_case() -> dict:
    # pipeline=False: the split-and-reduce in one alltoall instead of P - 1 steps.
    return {"alg": "oktopk", "n": 20_011, "calls": 8, "density": 0.01, "seed": 4,
            "kwargs": {"warmup": 1, "tau_local": 4, "pipeline": False}}


def test_oktopk_in_one_alltoall_keeps_the_identity() -> None:
    result = _sized_job(3)
    for got in _case(result, "oktopk-one-alltoall", 3):
        assert got["worst"] < 1e-5, result.explain()


def _oktopk_volume_case() -> dict:
    return {"alg": "oktopk", "n": 100_000, "calls": 12, "density": 0.01, "seed": 5,
            "kwargs": {"warmup": 1, "tau_local": 4, "tau_global": 4, "tau_region": 64}}


@pytest.mark.parametrize("n_ranks", [2, 3, 4])
def test_oktopk_volume_stays_under_6k(n_ranks: int) -> None:
    case = _oktopk_volume_case()
    k_density, n = case["density"], case["n"]
    result = _sized_job(n_ranks)
    bound = 6 * n * k_density * (n_ranks - 1) / n_ranks
    for r, got in enumerate(_case(result, "oktopk-volume", n_ranks)):
        vols = got["volumes"]
        # Calls that reuse both thresholds and the regions (not the first sparse call,
        # nor every fourth, which recompute the thresholds).
        reuse = [v for v in vols[2:] if (v["call"] - 1) % 4 != 0]
        assert reuse, vols
        for v in reuse:
            assert _words(v) <= bound, (r, v, bound)


def _topka_volume_case() -> dict:
    return {"alg": "topka", "n": 100_000, "calls": 3, "density": 0.01, "seed": 5}


@pytest.mark.parametrize("n_ranks", [2, 4])
def test_topka_volume_grows_with_ranks(n_ranks: int) -> None:
    case = _topka_volume_case()
    result = _sized_job(n_ranks)
    k = case["n"] * case["density"]
    for got in _case(result, "topka-volume", n_ranks):
        for v in got["volumes"]:
            # The ring allgather forwards every rank's k pairs (2 words each) P-1 times.
            assert 0.9 * 2 * k * (n_ranks - 1) <= _words(v) <= 1.1 * 2 * k * (n_ranks - 1), v


def _gtopk_cases() -> dict[str, dict]:
    # Odd lengths, both float widths; "volume" long enough that k dwarfs the splits
    # phases' few words.
    return {"f32": {"alg": "gtopk", "n": 20_011, "calls": 6, "density": 0.01, "seed": 11},
            "f64": {"alg": "gtopk", "n": 7_919, "calls": 6, "density": 0.02, "seed": 12,
                    "dtype": "float64"},
            "volume": {"alg": "gtopk", "n": 100_003, "calls": 3, "density": 0.01,
                       "seed": 13}}


@pytest.mark.parametrize("n_ranks", [2, 3, 4])
@pytest.mark.parametrize("case", ["f32", "f64"])
def test_gtopk_is_the_published_tree_merge(case: str, n_ranks: int) -> None:
    """Output, residuals and the identity's gap equal a numpy tree merge of every rank's
    input (sparse_workers._gtopk_reference, checked on every call inside the worker)."""
    result = _sized_job(n_ranks)
    got = _case(result, f"gtopk:{case}", n_ranks)
    assert got[0]["worst"] < 1e-5
    if n_ranks == 2:
        assert got[0]["lost"] == 0  # the only merge is the last: nothing wins unsummed
    else:
        # Contributions dropped at a merge whose index still won: gone from both the
        # output and every residual (a few percent of what the winners consumed).
        assert 0 < got[0]["lost_fraction"] < 0.2, got[0]


@pytest.mark.parametrize("n_ranks", [2, 3, 4])
def test_gtopk_volume(n_ranks: int) -> None:
    """Each rank sends at most one tree message and one broadcast hop of k pairs (2 words
    each): at most 4k; rank 0 receives k pairs per round, 2k ceil(log2 P)."""
    result = _sized_job(n_ranks)
    per_rank = _case(result, "gtopk:volume", n_ranks)
    rounds = (n_ranks - 1).bit_length()
    for r, got in enumerate(per_rank):
        for v in got["volumes"]:
            k = v["k"]
            assert _words(v) <= 4 * k + 4 * n_ranks * rounds, (r, v)
            if r == 0:
                assert 2 * k * rounds <= _recv_words(v) <= 2 * k * rounds + 4 * n_ranks \
                    * rounds + 8, v


EDGE_CASES = ["silent_rank", "zeros", "ties"]


def _edge_case(alg: str, case: str) -> dict:
    kwargs = {"warmup": 1, "tau_local": 2, "tau_global": 2} if alg == "oktopk" else {}
    return {"alg": alg, "n": 5_003, "calls": 5, "density": 0.02, "seed": 7, "case": case,
            "kwargs": kwargs}


@pytest.mark.parametrize("case", EDGE_CASES)
@pytest.mark.parametrize("alg", ALGS)
def test_edge_cases(alg: str, case: str) -> None:
    _case(_sized_job(3), f"edge:{alg}-{case}", 3)


def _long_buffer_case(alg: str) -> dict:
    # Past 2^24 a float32 no longer holds every integer: an index carried in one would
    # land a value beside its place, and the identity would fail there.
    # TopkA and gTopk have no warm-up: two calls reach a residual.
    return {"alg": alg, "n": (1 << 24) + (1 << 20), "calls": 3 if alg == "oktopk" else 2,
            "density": 1e-4, "seed": 2, "nonzero": 0.01,
            "kwargs": {"warmup": 1} if alg == "oktopk" else {}}


# Each case here costs over 30 s on a loaded 2-core host; gtopk-exact packs its indices
# as gtopk does (index_dtype), which the gtopk case covers.
LONG_ALGS = ["oktopk", "topka", "gtopk"]


@pytest.mark.parametrize("alg", LONG_ALGS)
def test_a_buffer_longer_than_float32_counts_exactly(alg: str) -> None:
    result = _job("long", 2, {a: _long_buffer_case(a) for a in LONG_ALGS}, timeout=240)
    for got in _case(result, alg, 2):
        assert got["worst"] < 1e-5, result.explain()
        assert got["last_nonzero"] >= 1 << 24, got  # some output lies past 2^24


def _k_of_one_case(alg: str) -> dict:
    return {"alg": alg, "n": 999, "calls": 4, "density": 1e-6, "seed": 1,
            "kwargs": {"warmup": 1} if alg == "oktopk" else {}}


@pytest.mark.parametrize("alg", ALGS)
def test_k_of_one(alg: str) -> None:
    assert _case(_sized_job(2), f"k1:{alg}", 2)[0]["volumes"][-1]["k"] == 1


def _torch_part(name: str) -> Result:
    """Part ``name`` of the shared 2-rank torch job (shared_jobs.py)."""
    pytest.importorskip("torch")
    return shared_job(2).part(name)


@pytest.mark.parametrize("alg", SPARSE_OPTIMIZER_ALGS)
def test_distributed_optimizer_with_a_sparse_compressor(alg: str) -> None:
    result = _torch_part("sparse_optimizer")
    for r in range(2):
        assert result.report(r).get(f"sparse_ok:{alg}"), result.explain()


def test_overlapped_buckets_give_the_weights_of_reducing_at_step() -> None:
    result = _torch_part("sparse_overlap")
    for r in range(2):
        got = result.report(r)
        for label in ("none", "oktopk", "topka", "gtopk"):
            assert f"same:{label}" in got, result.explain()
        # Dense at step(), with nothing launched during backward: each bucket a blocking
        # allreduce on the step's thread, none left to the engine's loop.
        assert got["at_step_direct"] >= got["at_step_buckets"] > 0, result.explain()


def test_oktopk_ddp_hook() -> None:
    result = _torch_part("sparse_hook")
    assert result.report(0).get("hook_ok"), result.explain()


def _momentum_case(alg: str) -> dict:
    # Each algorithm with momentum correction and a different mix of the other knobs:
    # dense warm-up then masking (Ok-Topk), DGC's exponential warm-up with local clipping
    # (TopkA), no masking (gTopk as published), masking (gTopk with exact sums).
    kwargs = {"oktopk": {"warmup": 2, "tau_local": 4, "tau_global": 4, "tau_region": 8,
                         "momentum": 0.9},
              "topka": {"warmup": 3, "warmup_mode": "exponential", "momentum": 0.9,
                        "clip_norm": 1.0},
              "gtopk": {"momentum": 0.8, "momentum_masking": False},
              "gtopk-exact": {"momentum": 0.8}}[alg]
    return {"alg": alg, "n": 10_007, "calls": 6, "density": 0.01, "seed": 6,
            "kwargs": kwargs, "roundtrip": True}


@pytest.mark.parametrize("alg", ALGS)
def test_momentum_correction_keeps_the_identity_on_the_velocity(alg: str) -> None:
    """With momentum correction what goes in is the velocity: P * out + the new residuals
    equal the velocities plus the old residuals, the velocity recomputed in numpy (and
    zeroed where the rank's value was sent, with masking) matches the algorithm's, and a
    state_dict round trip carries the velocity: the copy goes on exactly as the original."""
    result = _sized_job(3)
    for got in _case(result, f"momentum:{alg}", 3):
        assert got["worst"] < 1e-5 and got["worst_velocity"] < 1e-6, result.explain()
    if alg == "topka":  # the exponential warm-up's densities: 0.01^(1/4), ^(2/4), ^(3/4)
        ks = [v["k"] for v in _case(result, f"momentum:{alg}", 3)[0]["volumes"]]
        assert ks[:4] == [int(10_007 * 0.01 ** (c / 4)) for c in (1, 2, 3)] + [100], ks


def test_sparse_state_round_trip_keeps_the_velocity() -> None:
    from totalreduce.compression.sparse import State

    state = State(5, np.dtype(np.float32))
    state.residual[:] = [1, 0, 2, 0, 3]
    state.velocity = np.array([0.5, 0, 0, 1, 0], np.float32)
    state.calls, state.stats = 7, {"global_selected": 3}
    back = State.from_dict(state.as_dict())
    assert back.velocity is not None and np.array_equal(back.velocity, state.velocity)
    assert back.velocity.dtype == np.float32 and back.velocity is not state.velocity
    assert np.array_equal(back.residual, state.residual) and back.calls == 7
    assert back.stats == {"global_selected": 3}
    old = {k: v for k, v in state.as_dict().items() if k not in ("velocity", "stats")}
    assert State.from_dict(old).velocity is None  # a checkpoint from before momentum


def test_a_sparse_compression_reduces_small_buckets_whole() -> None:
    result = _torch_part("sparse_small")
    for r in range(2):
        assert result.report(r).get("small_whole"), result.explain()
