"""totalrun: environment, output prefixes, failure reporting, signals, no orphans."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from harness import HERE, JOB_ENDS, launch

pytestmark = pytest.mark.multiprocess


def test_max_restarts_restarts_only_the_dead_rank_with_the_same_rank() -> None:
    result = launch(3, "workers:die_on_early_lives", {"victim": 1, "deaths": 2}, timeout=60,
                    launcher_args=("--max-restarts", "2"))
    assert result.returncode == 0, result.explain()
    victim = result.report(1)
    assert set(victim) == {"life0", "life1", "life2"}, victim
    assert len(set(victim.values())) == 3  # a new process each life
    for r in (0, 2):  # the others were never restarted
        assert set(result.report(r)) == {"life0"}, result.explain()
    assert "restarting it (1/2 restarts of this rank)" in result.stderr, result.explain()
    assert "restarting it (2/2 restarts of this rank)" in result.stderr, result.explain()
    assert "job finished after 2 restart(s)" in result.stderr, result.explain()


def test_a_rank_that_has_used_its_restarts_ends_the_job() -> None:
    result = launch(2, "workers:die_on_early_lives", {"victim": 1, "deaths": 2}, timeout=60,
                    launcher_args=("--max-restarts", "1"))
    assert result.returncode == 128 + signal.SIGKILL, result.explain()
    assert re.search(r"1\s+\d+\s+killed by SIGKILL\s+\(restarted\)", result.stderr), \
        result.explain()
    assert re.search(r"1\s+\d+\s+killed by SIGKILL\s+<- first failure", result.stderr), \
        result.explain()


def test_env_and_prefixed_output_and_exit_code() -> None:
    result = launch(3, "workers:exit_with", {"rank": 2, "code": 7, "others_sleep": 0.2},
                    timeout=30)
    assert result.returncode == 7, result.explain()
    for r in range(3):
        assert result.report(r) == {"env_rank": r, "env_size": 3}, result.explain()
    assert re.search(r"rank 2 \(pid \d+\) failed: exit code 7", result.stderr)


def test_worker_failure_stops_the_others() -> None:
    # Ranks 0 and 1 would sleep 100 s; rank 1 failing must end the job within grace + kill.
    result = launch(3, "workers:exit_with", {"rank": 1, "code": 2, "others_sleep": 100},
                    timeout=30, launcher_args=("--grace", "1"))
    assert result.returncode == 2, result.explain()
    assert result.elapsed < JOB_ENDS, result.explain()
    assert "<- first failure (root cause)" in result.stderr


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


@pytest.mark.parametrize("ignore_term", [False, True])
def test_sigterm_is_forwarded_and_no_orphans_remain(ignore_term: bool) -> None:
    env = dict(os.environ, PYTHONPATH=str(HERE))
    proc = subprocess.Popen(
        [sys.executable, "-m", "totalreduce.run", "-np", "2", "--grace", "0.5",
         sys.executable, str(HERE / "run_worker.py"), "workers:sleep_forever",
         '{"ignore_term": %s}' % ("true" if ignore_term else "false")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = []
    deadline = time.monotonic() + 20
    while len(pids) < 2 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        m = re.search(r"PID (\d+)", line)
        if m:
            pids.append(int(m.group(1)))
    assert len(pids) == 2
    proc.send_signal(signal.SIGTERM)
    try:
        _out, err = proc.communicate(timeout=15)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode != 0
    assert "received SIGTERM; forwarding it" in err
    time.sleep(0.2)
    assert not [p for p in pids if _alive(p)], "orphan workers remain"
