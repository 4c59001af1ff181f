"""Rerun the benchmarks behind docs/BENCHMARKS.md and rebuild the page, in one command.

    python docs/bench/regenerate.py              # every job this machine can run
    python docs/bench/regenerate.py --list       # the jobs, their commands and files
    python docs/bench/regenerate.py --only latency,preempt-2
    python docs/bench/regenerate.py --cores16    # the 16-core tables (one rank per core)

Each job runs ``python -m totalreduce.bench ...`` in this folder (where its ``--plot``
lands) and writes what the bench printed to ``<name>.txt``; then make_page.py rebuilds
the page.  The tables name their machine and commit: run it on a quiet machine, with
nothing else running, from a clean checkout of the commit the page should describe.
The 16-core jobs need a machine with a core per rank and run only when asked.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent

NEG = "totalreduce-shm,totalreduce-neg,totalreduce-neg-nocache,totalreduce-neg-nofusion,mpi"


class Job(NamedTuple):
    name: str  # docs/bench/<name>.txt
    command: str  # as the page shows it
    cores16: bool = False


JOBS = (
    Job("collectives-2", "python -m totalreduce.bench collectives -n 2 --rounds 6 "
        "--reps-scale 0.5 --plot collectives-2.png"),
    Job("collectives-2-huge", "python -m totalreduce.bench collectives -n 2 --backends "
        "totalreduce-shm,mpi --sizes 64K,1M,4M,16M,64M,256M --rounds 4 --reps-scale 0.5 "
        "--arrays huge"),
    Job("collectives-4", "python -m totalreduce.bench collectives -n 4 --ops allreduce "
        "--sizes 4,1K,64K,1M,4M,16M,64M --rounds 2 --plot collectives-4.png"),
    Job("floor-2", "python -m totalreduce.bench floor --sizes 1M,4M,16M,64M --reps 60"),
    Job("latency", "python -m totalreduce.bench latency -n 2,4 --rounds 3"),
    Job("latency-small", "python -m totalreduce.bench latency -n 2,4 --backends "
        "totalreduce-shm,mpi,gloo --rounds 3"),
    Job("tiny-neg", "python -m totalreduce.bench tiny -n 2,4 --rounds 4 --reps 10"),
    Job("latency-neg", "python -m totalreduce.bench latency -n 2,4 --backends "
        "totalreduce-shm,totalreduce-neg,mpi --rounds 3"),
    Job("preempt-2", "python -m totalreduce.bench preempt -n 2 --rounds 2 --reps 40"),
    Job("replay-2-optimizer", "python -m totalreduce.bench replay -n 2 --models resnet50 "
        "--backends totalreduce-shm,mpi --buckets-mb 4,8,16,25 --rounds 2 --reps 15"),
    Job("replay-neg", f"python -m totalreduce.bench replay -n 2,4 --models resnet50 "
        f"--backends {NEG} --buckets-mb 16 --rounds 2 --reps 10"),
    Job("skew-2", "python -m totalreduce.bench skew -n 2 --rounds 2"),
    Job("skew-neg", f"python -m totalreduce.bench skew -n 2,4 --backends {NEG} --rounds 2 "
        "--reps 10"),
    Job("train-mlp", "python -m totalreduce.bench train -n 2,4 --rounds 2 --reps 3 "
        "--plot train-mlp.png"),
    Job("train-convnet", "python -m totalreduce.bench train -n 2,4 --model convnet "
        "--rounds 2 --reps 3 --plot train-convnet.png"),
    Job("sparse", "python -m totalreduce.bench sparse -n 2,3,4 --backends totalreduce-shm "
        "--calls 10"),
    Job("sparse-words", "python -m totalreduce.bench sparse -n 2,4 --backends "
        "totalreduce-shm --elements 100000 --calls 6"),
    Job("convergence-4", "python -m totalreduce.bench convergence -n 4 --epochs 30 "
        "--plot convergence-4.png"),
    Job("recovery", "python -m totalreduce.bench recovery -n 2,4 --rounds 3"),
    Job("ps", "python -m totalreduce.bench ps --rounds 3 --plot ps.png"),
    Job("hosts-1gbit", "python -m totalreduce.bench hosts --link 1gbit --sizes 16M,64M "
        "--rounds 3"),
    Job("hosts-10gbit", "python -m totalreduce.bench hosts --link 10gbit --sizes 16M,64M "
        "--rounds 3"),
    Job("hosts-10gbit-1", "python -m totalreduce.bench hosts --link 10gbit --sizes 16M,64M "
        "--rounds 3 --per-host 1 --modes flat"),
    Job("hosts-100gbit", "python -m totalreduce.bench hosts --link 100gbit --sizes 16M,64M "
        "--rounds 3"),
    Job("hosts-train-1", "python -m totalreduce.bench hosts --train --link 1gbit "
        "--epochs 20 --per-host 1"),
    Job("hosts-train", "python -m totalreduce.bench hosts --train --link 1gbit --epochs 20"),
    Job("cores16-allreduce", "python -m totalreduce.bench collectives -n 4,8,16 --ops "
        "allreduce --sizes 1M,4M,16M,64M --rounds 2 --reps-scale 0.5 --backends "
        "totalreduce-shm,mpi,gloo", cores16=True),
    Job("cores16-others", "python -m totalreduce.bench collectives -n 8,16 --ops "
        "allgather,alltoall,broadcast,reducescatter --sizes 1M,4M,16M,64M --rounds 2 "
        "--reps-scale 0.5 --backends totalreduce-shm,mpi", cores16=True),
    Job("cores16-latency", "python -m totalreduce.bench latency -n 2,4,8,16 --backends "
        "totalreduce-shm,mpi --rounds 2 --reps 1000", cores16=True),
)

BY_NAME = {job.name: job for job in JOBS}


def command(name: str) -> str:
    """The command of job ``name``, as the page shows it."""
    return BY_NAME[name].command


def run(job: Job) -> bool:
    """Run ``job``, its output into <name>.txt; False (the file kept as it was) if the
    bench failed."""
    argv = shlex.split(job.command)
    argv[0] = sys.executable
    print(f"{job.name}: {job.command}", file=sys.stderr, flush=True)
    start = time.monotonic()
    done = subprocess.run(argv, cwd=HERE, stdout=subprocess.PIPE, text=True, check=False)
    took = time.monotonic() - start
    if done.returncode != 0:
        print(f"{job.name}: exited with {done.returncode} after {took:.0f} s; "
              f"{job.name}.txt left as it was", file=sys.stderr, flush=True)
        return False
    (HERE / f"{job.name}.txt").write_text(done.stdout)
    print(f"{job.name}: {took:.0f} s", file=sys.stderr, flush=True)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the jobs and exit")
    parser.add_argument("--only", default="", help="comma-separated job names")
    parser.add_argument("--cores16", action="store_true",
                        help="the 16-core jobs instead (a machine with a core per rank)")
    args = parser.parse_args(argv)
    if args.list:
        for job in JOBS:
            print(f"{job.name:20} {'16 cores  ' if job.cores16 else ''}{job.command}")
        return 0
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        parser.error(f"no such job: {', '.join(unknown)} (see --list)")
    jobs = [BY_NAME[n] for n in names] if names else [
        job for job in JOBS if job.cores16 == args.cores16]
    if any(job.cores16 for job in jobs) and (os.cpu_count() or 1) < 16:
        print(f"warning: {os.cpu_count()} cores: the 16-core tables want one per rank",
              file=sys.stderr)
    # A job that cannot run here (hosts needs root for its network namespaces) does
    # not stop the others.
    failed = [job.name for job in jobs if not run(job)]
    subprocess.run([sys.executable, str(HERE / "make_page.py")], check=True)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
