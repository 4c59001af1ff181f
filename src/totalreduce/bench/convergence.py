"""``bench convergence``: test accuracy of the digits MLP against epochs and against bytes
sent, per way of averaging its gradients.

- ``totalreduce-shm`` jobs train with the DistributedOptimizer: dense (``none``), or a
  sparse compression (``oktopk``, ``topka``, ``gtopk``) at each density.  Bytes are the
  transport's own count of what this rank sent (``totalreduce.transport_stats()``).
- ``gloo`` jobs train with torch DDP over gloo and torch's PowerSGD communication hook
  (rank-2 approximation, vanilla allreduce for the first 10 steps, as Ok-Topk's dense
  warm-up).  gloo keeps no
  byte count, so its bytes are computed: what the hook hands to ``all_reduce``, times
  2(P-1)/P, the per-rank volume of a ring allreduce.

Every job trains the same model from the same seed on its rank's shard of the scikit-learn
digits set (as ``examples/train_digits.py`` does), with that example's learning rates:
SGD at 0.05 per rank and momentum 0.9 for dense and PowerSGD (which keeps its own error
feedback), and plain SGD at 0.25 per rank for the sparse methods, whose residuals already
carry held-back gradients forward.
"""

from __future__ import annotations

import os
import time
from typing import Any

SPARSE = ("oktopk", "topka", "gtopk")


def digits_mlp(hidden: tuple[int, int] = (256, 128)) -> Any:
    """The digits example's MLP (64-256-128-10, 50,890 parameters), or one as wide as
    ``hidden`` says (2048, 2048: 4,350,986 parameters)."""
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden[0]), torch.nn.ReLU(),
        torch.nn.Linear(hidden[0], hidden[1]), torch.nn.ReLU(),
        torch.nn.Linear(hidden[1], 10))


def _data(rank: int, size: int) -> tuple[Any, Any, Any, Any]:
    import numpy as np
    import torch
    from sklearn.datasets import load_digits  # type: ignore[import-untyped]
    from sklearn.model_selection import train_test_split  # type: ignore[import-untyped]

    digits = load_digits()
    x = digits.data.astype(np.float32) / 16.0
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.25, random_state=0, stratify=digits.target)
    return (torch.from_numpy(x_train[rank::size]), torch.from_numpy(y_train[rank::size]),
            torch.from_numpy(x_test[rank::size]), torch.from_numpy(y_test[rank::size]))


def _methods(cfg: dict[str, Any], backend: str) -> list[tuple[str, str, float]]:
    """(label, method, density) of every run this backend's job makes."""
    if backend == "gloo":
        return [("PowerSGD (torch DDP hook, rank 2)", "powersgd", 0.0)]
    runs = [("dense", "none", 1.0)]
    for method in cfg["methods"]:
        for density in cfg["densities"]:
            runs.append((f"{method} {density:g}", method, density))
    return runs


def convergence(backend: str, cfg: dict[str, Any]) -> tuple[int, int, list[dict[str, Any]]]:
    import torch

    torch.set_num_threads(1)  # the ranks share the host's cores
    if backend == "gloo":
        import torch.distributed as dist

        rank = int(os.environ["TOTALREDUCE_RANK"])
        size = int(os.environ["TOTALREDUCE_SIZE"])
        dist.init_process_group("gloo", init_method=os.environ["BENCH_GLOO_INIT"],
                                rank=rank, world_size=size)
    else:
        import totalreduce.torch as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    out = []
    for label, method, density in _methods(cfg, backend):
        curve = _train(method, density, rank, size, cfg)
        out.append({"mode": label, "curve": curve})
    if backend == "gloo":
        dist.destroy_process_group()
    else:
        hvd.shutdown()
    return rank, size, out


def _train(method: str, density: float, rank: int, size: int, cfg: dict[str, Any]
           ) -> list[dict[str, float]]:
    """One training run; per epoch: accuracy on the whole test set, bytes this rank
    sent so far, seconds so far."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    x_train, y_train, x_test, y_test = _data(rank, size)
    net = digits_mlp(tuple(cfg.get("hidden", (256, 128))))  # type: ignore[arg-type]
    sparse = method in SPARSE
    lr, momentum = (0.25, 0.0) if sparse else (0.05, 0.9)
    if method == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(net)
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                   start_powerSGD_iter=10)
        net.register_comm_hook(state, psgd.powerSGD_hook)
        optimizer: Any = torch.optim.SGD(net.parameters(), lr=lr * size, momentum=momentum)
        reduce_sum = _gloo_sum
    else:
        import totalreduce.torch as hvd

        sgd = torch.optim.SGD(net.parameters(), lr=lr * size, momentum=momentum)
        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
        compression = getattr(hvd.Compression, method)(density=density) \
            if sparse else hvd.Compression.none
        optimizer = hvd.DistributedOptimizer(
            sgd, named_parameters=net.named_parameters(), compression=compression)
        reduce_sum = _totalreduce_sum
    steps = int(reduce_sum(torch.tensor([float(len(x_train))]), min_=True)) // cfg["batch"]
    curve = []
    sent = _Bytes(method == "powersgd", size)  # from here: the set-up's broadcasts do not count
    start = time.perf_counter()
    for epoch in range(1, cfg["epochs"] + 1):
        net.train()
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        for i in range(steps):
            idx = order[i * cfg["batch"]:(i + 1) * cfg["batch"]]
            optimizer.zero_grad()
            F.cross_entropy(net(x_train[idx]), y_train[idx]).backward()
            optimizer.step()
        net.eval()
        with torch.no_grad():
            correct = float((net(x_test).argmax(1) == y_test).sum())
        totals = reduce_sum(torch.tensor([correct, float(len(y_test))]))
        curve.append({"epoch": epoch, "accuracy": float(totals[0] / totals[1]),
                      "bytes_sent": sent.total(), "seconds": time.perf_counter() - start})
    sent.close()
    return curve


def _totalreduce_sum(t: Any, min_: bool = False) -> Any:
    import totalreduce.torch as hvd

    return hvd.allreduce(t, op=hvd.Min if min_ else hvd.Sum, name="bench.metrics")


def _gloo_sum(t: Any, min_: bool = False) -> Any:
    import torch.distributed as dist

    _uncounted(dist)(t, op=dist.ReduceOp.MIN if min_ else dist.ReduceOp.SUM)
    return t


def _uncounted(dist: Any) -> Any:
    return getattr(dist.all_reduce, "uncounted", dist.all_reduce)


class _Bytes:
    """Bytes this rank has sent: the transport's count for totalreduce; for DDP over
    gloo, what goes to ``all_reduce`` (the hook calls it, also from its futures'
    callbacks) times a ring allreduce's 2(P-1)/P."""

    def __init__(self, gloo: bool, size: int) -> None:
        self._gloo = gloo
        self._size = size
        self._payload = 0
        if gloo:
            import torch.distributed as dist

            real = dist.all_reduce

            def counting(tensor: Any, *args: Any, **kwargs: Any) -> Any:
                self._payload += tensor.numel() * tensor.element_size()
                return real(tensor, *args, **kwargs)

            counting.uncounted = real  # type: ignore[attr-defined]
            dist.all_reduce = counting
        else:
            import totalreduce

            self._base = totalreduce.transport_stats()["bytes_sent"]

    def close(self) -> None:
        if self._gloo:
            import torch.distributed as dist

            dist.all_reduce = _uncounted(dist)

    def total(self) -> float:
        if self._gloo:
            return self._payload * 2 * (self._size - 1) / self._size
        import totalreduce

        return float(totalreduce.transport_stats()["bytes_sent"] - self._base)
