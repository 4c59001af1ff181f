"""``bench train``: training steps per second of one model under each way of averaging
its gradients.

- ``totalreduce-shm``: totalreduce's DistributedOptimizer (hooks, in-place buckets), once
  per bucket size of the sweep, once with ``overlap=False`` (every bucket reduced when
  ``step()`` synchronizes: what overlapping with backward gains or loses), then once per
  sparse compression (``--sparse``, at ``--density``, default bucket size);
- ``gloo``: torch DDP over gloo (its default 25 MB buckets);
- ``ddp-hook``: the same DDP, its buckets reduced through ``totalreduce.torch.ddp_comm_hook``.

Every rank runs the same fixed random batch: the step time is compute plus whatever
communication the step could not hide.  A repetition is ``steps`` steps; its time is the
slowest rank's.  A job builds all its modes first and times them in turns, one repetition
of each per round, in an order that alternates: a shared machine's speed can drift by
tens of percent from one minute to the next, and modes timed one after the other would
carry that drift into their ratios.

Every job also times the model's step with no communication at all (``compute only``:
every rank computing at once, as in the other modes), and each mode's communication with
nothing else running (``comm alone``: the optimizer's buckets reduced after backward, or
DDP's bucket sizes allreduced over gloo).  The share of communication hidden behind
backward is ``1 - (step - compute only) / comm alone``: 100 % when a step costs no more
than its computation, 0 % when it costs its computation plus the whole communication.
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


def _runtime_bucket_mb() -> float:
    import totalreduce

    from .. import runtime

    assert totalreduce.is_initialized()
    return runtime.current().config.bucket_bytes / (1 << 20)


def _ddp_bucket_sizes(model: Any) -> list[int]:
    """Element counts of DDP's default buckets (1 MB first, then 25 MB) over the
    parameters in reverse order, as DDP's reducer forms them."""
    sizes, current, cap = [], 0, 1 << 20
    for p in reversed(list(model.parameters())):
        current += p.numel()
        if current * 4 >= cap:
            sizes.append(current)
            current, cap = 0, 25 << 20
    return sizes + ([current] if current else [])


# Steps the plain model runs before it is timed: the first ~10 steps of a fresh process
# run 1.3-1.5x slower (the allocator and the page tables settle: 53-63 ms against 40 for
# the MLP), and a bound measured during them would be one the other modes beat.
_COMPUTE_WARMUP = 12


def _interleaved(steps_of: list[Any], barrier: Any, steps: int, reps: int,
                 warmups: list[int]) -> list[list[float]]:
    """Seconds per step of each of ``steps_of``, repetition by repetition in turns."""
    for step, warmup in zip(steps_of, warmups, strict=True):
        for _ in range(warmup):
            step()
    times: list[list[float]] = [[] for _ in steps_of]
    order = list(range(len(steps_of)))
    for rep in range(reps):
        for i in (order if rep % 2 == 0 else order[::-1]):
            barrier()
            t = time.perf_counter()
            for _ in range(steps):
                steps_of[i]()
            times[i].append((time.perf_counter() - t) / steps)
    return times


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
    import gc
    import os

    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)  # the ranks share the host's cores
    batch = cfg["batch_size"]
    out: list[dict[str, Any]] = []
    barrier: Callable[[], Any]
    # (mode, its model and optimizer, steps run before it is timed)
    setups: list[tuple[str, Callable[[], tuple[Any, Any]], int]]
    if backend.startswith("totalreduce"):
        import totalreduce.torch as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        barrier = hvd.barrier
        def optimizer(**kw: Any) -> Callable[[], tuple[Any, Any]]:
            def make() -> tuple[Any, Any]:
                model = _model(cfg["model"])
                opt = hvd.DistributedOptimizer(
                    torch.optim.SGD(model.parameters(), lr=1e-4),
                    named_parameters=model.named_parameters(), **kw)
                return model, opt
            return make

        def sparse(alg: str) -> tuple[str, Callable[[], tuple[Any, Any]], int]:
            compression = getattr(hvd.Compression, alg)(density=cfg["density"])
            # Its dense warm-up calls (Ok-Topk's first 10) are not the mode being timed.
            return (f"{alg} {cfg['density']:g}", optimizer(compression=compression),
                    3 + compression.algorithm.dense_calls)

        setups = [(f"optimizer {mb:g}MB", optimizer(bucket_bytes=int(mb * (1 << 20))), 3)
                  for mb in cfg["buckets_mb"]]
        setups.append(("optimizer, reduced at step", optimizer(overlap=False), 3))
        setups += [sparse(alg) for alg in cfg["sparse"]]
        default_mb = _runtime_bucket_mb()
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
        setups = [("DDP + totalreduce hook" if backend == "ddp-hook" else "DDP", make_ddp, 3)]
    x, y = _batch(cfg["model"], batch)

    def stepper(model: Any, opt: Any) -> Callable[[], None]:
        def step() -> None:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        return step

    base = _model(cfg["model"])
    built = [("compute only", base, torch.optim.SGD(base.parameters(), lr=1e-4),
              _COMPUTE_WARMUP)]
    for mode, build, warmup in setups:
        model, opt = build()
        built.append((mode, model, opt, warmup))
    times = _interleaved([stepper(m, o) for _, m, o, _ in built], barrier, cfg["steps"],
                         cfg["reps"], [w for *_, w in built])
    out.append({"model": cfg["model"], "mode": "compute only", "batch": batch,
                "times": times[0]})
    for (mode, model, opt, _), mode_times in zip(built[1:], times[1:], strict=True):
        if hasattr(opt, "synchronize"):
            # The buckets reduced with backward over: what overlap has to hide.
            alone = _time_steps(lambda opt=opt: opt.synchronize(force=True), barrier,
                                cfg["steps"], cfg["reps"], warmup=1)
        else:
            flats = [torch.zeros(n) for n in _ddp_bucket_sizes(model)]
            alone = _time_steps(lambda flats=flats: [dist.all_reduce(f) for f in flats],
                                barrier, cfg["steps"], cfg["reps"], warmup=1)
        row = {"model": cfg["model"], "mode": mode, "batch": batch, "times": mode_times,
               "alone": alone}
        if backend.startswith("totalreduce") and not mode.startswith("optimizer "):
            row["versus"] = f"optimizer {default_mb:g}MB"  # the dense run it compares with
        out.append(row)
    # Every DDP model gone before its process group: a DDP reducer that outlives it
    # aborted the process at exit ("terminate called without an active exception") in
    # one gloo job of several.
    del built
    model = opt = None
    gc.collect()
    if backend.startswith("totalreduce"):
        hvd.shutdown()
    else:
        if backend == "ddp-hook":
            hvd.shutdown()
        dist.destroy_process_group()
    return rank, size, out
