"""``bench train``: training steps per second of one model under each way of averaging
its gradients.

- ``totalreduce-shm``: totalreduce's DistributedOptimizer (hooks, in-place buckets), once
  per bucket size of the sweep;
- ``gloo``: torch DDP over gloo (its default 25 MB buckets);
- ``ddp-hook``: the same DDP, its buckets reduced through ``totalreduce.torch.ddp_comm_hook``.

Every rank runs the same fixed random batch: the step time is compute plus whatever
communication the step could not hide.  A repetition is ``steps`` steps; its time is the
slowest rank's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

_IN = 1024  # the MLP's input width


def _model(name: str) -> Any:
    import torch

    torch.manual_seed(0)
    if name == "mlp":
        # 12.6 M parameters (50 MB of gradients) and little compute per sample: the
        # reduction is most of a step, so hiding it shows.
        return torch.nn.Sequential(
            torch.nn.Linear(_IN, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
            torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
            torch.nn.Linear(2048, 1000))
    if name == "convnet":
        # Compute-heavy for its 1.2 M parameters: communication is a small share.
        layers: list[Any] = []
        cin = 3
        for cout in (32, 64, 128, 256):
            layers += [torch.nn.Conv2d(cin, cout, 3, padding=1), torch.nn.BatchNorm2d(cout),
                       torch.nn.ReLU(), torch.nn.MaxPool2d(2)]
            cin = cout
        layers += [torch.nn.Flatten(), torch.nn.Linear(256 * 2 * 2, 1000)]
        return torch.nn.Sequential(*layers)
    raise ValueError(f"unknown model {name!r}; use mlp or convnet")


def _batch(name: str, size: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    x = torch.randn(size, _IN, generator=g) if name == "mlp" else \
        torch.randn(size, 3, 32, 32, generator=g)
    return x, torch.randint(0, 1000, (size,), generator=g)


def _time_steps(step: Any, barrier: Any, steps: int, reps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        barrier()
        t = time.perf_counter()
        for _ in range(steps):
            step()
        times.append((time.perf_counter() - t) / steps)
    return times


def train(backend: str, cfg: dict[str, Any]) -> tuple[int, int, list[dict[str, Any]]]:
    """Run the sweep for ``backend``; returns (rank, size, results)."""
    import os

    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)  # the ranks share the host's cores
    batch = cfg["batch_size"]
    out: list[dict[str, Any]] = []
    barrier: Callable[[], Any]
    setups: list[tuple[str, Callable[[], tuple[Any, Any]]]]
    if backend.startswith("totalreduce"):
        import totalreduce.torch as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        barrier = hvd.barrier
        setups = []
        for mb in cfg["buckets_mb"]:
            def make(mb: float = mb) -> tuple[Any, Any]:
                model = _model(cfg["model"])
                opt = hvd.DistributedOptimizer(
                    torch.optim.SGD(model.parameters(), lr=1e-4),
                    named_parameters=model.named_parameters(),
                    bucket_bytes=int(mb * (1 << 20)))
                return model, opt
            setups.append((f"optimizer {mb:g}MB", make))
    else:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        rank = int(os.environ["TOTALREDUCE_RANK"])
        size = int(os.environ["TOTALREDUCE_SIZE"])
        dist.init_process_group("gloo", init_method=os.environ["BENCH_GLOO_INIT"],
                                rank=rank, world_size=size)
        barrier = dist.barrier
        if backend == "ddp-hook":
            import totalreduce.torch as hvd

            hvd.init()

        def make_ddp() -> tuple[Any, Any]:
            model = DDP(_model(cfg["model"]))
            if backend == "ddp-hook":
                model.register_comm_hook(None, hvd.ddp_comm_hook)
            return model, torch.optim.SGD(model.parameters(), lr=1e-4)
        setups = [("DDP + totalreduce hook" if backend == "ddp-hook" else "DDP", make_ddp)]
    x, y = _batch(cfg["model"], batch)
    for mode, build in setups:
        model, opt = build()

        def step(model: Any = model, opt: Any = opt) -> None:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()

        times = _time_steps(step, barrier, cfg["steps"], cfg["reps"], warmup=3)
        out.append({"model": cfg["model"], "mode": mode, "batch": batch, "times": times})
        del model, opt
    if backend.startswith("totalreduce"):
        hvd.shutdown()
    else:
        if backend == "ddp-hook":
            hvd.shutdown()
        dist.destroy_process_group()
    return rank, size, out
