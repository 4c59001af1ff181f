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
  straight into place (where each rank may read the other's memory).

The bare exchanges are what the rings and lending could give with no engine at all (no
headers, credit, handlers or loop turns): the gap between them and ``totalreduce`` is the
engine's own cost, and the gap between them and ``mpi`` is what the copies allow.  Every
result is checked against the sum, element by element.  Like the rings, the bare
exchanges rely on x86's ordering of stores and of loads between their counters and data.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..transport import cma

_CONTROL = 4096
_LINE = 8  # int64 words per cache line: each counter has a line of its own
# Counters, by line: a ring's head (written by its writer), its tail (by its reader), the
# pieces a rank has reduced, and the ops a rank has finished (bare cma).
_HEAD, _TAIL, _DONE, _END = 0, 2, 4, 6
_SLOTS = 4  # ring slots of one piece each: the writer may run three pieces ahead
_PATIENCE = 60.0  # seconds a bare exchange waits for its peer before it gives up
_CYCLE = 1021  # the values' period: every element differs from its neighbours, exactly


def _wait(ctl: np.ndarray, at: int, least: int) -> None:
    """Spin until ``ctl[at] >= least`` (the peer's counter)."""
    if ctl[at] >= least:
        return
    give_up = time.monotonic() + _PATIENCE
    while ctl[at] < least:
        if time.monotonic() > give_up:
            raise TimeoutError(f"bench floor: the peer's counter {at} stayed below {least}")


class _Pair:
    """The two ranks' shared counters and rings, and the bare exchanges over them."""

    def __init__(self, comm: Any, mpi: Any, piece: int) -> None:
        self.me = comm.rank
        self.peer = 1 - comm.rank
        self.piece = piece // 4  # float32 elements
        ring_bytes = _SLOTS * self.piece * 4
        size = _CONTROL + 2 * ring_bytes
        # MPI's shared window: no file to leave behind if a rank dies.
        self._window = mpi.Win.Allocate_shared(size if comm.rank == 0 else 0, 1, comm=comm)
        memory, _unit = self._window.Shared_query(0)
        self.ctl = np.frombuffer(memory, np.int64, _CONTROL // 8)
        if comm.rank == 0:
            self.ctl[:] = 0
        comm.Barrier()
        rings = [np.frombuffer(memory, np.float32, ring_bytes // 4, _CONTROL + r * ring_bytes)
                 for r in range(2)]
        self.out_ring, self.in_ring = rings[self.me], rings[self.peer]
        self.sent = self.got = 0  # pieces through each ring, ever
        self.done = 0  # pieces of our half reduced in bare cma, ever (the peer counts too)
        self.ops = 0
        self.scratch = np.empty(self.piece, np.float32)
        self.peer_pid = 0
        self.peer_address = 0

    def close(self) -> None:
        self.ctl = self.out_ring = self.in_ring = None  # type: ignore[assignment]
        self._window.Free()

    def _send(self, src: np.ndarray) -> None:
        ctl, k, p = self.ctl, self.sent, self.piece
        _wait(ctl, (_TAIL + self.me) * _LINE, k + 1 - _SLOTS)
        at = (k % _SLOTS) * p
        self.out_ring[at:at + src.size] = src
        self.sent = k + 1
        ctl[(_HEAD + self.me) * _LINE] = k + 1

    def _recv(self, dst: np.ndarray, reduce: bool) -> None:
        ctl, k, p = self.ctl, self.got, self.piece
        _wait(ctl, (_HEAD + self.peer) * _LINE, k + 1)
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
            for at in range(0, src.size, p):  # the halves are the same size
                self._send(src[at:at + p])
                self._recv(dst[at:at + p], reduce)

    def cma(self, x: np.ndarray) -> None:
        """Allreduce (sum) ``x`` by reading the peer's memory, one copy a piece.  Both ranks
        must have entered it after ``x`` was set (a barrier)."""
        mine, other = self._halves(x)
        ctl, p, pid = self.ctl, self.piece, self.peer_pid
        half = x.size // 2
        # Where the peer keeps our half and its own, in its copy of x.
        mine_at = self.peer_address + (0 if self.me == 0 else half * 4)
        other_at = self.peer_address + (half * 4 if self.me == 0 else 0)
        # Both ranks count the same pieces, call after call (sizes may shrink: a count per
        # call would let a smaller call see the last one's counts as its own).
        base = self.done
        for i, at in enumerate(range(0, mine.size, p)):
            part = mine[at:at + p]
            scratch = self.scratch[:part.size]
            cma.read_into(pid, scratch.data.cast("B"), mine_at + at * 4)
            np.add(part, scratch, out=part)
            ctl[(_DONE + self.me) * _LINE] = base + i + 1
        for i, at in enumerate(range(0, other.size, p)):
            _wait(ctl, (_DONE + self.peer) * _LINE, base + i + 1)
            part = other[at:at + p]
            cma.read_into(pid, part.data.cast("B"), other_at + at * 4)
        self.done = base + -(-mine.size // p)
        # The peer may still be reading our reduced half: x stays as it is until it is done.
        self.ops += 1
        ctl[(_END + self.me) * _LINE] = self.ops
        _wait(ctl, (_END + self.peer) * _LINE, self.ops)


def _peer_memory(comm: Any, mpi: Any, peer: int) -> tuple[int, bool]:
    """The peer's pid, and whether both ranks can read each other's memory (a token each
    reads out of the other, as the rings' set-up probes it)."""
    token = np.frombuffer(secrets.token_bytes(64), np.uint8).copy()
    pid, address, expected = comm.sendrecv((os.getpid(), cma.address_of(token),
                                            token.tobytes()), dest=peer, source=peer)
    ok = cma.cma_works() and cma.probe(pid, address, expected)
    return pid, bool(comm.allreduce(ok, op=mpi.LAND))


def _worker(sizes: list[int], reps: int, piece: int) -> None:
    import totalreduce as tr

    tr.init()  # before mpi4py: totalreduce over the rings, MPI beside it
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.size != 2:
        raise SystemExit("bench floor: runs at exactly 2 ranks")
    pair = _Pair(comm, MPI, piece)
    pair.peer_pid, lends = _peer_memory(comm, MPI, pair.peer)
    if not lends and comm.rank == 0:
        print("bench floor: the ranks cannot read each other's memory (process_vm_readv): "
              "no bare cma", file=sys.stderr)
    rows = []
    for size in sizes:
        x = np.empty(size // 4, np.float32)
        # Values that differ element by element, so that a piece read from the wrong place
        # shows: the two ranks' sum is 2 * (i % _CYCLE) + 1.
        start = np.arange(x.size, dtype=np.float32) % _CYCLE
        want = 2 * start + 1
        pair.peer_address = comm.sendrecv(cma.address_of(x), dest=pair.peer,
                                          source=pair.peer)
        runs: dict[str, Callable[[], Any]] = {
            "mpi": functools.partial(comm.Allreduce, MPI.IN_PLACE, x, MPI.SUM),
            "totalreduce": functools.partial(tr.allreduce_, x, op=tr.Sum, name="floor"),
            "bare ring": functools.partial(pair.ring, x),
        }
        if lends:
            runs["bare cma"] = functools.partial(pair.cma, x)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for rep in range(reps + 3):  # three to warm up
            for name, run in runs.items():
                np.add(start, comm.rank, out=x)
                comm.Barrier()
                t = time.perf_counter()
                run()
                took = time.perf_counter() - t
                if not np.array_equal(x, want):
                    raise AssertionError(f"{name} allreduce of {size} bytes came out wrong")
                if rep >= 3:
                    times[name].append(took)
        slowest = {name: np.max(comm.allgather(t), axis=0) for name, t in times.items()}
        rows.append({"bytes": size, "ms": {name: float(np.median(t)) * 1e3
                                          for name, t in slowest.items()}})
    if comm.rank == 0:
        print(json.dumps({"rows": rows, "bare_cma": lends}))
    comm.Barrier()
    pair.close()
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
    # A session of its own: on a timeout the whole job goes, not only mpiexec (a bare
    # exchange left spinning would hold a core).
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        print(f"bench floor: no result after {args.timeout:g} s", file=sys.stderr)
        return 1
    if proc.returncode != 0:
        print(out[-3000:], err[-3000:], sep="\n", file=sys.stderr)
        return 1
    result = json.loads(out.strip().splitlines()[-1])
    rows = result["rows"]
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
            json.dump({"machine": _machine(), "piece": piece, "rows": rows,
                       "bare_cma": result["bare_cma"]}, f, indent=1)
    return 0


def _label(n: int) -> str:
    for unit, shift in (("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main(sys.argv[1:]))
