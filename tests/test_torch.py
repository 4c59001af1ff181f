"""totalreduce.torch on real ranks: Horovod's API, the DistributedOptimizer, DDP's hook."""

from __future__ import annotations

import pytest

from harness import HERE, run_ok

torch = pytest.importorskip("torch", reason="the torch extra is not installed")

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("n", [2, 3])
def test_collectives_on_tensors(n: int) -> None:
    result = run_ok(n, "torch_workers:collectives", {}, timeout=90)
    for r in range(n):
        assert "collectives ok" in result.lines(r), result.explain()


@pytest.mark.parametrize("n", [2, 4])
def test_training_matches_one_process_with_the_whole_batch(n: int) -> None:
    cases = [{}, {"momentum": True}, {"passes": 2}, {"fp16": True}]
    result = run_ok(n, "torch_workers:equivalence", {"cases": cases}, timeout=100)
    for r in range(n):
        assert sum(ln.startswith("equivalent") for ln in result.lines(r)) == len(cases), \
            result.explain()


def test_optimizer_state_broadcast() -> None:
    result = run_ok(2, "torch_workers:optimizer_state", {}, timeout=60)
    assert "optimizer state ok" in result.lines(1), result.explain()


@pytest.mark.parametrize("n", [1, 2, 4])
def test_horovod_script_runs_with_only_the_import_changed(n: int) -> None:
    result = run_ok(n, "torch_workers:horovod_script",
                    {"path": str(HERE / "horovod_script.py")}, timeout=100)
    assert any(ln.startswith(f"done: {n} ranks") for ln in result.lines(0)), result.explain()


def test_reduction_overlaps_backward() -> None:
    result = run_ok(2, "torch_workers:overlap", {}, timeout=90)
    assert any(ln.startswith("overlap early=4") for ln in result.lines(0)), result.explain()


@pytest.mark.parametrize("n", [2, 3, 4])
def test_unused_parameter_and_uneven_join(n: int) -> None:
    result = run_ok(n, "torch_workers:unused_and_join", {}, timeout=60)
    for r in range(n):
        assert f"unused and join ok {n - 2}" in result.lines(r), result.explain()


def test_collective_other_than_allreduce_after_join_fails_loudly() -> None:
    result = run_ok(2, "torch_workers:joined_rank_refuses", {}, timeout=60)
    assert any(ln.startswith("refused:") for ln in result.lines(1)), result.explain()


def test_model_that_differs_on_one_rank_names_the_parameter_everywhere() -> None:
    result = run_ok(3, "torch_workers:model_mismatch", {}, timeout=60)
    for r in range(3):
        lines = [ln for ln in result.lines(r) if ln.startswith("mismatch:")]
        assert lines and "parameter '0.weight' differs" in lines[0] and \
            "rank 1: (17, 8) float32" in lines[0], result.explain()


def test_misuse_gets_clear_errors() -> None:
    result = run_ok(1, "torch_workers:misuse", {}, timeout=60)
    assert "misuse ok" in result.lines(0), result.explain()


def test_ddp_comm_hook_under_totalrun_matches_gloo() -> None:
    result = run_ok(2, "torch_workers:ddp_hook", {}, timeout=90)
    assert "ddp hook ok" in result.lines(0), result.explain()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_tensors_are_staged_through_host_memory() -> None:
    result = run_ok(2, "torch_workers:cuda_tensors", {}, timeout=60)
    assert "cuda ok" in result.lines(0), result.explain()
