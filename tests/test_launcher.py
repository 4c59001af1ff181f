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
    # --grace 1: the other rank never calls into totalreduce, so it waits out the grace.
    result = launch(2, "workers:die_on_early_lives", {"victim": 1, "deaths": 2}, timeout=60,
                    launcher_args=("--max-restarts", "1", "--grace", "1"))
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


def _totalrun(*args: str, env: dict[str, str] | None = None
              ) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items()
            if not k.startswith(("TOTALREDUCE_", "TOTALRUN_", "HOROVOD_"))}
    full.update(env or {}, PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "totalreduce.run", *args], env=full,
                          capture_output=True, text=True, timeout=60)


def test_a_program_that_cannot_start_is_one_line(tmp_path) -> None:
    missing = _totalrun("-np", "2", "/no/such/program")
    assert missing.returncode == 127, missing
    assert missing.stderr == ("totalrun: cannot start the workers: /no/such/program: "
                              "no such file\n"), missing.stderr
    unknown = _totalrun("-np", "2", "no-such-command-anywhere")
    assert unknown.returncode == 127 and unknown.stderr.count("\n") == 1, unknown
    assert "no-such-command-anywhere: command not found" in unknown.stderr
    script = tmp_path / "train.sh"
    script.write_text("#!/no/such/interpreter\necho never\n")
    script.chmod(0o644)
    not_executable = _totalrun("-np", "2", str(script))
    assert not_executable.returncode == 126, not_executable
    assert not_executable.stderr.count("\n") == 1 and "not executable" in not_executable.stderr
    script.chmod(0o755)
    bad_interpreter = _totalrun("-np", "2", str(script))
    assert bad_interpreter.returncode == 127, bad_interpreter
    assert bad_interpreter.stderr == (f"totalrun: cannot start the workers: {script}: the "
                                      "interpreter on its #! line was not found\n")


def test_every_wrong_knob_is_one_line_before_anything_starts(tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {"HOROVOD_FUSION_THRESHOLD": "-5", "TOTALREDUCE_CYCLE_TIME_MS": "abc",
           "TOTALREDUCE_CONNECT_TIMEOUT": "-1", "TOTALRUN_GRACE": "soon",
           "TOTALREDUCE_TIMELINE": str(blocker / "t.json")}
    started = tmp_path / "started"
    result = _totalrun("-np", "2", sys.executable, "-c",
                       f"open({str(started)!r}, 'w')", env=env)
    assert result.returncode == 2, result
    assert result.stderr.splitlines() == [
        "totalrun: TOTALRUN_GRACE=soon: must be >= 0 (seconds)",
        "totalrun: TOTALREDUCE_CYCLE_TIME_MS=abc: not a number; must be >= 0 (milliseconds)",
        "totalrun: TOTALREDUCE_CONNECT_TIMEOUT=-1: must be >= 0 (seconds; 0 = no limit)",
        "totalrun: HOROVOD_FUSION_THRESHOLD=-5: must be >= 0 (bytes; 0 = no fusion)",
        f"totalrun: TOTALREDUCE_TIMELINE={blocker}/t.json: {blocker} is not a folder",
    ], result.stderr
    assert not started.exists()


def test_oversubscribed_job_says_so_once() -> None:
    cores = len(os.sched_getaffinity(0))
    result = _totalrun("-np", str(cores + 1), sys.executable, "-c", "pass")
    assert result.returncode == 0, result
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "oversubscribed" in lines[0], result.stderr
    assert lines[0].startswith(f"totalrun: {cores + 1} ranks on {cores} cores"), lines


def test_output_read_by_a_reader_that_stops_early_ends_quietly(tmp_path) -> None:
    # ``totalrun ... | head -2``: the reader goes after two lines; the job still runs to
    # its end (the file it writes last proves it) and totalrun exits 0 with no traceback.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOTALREDUCE_")}
    script = ("import sys, totalreduce as tr, numpy as np; tr.init()\n"
              "for i in range(5000): print('line', i)\n"
              "total = tr.allreduce(np.ones(2), op=tr.Sum, name='end')\n"
              "if tr.rank() == 0: open(sys.argv[1], 'w').write(str(total[0]))\n"
              "tr.shutdown()\n")
    marker = tmp_path / "done"
    proc = subprocess.Popen(
        [sys.executable, "-m", "totalreduce.run", "-np", "2", sys.executable, "-c", script,
         str(marker)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    first = [proc.stdout.readline() for _ in range(2)]
    proc.stdout.close()
    try:
        _out, err = proc.communicate(timeout=JOB_ENDS * 3)
    finally:
        proc.kill()
    assert all(line.startswith(b"[") for line in first), first
    assert proc.returncode == 0, err.decode()
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
    assert marker.read_text() == "2.0"
