"""``python -m totalreduce.bench hosts``: allreduce across simulated hosts (simhosts.py).

Each job runs ``--per-host`` ranks on each of ``--hosts`` network namespaces joined by
links of ``--link`` (and ``--delay`` where the kernel can delay), started with the
environment srun gives (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``) plus
``TOTALREDUCE_RENDEZVOUS`` on host 0 and ``TOTALREDUCE_SECRET``.  Every mode
(``TOTALREDUCE_HIERARCHICAL`` off: the flat ring; on: hierarchical) runs once per round,
the modes interleaved.  A rep's time is the slowest rank's; the table gives the median
over every round's reps, next to the link bound.

The link bound: a host's ranks must together send (and receive) ``2 (H - 1) / H`` of the
buffer across its link for every rank to end with the sum, as the ring algorithms do
between hosts; at ``rate`` bits/s that takes ``2 (H - 1) / H * bytes * 8 / rate``
seconds (64 MiB over 1 Gbit/s between 2 hosts: 0.537 s).  It ignores latency, headers
and TCP's own overhead (about 3 % at a 1500-byte MTU), so no algorithm reaches it.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .simhosts import SimulatedHosts, bits_per_second, unavailable

MODES = {"flat": "off", "hierarchical": "on"}


def link_bound(nbytes: int, hosts: int, rate_bps: int) -> float:
    return 2 * (hosts - 1) / hosts * nbytes * 8 / rate_bps


def worker(spec: dict[str, Any]) -> None:
    """One rank: time ``reps`` allreduces of each size after a warm-up; rank 0 keeps the
    slowest rank's time of each."""
    import numpy as np

    import totalreduce as tr

    tr.init()
    out: dict[str, list[float]] = {}
    for nbytes in spec["sizes"]:
        x = np.ones(nbytes // 4, np.float32)
        tr.allreduce(x, op=tr.Sum, name=f"warm{nbytes}")
        times = []
        for rep in range(spec["reps"]):
            tr.barrier()
            t0 = time.perf_counter()
            got = tr.allreduce(x, op=tr.Sum, name=f"t{nbytes}")
            mine = np.array([time.perf_counter() - t0])
            slowest = tr.allreduce(mine, op=tr.Max, name="slowest")
            times.append(float(slowest[0]))
            if rep == 0 and x.size and got[0] != tr.size():
                raise AssertionError(f"rank {tr.rank()}: allreduce gave {got[0]}, "
                                     f"not {tr.size()}")
        out[str(nbytes)] = times
    if tr.rank() == 0:
        Path(spec["out"]).write_text(json.dumps(out))
    tr.shutdown()


def train_worker(spec: dict[str, Any]) -> None:
    """One rank of ``--train``: convergence.py's runs, one after another."""
    from .convergence import convergence

    rank, size, runs = convergence("totalreduce-shm", spec)
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps({"size": size, "runs": runs}))


def train_table(result: dict[str, Any], spec: dict[str, Any], target: float) -> None:
    """Samples/s over the whole run, and the epoch and seconds where test accuracy first
    reached ``target``."""
    print(f"{'method':<14} {'samples/s':>10} {'final acc':>10} {'epoch to':>9} "
          f"{'s to':>7}  (target {target:.0%})")
    for run in result["runs"]:
        curve = run["curve"]
        samples = spec["samples"] * len(curve)
        rate = samples / curve[-1]["seconds"]
        hit = next((p for p in curve if p["accuracy"] >= target), None)
        when = (f"{hit['epoch']:>9} {hit['seconds']:>7.1f}" if hit
                else f"{'-':>9} {'-':>7}")
        print(f"{run['mode']:<14} {rate:>10.0f} {curve[-1]['accuracy']:>10.4f} {when}")


def run_job(hosts: SimulatedHosts, per_host: int, spec: dict[str, Any],
            env: dict[str, str], timeout: float) -> Any:
    """Start ``per_host`` ranks on each host as srun would and wait for them."""
    n = hosts.n * per_host
    with tempfile.TemporaryDirectory(prefix="trbench-hosts-") as tmp:
        out = os.path.join(tmp, "times.json")
        base = dict(os.environ, **env, SLURM_NTASKS=str(n), SLURM_NNODES=str(hosts.n),
                    TOTALREDUCE_RENDEZVOUS=f"{hosts.address(0)}:29400",
                    TOTALREDUCE_SECRET=secrets.token_hex(16))
        argv = [sys.executable, "-m", "totalreduce.bench.hosts",
                "--train-worker" if "epochs" in spec else "--worker",
                json.dumps(dict(spec, out=out))]
        procs = [hosts.popen(r // per_host, argv, dict(
            base, SLURM_PROCID=str(r), SLURM_LOCALID=str(r % per_host),
            SLURM_NODEID=str(r // per_host))) for r in range(n)]
        deadline = time.monotonic() + timeout
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
        if any(codes):
            raise RuntimeError(f"a rank failed: exit codes {codes}")
        return json.loads(Path(out).read_text())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m totalreduce.bench hosts",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--per-host", type=int, default=2)
    ap.add_argument("--link", default="1gbit", help="tc rate of each host's link")
    ap.add_argument("--delay", default="100us", help="one-way delay between hosts")
    ap.add_argument("--sizes", default="64M", help="comma-separated, e.g. 1M,16M,64M")
    ap.add_argument("--modes", default="flat,hierarchical")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--train", action="store_true",
                    help="instead: train the digits MLP, widened to 4.35M parameters, "
                    "dense and with each sparse method at --density, and report samples/s "
                    "and the time to --target test accuracy")
    ap.add_argument("--methods", default="oktopk,topka,gtopk")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--train-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return
    if args.train_worker:
        train_worker(json.loads(args.train_worker))
        return
    why = unavailable()
    if why:
        sys.exit(f"bench hosts: {why}")
    if args.train:
        from .__main__ import _machine, _print_machine

        _print_machine(_machine())
        _train(args)
        return
    from .__main__ import _machine, _print_machine, parse_size

    _print_machine(_machine())
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    modes = args.modes.split(",")
    spec = {"sizes": sizes, "reps": args.reps}
    got: dict[str, dict[int, list[float]]] = {m: {s: [] for s in sizes} for m in modes}
    with SimulatedHosts(args.hosts, args.link, args.delay) as hosts:
        for _ in range(args.rounds):
            for mode in modes:
                times = run_job(hosts, args.per_host, spec,
                                {"TOTALREDUCE_HIERARCHICAL": MODES[mode]}, args.timeout)
                for s in sizes:
                    got[mode][s] += times[str(s)]
        delayed = hosts.delayed
    rate = bits_per_second(args.link)
    print(f"# {args.hosts} hosts x {args.per_host} ranks, links of {args.link}"
          + (f" and {args.delay}" if delayed else " (no delay: this kernel has no netem)")
          + f"; median of {args.rounds} rounds x {args.reps} reps, slowest rank's time")
    print(f"{'bytes':>10}  {'mode':<13} {'median s':>9} {'bound s':>8} {'x bound':>8}")
    for s in sizes:
        bound = link_bound(s, args.hosts, rate)
        for mode in modes:
            med = statistics.median(got[mode][s])
            print(f"{s:>10}  {mode:<13} {med:>9.3f} {bound:>8.3f} {med / bound:>8.2f}")


if __name__ == "__main__":
    main()


def _train(args: argparse.Namespace) -> None:
    n = args.hosts * args.per_host
    batch = 32
    # The digits training split has 1347 samples; each rank takes every n-th.
    steps = (1347 // n) // batch
    spec = {"methods": [m for m in args.methods.split(",") if m],
            "densities": [args.density], "epochs": args.epochs, "batch": batch,
            "hidden": [2048, 2048], "samples": steps * batch * n}
    with SimulatedHosts(args.hosts, args.link, args.delay) as hosts:
        result = run_job(hosts, args.per_host, spec, {}, args.timeout)
        delayed = hosts.delayed
    print(f"# digits MLP 64-2048-2048-10 (4,350,986 parameters), {args.hosts} hosts x "
          f"{args.per_host} ranks, batch {batch} per rank, links of {args.link}"
          + (f" and {args.delay}" if delayed else " (no delay: this kernel has no netem)"))
    train_table(result, spec, args.target)
