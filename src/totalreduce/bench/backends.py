"""The libraries under test, behind one small interface, as seen from inside one rank.

``totalreduce-*`` backends use totalreduce's public API; ``mpi`` is mpi4py's native
collectives (MPICH's own algorithms, shared memory included) and ``gloo`` is
``torch.distributed`` with the gloo backend.  Every call is in place or into a buffer
allocated once, except where totalreduce's API itself returns a new array.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from .buffers import float32s

Step = Callable[[], None]

# What Backend.small_calls' object collectives send: a training loop's metrics.
_SMALL_OBJECT = {"epoch": 3, "step": 1200, "loss": 0.25, "accuracy": 0.97}


class Backend:
    name = ""
    rank = 0
    size = 1

    def barrier(self) -> None:
        raise NotImplementedError

    def collective(self, op: str, count: int, arrays: str = "numpy") -> Step:
        """A closure running one ``op`` on preallocated float32 buffers of ``count``,
        made as ``arrays`` says (buffers.py)."""
        raise NotImplementedError

    def replay_modes(self, grads: list[np.ndarray], flat: np.ndarray,
                     bucket_bytes: int) -> dict[str, Step]:
        """One iteration's gradient reduction, per mode.  ``grads`` are views of ``flat``,
        listed in the order backward produces them."""
        raise NotImplementedError

    def submit_when_ready(self, grads: list[np.ndarray], order: list[int],
                          ready: list[float], t0: float) -> None:
        """Skew: reduce each gradient as soon as this rank has it (``ready[i]`` seconds
        after ``t0``), in this rank's own order; return when all are reduced."""
        raise NotImplementedError

    def preempt(self, big: np.ndarray | None, small: np.ndarray, delay: float,
                priorities: bool) -> float:
        """Latency (s) of ``small``'s allreduce, issued ``delay`` s after ``big``'s (after
        ``delay`` s of nothing where ``big`` is None)."""
        raise NotImplementedError

    def tiny(self, count: int) -> Step:
        """``count`` async allreduces of one float32 each, submitted, then all waited."""
        raise NotImplementedError

    def small_calls(self) -> dict[str, Step]:
        """Latency-bound calls besides the 8-byte allreduce and the barrier, by mode, as
        the library's users make them: an allgather of 8 bytes whose ranks' rows may
        differ (the rows gathered first, as Horovod's allgather does over MPI), and the
        object collectives of a small dict (a metric, a step count)."""
        return {}

    def close(self) -> None:
        pass


def _sleep_until(t: float) -> None:
    import time

    left = t - time.perf_counter()
    if left > 0:
        time.sleep(left)


class TotalReduceBackend(Backend):
    def __init__(self, name: str) -> None:
        import totalreduce as tr

        self.name = name
        self.tr = tr
        tr.init()
        self.rank, self.size = tr.rank(), tr.size()

    def barrier(self) -> None:
        self.tr.barrier()

    def collective(self, op: str, count: int, arrays: str = "numpy") -> Step:
        tr = self.tr
        x = float32s(count, arrays)
        if op == "allreduce":
            return lambda: tr.allreduce_(x, op=tr.Sum, name="bench")
        # Results go into arrays made once, as MPI's do: a new big array a call costs its
        # pages' first touch, as much as the copies (both kinds are in the API).  Every
        # rank's block has the same size, as MPI_Allgather and MPI_Alltoall are told
        # (same_shape=True): no size exchange.
        if op == "allgather":
            part = x[: count // self.size]
            gathered = float32s(part.size * self.size, arrays, None)
            return lambda: tr.allgather(part, name="bench", out=gathered, same_shape=True)
        if op == "broadcast":
            return lambda: tr.broadcast_(x, root_rank=0, name="bench")
        if op == "alltoall":
            swapped = float32s(x.size, arrays, None)
            return lambda: tr.alltoall(x, name="bench", out=swapped, same_shape=True)
        if op == "reducescatter":
            return lambda: tr.reducescatter(x, op=tr.Sum, name="bench")
        raise ValueError(op)

    def replay_modes(self, grads: list[np.ndarray], flat: np.ndarray,
                     bucket_bytes: int) -> dict[str, Step]:
        tr = self.tr
        names = [f"grad.{i}" for i in range(len(grads))]
        buckets: list[list[int]] = [[]]
        filled = 0
        for i, g in enumerate(grads):
            if filled and filled + g.nbytes > bucket_bytes:
                buckets.append([])
                filled = 0
            buckets[-1].append(i)
            filled += g.nbytes

        def per_tensor() -> None:
            handles = [tr.allreduce_async_(g, op=tr.Sum, name=n)
                       for g, n in zip(grads, names, strict=True)]
            for h in handles:
                h.wait()

        def grouped() -> None:
            handles = [tr.grouped_allreduce_async_([grads[i] for i in b], op=tr.Sum,
                                                   name=f"bucket.{k}")
                       for k, b in enumerate(buckets)]
            for h in handles:
                h.wait()

        def one_flat() -> None:
            tr.allreduce_(flat, op=tr.Sum, name="flat")

        modes = {"per-tensor": per_tensor, f"grouped {bucket_bytes >> 20}MB": grouped,
                 "flat": one_flat}
        optimizer = self._optimizer_mode(grads, bucket_bytes)
        if optimizer is not None:
            modes[f"optimizer {bucket_bytes >> 20}MB"] = optimizer
        return modes

    def _optimizer_mode(self, grads: list[np.ndarray], bucket_bytes: int) -> Step | None:
        """The torch DistributedOptimizer's buckets reduced at ``synchronize()``, as if
        backward had just ended (None without torch)."""
        if importlib.util.find_spec("torch") is None:
            return None
        import torch

        import totalreduce.torch as hvd

        # Forward order (grads come in backward order); the optimizer reverses it again.
        params = [torch.nn.Parameter(torch.from_numpy(g)) for g in reversed(grads)]
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.0), op=hvd.Sum,
                                       bucket_bytes=bucket_bytes)
        opt.zero_grad()
        return lambda: opt.synchronize(force=True)

    def submit_when_ready(self, grads: list[np.ndarray], order: list[int],
                          ready: list[float], t0: float) -> None:
        tr = self.tr
        handles = []
        for i in order:
            _sleep_until(t0 + ready[i])
            handles.append(tr.allreduce_async_(grads[i], op=tr.Sum, name=f"grad.{i}"))
        for h in handles:
            h.wait()

    def preempt(self, big: np.ndarray | None, small: np.ndarray, delay: float,
                priorities: bool) -> float:
        import time

        tr = self.tr
        hbig = None if big is None else tr.allreduce_async_(big, op=tr.Sum, name="big",
                                                            priority=0)
        time.sleep(delay)
        t = time.perf_counter()
        tr.allreduce_(small, op=tr.Sum, name="small", priority=10 if priorities else 0)
        latency = time.perf_counter() - t
        if hbig is not None:
            hbig.wait()
        return latency

    def tiny(self, count: int) -> Step:
        tr = self.tr
        xs = [np.ones(1, np.float32) for _ in range(count)]
        names = [f"tiny.{i}" for i in range(count)]

        def step() -> None:
            handles = [tr.allreduce_async_(x, op=tr.Sum, name=nm)
                       for x, nm in zip(xs, names, strict=True)]
            for h in handles:
                h.wait()
        return step

    def small_calls(self) -> dict[str, Step]:
        tr = self.tr
        x = np.ones(2, np.float32)
        obj = _SMALL_OBJECT
        return {"allgather 8 B, rows gathered": lambda: tr.allgather(x, name="rows"),
                "allgather_object": lambda: tr.allgather_object(obj),
                "broadcast_object": lambda: tr.broadcast_object(obj, root_rank=0)}

    def close(self) -> None:
        self.tr.shutdown()


class MpiBackend(Backend):
    name = "mpi"

    def __init__(self) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def barrier(self) -> None:
        self.comm.Barrier()

    def collective(self, op: str, count: int, arrays: str = "numpy") -> Step:
        MPI, comm, n = self.MPI, self.comm, self.size
        x = float32s(count, arrays)
        if op == "allreduce":
            return lambda: comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM)
        if op == "allgather":
            part, out = x[: count // n], float32s(count // n * n, arrays, None)
            return lambda: comm.Allgather(part, out)
        if op == "broadcast":
            return lambda: comm.Bcast(x, root=0)
        if op == "alltoall":
            y = x[: count // n * n]
            out = float32s(y.size, arrays, None)
            return lambda: comm.Alltoall(y, out)
        if op == "reducescatter":
            y = x[: count // n * n]
            out = float32s(count // n, arrays, None)
            return lambda: comm.Reduce_scatter_block(y, out, MPI.SUM)
        raise ValueError(op)

    def replay_modes(self, grads: list[np.ndarray], flat: np.ndarray,
                     bucket_bytes: int) -> dict[str, Step]:
        MPI, comm = self.MPI, self.comm

        def per_tensor() -> None:
            reqs = [comm.Iallreduce(MPI.IN_PLACE, g, MPI.SUM) for g in grads]
            MPI.Request.Waitall(reqs)

        def one_flat() -> None:
            comm.Allreduce(MPI.IN_PLACE, flat, MPI.SUM)

        return {"per-tensor": per_tensor, "flat": one_flat}

    def submit_when_ready(self, grads: list[np.ndarray], order: list[int],
                          ready: list[float], t0: float) -> None:
        # MPI collectives must be issued in the same order everywhere: take the tensors in
        # backward order, each once this rank has it (a rank's own order cannot be used).
        MPI, comm = self.MPI, self.comm
        reqs = []
        for i in range(len(grads)):
            _sleep_until(t0 + ready[i])
            reqs.append(comm.Iallreduce(MPI.IN_PLACE, grads[i], MPI.SUM))
        MPI.Request.Waitall(reqs)

    def preempt(self, big: np.ndarray | None, small: np.ndarray, delay: float,
                priorities: bool) -> float:
        import time

        MPI, comm = self.MPI, self.comm
        rbig = None if big is None else comm.Iallreduce(MPI.IN_PLACE, big, MPI.SUM)
        time.sleep(delay)
        t = time.perf_counter()
        comm.Iallreduce(MPI.IN_PLACE, small, MPI.SUM).Wait()
        latency = time.perf_counter() - t
        if rbig is not None:
            rbig.Wait()
        return latency

    def tiny(self, count: int) -> Step:
        MPI, comm = self.MPI, self.comm
        xs = [np.ones(1, np.float32) for _ in range(count)]

        def step() -> None:
            MPI.Request.Waitall([comm.Iallreduce(MPI.IN_PLACE, x, MPI.SUM) for x in xs])
        return step

    def small_calls(self) -> dict[str, Step]:
        MPI, comm, n = self.MPI, self.comm, self.size
        x = np.ones(2, np.float32)
        rows = np.array([x.size], np.int64)
        counts = np.zeros(n, np.int64)
        out = np.empty(2 * n, np.float32)
        obj = _SMALL_OBJECT

        def allgather_rows() -> None:
            comm.Allgather(rows, counts)
            comm.Allgatherv(x, [out, counts.tolist(), None, MPI.FLOAT])
        return {"allgather 8 B, rows gathered": allgather_rows,
                "allgather_object": lambda: comm.allgather(obj),
                "broadcast_object": lambda: comm.bcast(obj, root=0)}


class GlooBackend(Backend):
    name = "gloo"

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        self.torch = torch
        self.dist = dist
        rank = int(os.environ["TOTALREDUCE_RANK"])
        size = int(os.environ["TOTALREDUCE_SIZE"])
        dist.init_process_group("gloo", init_method=os.environ["BENCH_GLOO_INIT"],
                                rank=rank, world_size=size)
        self.rank, self.size = rank, size

    def barrier(self) -> None:
        self.dist.barrier()

    def collective(self, op: str, count: int, arrays: str = "numpy") -> Step:
        torch, dist, n = self.torch, self.dist, self.size

        def empty(k: int) -> Any:  # torch's own allocation, as a torch user's
            return torch.empty(k) if arrays == "numpy" else \
                torch.from_numpy(float32s(k, arrays, None))

        x = torch.ones(count, dtype=torch.float32) if arrays == "numpy" else \
            torch.from_numpy(float32s(count, arrays))
        if op == "allreduce":
            return lambda: dist.all_reduce(x)
        if op == "allgather":
            part, out = x[: count // n], empty(count // n * n)
            return lambda: dist.all_gather_into_tensor(out, part)
        if op == "broadcast":
            return lambda: dist.broadcast(x, src=0)
        if op == "alltoall":
            y = x[: count // n * n]
            out = empty(y.numel())
            return lambda: dist.all_to_all_single(out, y)
        if op == "reducescatter":
            y = x[: count // n * n]
            out = empty(count // n)
            return lambda: dist.reduce_scatter_tensor(out, y)
        raise ValueError(op)

    def replay_modes(self, grads: list[np.ndarray], flat: np.ndarray,
                     bucket_bytes: int) -> dict[str, Step]:
        torch, dist = self.torch, self.dist
        tensors = [torch.from_numpy(g) for g in grads]
        tflat = torch.from_numpy(flat)

        def per_tensor() -> None:
            works = [dist.all_reduce(t, async_op=True) for t in tensors]
            for w in works:
                w.wait()

        def one_flat() -> None:
            dist.all_reduce(tflat)

        return {"per-tensor": per_tensor, "flat": one_flat}

    def submit_when_ready(self, grads: list[np.ndarray], order: list[int],
                          ready: list[float], t0: float) -> None:
        torch, dist = self.torch, self.dist
        works = []
        for i in range(len(grads)):  # like MPI: one common order
            _sleep_until(t0 + ready[i])
            works.append(dist.all_reduce(torch.from_numpy(grads[i]), async_op=True))
        for w in works:
            w.wait()

    def preempt(self, big: np.ndarray | None, small: np.ndarray, delay: float,
                priorities: bool) -> float:
        import time

        torch, dist = self.torch, self.dist
        wbig = None if big is None else dist.all_reduce(torch.from_numpy(big), async_op=True)
        time.sleep(delay)
        t = time.perf_counter()
        dist.all_reduce(torch.from_numpy(small))
        latency = time.perf_counter() - t
        if wbig is not None:
            wbig.wait()
        return latency

    def tiny(self, count: int) -> Step:
        torch, dist = self.torch, self.dist
        xs = [torch.ones(1, dtype=torch.float32) for _ in range(count)]

        def step() -> None:
            for work in [dist.all_reduce(x, async_op=True) for x in xs]:
                work.wait()
        return step

    def small_calls(self) -> dict[str, Step]:
        dist = self.dist
        obj = _SMALL_OBJECT
        gathered: list[Any] = [None] * self.size
        return {"allgather_object": lambda: dist.all_gather_object(gathered, obj),
                "broadcast_object": lambda: dist.broadcast_object_list([obj], src=0)}

    def close(self) -> None:
        self.dist.destroy_process_group()


def make_backend(name: str) -> Backend:
    if name.startswith("totalreduce"):
        return TotalReduceBackend(name)
    if name == "mpi":
        return MpiBackend()
    if name == "gloo":
        return GlooBackend()
    raise ValueError(f"unknown backend {name!r}")
