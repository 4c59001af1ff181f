"""Worker functions for the parameter-server tests: every rank runs one; servers serve
inside ``ps.start`` and leave from there, workers train and report."""

from __future__ import annotations

import os
import signal
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


PUSHES_BEFORE_KILL = 11  # pushes (of any key) the victim server takes, then it is killed
KILL_KEYS = {"a": 11, "z": 1}  # z: smaller than the server count


def kill_push(key: str, worker: int, step: int) -> np.ndarray:
    """Worker ``worker``'s push of ``key`` at ``step``: integers unique to the push, so
    the final weights show each one counted exactly once."""
    n = KILL_KEYS[key]
    return (worker + 1) * 100_000 + step * 100 + np.arange(n, dtype=np.int64) % 7


def add(name: str, weights: np.ndarray, grad: np.ndarray, state: dict) -> None:
    """A deterministic updater: the weights are the sum of every push taken."""
    state["pushes"] = state.get("pushes", 0) + 1
    weights += grad


def through_a_kill(arg: dict) -> None:
    """Training through a SIGKILL of rank ``victim``'s first life: a server dies after
    taking PUSHES_BEFORE_KILL pushes (its replacement takes over its share from its
    peer), a worker between its two pushes of iteration 3 (its replacement goes on
    from where it stopped)."""
    attempt = int(os.environ.get("TOTALREDUCE_ATTEMPT", "0"))
    tr.init()
    if tr.rank() == arg["victim"] and attempt == 0:
        from totalreduce.ps.server import Server
        taken = Server._from_worker
        count = [0]

        def counting(self, request, payload, worker):  # type: ignore[no-untyped-def]
            if request.op == 2:  # Op.PUSH
                count[0] += 1
                if count[0] > arg.get("kill_after", PUSHES_BEFORE_KILL):
                    os.kill(os.getpid(), signal.SIGKILL)
            taken(self, request, payload, worker)

        Server._from_worker = counting  # type: ignore[method-assign]
    ps.start(updater=add, max_delay=arg["max_delay"])
    me = ps.worker_rank()
    report(**{f"pid{attempt}": os.getpid()})
    for key, n in KILL_KEYS.items():
        ps.init(key, np.zeros(n, np.int64))
    for step in range(ps.iterations_done(), arg["steps"]):
        for key in KILL_KEYS:
            ps.push(key, kill_push(key, me, step))
            if tr.rank() == arg["victim"] and attempt == 0 and step == 3:
                os.kill(os.getpid(), signal.SIGKILL)
        ps.clock()
    ps.clock()  # at max_delay 0: every worker has pushed everything
    workers = ps.num_workers()
    expected = {key: sum(kill_push(key, w, t) for w in range(workers)
                         for t in range(arg["steps"])) for key in KILL_KEYS}
    deadline = time.monotonic() + 30
    while True:  # without a delay bound, the others' last pushes may be on their way
        got = {key: ps.pull(key) for key in KILL_KEYS}
        if all(np.array_equal(got[k], expected[k]) for k in KILL_KEYS) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    report(ok=True, **{key: value.tolist() for key, value in got.items()})
    ps.finish()
