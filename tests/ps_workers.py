"""Worker functions for the parameter-server tests: every rank runs one; servers serve
inside ``ps.start`` and leave from there, workers train and report."""

from __future__ import annotations

import time

import numpy as np

import totalreduce as tr
import totalreduce.ps as ps
from message_workers import _failure
from reporting import report

SHAPES = {"w": (13, 3), "b": (1,)}  # b: smaller than the server count


def problem(worker: int, seed: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """Worker ``worker``'s shard of a linear least-squares problem."""
    rng = np.random.default_rng(seed + worker)
    x = rng.standard_normal((9 + worker, 13))  # shards of unequal length
    return x, rng.standard_normal((9 + worker, 3))


def gradients(x: np.ndarray, y: np.ndarray, w: np.ndarray, b: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
    err = x @ w + b - y
    return x.T @ err / len(x), np.array([err.mean()])


def start_weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {name: rng.standard_normal(shape) for name, shape in SHAPES.items()}


def train(arg: dict) -> None:
    """SGD on the linear problem through the servers; reports the final weights and, at
    every clock, how far this worker was ahead of the slowest."""
    ps.start(updater="sgd", lr=arg["lr"], max_delay=arg["max_delay"])
    me = ps.worker_rank()
    x, y = problem(me)
    # Worker 0's value wins: the others offer garbage.
    mine = start_weights() if me == 0 else {n: np.full(s, 7.0) for n, s in SHAPES.items()}
    w, b = ps.init("w", mine["w"]), ps.init("b", mine["b"])
    started = {"w": w.tolist(), "b": b.tolist()}
    leads, slow = [], arg.get("straggler")
    compression = ps.TopK(arg["topk"]) if "topk" in arg else None
    for step in range(arg["steps"]):
        if me == slow:
            time.sleep(0.03)
        gw, gb = gradients(x, y, w, b)
        ps.push("w", gw, compression=compression)
        ps.push("b", gb)
        leads.append(step + 1 - ps.clock())  # iterations finished here, by the slowest
        w, b = ps.pull("w"), ps.pull("b")
    ps.finish()
    report(ok=True, w=w.tolist(), b=b.tolist(), started=started, leads=leads)



def refusals(arg: dict) -> None:
    """Bad pushes and inits: each refused with a clear error, the key unchanged."""
    ps.start(updater="sgd", lr=0.5)
    me = ps.worker_rank()
    k = ps.init("k", np.arange(10, dtype=np.float32))
    ps.init("i", np.arange(3))
    bad = {
        "outside": _failure(lambda: ps.push("k", np.ones(4, np.float32), lo=8, hi=12)),
        "dtype": _failure(lambda: ps.push("k", np.ones(10, np.float64))),
        "count": _failure(lambda: ps.push("k", np.ones(3, np.float32), lo=0, hi=4)),
        "unknown": _failure(lambda: ps.push("nope", np.ones(3, np.float32))),
        "fp16_int": _failure(lambda: ps.push("i", np.arange(3), compression="fp16")),
    }
    ps.clock()  # every worker has made its bad pushes
    unchanged = ps.pull("k")
    # Worker 0 makes "m" float32; once everyone is past the clock, worker 1 tries float64.
    if me == 0:
        ps.init("m", np.zeros(5, np.float32))
    ps.clock()
    clash = _failure(lambda: ps.init("m", np.zeros(5, np.float64))) if me == 1 else ""
    # A range push and a range pull: [3, 7) crosses the boundary between the two servers.
    ps.clock()
    if me == 0:
        ps.push("k", np.full(4, 2.0, np.float32), lo=3, hi=7)
    ps.clock()
    ranged = ps.pull("k", 2, 8)
    among = tr.allreduce(np.ones(3), op=tr.Sum, process_set=ps.workers())
    report(ok=True, bad=bad, k=k.tolist(), unchanged=unchanged.tolist(), clash=clash,
           ranged=ranged.tolist(), workers=ps.num_workers(), among=among.tolist())
