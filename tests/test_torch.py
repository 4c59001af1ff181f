"""totalreduce.torch on real ranks: Horovod's API, the DistributedOptimizer, DDP's hook."""

from __future__ import annotations

import re

import pytest

from harness import Result, launch, run_ok
from shared_jobs import EQUIVALENCE_CASES, shared_job

torch = pytest.importorskip("torch", reason="the torch extra is not installed")

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("n", [2, 3])
def test_collectives_on_tensors(n: int) -> None:
    result = shared_job(n).part("collectives")
    for r in range(n):
        assert result.report(r).get("collectives_ok"), result.explain()


@pytest.mark.parametrize("n", [2, 4])
def test_training_matches_one_process_with_the_whole_batch(n: int) -> None:
    result = shared_job(n).part("equivalence")
    for r in range(n):
        done = [k for k in result.report(r) if k.startswith("equivalent")]
        assert len(done) == len(EQUIVALENCE_CASES), result.explain()


@pytest.mark.parametrize("n", [1, 2, 4])
def test_horovod_script_runs_with_only_the_import_changed(n: int) -> None:
    result = shared_job(n).part("script")
    assert any(ln.startswith(f"done: {n} ranks") for ln in result.lines(0)), result.explain()


def test_reduction_overlaps_backward() -> None:
    result = shared_job(2).part("overlap")
    assert result.report(0).get("overlap_early") == 4, result.explain()


def test_autotune_tries_bucket_sizes_and_overlap_and_every_rank_keeps_one() -> None:
    result = shared_job(2).part("autotune")
    for r in range(2):
        assert result.report(r).get("autotune_ok"), result.explain()
    tried = [tuple(t) for t in result.report(0)["tried"]]
    mib = 1 << 20
    # The default first, then each bucket size that changes the plan (1 MiB does for a
    # model of 4.4 MiB in small weights), each with overlap on and off.
    assert tried[:4] == [(16 * mib, True), (16 * mib, False), (mib, True), (mib, False)]
    assert sorted(tried) == sorted({(size, o) for size, _ in tried for o in (True, False)})


@pytest.mark.parametrize("n", [2, 3, 4])
def test_unused_parameter_and_uneven_join(n: int) -> None:
    result = shared_job(n).part("unused_and_join")
    for r in range(n):
        assert result.report(r).get("unused_and_join_ok") == n - 2, result.explain()


def test_collective_other_than_allreduce_after_join_fails_loudly() -> None:
    result = shared_job(2).part("joined")
    assert "join()" in result.report(1).get("refused", ""), result.explain()


def test_model_that_differs_on_one_rank_names_the_parameter_everywhere() -> None:
    result = shared_job(3).part("model_mismatch")
    for r in range(3):
        msg = result.report(r).get("mismatch", "")
        assert "parameter '0.weight' differs" in msg and "rank 1: (17, 8) float32" in msg, \
            result.explain()


def test_misuse_gets_clear_errors() -> None:
    result = shared_job(1).part("misuse")
    assert result.report(0).get("misuse_ok"), result.explain()


def test_ddp_comm_hook_under_totalrun_matches_gloo() -> None:
    result = shared_job(2).part("ddp_hook")
    assert result.report(0).get("ddp_hook_ok"), result.explain()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_tensors_are_staged_through_host_memory() -> None:
    result = run_ok(2, "torch_workers:cuda_tensors", {}, timeout=60)
    assert result.report(0).get("cuda_ok"), result.explain()


@pytest.fixture(scope="module")
def first_use() -> Result:
    """The checks of a new user's first steps (torch_workers.first_use)."""
    return shared_job(2).part("first_use")


def test_collectives_are_differentiable(first_use: Result) -> None:
    for r in range(2):
        assert first_use.report(r).get("gradients_ok") == [
            "allreduce Sum", "allreduce Average", "grouped_allreduce", "allgather",
            "broadcast", "max refused"], first_use.explain()


def test_0d_tensors_keep_their_shape(first_use: Result) -> None:
    for r in range(2):
        assert len(first_use.report(r).get("scalars", [])) == 7, first_use.explain()


def test_ddp_hook_error_names_the_op_and_each_ranks_shape(first_use: Result) -> None:
    for r in range(2):
        rep = first_use.report(r)
        error = rep.get("error", "")
        assert "allreduce 'ddp.bucket0'" in error, first_use.explain()
        assert "differs: shape" in error, first_use.explain()
        assert re.search(r"rank 0: .*shape=\(467,\)", error), first_use.explain()  # all
        assert re.search(r"rank 1: .*shape=\(3,\)", error), first_use.explain()
        assert any("bucket_cap_mb" in n for n in rep.get("notes", [])), first_use.explain()
        assert rep.get("went_on"), first_use.explain()


def test_launcher_names_the_rank_that_raised_in_its_ddp_hook() -> None:
    # The raising rank is made to exit 1.5 s after the others (and the others get no
    # follower delay): who exits first would name the wrong rank.
    result = launch(2, "torch_workers:ddp_errors",
                    {"case": "raise", "victim": 1, "slow_victim": True}, timeout=60)
    assert result.returncode == 1, result.explain()
    assert re.search(r"totalrun: rank 1 \(pid \d+\) failed", result.stderr), result.explain()
    assert re.search(r"^\s+1\s+\d+\s+exit code 1\s+<- first failure \(root cause\)$",
                     result.stderr, re.M), result.explain()
    assert "ValueError: rank 1: bad gradient bucket at step 3" in result.stderr
    assert any("PeerFailureError" in ln for ln in result.lines(0)), result.explain()


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def parity(request: pytest.FixtureRequest) -> Result:
    """The Horovod parity checks (parity_workers.horovod_parity) at each world size, 3 ranks
    catching what only an odd world shows (uneven splits, Adasum's folded rank)."""
    return shared_job(request.param).part("parity")


def _ranks(result: Result) -> range:
    return range(int(result.report(0)["launcher_env"]["HOROVOD_SIZE"]))


def test_totalrun_exports_horovodrun_variables(parity: Result) -> None:
    n = len(_ranks(parity))
    for r in _ranks(parity):
        assert parity.report(r).get("launcher_env") == {
            "HOROVOD_RANK": str(r), "HOROVOD_SIZE": str(n), "HOROVOD_LOCAL_RANK": str(r),
            "HOROVOD_LOCAL_SIZE": str(n), "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1",
        }, parity.explain()


def test_horovod_queries_grouped_and_sparse_collectives_and_timeline(parity: Result) -> None:
    for r in _ranks(parity):
        assert parity.report(r).get("parity_b"), parity.explain()


def test_integer_tensors_scale_and_average_toward_zero(parity: Result) -> None:
    for r in _ranks(parity):
        assert parity.report(r).get("parity_c"), parity.explain()


def test_repeated_blocking_broadcasts_match_and_run_from_repeats(parity: Result) -> None:
    for r in _ranks(parity):
        assert parity.report(r).get("parity_f", 0) > 0, parity.explain()


def test_repeated_blocking_gathers_and_reducescatters_match_and_run_from_repeats(
        parity: Result) -> None:
    for r in _ranks(parity):
        assert parity.report(r).get("parity_g", 0) > 0, parity.explain()


def test_uneven_alltoall_and_a_name_in_flight_raise_value_error(parity: Result) -> None:
    for r in _ranks(parity):
        assert parity.report(r).get("parity_d"), parity.explain()


def test_optimizer_state_broadcast(parity: Result) -> None:
    for r in _ranks(parity):
        assert parity.report(r).get("optimizer_state_ok"), parity.explain()


def test_optimizer_state_created_unnamed_parameters_and_sparse_gradients(
        parity: Result) -> None:
    for r in _ranks(parity):
        assert parity.report(r).get("parity_e"), parity.explain()


def test_more_collectives_are_differentiable(parity: Result) -> None:
    for r in _ranks(parity):
        assert parity.report(r).get("more_gradients") == [
            "alltoall", "alltoall without splits", "reducescatter Sum",
            "reducescatter Average", "grouped_allgather", "grouped_reducescatter",
        ], parity.explain()


ADASUM_CASES = [f"Adasum {d} {s}" for d in ("torch.float32", "torch.float64")
                for s in ("(7,)", "(3, 5)", "(1,)", "(2, 3, 3)")]


def test_adasum_matches_the_numpy_reference(parity: Result) -> None:
    for r in _ranks(parity):
        assert parity.report(r).get("adasum") == ADASUM_CASES, parity.explain()


def test_adasum_at_4_ranks_two_tree_levels() -> None:
    result = shared_job(4).part("parity")
    for r in range(4):
        assert result.report(r).get("adasum") == ADASUM_CASES, result.explain()


def test_distributed_optimizer_with_adasum_combines_each_parameter(parity: Result) -> None:
    for r in _ranks(parity):
        assert parity.report(r).get("adasum_optimizer"), parity.explain()


def test_sync_batch_norm_equals_batch_norm_over_the_global_batch(parity: Result) -> None:
    for r in _ranks(parity):
        assert len(parity.report(r).get("sync_batch_norm", [])) == 5, parity.explain()
