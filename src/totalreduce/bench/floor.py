"""``python -m totalreduce.bench floor``: how fast this host lets a 2-rank allreduce be.

One job of two ranks under ``mpiexec`` runs four allreduces of the same float32 array in
turn, op by op, so that every one sees the same machine state:

- ``mpi``: ``MPI_Allreduce`` (mpi4py);
- ``totalreduce``: ``allreduce_`` over the shared-memory rings (as under ``totalrun``;
  mpiexec starts the ranks, totalreduce's own rendezvous connects them);
- ``bare ring``: the same two-copy exchange with no engine: each rank copies the half its
  peer owns into a shared ring, piece by piece, and reduces its own half straight out of
  the peer's ring; then the same the other way for the reduced halves (numpy, spinning on
  two counters per ring);
- ``bare cma``: one copy per piece: each rank reads the peer's copy of its half out of the
  peer's memory (``process_vm_readv``) and adds it in, then reads the peer's reduced half
  straight into place.

The bare exchanges are what the rings and lending could give with no engine at all (no
headers, credit, handlers or loop turns): the gap between them and ``totalreduce`` is the
engine's own cost, and the gap between them and ``mpi`` is what the copies allow.  Every
result is checked against the sum.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import mmap
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

_CONTROL = 4096
_LINE = 8  # int64 words per cache line: each counter has a line of its own
# Counters, by line: a ring's head (written by its writer), its tail (by its reader), the
# pieces a rank has reduced, and the ops a rank has finished (bare cma).
_HEAD, _TAIL, _DONE, _END = 0, 2, 4, 6
_SLOTS = 4  # ring slots of one piece each: the writer may run three pieces ahead


class _Pair:
    """The two ranks' shared counters and rings, and the bare exchanges over them."""

    def __init__(self, comm: Any, piece: int) -> None:
        self.me = comm.rank
        self.peer = 1 - comm.rank
        self.piece = piece // 4  # float32 elements
        ring_bytes = _SLOTS * self.piece * 4
        name = comm.bcast(f"totalreduce-floor-{secrets.token_hex(8)}"
                          if comm.rank == 0 else None)
        path = os.path.join("/dev/shm", name)
        size = _CONTROL + 2 * ring_bytes
        if comm.rank == 0:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, size)
            os.close(fd)
        comm.Barrier()
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        comm.Barrier()
        if comm.rank == 0:
            os.unlink(path)
        self.ctl = np.frombuffer(self._map, np.int64, _CONTROL // 8)
        rings = [np.frombuffer(self._map, np.float32, ring_bytes // 4, _CONTROL + r * ring_bytes)
                 for r in range(2)]
        self.out_ring, self.in_ring = rings[self.me], rings[self.peer]
        self.sent = self.got = 0  # pieces through each ring, ever
        self.ops = 0
        self.scratch = np.empty(self.piece, np.float32)
        self.peer_pid = 0
        self.peer_address = 0

    def _send(self, src: np.ndarray) -> None:
        ctl, k, p = self.ctl, self.sent, self.piece
        while k - ctl[(_TAIL + self.me) * _LINE] >= _SLOTS:
            pass
        at = (k % _SLOTS) * p
        self.out_ring[at:at + src.size] = src
        self.sent = k + 1
        ctl[(_HEAD + self.me) * _LINE] = k + 1

    def _recv(self, dst: np.ndarray, reduce: bool) -> None:
        ctl, k, p = self.ctl, self.got, self.piece
        while ctl[(_HEAD + self.peer) * _LINE] <= k:
            pass
        at = (k % _SLOTS) * p
        body = self.in_ring[at:at + dst.size]
        if reduce:
            np.add(dst, body, out=dst)
        else:
            dst[:] = body
        self.got = k + 1
        ctl[(_TAIL + self.peer) * _LINE] = k + 1

    def _halves(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        half = x.size // 2
        lower, upper = x[:half], x[half:]
        return (lower, upper) if self.me == 0 else (upper, lower)

    def ring(self, x: np.ndarray) -> None:
        """Allreduce (sum) ``x`` through the rings, two copies a piece."""
        mine, other = self._halves(x)
        p = self.piece
        for src, dst, reduce in ((other, mine, True), (mine, other, False)):
            for at in range(0, max(src.size, dst.size), p):
                self._send(src[at:at + p])
                self._recv(dst[at:at + p], reduce)

    def cma(self, x: np.ndarray) -> None:
        """Allreduce (sum) ``x`` by reading the peer's memory, one copy a piece.  Both ranks
        must have entered it after ``x`` was set (a barrier)."""
        from ..transport import cma

        mine, other = self._halves(x)
        ctl, p, pid = self.ctl, self.piece, self.peer_pid
        half = x.size // 2
        # Where the peer keeps our half and its own, in its copy of x.
        mine_at = self.peer_address + (0 if self.me == 0 else half * 4)
        other_at = self.peer_address + (half * 4 if self.me == 0 else 0)
        pieces = -(-mine.size // p)
        base = self.ops * pieces
        for i, at in enumerate(range(0, mine.size, p)):
            part = mine[at:at + p]
            scratch = self.scratch[:part.size]
            cma.read_into(pid, scratch.data.cast("B"), mine_at + at * 4)
            np.add(part, scratch, out=part)
            ctl[(_DONE + self.me) * _LINE] = base + i + 1
        for i, at in enumerate(range(0, other.size, p)):
            while ctl[(_DONE + self.peer) * _LINE] < base + i + 1:
                pass
            part = other[at:at + p]
            cma.read_into(pid, part.data.cast("B"), other_at + at * 4)
        # The peer may still be reading our reduced half: x stays as it is until it is done.
        self.ops += 1
        ctl[(_END + self.me) * _LINE] = self.ops
        while ctl[(_END + self.peer) * _LINE] < self.ops:
            pass


def _worker(sizes: list[int], reps: int, piece: int) -> None:
    import totalreduce as tr

    tr.init()  # before mpi4py: totalreduce over the rings, MPI beside it
    from mpi4py import MPI

    from ..transport import cma

    comm = MPI.COMM_WORLD
    if comm.size != 2:
        raise SystemExit("bench floor: runs at exactly 2 ranks")
    pair = _Pair(comm, piece)
    rows = []
    for size in sizes:
        x = np.empty(size // 4, np.float32)
        pair.peer_pid = comm.sendrecv(os.getpid(), dest=pair.peer, source=pair.peer)
        pair.peer_address = comm.sendrecv(cma.address_of(x), dest=pair.peer,
                                           source=pair.peer)
        runs: dict[str, Callable[[], Any]] = {
            "mpi": functools.partial(comm.Allreduce, MPI.IN_PLACE, x, MPI.SUM),
            "totalreduce": functools.partial(tr.allreduce_, x, op=tr.Sum, name="floor"),
            "bare ring": functools.partial(pair.ring, x),
        }
        if cma.cma_works():
            runs["bare cma"] = functools.partial(pair.cma, x)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for rep in range(reps + 3):  # three to warm up
            for name, run in runs.items():
                x.fill(comm.rank + 1)
                comm.Barrier()
                t = time.perf_counter()
                run()
                took = time.perf_counter() - t
                if not np.all(x == 3):
                    raise AssertionError(f"{name} allreduce of {size} bytes came out wrong")
                if rep >= 3:
                    times[name].append(took)
        slowest = {name: np.max(comm.allgather(t), axis=0) for name, t in times.items()}
        rows.append({"bytes": size, "ms": {name: float(np.median(t)) * 1e3
                                          for name, t in slowest.items()}})
    if comm.rank == 0:
        print(json.dumps(rows))
    tr.shutdown()


def _size(text: str) -> int:
    from .__main__ import parse_size

    return parse_size(text)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m totalreduce.bench floor",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M,4M,16M", help="bytes per rank, comma-separated")
    ap.add_argument("--reps", type=int, default=40, help="timed calls of each, per size")
    ap.add_argument("--piece", default="1M", help="bytes per piece of the bare exchanges")
    ap.add_argument("--json", metavar="FILE", help="write the results")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sizes = [_size(s) for s in args.sizes.split(",")]
    piece = _size(args.piece)
    if any(s < 8 or s % 8 for s in sizes) or piece < 64 or piece % 4:
        ap.error("sizes must be multiples of 8 bytes, the piece of 4 bytes and >= 64")
    if args.worker:
        _worker(sizes, args.reps, piece)
        return 0
    from ..launcher.mpiexec import find_mpiexec
    from .__main__ import _free_port, _machine, _print_machine

    mpiexec = find_mpiexec()
    if mpiexec is None:
        print("bench floor needs mpi4py and mpiexec: pip install 'totalreduce[mpi]'",
              file=sys.stderr)
        return 2
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOTALREDUCE_")}
    env.update(TOTALREDUCE_TRANSPORT="shm", TOTALREDUCE_SECRET=secrets.token_hex(32),
               TOTALREDUCE_RENDEZVOUS=f"127.0.0.1:{_free_port()}")
    cmd = [mpiexec, "-n", "2", sys.executable, "-m", "totalreduce.bench.floor", "--worker",
           "--sizes", args.sizes, "--reps", str(args.reps), "--piece", args.piece]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          timeout=args.timeout)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
        return 1
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    _print_machine(_machine())
    names = list(rows[0]["ms"])
    print(f"2 ranks, median ms of {args.reps} calls (the slower rank's), speed vs mpi; "
          f"bare exchanges in pieces of {args.piece}")
    print(f"{'size':>6}  " + "  ".join(f"{n:>20}" for n in names))
    for row in rows:
        mpi = row["ms"]["mpi"]
        cells = [f"{ms:8.3f} ({mpi / ms:4.2f}x)" for ms in row["ms"].values()]
        print(f"{_label(row['bytes']):>6}  " + "  ".join(f"{c:>20}" for c in cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": _machine(), "piece": piece, "rows": rows}, f, indent=1)
    return 0


def _label(n: int) -> str:
    for unit, shift in (("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main(sys.argv[1:]))
