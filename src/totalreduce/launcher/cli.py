"""totalrun — start N workers on this host and supervise them.

Usage::

    totalrun -np 4 python train.py --epochs 3
    python -m totalreduce.run -np 4 python train.py

Every worker gets these environment variables (``init()`` reads them):

=========================  ==============================================================
TOTALREDUCE_RANK           0 .. N-1
TOTALREDUCE_SIZE           N
TOTALREDUCE_LOCAL_RANK     same as the rank (all workers are on this host)
TOTALREDUCE_LOCAL_SIZE     N
TOTALREDUCE_RENDEZVOUS     host:port of the launcher's authenticated address store
TOTALREDUCE_SECRET         a fresh random job secret; every connection must prove it
TOTALREDUCE_JOB_ID         a fresh random job id
TOTALREDUCE_FAILURE_DIR    where a rank that dies of an uncaught exception notes whether
                           it failed on its own or because another rank did
TOTALREDUCE_MAX_RESTARTS   the ``--max-restarts`` value (init() turns recovery on when > 0)
TOTALREDUCE_SERVERS        the ``--servers`` value, where given (totalreduce.ps)
TOTALREDUCE_ATTEMPT        0 in a worker's first life, 1 after its first restart, ...
RANK, WORLD_SIZE,          what ``torch.distributed``'s ``env://`` init reads, so that
LOCAL_RANK,                ``init_process_group("gloo")`` (DDP, with or without
LOCAL_WORLD_SIZE,          ``totalreduce.torch.ddp_comm_hook``) works under totalrun too;
MASTER_ADDR, MASTER_PORT   the port is one that was free on 127.0.0.1 at launch
HOROVOD_RANK,              what ``horovodrun`` sets, for scripts that read them before
HOROVOD_SIZE,              ``init()``: the rank, N, the rank, N, 0 and 1 (one host)
HOROVOD_LOCAL_RANK,
HOROVOD_LOCAL_SIZE,
HOROVOD_CROSS_RANK,
HOROVOD_CROSS_SIZE
=========================  ==============================================================

Before it starts a worker, totalrun checks what it can: every ``TOTALREDUCE_*`` setting
(and the Horovod variables read in their place), ``TOTALRUN_NP`` and ``TOTALRUN_GRACE``,
each wrong one reported as a line ``VARIABLE=value: why`` (exit status 2), and the program
(one line and exit status 127 if it is not found, 126 if it cannot be executed).  More
ranks than cores get a one-line note that the job is oversubscribed.

Output: each line a worker prints appears on the launcher's stdout/stderr prefixed with
``[rank]``; with ``--output-dir DIR`` it is also written to ``DIR/rank.NN/stdout|stderr``.

Failure: when a worker exits non-zero or is killed by a signal, totalrun names it at once,
gives the others ``--grace`` seconds to notice (they raise ``PeerFailureError``) and exit,
then sends SIGTERM and, 3 s later, SIGKILL to their whole process groups.  It then prints a
table of every rank's exit status with the first failure marked as the root cause, and
exits with that worker's exit code (128 + signal number for a signal).  The root cause is
the first rank to fail of its own accord: a rank whose uncaught exception followed from
another rank's failure (a ``PeerFailureError``, even one that DDP or autograd re-raised
as another exception) notes so in ``TOTALREDUCE_FAILURE_DIR``, and the rank it names is
reported instead, however late that one exits.  Ctrl-C or SIGTERM
sent to totalrun is forwarded to every worker the same way (in the workers it arrives as
``KeyboardInterrupt``).  Workers die with totalrun even if it is killed outright, however
deep they sit under the command (a wrapper script, ``bash -c``): a watchdog process ends
their process groups (``watchdog.py``), so no orphans remain.

Restarts: with ``--max-restarts K``, a worker that exits non-zero or is killed is started
again with the same rank (``TOTALREDUCE_ATTEMPT`` one higher), up to K times per rank,
while the others keep running: they wait in their current collective for it and hand it
the last checkpoint and the results since (see ``totalreduce.checkpoint``).  Only when a
rank has used its K restarts does a failure end the job as above.  A whole job started
again by hand (or by another launcher) is a new job: ranks may be placed differently.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import socket
import sys

from ..config import check_environment
from ..rendezvous import KVServer
from .supervisor import Supervisor


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="totalrun", description="Start N totalreduce workers on this host.",
        epilog="Everything after the options is the command each worker runs.")
    # The env twins are read in _launcher_settings, so that a bad value is named by its
    # variable rather than reported as a bad flag.
    p.add_argument("-np", "--num-proc", dest="np", type=int, default=None,
                   help="number of workers (env TOTALRUN_NP, default 1)")
    p.add_argument("--grace", type=float, default=None,
                   help="seconds the other workers get to exit after one fails "
                        "(env TOTALRUN_GRACE, default 5)")
    p.add_argument("--max-restarts", type=int, default=None,
                   help="restart a worker that dies, with the same rank, up to this many "
                        "times per rank, while the others wait for it and keep their "
                        "memory; the job must checkpoint with totalreduce.checkpoint() "
                        "(env TOTALRUN_MAX_RESTARTS, default 0: a failure ends the job)")
    p.add_argument("--servers", type=int, default=None, metavar="S",
                   help="make the last S of the -np ranks parameter servers and the rest "
                        "their workers (totalreduce.ps; env TOTALREDUCE_SERVERS)")
    p.add_argument("--output-dir", default=os.environ.get("TOTALRUN_OUTPUT_DIR"),
                   help="also write each rank's output to DIR/rank.NN/ "
                        "(env TOTALRUN_OUTPUT_DIR)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command to run")
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _unrunnable(program: str) -> tuple[str, int] | None:
    """Why ``program`` cannot be started, and the shell's exit status for it (127: not
    found, 126: found but not executable); None if it can."""
    if os.sep not in program:
        if shutil.which(program) is None:
            return f"{program}: command not found (not in PATH)", 127
        return None
    if not os.path.exists(program):
        return f"{program}: no such file", 127
    if os.path.isdir(program):
        return f"{program}: is a directory", 126
    if not os.access(program, os.X_OK):
        return f"{program}: not executable (chmod +x it, or run it with its interpreter)", 126
    return None


def _launcher_settings(args: argparse.Namespace) -> list[str]:
    """Fill in -np, --grace and --max-restarts from TOTALRUN_NP, TOTALRUN_GRACE and
    TOTALRUN_MAX_RESTARTS where not given; a ``VARIABLE=value: why`` line for each of those
    that is wrong."""
    problems = []
    for attr, var, kind, default, lowest, why in (
            ("np", "TOTALRUN_NP", int, 1, 1, "must be an integer >= 1 (workers)"),
            ("grace", "TOTALRUN_GRACE", float, 5.0, 0.0, "must be >= 0 (seconds)"),
            ("max_restarts", "TOTALRUN_MAX_RESTARTS", int, 0, 0,
             "must be an integer >= 0 (restarts per rank)")):
        if getattr(args, attr) is not None:
            continue
        raw = os.environ.get(var, "")
        if raw == "":
            setattr(args, attr, default)
            continue
        try:
            value = kind(raw)
        except ValueError:
            value = None
        if value is None or value < lowest:
            problems.append(f"{var}={raw}: {why}")
        else:
            setattr(args, attr, value)
    return problems


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.command:
        _parser().error("no command given (e.g. totalrun -np 2 python train.py)")
    if args.np is not None and args.np < 1:
        _parser().error(f"-np must be at least 1, got {args.np}")
    if args.max_restarts is not None and args.max_restarts < 0:
        _parser().error(f"--max-restarts must be at least 0, got {args.max_restarts}")
    if args.servers is not None and args.servers < 0:
        _parser().error(f"--servers must be at least 0, got {args.servers}")
    if args.grace is not None and args.grace < 0:
        _parser().error(f"--grace must be >= 0, got {args.grace}")
    # Every wrong knob at once, one line each, before anything starts.
    problems = _launcher_settings(args) + check_environment(os.environ)
    if problems:
        for line in problems:
            print(f"totalrun: {line}", file=sys.stderr)
        return 2
    problem = _unrunnable(args.command[0])
    if problem is not None:
        print(f"totalrun: cannot start the workers: {problem[0]}", file=sys.stderr)
        return problem[1]
    if args.servers is not None and args.servers >= args.np:
        _parser().error(f"--servers {args.servers} leaves no workers among -np {args.np} "
                        "ranks (servers are taken from the -np ranks)")
    cores = _cores()
    if args.np > cores:
        print(f"totalrun: {args.np} ranks on {cores} cores: the job is oversubscribed; ranks "
              "take turns on the cores and every collective waits for the last one to get "
              f"its turn, so steps take {args.np / cores:.2g}x as long or more as with a "
              f"core per rank (-np {cores} or fewer to measure speed)", file=sys.stderr)
    secret = secrets.token_hex(32)
    job_id = secrets.token_hex(8)
    store = KVServer("127.0.0.1", 0, secret.encode(), job_id)
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update({
        "TOTALREDUCE_SIZE": str(args.np),
        "TOTALREDUCE_LOCAL_SIZE": str(args.np),
        "TOTALREDUCE_RENDEZVOUS": store.address,
        "TOTALREDUCE_SECRET": secret,
        "TOTALREDUCE_JOB_ID": job_id,
        "WORLD_SIZE": str(args.np),
        "LOCAL_WORLD_SIZE": str(args.np),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        # What horovodrun exports, for scripts that read them before init().
        "HOROVOD_SIZE": str(args.np),
        "HOROVOD_LOCAL_SIZE": str(args.np),
        "HOROVOD_CROSS_RANK": "0",
        "HOROVOD_CROSS_SIZE": "1",
        "TOTALREDUCE_MAX_RESTARTS": str(args.max_restarts),
    })
    if args.servers is not None:
        env["TOTALREDUCE_SERVERS"] = str(args.servers)
    try:
        supervisor = Supervisor(args.command, args.np, env, args.grace, args.output_dir,
                                args.max_restarts, store.set_generation)
        return supervisor.run()
    finally:
        store.close()


if __name__ == "__main__":
    sys.exit(main())
