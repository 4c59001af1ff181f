"""The benchmark tool: its arithmetic on made-up timings, and one real tiny run."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import totalreduce
from harness import mpiexec
from totalreduce.bench.buffers import float32s
from totalreduce.bench.compare import compare
from totalreduce.bench.models import bert_base_shapes, resnet50_shapes
from totalreduce.bench.report import print_table, summarize


def test_model_shapes_match_the_published_parameter_counts() -> None:
    r50, bert = resnet50_shapes(), bert_base_shapes()
    assert (len(r50), sum(math.prod(s) for s in r50)) == (161, 25_557_032)
    assert (len(bert), sum(math.prod(s) for s in bert)) == (199, 109_482_240)


def test_the_commit_a_result_names_says_when_the_tree_differs_from_it(tmp_path) -> None:
    # A copy of the package in a repository of its own: committed as it is, then with a
    # change the commit lacks.
    pkg = Path(totalreduce.__file__).parent
    shutil.copytree(pkg, tmp_path / "src" / "totalreduce",
                    ignore=shutil.ignore_patterns("__pycache__"))
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "copy"], check=True)
    ask = [sys.executable, "-c", "from totalreduce.bench.__main__ import _machine; "
           "print(_machine()['commit'])"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "src")}

    def commit() -> str:
        return subprocess.run(ask, env=env, capture_output=True, text=True, check=True,
                              timeout=60).stdout.strip()

    clean = commit()
    assert clean and not clean.endswith("+modified"), clean
    with open(tmp_path / "src" / "totalreduce" / "version.py", "a") as f:
        f.write("# changed\n")
    assert commit() == clean + "+modified"


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


def test_compare_flags_cells_more_than_a_fifth_slower_by_their_ratio_to_mpi(tmp_path) -> None:
    def row(backend: str, nbytes: int, median: float, vs_mpi: float | None) -> dict:
        return {"op": "allreduce", "bytes": nbytes, "count": nbytes // 4, "ranks": 2,
                "backend": backend, "median": median, "speed_vs_mpi": vs_mpi}

    old = tmp_path / "old.json"
    old.write_text(json.dumps({"summary": [row("totalreduce-shm", 8, 1.0, 1.0),
                                           row("totalreduce-shm", 1024, 1.0, 2.0),
                                           row("totalreduce-shm", 4096, 1.0, 1.0),
                                           row("gone", 8, 1.0, 1.0)]}))
    # The host got twice as slow (medians doubled) but the ratios tell the story: 8 B
    # lost a quarter of its speed against MPI, 1 KiB lost a tenth, 4 KiB gained.
    new = [row("totalreduce-shm", 8, 2.0, 0.75), row("totalreduce-shm", 1024, 2.0, 1.8),
           row("totalreduce-shm", 4096, 2.0, 1.5), row("new", 8, 1.0, 1.0)]
    got = {e["cell"].split("bytes=")[1].split(",")[0]: e for e in compare(new, str(old))}
    assert set(got) == {"8", "1024", "4096"}
    assert got["8"]["flagged"] and got["8"]["slowdown"] == pytest.approx(1 / 0.75 - 1)
    assert not got["1024"]["flagged"] and not got["4096"]["flagged"]
    assert got["4096"]["slowdown"] < 0


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
    # The run compared with itself: every cell found, none flagged.
    again = compare(json.loads(out.read_text())["summary"], str(out))
    assert len(again) == 2 * 2 * len(backends)
    assert not any(e["flagged"] for e in again)
    rows = json.loads(out.read_text())["summary"]
    seen = {(r["backend"], r["op"], r["bytes"]) for r in rows if r["median"] > 0}
    assert seen == {(b, op, s) for b in backends for op in ("allreduce", "alltoall")
                    for s in (4, 65536)}
    for b in backends:
        assert b in proc.stdout



def test_huge_arrays_start_on_a_huge_page_and_hold_what_numpys_would() -> None:
    for count in (0, 1, 1000, (3 << 20) // 4 + 5):
        ones = float32s(count, "huge")
        assert ones.dtype == np.float32 and ones.shape == (count,)
        assert np.array_equal(ones, np.ones(count))
        assert count == 0 or ones.ctypes.data % (2 << 20) == 0
        assert ones.flags.c_contiguous and ones.flags.writeable
        assert float32s(count, "huge", None).shape == (count,)
        assert np.array_equal(float32s(count, "numpy"), ones)
    with pytest.raises(ValueError, match="huge"):
        float32s(4, "hugh")


def test_collectives_with_huge_arrays_run_every_backend_and_say_so() -> None:
    backends = ["totalreduce-shm"] + (["mpi"] if mpiexec() is not None else [])
    proc = subprocess.run(
        [sys.executable, "-m", "totalreduce.bench", "collectives", "-n", "2", "--ops",
         "allgather,alltoall,broadcast", "--sizes", "4,3M", "--reps-scale", "0.02",
         "--backends", ",".join(backends), "--arrays", "huge"],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "arrays: huge" in proc.stdout
    rows = {tuple(line.split()[:4]) for line in proc.stdout.splitlines()}
    for b in backends:
        for op in ("allgather", "alltoall", "broadcast"):
            assert (op, "2", "3M", b) in rows, proc.stdout

@pytest.mark.multiprocess
@pytest.mark.skipif(mpiexec() is None, reason="needs mpi4py and mpiexec")
def test_floor_command_times_every_exchange_and_checks_their_sums(tmp_path) -> None:
    out = tmp_path / "floor.json"
    # 24 KiB halves in 5000-byte pieces: a short last piece, and the rings wrap; then a
    # smaller call after it, which must not take the counts of the bigger one for its own.
    # Each call's result is checked in the job, element by element, against the sum.
    proc = subprocess.run(
        [sys.executable, "-m", "totalreduce.bench", "floor", "--sizes", "48K,8,40",
         "--piece", "5000", "--reps", "3", "--json", str(out)],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["bytes"] for r in rows] == [48 << 10, 8, 40]
    want = {"mpi", "totalreduce", "bare ring"} | ({"bare cma"} if result["bare_cma"] else set())
    for row in rows:
        assert set(row["ms"]) == want
        assert all(ms > 0 for ms in row["ms"].values())
    assert "bare ring" in proc.stdout
    assert result["bare_cma"] or "no bare cma" in proc.stderr


def test_convergence_summary_merges_ranks_and_finds_the_epoch_that_reaches_the_target(
        ) -> None:
    from totalreduce.bench.curves import summarize_curves

    def job(backend: str, mode: str, accs: list[float], sent: list[list[float]]) -> dict:
        return {"backend": backend, "ranks": 2, "round": 0, "per_rank": [
            {"rank": r, "results": [{"mode": mode, "curve": [
                {"epoch": e + 1, "accuracy": a, "bytes_sent": s[e], "seconds": 1.0 + r}
                for e, a in enumerate(accs)]}]} for r, s in enumerate(sent)]}

    raw = [job("totalreduce-shm", "dense", [0.90, 0.95, 0.97], [[10, 20, 30], [12, 22, 32]]),
           job("totalreduce-shm", "oktopk 0.01", [0.80, 0.955, 0.96], [[1, 2, 3], [3, 4, 5]])]
    rows = {r["mode"]: r for r in summarize_curves(raw)}
    assert rows["dense"]["target"] == pytest.approx(0.96)
    assert rows["dense"]["epochs_to_target"] == 3
    sparse = rows["oktopk 0.01"]
    assert sparse["epochs_to_target"] == 3  # 95.5% at epoch 2 is short of 96%
    assert sparse["mb_to_target"] == pytest.approx(4e-6)  # the ranks' mean: (3 + 5) / 2
    assert [p["seconds"] for p in sparse["curve"]] == [2.0, 2.0, 2.0]  # the slowest rank


def test_train_summary_pools_compute_only_and_computes_the_hidden_share() -> None:
    """Step, compute-only and communication-alone times (the slowest rank's per rep) give
    the speed against DDP and against dense, and 1 - (step - compute) / alone."""
    def job(backend: str, rows: list[tuple[str, list[list[float]], list[list[float]]]],
            versus: str | None = None) -> dict:
        def item(mode: str, times: list[float], alone: list[float]) -> dict:
            out = {"model": "mlp", "mode": mode, "batch": 8, "times": times}
            if alone:
                out["alone"] = alone
            if versus and mode.startswith(("oktopk", "optimizer,")):
                out["versus"] = versus
            return out
        return {"backend": backend, "ranks": 2, "round": 0, "per_rank": [
            {"rank": r, "results": [item(m, ts[r], al[r] if al else []) for m, ts, al in rows]}
            for r in range(2)]}

    raw = [job("totalreduce-shm", [("compute only", [[1.0, 1.0], [0.9, 1.2]], []),
                                   ("optimizer 16MB", [[1.4, 1.2], [1.2, 1.2]],
                                    [[0.8, 0.8], [0.8, 0.8]]),
                                   ("oktopk 0.01", [[2.0, 2.0], [2.0, 2.0]],
                                    [[2.0, 2.0], [1.0, 1.0]])], versus="optimizer 16MB"),
           job("gloo", [("compute only", [[1.0, 1.0], [1.0, 1.0]], []),
                        ("DDP", [[2.6, 2.6], [2.6, 2.6]], [[1.0, 1.0], [1.0, 1.0]])])]
    rows = {(r["backend"], r["mode"]): r for r in summarize("train", raw)}
    compute = rows[("any", "compute only")]
    assert compute["median"] == pytest.approx(1.0)  # slowest per rep: 1.0, 1.2, 1.0, 1.0
    dense = rows[("totalreduce-shm", "optimizer 16MB")]
    assert dense["median"] == pytest.approx(1.3)    # slowest per rep: 1.4, 1.2
    assert dense["samples_per_s"] == pytest.approx(16 / 1.3)
    assert dense["speed_vs_ddp"] == pytest.approx(2.6 / 1.3)
    assert dense["hidden"] == pytest.approx(1 - (1.3 - 1.0) / 0.8)
    sparse = rows[("totalreduce-shm", "oktopk 0.01")]
    assert sparse["speed_vs_dense"] == pytest.approx(1.3 / 2.0)
    assert sparse["hidden"] == pytest.approx(0.5)   # 1.0 s over compute, of 2.0 s alone
    ddp = rows[("gloo", "DDP")]
    assert ddp["hidden"] == pytest.approx(1 - 1.6 / 1.0)  # below zero: worse than serial
    assert ddp["speed_vs_dense"] is None


def test_latency_is_each_calls_time_against_mpis_for_the_same_op(
        capsys: pytest.CaptureFixture[str]) -> None:
    def job(backend: str, allreduce: list[list[float]], barrier: list[list[float]]) -> dict:
        return {"backend": backend, "ranks": 2, "round": 0, "per_rank": [
            {"rank": r, "results": [{"mode": "allreduce 8 B", "times": allreduce[r]},
                                    {"mode": "barrier", "times": barrier[r]}]}
            for r in range(2)]}

    raw = [job("mpi", [[4e-6] * 3, [5e-6] * 3], [[3e-6] * 3] * 2),
           job("totalreduce-shm", [[20e-6, 30e-6, 20e-6], [10e-6, 10e-6, 40e-6]],
               [[30e-6] * 3] * 2)]
    rows = {(r["backend"], r["mode"]): r for r in summarize("latency", raw)}
    ours = rows[("totalreduce-shm", "allreduce 8 B")]
    assert ours["median"] == pytest.approx(30e-6)  # the slowest rank: 20, 30, 40 us
    assert ours["time_vs_mpi"] == pytest.approx(30 / 5)  # MPI's slowest rank: 5 us
    assert rows[("totalreduce-shm", "barrier")]["time_vs_mpi"] == pytest.approx(10.0)
    print_table("latency", list(rows.values()))
    assert "6.00x" in capsys.readouterr().out


def test_preempt_sets_each_op_during_the_big_one_against_itself_after_the_same_delay(
        capsys: pytest.CaptureFixture[str]) -> None:
    def job(backend: str, results: list[tuple[str, list[float]]]) -> dict:
        return {"backend": backend, "ranks": 2, "round": 0, "per_rank": [
            {"rank": r, "results": [{"mode": m, "times": t} for m, t in results]}
            for r in range(2)]}

    raw = [job("mpi", [("small alone", [1e-5] * 3), ("small alone after the delay", [5e-5] * 3),
                       ("during big (no priorities)", [2e-2] * 3)]),
           job("totalreduce-shm", [("small alone", [3e-5] * 3),
                                   ("small alone after the delay", [1e-4, 2e-4, 1e-4]),
                                   ("during big, priority on", [3e-4] * 3),
                                   ("during big, priority off", [1.5e-2] * 3)])]
    rows = {(r["backend"], r["mode"]): r for r in summarize("preempt", raw)}
    assert rows[("mpi", "during big (no priorities)")]["time_vs_alone"] == pytest.approx(400)
    ours = rows[("totalreduce-shm", "during big, priority on")]
    assert ours["time_vs_alone"] == pytest.approx(3.0)  # the median alone: 100 us
    assert rows[("totalreduce-shm", "during big, priority off")]["time_vs_alone"] == (
        pytest.approx(150))
    assert "time_vs_alone" not in rows[("totalreduce-shm", "small alone")]
    print_table("preempt", list(rows.values()))
    assert "3.00x" in capsys.readouterr().out


def test_tiny_shows_both_scheduling_modes_by_default(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    """What ``python -m totalreduce.bench tiny`` runs and prints without --backends: the
    rows of the table docs/BENCHMARKS.md quotes, with the modes said."""
    from totalreduce.bench.__main__ import chosen_backends

    chosen = chosen_backends("tiny", None)
    assert chosen == ["totalreduce-shm", "totalreduce-neg", "totalreduce-neg-nocache",
                      "totalreduce-neg-nofusion", "mpi", "gloo"]
    assert "ddp-hook" not in chosen_backends("collectives", None)
    raw = [{"backend": b, "ranks": 2, "round": 0, "per_rank": [
        {"rank": r, "results": [{"mode": "1000 x 4 B async", "count": 1000,
                                 "times": [1e-3 * (i + 1)] * 3}]} for r in range(2)]}
           for i, b in enumerate(chosen)]
    print_table("tiny", summarize("tiny", raw))
    out = capsys.readouterr().out
    for b in chosen:
        assert f"2  {b} " in out, out
    assert "totalreduce-shm/-tcp/-mpi self-guided" in out
    assert "totalreduce-neg negotiated" in out


def test_hosts_bench_runs_flat_and_hierarchical_on_simulated_hosts() -> None:
    from totalreduce.bench.hosts import link_bound
    from totalreduce.bench.simhosts import unavailable

    # 64 MiB over 1 Gbit/s between 2 hosts: each host sends the buffer once.
    assert link_bound(64 << 20, 2, 10**9) == pytest.approx(0.537, abs=1e-3)
    why = unavailable()
    if why:
        pytest.skip(why)
    done = subprocess.run([sys.executable, "-m", "totalreduce.bench", "hosts", "--sizes",
                           "256K", "--reps", "2", "--rounds", "1", "--link", "10gbit"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()
            if line.strip().split(" ")[0].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [("262144", "flat"), ("262144", "hierarchical")]
    assert all(float(r[2]) > 0 for r in rows), done.stdout


DOCS_BENCH = Path(__file__).resolve().parents[1] / "docs" / "bench"


def test_bench_outputs_are_read_by_column(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/bench/bench_tables.py, which the page's sentences quote the tables through: a cell
    holding spaces stays whole, a header naming a column twice numbers the second, and a
    lookup that matches no row or several says so."""
    monkeypatch.syspath_prepend(str(DOCS_BENCH))
    from bench_tables import find, num, rows, span

    row = find("latency", n="2", op="allreduce 8 B", backend="mpi")
    assert row["time / mpi"] == "1.00x" and num(row["median us"]) > 0
    speeds = [num(r["speed vs mpi"]) for r in rows("collectives-2") if r["backend"] == "mpi"]
    assert speeds and set(speeds) == {1.0}
    assert {"accuracy", "accuracy 2"} <= set(rows("ps")[0])
    with pytest.raises(LookupError, match="0 rows"):
        find("latency", op="no such op")
    with pytest.raises(LookupError, match="rows match"):
        find("latency", backend="mpi")
    assert (num("55,164"), num("97.33%"), num("0.075 (1.58x)")) == (55164, 97.33, 0.075)
    assert (span([1.5, 0.25]), span([2.0, 2.0], unit="x")) == ("0.25-1.50", "2.00x")


def test_the_benchmarks_page_is_what_make_page_builds(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/BENCHMARKS.md is rebuilt from docs/bench/*.txt, not edited: its sentences
    quote the tables, so a table changed without the page (or the page without the
    tables) shows here."""
    monkeypatch.syspath_prepend(str(DOCS_BENCH))
    import make_page

    monkeypatch.setattr(make_page, "PAGE", tmp_path / "BENCHMARKS.md")
    make_page.main()
    assert (tmp_path / "BENCHMARKS.md").read_text() == \
        (DOCS_BENCH.parent / "BENCHMARKS.md").read_text()
