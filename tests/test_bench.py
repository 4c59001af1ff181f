"""The benchmark tool: its arithmetic on made-up timings, and one real tiny run."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from harness import mpiexec
from totalreduce.bench.models import bert_base_shapes, resnet50_shapes
from totalreduce.bench.report import summarize


def test_model_shapes_match_the_published_parameter_counts() -> None:
    r50, bert = resnet50_shapes(), bert_base_shapes()
    assert (len(r50), sum(math.prod(s) for s in r50)) == (161, 25_557_032)
    assert (len(bert), sum(math.prod(s) for s in bert)) == (199, 109_482_240)


def _job(backend: str, n: int, per_rank_times: list[list[float]]) -> dict:
    return {"backend": backend, "ranks": n, "round": 0, "per_rank": [
        {"rank": r, "results": [{"op": "allreduce", "bytes": 4000, "count": 1000,
                                 "times": ts}]} for r, ts in enumerate(per_rank_times)]}


def test_summary_takes_the_slowest_rank_and_nccl_bus_factors() -> None:
    raw = [_job("mpi", 4, [[1.0, 1.0, 1.0]] * 4),
           _job("totalreduce-shm", 4, [[0.5, 0.1, 0.5], [0.1, 0.5, 0.1], [0.2] * 3,
                                       [0.1] * 3])]
    rows = {r["backend"]: r for r in summarize("collectives", raw)}
    tr = rows["totalreduce-shm"]
    assert tr["median"] == pytest.approx(0.5)   # per rep the slowest rank: 0.5, 0.5, 0.5
    assert tr["algbw"] == pytest.approx(4000 / 0.5 / 1e9)
    assert tr["busbw"] == pytest.approx(tr["algbw"] * 2 * 3 / 4)
    assert tr["speed_vs_mpi"] == pytest.approx(2.0)
    assert rows["mpi"]["speed_vs_mpi"] == pytest.approx(1.0)


@pytest.mark.multiprocess
def test_collectives_command_runs_and_reports_every_backend(tmp_path) -> None:
    backends = ["totalreduce-shm", "totalreduce-tcp"]
    if mpiexec() is not None:
        backends += ["totalreduce-mpi", "mpi"]
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "totalreduce.bench", "collectives", "-n", "2", "--ops",
         "allreduce,alltoall", "--sizes", "4,64K", "--reps-scale", "0.02", "--backends",
         ",".join(backends), "--json", str(out)],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["summary"]
    seen = {(r["backend"], r["op"], r["bytes"]) for r in rows if r["median"] > 0}
    assert seen == {(b, op, s) for b in backends for op in ("allreduce", "alltoall")
                    for s in (4, 65536)}
    for b in backends:
        assert b in proc.stdout
