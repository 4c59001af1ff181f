"""totalreduce.torch on real ranks: Horovod's API, the DistributedOptimizer, DDP's hook."""

from __future__ import annotations

import re

import pytest

from harness import HERE, Result, launch, run_ok

torch = pytest.importorskip("torch", reason="the torch extra is not installed")

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("n", [2, 3])
def test_collectives_on_tensors(n: int) -> None:
    result = run_ok(n, "torch_workers:collectives", {}, timeout=90)
    for r in range(n):
        assert result.report(r).get("collectives_ok"), result.explain()


@pytest.mark.parametrize("n", [2, 4])
def test_training_matches_one_process_with_the_whole_batch(n: int) -> None:
    cases = [{}, {"momentum": True}, {"passes": 2}, {"fp16": True}]
    result = run_ok(n, "torch_workers:equivalence", {"cases": cases}, timeout=100)
    for r in range(n):
        done = [k for k in result.report(r) if k.startswith("equivalent")]
        assert len(done) == len(cases), result.explain()


def test_optimizer_state_broadcast() -> None:
    result = run_ok(2, "torch_workers:optimizer_state", {}, timeout=60)
    assert result.report(1).get("optimizer_state_ok"), result.explain()


@pytest.mark.parametrize("n", [1, 2, 4])
def test_horovod_script_runs_with_only_the_import_changed(n: int) -> None:
    result = run_ok(n, "torch_workers:horovod_script",
                    {"path": str(HERE / "horovod_script.py")}, timeout=100)
    assert any(ln.startswith(f"done: {n} ranks") for ln in result.lines(0)), result.explain()


def test_reduction_overlaps_backward() -> None:
    result = run_ok(2, "torch_workers:overlap", {}, timeout=90)
    assert result.report(0).get("overlap_early") == 4, result.explain()


@pytest.mark.parametrize("n", [2, 3, 4])
def test_unused_parameter_and_uneven_join(n: int) -> None:
    result = run_ok(n, "torch_workers:unused_and_join", {}, timeout=60)
    for r in range(n):
        assert result.report(r).get("unused_and_join_ok") == n - 2, result.explain()


def test_collective_other_than_allreduce_after_join_fails_loudly() -> None:
    result = run_ok(2, "torch_workers:joined_rank_refuses", {}, timeout=60)
    assert "join()" in result.report(1).get("refused", ""), result.explain()


def test_model_that_differs_on_one_rank_names_the_parameter_everywhere() -> None:
    result = run_ok(3, "torch_workers:model_mismatch", {}, timeout=60)
    for r in range(3):
        msg = result.report(r).get("mismatch", "")
        assert "parameter '0.weight' differs" in msg and "rank 1: (17, 8) float32" in msg, \
            result.explain()


def test_misuse_gets_clear_errors() -> None:
    result = run_ok(1, "torch_workers:misuse", {}, timeout=60)
    assert result.report(0).get("misuse_ok"), result.explain()


def test_ddp_comm_hook_under_totalrun_matches_gloo() -> None:
    result = run_ok(2, "torch_workers:ddp_hook", {}, timeout=90)
    assert result.report(0).get("ddp_hook_ok"), result.explain()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_tensors_are_staged_through_host_memory() -> None:
    result = run_ok(2, "torch_workers:cuda_tensors", {}, timeout=60)
    assert result.report(0).get("cuda_ok"), result.explain()


@pytest.fixture(scope="module")
def first_use() -> Result:
    """One 2-rank job for the checks of a new user's first steps (torch_workers.first_use)."""
    return run_ok(2, "torch_workers:first_use", {}, timeout=90)


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


@pytest.fixture(scope="module")
def parity() -> Result:
    """One 2-rank job for the Horovod parity checks (torch_workers.horovod_parity)."""
    return run_ok(2, "torch_workers:horovod_parity", {}, timeout=90)


def test_totalrun_exports_horovodrun_variables(parity: Result) -> None:
    for r in range(2):
        assert parity.report(r).get("launcher_env") == {
            "HOROVOD_RANK": str(r), "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": str(r),
            "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1",
        }, parity.explain()


def test_horovod_queries_grouped_and_sparse_collectives_and_timeline(parity: Result) -> None:
    for r in range(2):
        assert parity.report(r).get("parity_b"), parity.explain()


def test_integer_tensors_scale_and_average_toward_zero(parity: Result) -> None:
    for r in range(2):
        assert parity.report(r).get("parity_c"), parity.explain()


def test_uneven_alltoall_and_a_name_in_flight_raise_value_error(parity: Result) -> None:
    for r in range(2):
        assert parity.report(r).get("parity_d"), parity.explain()


def test_optimizer_state_created_unnamed_parameters_and_sparse_gradients(
        parity: Result) -> None:
    for r in range(2):
        assert parity.report(r).get("parity_e"), parity.explain()


def test_more_collectives_are_differentiable(parity: Result) -> None:
    for r in range(2):
        assert parity.report(r).get("more_gradients") == [
            "alltoall", "alltoall without splits", "reducescatter Sum",
            "reducescatter Average", "grouped_allgather", "grouped_reducescatter",
        ], parity.explain()
