"""Run a worker function on N real ranks, with a timeout, over a chosen transport.

Every job's timeout is below pytest-timeout's (300 s, pyproject.toml), so a hung job is
ended here, with every rank's stacks, rather than by pytest without them.

``launch(n, "workers:check_collectives", arg=...)`` starts ``totalrun -np n`` running
``tests/run_worker.py``, which imports ``tests/workers.py`` and calls the function on every
rank.  A hung job is killed after ``timeout`` seconds, but first every rank dumps its
Python stacks (faulthandler) so the failure says where it hung.

``transport`` picks the data path: ``shm`` (totalrun, TCP plus shared-memory rings, the
default), ``tcp`` (totalrun, sockets only), ``mpi`` (mpiexec, the MPI transport) or
``srun`` (no launcher process: the ranks are started directly with the variables srun
sets, ``SLURM_PROCID``/``SLURM_NTASKS``, plus ``TOTALREDUCE_RENDEZVOUS`` and
``TOTALREDUCE_SECRET``, as a SLURM job would; TCP and shared memory).  With ``hosts``
(a :class:`totalreduce.bench.simhosts.SimulatedHosts`), srun's ranks are spread over
simulated hosts.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reporting import read_reports
from totalreduce.bench.simhosts import SimulatedHosts
from totalreduce.launcher.mpiexec import find_mpiexec

HERE = Path(__file__).resolve().parent
TRANSPORTS = ("shm", "tcp", "mpi")

# Ceilings for "fails fast" and "the job ends": far above what the step takes on a loaded
# 2-core machine (under a few seconds), far below what a hang runs into (the job's own
# timeout, or TOTALREDUCE_OP_TIMEOUT).  Tests assert order and outcome; these only catch
# a hang.
PROMPTLY = 20.0
JOB_ENDS = 40.0


mpiexec = find_mpiexec


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    elapsed: float
    reports: dict[int, dict[str, Any]] = field(default_factory=dict)

    def report(self, rank: int) -> dict[str, Any]:
        """What rank ``rank`` reported (reporting.py); empty if it reported nothing."""
        return self.reports.get(rank, {})

    def part(self, name: str) -> Result:
        """This job's result as seen by its part ``name`` (torch_workers.shared): the
        reports that part made, the job's exit and output."""
        return Result(self.returncode, self.stdout, self.stderr, self.elapsed,
                      {r: rep.get(name, {}) for r, rep in self.reports.items()})

    def lines(self, rank: int) -> list[str]:
        out = []
        for ln in (self.stdout + self.stderr).splitlines():
            # totalrun prefixes "[r]: ", run_worker.py under mpiexec "[r] ".
            for prefix in (f"[{rank}]: ", f"[{rank}] "):
                if ln.startswith(prefix):
                    out.append(ln[len(prefix):])
                    break
        return out

    def explain(self) -> str:
        return (f"rc={self.returncode} after {self.elapsed:.1f}s\n--- stdout ---\n"
                f"{self.stdout[-6000:]}\n--- stderr ---\n{self.stderr[-6000:]}")


def launch(n: int, target: str, arg: object = None, *, timeout: float = 60,
           env: dict[str, str] | None = None, launcher_args: tuple[str, ...] = (),
           transport: str = "shm", hosts: SimulatedHosts | None = None) -> Result:
    """``hosts``: start the ranks as srun would (``transport`` is ignored), an equal share
    on each simulated host, in rank order."""
    with tempfile.TemporaryDirectory(prefix="trtest-reports-") as reports:
        result = _launch(n, target, arg, timeout, dict(env or {}, WORKER_REPORT_DIR=reports),
                         launcher_args, "srun" if hosts else transport, hosts)
        result.reports = read_reports(reports)
        return result


def _launch(n: int, target: str, arg: object, timeout: float, env: dict[str, str],
            launcher_args: tuple[str, ...], transport: str,
            hosts: SimulatedHosts | None = None) -> Result:
    full_env = dict(os.environ)
    for key in list(full_env):
        if key.startswith("TOTALREDUCE_"):
            del full_env[key]
    full_env["PYTHONPATH"] = str(HERE) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env["WORKER_STACK_DUMP_AFTER"] = str(max(1.0, timeout - 5))
    full_env.update(env or {})
    worker = [sys.executable, str(HERE / "run_worker.py"), target, json.dumps(arg)]
    if transport == "srun":
        return _launch_srun(n, worker, full_env, timeout, hosts)
    if transport == "mpi":
        exe = mpiexec()
        assert exe is not None, "the mpi transport needs mpi4py and mpiexec"
        full_env["TOTALREDUCE_TRANSPORT"] = "mpi"
        full_env["WORKER_TAG_LINES"] = "1"
        cmd = [exe, "-n", str(n), *launcher_args, *worker]
    else:
        full_env["TOTALREDUCE_TRANSPORT"] = transport
        cmd = [sys.executable, "-m", "totalreduce.run", "-np", str(n), *launcher_args, *worker]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        raise AssertionError(f"job timed out after {timeout}s\n" + Result(
            proc.returncode, out, err, time.monotonic() - start).explain()) from None
    finally:
        # Whatever happened (Ctrl-C in the test run included), nothing of the launcher's
        # group outlives the call; workers in groups of their own are the leak check's.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.wait()
    return Result(proc.returncode, out, err, time.monotonic() - start)


def send_and_drain(sock: socket.socket, data: bytes, timeout: float) -> None:
    """Send ``data``, end our side, and read until the peer closes (or gives up on us,
    which is a clean rejection too)."""
    try:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(timeout)
        while sock.recv(4096):
            pass
    except OSError:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch_srun(n: int, worker: list[str], env: dict[str, str], timeout: float,
                 hosts: SimulatedHosts | None = None) -> Result:
    """Start ``n`` ranks as srun would (each in its own process group), merge their output
    with ``[rank] `` prefixes; the return code is the first non-zero one, as srun's.  With
    ``hosts``, ranks ``r * n // hosts.n`` onwards run on host ``r``."""
    per_host = n // hosts.n if hosts else n
    address = f"{hosts.address(0)}:29400" if hosts else f"127.0.0.1:{_free_port()}"
    env = dict(env, TOTALREDUCE_RENDEZVOUS=address,
               TOTALREDUCE_SECRET=secrets.token_hex(16), SLURM_NTASKS=str(n),
               WORKER_TAG_LINES="1")
    start = time.monotonic()

    def start_rank(r: int) -> subprocess.Popen[str]:
        rank_env = dict(env, SLURM_PROCID=str(r), SLURM_LOCALID=str(r % per_host),
                        SLURM_NODEID=str(r // per_host))
        if hosts:
            return hosts.popen(r // per_host, worker, rank_env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
        return subprocess.Popen(worker, env=rank_env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)

    procs = [start_rank(r) for r in range(n)]
    outs: list[tuple[str, str]] = []
    try:
        deadline = start + timeout
        for proc in procs:
            outs.append(proc.communicate(timeout=max(0.1, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        rest = [p.communicate() for p in procs[len(outs):]]
        out = "".join(o for o, _ in outs + rest)
        err = "".join(e for _, e in outs + rest)
        raise AssertionError(f"job timed out after {timeout}s\n" + Result(
            -9, out, err, time.monotonic() - start).explain()) from None
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    codes = [p.returncode for p in procs]
    rc = next((c for c in codes if c), 0)
    return Result(rc, "".join(o for o, _ in outs), "".join(e for _, e in outs),
                  time.monotonic() - start)


def run_ok(n: int, target: str, arg: object = None, **kw: object) -> Result:
    result = launch(n, target, arg, **kw)  # type: ignore[arg-type]
    assert result.returncode == 0, result.explain()
    return result
