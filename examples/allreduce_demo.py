"""The numpy demo job: a few collectives, checked, and the allreduce bandwidth.

    totalrun -np 4 python examples/allreduce_demo.py
"""

from __future__ import annotations

import time

import numpy as np

import totalreduce as tr


def main() -> None:
    tr.init()
    rank, n = tr.rank(), tr.size()

    x = np.arange(5, dtype=np.float32) + rank
    avg = tr.allreduce(x, name="demo.avg")                    # Average is the default
    total = tr.allreduce(x, op=tr.Sum, name="demo.sum")
    gathered = tr.allgather(np.full((rank + 1, 2), rank, np.int32))
    if rank == 0:
        print(f"world of {n} ranks")
        print(f"allreduce Average of arange(5) + rank: {avg}")
        print(f"allreduce Sum:                         {total}")
        print(f"allgather of (rank+1) rows of rank:    {gathered[:, 0].tolist()}")
    expected = np.arange(5) * n + n * (n - 1) / 2
    assert np.allclose(total, expected), (total, expected)

    for mib in (1, 16, 64):
        buf = np.ones((mib << 20) // 4, np.float32)
        # One name for every call, as a training loop gives a gradient each step: the
        # first calls of a name set up what the later ones reuse (a name per call would
        # time that set-up every time).
        name = f"bw.{mib}"
        for _ in range(3):
            tr.allreduce_(buf, op=tr.Sum, name=name)
        times = []
        for _ in range(20):
            tr.barrier()
            t0 = time.perf_counter()
            tr.allreduce_(buf, op=tr.Sum, name=name)
            times.append(time.perf_counter() - t0)
        best = float(np.median(times))
        algbw = buf.nbytes / best / 1e9
        busbw = algbw * 2 * (n - 1) / n
        if rank == 0:
            print(f"allreduce {mib:3d} MiB float32: median {best * 1e3:8.2f} ms  "
                  f"algbw {algbw:6.2f} GB/s  busbw {busbw:6.2f} GB/s")
    tr.shutdown()


if __name__ == "__main__":
    main()
