"""What a new user's ordinary mistakes and training patterns must get: flat memory under
varying shapes, loud broadcast disagreements, prompt failure on an exception or a rank
that leaves, Ctrl-C as KeyboardInterrupt, and no orphans."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import HERE, JOB_ENDS, PROMPTLY, TRANSPORTS, Result, launch, mpiexec, run_ok

pytestmark = pytest.mark.multiprocess

ALL_LAUNCHES = ("shm", "tcp", "mpi", "srun")


@pytest.fixture(params=ALL_LAUNCHES)
def launch_kind(request: pytest.FixtureRequest) -> str:
    if request.param == "mpi" and mpiexec() is None:
        pytest.skip("mpi transport: mpi4py/mpiexec not installed (pip install '.[mpi]')")
    return request.param


def test_memory_stays_flat_under_random_sizes_kinds_and_names() -> None:
    # 4 MiB of idle receive buffers at most, and 128 remembered names (a quarter of the
    # ops use a name never seen before), so both bounds are reached during the warm-up.
    # glibc's dynamic mmap threshold serves freed arrays of up to ~1 MB (the test's own
    # inputs and results) from a fragmenting heap afterwards, which moves RSS by tens of
    # MB up or down whatever a library keeps; a fixed threshold shows what is retained.
    # The warm-up is long for the library's fixed-size caches (schedules, specs; a few
    # hundred entries each) too: after 700 ops they still grew 4-6 MB, after 1500 about
    # 2.5-3 MB.  1800 ops after it show a leak.  At 4 ranks, with the scratch pool's
    # eviction switched off every rank grew 7-11 MB, keeping each finished op's handle
    # 325 MB, and even 2 KiB kept per op took every rank past the bound (5.8-6.1 MB).  3
    # ranks (a folded, non-power-of-two world) take two thirds of 4's time and tell as
    # much: with a 1 GiB scratch pool every rank grew 5.5-9.4 MB, with the test's 4 MiB
    # 1.9-2.5 MB.
    ops, warmup, n = 3300, 1500, 3
    result = run_ok(n, "workers:soak", {"seed": 7, "ops": ops, "warmup": warmup},
                    env={"TOTALREDUCE_SCRATCH_BYTES": str(4 << 20),
                         "TOTALREDUCE_NAME_CAPACITY": "128",
                         "MALLOC_MMAP_THRESHOLD_": str(64 << 10)}, timeout=240)
    for r in range(n):
        got = result.report(r)
        warm, end = got["rss_warm_mb"], got["rss_end_mb"]
        # Unbounded tables grew 130-250 KB per op (230+ MB here); the bounded caches that
        # are still filling after the warm-up hold about 3 MB more.
        assert end - warm < 5, f"rank {r} grew {end - warm:.1f} MB over " \
            f"{ops - warmup} ops: {got}"


BROADCAST_VARIANTS = ["every_rank_its_own_root", "last_rank_other_root",
                      "broadcast_against_allreduce"]


@pytest.fixture(scope="module", params=[(n, t) for n in (2, 3) for t in TRANSPORTS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def broadcast_mismatch_job(request: pytest.FixtureRequest) -> tuple[int, Result]:
    """One job per size and transport runs every disagreeing broadcast in turn (the job
    must go on after each, which the worker checks); each variant is still judged by a
    test of its own."""
    n, transport = request.param
    if transport == "mpi" and mpiexec() is None:
        pytest.skip("mpi transport: mpi4py/mpiexec not installed (pip install '.[mpi]')")
    return n, run_ok(n, "workers:broadcast_mismatch", {"variants": BROADCAST_VARIANTS},
                     timeout=90, transport=transport)


@pytest.mark.parametrize("variant", BROADCAST_VARIANTS)
def test_disagreeing_broadcast_raises_on_every_rank(
        variant: str, broadcast_mismatch_job: tuple[int, Result]) -> None:
    n, result = broadcast_mismatch_job
    differs = "kind" if variant == "broadcast_against_allreduce" else "root"
    for r in range(n):
        got = result.report(r).get(f"case:{variant}", {})
        assert not got.get("returned_data") and "mismatch" in got, result.explain()
        msg = got["mismatch"]
        assert got["after_s"] < PROMPTLY, got
        assert f"rank {r}: ranks disagree on broadcast 'weights'" in msg or \
            f"rank {r}: ranks disagree on allreduce 'weights'" in msg, msg
        assert f"differs: {differs}" in msg or f"differs: {differs}," in msg \
            or re.search(rf"differs: [^)]*{differs}", msg), msg
        for other in range(n):
            assert f"rank {other}: kind=" in msg, msg
        assert got["after_ok"], got  # the job went on


def test_exception_on_one_rank_fails_every_rank_fast(launch_kind: str) -> None:
    n, victim = 3, 1
    result = launch(n, "workers:raise_midloop", {"victim": victim}, timeout=60,
                    transport=launch_kind)
    assert result.returncode != 0, result.explain()
    t_raise = result.report(victim)["raising_at"]
    for r in range(n):
        if r == victim:
            continue
        got = result.report(r)
        assert got.get("caught_rank") == victim, result.explain()
        assert "RuntimeError: boom on rank 1" in got["caught"], got
        t_caught = got["caught_at"]
        assert t_caught - t_raise < PROMPTLY, \
            f"rank {r} learned of it after {t_caught - t_raise}s"
    # The failing rank's own traceback, printed once and not buried under the library's.
    own = [ln for ln in result.lines(victim) if "RuntimeError: boom on rank 1" in ln]
    assert len(own) == 1, result.explain()
    assert result.elapsed < JOB_ENDS, result.explain()
    if launch_kind in ("shm", "tcp"):
        assert re.search(rf"rank {victim} \(pid \d+\) failed: exit code 1", result.stderr), \
            result.explain()


def test_rank_leaving_fails_the_ops_that_need_it(transport: str) -> None:
    result = run_ok(3, "workers:leave_midop", {}, timeout=60, transport=transport)
    for r in (0, 2):
        got = result.report(r)
        assert got.get("caught_rank") == 1, result.explain()
        assert got["after_s"] < PROMPTLY, got


def test_a_slow_rank_does_not_hold_up_the_others_shutdown(transport: str) -> None:
    result = run_ok(2, "workers:slow_to_shutdown", {"checkpoint": PROMPTLY}, timeout=60,
                    transport=transport)
    # Rank 1 held back its own shutdown() until rank 0's had returned.
    assert result.report(1)["peer_left_first"] is True, result.explain()
    assert "goodbye" not in result.stderr and "WARNING" not in result.stderr, result.explain()


def _worker_cmd(target: str) -> list[str]:
    return [sys.executable, str(HERE / "run_worker.py"), target, "{}"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOTALREDUCE_")}
    env["PYTHONPATH"] = str(HERE)
    return env


def _wait_for_lines(proc: subprocess.Popen[str], pattern: str, count: int,
                    timeout: float) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while len(seen) < count and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if re.search(pattern, line):
            seen.append(line)
    return seen


@pytest.mark.parametrize("coordination", ["selfguided", "negotiated"])
def test_ctrl_c_reaches_every_rank_as_keyboard_interrupt(coordination: str) -> None:
    n = 3
    proc = subprocess.Popen([sys.executable, "-m", "totalreduce.run", "-np", str(n),
                             *_worker_cmd("workers:interruptible_loop")],
                            env=dict(_env(), TOTALREDUCE_COORDINATION=coordination),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        ready = _wait_for_lines(proc, r"READY", n, 60)
        assert len(ready) == n, ready
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    for r in range(n):
        assert re.search(rf"^\[{r}\]: INTERRUPTED after \d+ steps$", out, re.M), out + err
    assert "Traceback" not in out + err, out + err
    assert "internal error" not in out + err, out + err
    assert proc.returncode == 128 + signal.SIGINT, err


def test_no_worker_outlives_a_killed_launcher(tmp_path: Path) -> None:
    # The workers sit below a shell script: the parent-death signal reaches only the
    # script, so it is the watchdog that must end them, and remove the folder where
    # failing workers leave notes for totalrun.
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\n" + " ".join(_worker_cmd("workers:sleep_forever")[:-1])
                      + " '{}'\necho script-done\n")
    script.chmod(0o755)
    proc = subprocess.Popen([sys.executable, "-m", "totalreduce.run", "-np", "2",
                             str(script)], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        lines = _wait_for_lines(proc, r"PID \d+", 2, 30)
        pids = [int(re.search(r"PID (\d+)", ln).group(1)) for ln in lines]
        notes = {re.search(r"NOTES (\S+)", ln).group(1) for ln in lines}
        assert len(pids) == 2 and len(notes) == 1
        assert all(os.path.isdir(folder) for folder in notes)
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 8
        while (any(_alive(p) for p in pids) or any(map(os.path.exists, notes))) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], "workers outlived the killed launcher"
        assert not [f for f in notes if os.path.exists(f)], "the notes folder outlived it"
    finally:
        for p in pids if "pids" in locals() else []:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        proc.communicate()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or the read
        return False


def test_ctrl_c_that_reaches_one_rank_late_is_still_a_keyboard_interrupt_there() -> None:
    # The other ranks handle theirs 0.6 s earlier and shut down while the last rank's
    # allreduce still needs them; that rank must see its own Ctrl-C, not their leaving.
    result = launch(3, "workers:late_ctrl_c", {"late": 0.6}, timeout=60)
    for r in range(3):
        assert result.report(r).get("interrupted") is True, result.explain()
