"""``python -m totalreduce.bench {collectives,latency,replay,skew,preempt,train,tiny,
sparse,convergence,recovery,hosts,ps,floor}``:
side-by-side numbers.

Each subcommand launches one job per (backend, world size) — totalreduce's under
``totalrun`` or ``mpiexec``, MPI's under ``mpiexec``, gloo's under ``totalrun`` — with the
backends interleaved round by round (``--rounds``) so that a noisy host slows them alike,
then merges the ranks' raw timings and prints a table.  Ratios are always against
``mpi`` (mpi4py's own collective) measured in the same invocation.

Backends (``--backends``, comma-separated; all by default, unavailable ones skipped):
  totalreduce-shm  totalreduce under totalrun: TCP plus shared-memory rings (the default)
  totalreduce-tcp  totalreduce under totalrun, sockets only (TOTALREDUCE_TRANSPORT=tcp)
  totalreduce-mpi  totalreduce's MPI transport under mpiexec (needs the mpi extra)
  mpi              mpi4py's own collectives under mpiexec (MPICH from the mpi extra)
  gloo             torch.distributed with the gloo backend (needs torch)
  ddp-hook         train only: DDP over gloo with totalreduce's comm hook (needs torch)
Not run unless named, except by ``tiny`` (negotiated coordination, over totalreduce-shm's
transport):
  totalreduce-neg           TOTALREDUCE_COORDINATION=negotiated (cache and fusion on)
  totalreduce-neg-nocache   the same with TOTALREDUCE_CACHE_CAPACITY=0
  totalreduce-neg-nofusion  the same with TOTALREDUCE_FUSION_THRESHOLD=0

``tiny`` runs both scheduling modes by default, self-guided (totalreduce-shm) and
negotiated with its mechanisms on and off, against mpi and gloo: the table in
docs/BENCHMARKS.md.

``train`` runs the totalreduce-shm, gloo and ddp-hook backends (the others have no
optimizer): samples/s of one model under each, with a bucket-size sweep for totalreduce's
DistributedOptimizer (see ``training.py``).  ``convergence`` trains the digits MLP with
dense and sparse averaging (totalreduce-shm) and with torch's PowerSGD DDP hook (gloo):
test accuracy against epochs and bytes sent (see ``convergence.py``).  ``recovery``
times a job's recovery from a killed worker against its checkpoint's size (totalreduce
alone: no other backend recovers; see ``recovery.py``).  ``hosts`` runs allreduce on
hosts simulated with network namespaces over rate-limited links, flat and hierarchical,
next to the link's bound (root only; see ``hosts.py``).  ``ps`` compares allreduce,
parameter averaging and the parameter server with and without a straggler (see
``parameter_server.py``).  ``floor`` times a 2-rank allreduce against bare exchanges
with no engine, two copies through the rings and one out of the peer's memory, op by op
in one job beside MPI (see ``floor.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
from typing import Any

from ..launcher.mpiexec import find_mpiexec
from .buffers import ARRAYS
from .curves import plot_curves, print_curves, summarize_curves
from .report import plot, print_table, summarize

BACKENDS = ("totalreduce-shm", "totalreduce-tcp", "totalreduce-mpi", "mpi", "gloo",
            "ddp-hook")
# Negotiated coordination, with its mechanisms on and off: named, never run by default.
NEGOTIATED = {
    "totalreduce-neg": {},
    "totalreduce-neg-nocache": {"TOTALREDUCE_CACHE_CAPACITY": "0"},
    "totalreduce-neg-nofusion": {"TOTALREDUCE_FUSION_THRESHOLD": "0"},
}
TRAIN_BACKENDS = ("totalreduce-shm", "gloo", "ddp-hook")
# Many tiny tensors are where the two scheduling modes differ most: both, by default.
TINY_BACKENDS = ("totalreduce-shm", "totalreduce-neg", "totalreduce-neg-nocache",
                 "totalreduce-neg-nofusion", "mpi", "gloo")
CONVERGENCE_BACKENDS = ("totalreduce-shm", "gloo")
OPS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")
DEFAULT_SIZES = ("4", "64", "1K", "16K", "256K", "1M", "4M", "16M", "64M", "256M")


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def unavailable(backend: str) -> str | None:
    """Why ``backend`` cannot run here, or None."""
    if backend in ("mpi", "totalreduce-mpi") and find_mpiexec() is None:
        return "needs mpi4py and mpiexec: pip install 'totalreduce[mpi]'"
    if backend in ("gloo", "ddp-hook") and importlib.util.find_spec("torch") is None:
        return "needs torch: pip install torch==2.13.0"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(backend: str, n: int, cfg: dict[str, Any], timeout: float,
            settings: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run one job; return every rank's output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOTALREDUCE_")}
    env.update(settings or {})
    worker = [sys.executable, "-m", "totalreduce.bench.worker",
              json.dumps(dict(cfg, backend=backend))]
    if backend in ("mpi", "totalreduce-mpi"):
        launcher = [find_mpiexec() or "mpiexec", "-n", str(n)]
        env["TOTALREDUCE_TRANSPORT"] = "mpi"
    else:
        launcher = [sys.executable, "-m", "totalreduce.run", "-np", str(n)]
        env["TOTALREDUCE_TRANSPORT"] = "tcp" if backend == "totalreduce-tcp" else "shm"
        if backend in NEGOTIATED:
            env.update(NEGOTIATED[backend], TOTALREDUCE_COORDINATION="negotiated")
        if backend in ("gloo", "ddp-hook"):
            env["BENCH_GLOO_INIT"] = f"tcp://127.0.0.1:{_free_port()}"
    with tempfile.TemporaryDirectory(prefix="trbench-") as tmp:
        out = os.path.join(tmp, "out")
        proc = subprocess.run([*launcher, *worker, out], env=env, capture_output=True,
                              text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{backend} at {n} ranks failed (exit {proc.returncode}):\n"
                               f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        ranks = []
        for r in range(n):
            with open(f"{out}.{r}") as f:
                ranks.append(json.load(f))
        return ranks


def chosen_backends(test: str, named: str | None) -> list[str]:
    """The backends a subcommand runs: those ``named`` (comma-separated) that it can run,
    or its default set."""
    if named is None:
        chosen = list(TINY_BACKENDS if test == "tiny" else BACKENDS)
        if test not in ("train", "convergence") and "ddp-hook" in chosen:
            chosen.remove("ddp-hook")  # train only
    else:
        chosen = named.split(",")
    if test == "train":
        chosen = [b for b in chosen if b in TRAIN_BACKENDS]
    elif test == "convergence":
        chosen = [b for b in chosen if b in CONVERGENCE_BACKENDS]
    return chosen


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["hosts"]:
        from .hosts import main as hosts_main

        hosts_main(argv[1:])
        return 0
    if argv[:1] == ["floor"]:
        from .floor import main as floor_main

        return floor_main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m totalreduce.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="test", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-n", "--ranks", default="2", help="world sizes, e.g. 2,4")
    common.add_argument("--backends", default=None,
                        help=f"comma-separated, from: {', '.join((*BACKENDS, *NEGOTIATED))} "
                        "(default: the unnamed ones above, for tiny "
                        f"{', '.join(TINY_BACKENDS)})")
    common.add_argument("--rounds", type=int, default=1,
                        help="repeat every job this many times, interleaved")
    common.add_argument("--json", metavar="FILE", help="write raw and summary results")
    common.add_argument("--compare", metavar="OLD.json",
                        help="flag every cell more than 20%% slower than in a run saved "
                             "with --json (exit status 3 if any is)")
    common.add_argument("--plot", metavar="FILE.png", help="draw a chart with matplotlib")
    common.add_argument("--timeout", type=float, default=1800)
    common.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="a TOTALREDUCE_* setting for the totalreduce jobs, e.g. "
                        "--set SMALL_BYTES=0 (repeatable)")
    p = sub.add_parser("collectives", parents=[common], help="op x size x ranks x backend")
    p.add_argument("--ops", default=",".join(OPS),
                   help=f"comma-separated, from: {', '.join(OPS)} (default: all)")
    p.add_argument("--sizes", default=",".join(DEFAULT_SIZES),
                   help="message sizes in bytes (K/M suffixes)")
    p.add_argument("--reps-scale", type=float, default=1.0,
                   help="multiply the per-size repetition counts")
    p.add_argument("--arrays", choices=ARRAYS, default="numpy",
                   help="numpy: np.ones/np.empty, as a user makes them (default); huge: "
                   "2 MiB aligned and advised for huge pages, in every backend alike")
    p = sub.add_parser("latency", parents=[common],
                       help="blocking 8-byte allreduces, barriers, small allgathers "
                       "and object collectives back to back")
    p.add_argument("--reps", type=int, default=3000, help="calls of each, timed one by one")
    p.add_argument("--warmup", type=int, default=200)
    p = sub.add_parser("replay", parents=[common], help="one iteration of real gradients")
    p.add_argument("--models", default="resnet50,bert-base")
    p.add_argument("--buckets-mb", default="4,25", help="bucket sizes for grouped mode")
    p.add_argument("--reps", type=int, default=10)
    p = sub.add_parser("skew", parents=[common], help="ranks ready at random times")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--max-delay", type=float, default=0.05, help="seconds")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("preempt", parents=[common], help="small op during a big one")
    p.add_argument("--big", default="64M")
    p.add_argument("--small", default="1K")
    p.add_argument("--delay", type=float, default=0.002, help="seconds after the big op")
    p.add_argument("--reps", type=int, default=20)
    p = sub.add_parser("tiny", parents=[common],
                       help="many async 4-byte allreduces: per-op overhead")
    p.add_argument("--count", type=int, default=1000, help="ops submitted before waiting")
    p.add_argument("--reps", type=int, default=20)
    p = sub.add_parser("sparse", parents=[common],
                       help="Ok-Topk, TopkA, gTopk against dense: time, words sent, nnz")
    p.add_argument("--densities", default="0.01,0.02")
    p.add_argument("--elements", type=int, default=1 << 20,
                   help="heavy-tailed gradient length (the digits MLP has 50,890)")
    p.add_argument("--calls", type=int, default=12)
    p = sub.add_parser("convergence", parents=[common],
                       help="digits accuracy against epochs and bytes: dense, sparse, PowerSGD")
    p.add_argument("--methods", default="oktopk,topka,gtopk")
    p.add_argument("--densities", default="0.01,0.02")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p = sub.add_parser("train", parents=[common], help="samples/s of a training step")
    p.add_argument("--model", default="mlp", help="mlp (communication-heavy) or convnet")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--buckets-mb", default="16",
                   help="DistributedOptimizer bucket sizes to sweep (MB), e.g. 1,4,16,25")
    p.add_argument("--sparse", default="oktopk,topka,gtopk",
                   help="sparse compressions to run at the default bucket size "
                   "('' for none)")
    p.add_argument("--density", type=float, default=0.01, help="of the sparse compressions")
    p.add_argument("--steps", type=int, default=5, help="steps per timed repetition")
    p.add_argument("--reps", type=int, default=5)
    p = sub.add_parser("ps", help="allreduce, averaging and the parameter server on the "
                       "digits MLP, with and without a straggler")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3, help="jobs per cell (median)")
    p.add_argument("--json", metavar="FILE", help="write the results")
    p.add_argument("--plot", metavar="PNG", help="write a bar chart")
    p.add_argument("--timeout", type=float, default=300)
    p = sub.add_parser("recovery", help="kill a worker: time to recover against the "
                       "checkpoint's size (totalrun --max-restarts)")
    p.add_argument("-n", "--ranks", default="4", help="world sizes, e.g. 2,4")
    p.add_argument("--sizes", default="1M,16M,64M,256M", help="checkpoint sizes")
    p.add_argument("--rounds", type=int, default=3, help="jobs per cell (median, worst)")
    p.add_argument("--json", metavar="FILE", help="write the results")
    p.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args(argv)
    if args.test == "recovery":
        return _recovery(args)
    if args.test == "ps":
        return _parameter_server(args)

    cfg: dict[str, Any] = {"test": args.test}
    if args.test == "collectives":
        cfg.update(ops=args.ops.split(","), reps_scale=args.reps_scale,
                   sizes=[parse_size(s) for s in args.sizes.split(",")], arrays=args.arrays)
    elif args.test == "replay":
        cfg.update(models=args.models.split(","), reps=args.reps,
                   buckets_mb=[int(b) for b in args.buckets_mb.split(",")])
    elif args.test == "skew":
        cfg.update(model=args.model, max_delay=args.max_delay, reps=args.reps,
                   seed=args.seed)
    elif args.test == "tiny":
        cfg.update(count=args.count, reps=args.reps)
    elif args.test == "latency":
        cfg.update(reps=args.reps, warmup=args.warmup)
    elif args.test == "sparse":
        cfg.update(densities=[float(d) for d in args.densities.split(",")],
                   n=args.elements, calls=args.calls)
    elif args.test == "convergence":
        cfg.update(methods=args.methods.split(","), epochs=args.epochs, batch=args.batch_size,
                   densities=[float(d) for d in args.densities.split(",")])
    elif args.test == "train":
        cfg.update(model=args.model, batch_size=args.batch_size, steps=args.steps,
                   reps=args.reps, buckets_mb=[float(b) for b in args.buckets_mb.split(",")],
                   sparse=[a for a in args.sparse.split(",") if a], density=args.density)
    else:
        cfg.update(big_bytes=parse_size(args.big), small_bytes=parse_size(args.small),
                   delay=args.delay, reps=args.reps)

    backends = []
    for b in chosen_backends(args.test, args.backends):
        if b not in BACKENDS and b not in NEGOTIATED:
            ap.error(f"unknown backend {b!r}; choose from "
                     f"{', '.join((*BACKENDS, *NEGOTIATED))}")
        why = unavailable(b)
        if why:
            print(f"skipping {b}: {why}", file=sys.stderr)
        else:
            backends.append(b)
    settings = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--set {item!r}: expected NAME=VALUE")
        settings["TOTALREDUCE_" + name.upper().removeprefix("TOTALREDUCE_")] = value
    sizes = [int(n) for n in args.ranks.split(",")]
    jobs = [(r, n, b) for r in range(args.rounds) for n in sizes for b in backends]

    try:
        from tqdm import tqdm  # type: ignore[import-untyped]
    except ImportError:  # a progress bar is optional (the dev and examples extras)
        def tqdm(items: Any, **_kw: Any) -> Any:
            return items

    raw: list[dict[str, Any]] = []
    for rnd, n, backend in tqdm(jobs, desc=args.test, unit="job", file=sys.stderr):
        ranks = run_job(backend, n, cfg, args.timeout,
                        settings if backend.startswith("totalreduce") else None)
        raw.append({"round": rnd, "backend": backend, "ranks": n, "per_rank": ranks})
    _print_machine(_machine())
    if cfg.get("arrays", "numpy") != "numpy":
        print(f"arrays: {cfg['arrays']} (--arrays)")
    if args.test == "convergence":
        summary = summarize_curves(raw)
        print_curves(summary)
    else:
        summary = summarize(args.test, raw)
        print_table(args.test, summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "machine": _machine(), "summary": summary, "raw": raw},
                      f, indent=1)
    if args.plot and args.test == "convergence":
        plot_curves(summary, args.plot)
    elif args.plot:
        plot(args.test, summary, args.plot)
    if args.compare and args.test != "convergence":
        from .compare import EXIT_SLOWER, compare, print_comparison

        if print_comparison(compare(summary, args.compare), args.compare):
            return EXIT_SLOWER
    return 0


def _recovery(args: argparse.Namespace) -> int:
    from .recovery import bench, print_rows

    rows = bench([int(n) for n in args.ranks.split(",")],
                 [parse_size(s) for s in args.sizes.split(",")], args.rounds, args.timeout)
    _print_machine(_machine())
    print_rows(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": _machine(), "rows": rows}, f, indent=1)
    return 0


def _parameter_server(args: argparse.Namespace) -> int:
    from .parameter_server import bench, plot_rows, print_rows

    rows = bench(args.workers, args.servers, args.epochs, args.rounds, args.timeout)
    _print_machine(_machine())
    print_rows(rows, args.workers, args.servers, args.epochs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": _machine(), "rows": rows}, f, indent=1)
    if args.plot:
        plot_rows(rows, args.plot)
    return 0


def _machine() -> dict[str, Any]:
    """The environment a result belongs to: host, library versions and the commit."""
    import platform
    from importlib import metadata

    info: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                            "kernel": platform.release(), "platform": platform.platform()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    for dist in ("totalreduce", "numpy", "mpi4py", "mpich", "torch"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = None
    if info["totalreduce"] is None:  # run from a source tree (PYTHONPATH)
        from ..version import __version__
        info["totalreduce"] = __version__
    info["mpi"] = f"mpich {info['mpich']}" if info["mpich"] else _mpiexec_version()
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        info["commit"] = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"],
                                        capture_output=True, text=True, timeout=5
                                        ).stdout.strip() or None
        # A table made from a tree with changes the commit lacks says so: the commit
        # alone would claim code that did not run.
        if info["commit"] and subprocess.run(
                ["git", "-C", here, "status", "--porcelain", "--untracked-files=no", "--",
                 os.path.dirname(here)], capture_output=True, text=True, timeout=5
                ).stdout.strip():
            info["commit"] += "+modified"
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    return info


def _mpiexec_version() -> str | None:
    """The first line ``mpiexec --version`` prints (an MPI other than the mpich wheel's,
    such as Open MPI's "mpiexec (OpenRTE) 4.1.6"), or None."""
    path = find_mpiexec()
    if path is None:
        return None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.stdout.strip().splitlines()
    return first[0].replace(",", " ") if first else None


def _print_machine(info: dict[str, Any]) -> None:
    keys = ("cpu", "cpus", "kernel", "python", "numpy", "mpi4py", "mpi", "torch",
            "totalreduce", "commit")
    print("environment: " + ", ".join(f"{k} {info.get(k)}" for k in keys))


if __name__ == "__main__":
    raise SystemExit(main())
