"""Worker functions for the totalreduce.torch tests (run on every rank by harness.py).

Each rank computes the single-process reference itself (same seeds everywhere) and
compares its own distributed result with it.
"""

from __future__ import annotations

import copy
import json
import time
import warnings
from typing import Any

import numpy as np
import torch

import totalreduce.torch as hvd
from reporting import report

torch.set_num_threads(1)

TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.float16, torch.bfloat16, torch.float32, torch.float64]


def tensor(seed: int, rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    return torch.randint(-50 if dtype != torch.uint8 else 0, 50, shape, generator=g,
                         dtype=torch.int64).to(dtype)


def close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float | None = None) -> None:
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    if tol is None:
        tol = {torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float32: 1e-5,
               torch.float64: 1e-12}.get(a.dtype, 0)
    if tol:
        assert torch.allclose(a.double(), b.double(), rtol=tol, atol=tol), \
            f"{what}: max diff {(a.double() - b.double()).abs().max()}"
    else:
        assert torch.equal(a, b), f"{what}: {a} != {b}"


def ref_sum(ts: list[torch.Tensor]) -> torch.Tensor:
    """Sum as the engine computes it: or for bool, wrapping for integers."""
    dtype = ts[0].dtype
    if dtype == torch.bool:
        out = ts[0].clone()
        for t in ts[1:]:
            out |= t
        return out
    if dtype.is_floating_point:
        return sum(t.double() for t in ts).to(dtype)
    return torch.from_numpy(np.sum([t.numpy() for t in ts], axis=0, dtype=t_np(dtype)))


def collectives(arg: dict) -> None:
    """Every collective of the Horovod API on tensors against a reference."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    shapes = [(0,), (1,), (7, 3), (1001,)]
    for seed, (dtype, shape) in enumerate((d, s) for d in TORCH_DTYPES for s in shapes):
        mine = tensor(seed, r, shape, dtype)
        everyone = [tensor(seed, q, shape, dtype) for q in range(n)]
        what = f"{dtype} {shape}"
        close(hvd.allreduce(mine, op=hvd.Sum, name=f"s{seed}"), ref_sum(everyone),
              "Sum " + what)
        want_max = everyone[0]
        for t in everyone[1:]:
            want_max = torch.maximum(want_max, t)
        inplace = mine.clone()
        out = hvd.allreduce_(inplace, op=hvd.Max, name=f"m{seed}")
        assert out is inplace
        close(inplace, want_max, "Max in place " + what)
        if dtype.is_floating_point:
            avg = hvd.synchronize(hvd.allreduce_async(mine, name=f"a{seed}"))
            close(avg, (sum(t.double() for t in everyone) / n).to(dtype), "Average " + what)
        gathered = hvd.allgather(mine, name=f"g{seed}")
        close(gathered, torch.cat(everyone), "allgather " + what)
        b = mine.clone()
        hvd.broadcast_(b, root_rank=n - 1, name=f"b{seed}")
        close(b, everyone[n - 1], "broadcast_ " + what)
    # Non-contiguous input, in place: the tensor's own memory is written.
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) * (r + 1)
    view = base[:, ::2]
    hvd.allreduce_(view, op=hvd.Sum, name="strided")
    want = torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, ::2] * sum(range(1, n + 1))
    close(base[:, ::2], want, "strided in place")
    close(base[:, 1::2], (torch.arange(24, dtype=torch.float32).reshape(4, 6) * (r + 1))[:, 1::2],
          "untouched columns")
    # A tensor that requires grad, and scale factors.
    w = torch.ones(5, requires_grad=True)
    out = hvd.allreduce(w, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0, name="sc")
    close(out, torch.full((5,), 1.5 * n), "scaled")
    try:
        hvd.allreduce(torch.ones(3, dtype=torch.bool), prescale_factor=2.0, name="bad")
        raise AssertionError("a bool tensor with a scale factor was accepted")
    except TypeError as exc:
        assert "prescale_factor" in str(exc), exc
    # Horovod's deprecated average= keyword.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = hvd.allreduce(torch.full((2,), float(r)), average=False, name="dep")
    assert any(issubclass(c.category, DeprecationWarning) for c in caught), caught
    close(out, torch.full((2,), float(sum(range(n)))), "average=False")
    try:
        hvd.allreduce(torch.ones(2), average=True, op=hvd.Sum)
        raise AssertionError("op and average together were accepted")
    except ValueError as exc:
        assert "average" in str(exc)
    # grouped forms.
    ts = [tensor(90 + i, r, (i * 5 + 1,), torch.float32) for i in range(4)]
    want = [sum(tensor(90 + i, q, (i * 5 + 1,), torch.float32).double() for q in range(n))
            for i in range(4)]
    for got, w_ in zip(hvd.grouped_allreduce(ts, op=hvd.Sum, name="grp"), want, strict=True):
        close(got, w_.float(), "grouped")
    copies = [t.clone() for t in ts]
    hvd.synchronize(hvd.grouped_allreduce_async_(copies, op=hvd.Sum, name="grp_"))
    for got, w_ in zip(copies, want, strict=True):
        close(got, w_.float(), "grouped in place")
    # fp16 compression.
    x = tensor(7, r, (33,), torch.float32)
    got = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16, name="fp16")
    close(got, sum(tensor(7, q, (33,), torch.float32) for q in range(n)), "fp16", 1e-2)
    assert got.dtype == torch.float32
    # alltoall: without splits the result alone, with splits also the received splits.
    rows = torch.arange(n * 2, dtype=torch.int64) + 100 * r
    out = hvd.alltoall(rows, name="a2a")
    close(out, torch.tensor([100 * q + 2 * r + k for q in range(n) for k in range(2)]),
          "alltoall")
    splits = torch.tensor([q + 1 for q in range(n)], dtype=torch.int32)
    data = torch.full((int(splits.sum()), 2), float(r))
    out, received = hvd.alltoall(data, splits=splits, name="a2av")
    assert received.tolist() == [r + 1] * n, received
    close(out, torch.cat([torch.full((r + 1, 2), float(q)) for q in range(n)]), "alltoallv")
    # reducescatter: lower ranks take the extra rows.
    x = tensor(8, r, (2 * n + 1, 3), torch.float64)
    total = sum(tensor(8, q, (2 * n + 1, 3), torch.float64) for q in range(n))
    lo = sum(2 + (1 if q < 1 else 0) for q in range(r))
    mine_rows = 2 + (1 if r < 1 else 0)
    close(hvd.reducescatter(x, op=hvd.Sum, name="rs"), total[lo:lo + mine_rows], "reducescatter")
    # Objects.
    assert hvd.broadcast_object({"from": r, "list": [1, 2]}, root_rank=1) == \
        {"from": 1, "list": [1, 2]}
    assert hvd.allgather_object(("rank", r)) == [("rank", q) for q in range(n)]
    h = hvd.broadcast_async(torch.full((3,), float(r)), root_rank=0, name="poll")
    while not hvd.poll(h):
        time.sleep(0.001)
    close(hvd.synchronize(h), torch.zeros(3), "poll")
    hvd.barrier()
    report(collectives_ok=True)


def t_np(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


# --- training -----------------------------------------------------------------------------


def _model(seed: int, hidden: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, 3))


def _batches(steps: int, total: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(total, 8, generator=g), torch.randint(0, 3, (total,), generator=g))
            for _ in range(steps)]


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list, lo: int,
           hi: int, passes: int, set_to_none: bool = True) -> None:
    loss_fn = torch.nn.CrossEntropyLoss()
    for x, y in batches:
        opt.zero_grad(set_to_none=set_to_none)
        xs, ys = x[lo:hi].chunk(passes), y[lo:hi].chunk(passes)
        for xp, yp in zip(xs, ys, strict=True):
            (loss_fn(model(xp), yp) / passes).backward()
        opt.step()


def equivalence(arg: dict) -> None:
    """N ranks with batch B each end with the weights of one process with batch N*B."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    per_rank, steps = 8, 5
    batches = _batches(steps, per_rank * n)
    for case in arg["cases"]:
        momentum = 0.9 if case.get("momentum") else 0.0
        passes = case.get("passes", 1)
        compression = hvd.Compression.fp16 if case.get("fp16") else hvd.Compression.none
        reference = _model(3)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=momentum)
        _train(reference, ref_opt, batches, 0, per_rank * n, passes)

        model = _model(100 + r)  # different on each rank: the broadcast must fix that
        if r == 0:
            model.load_state_dict(_model(3).state_dict())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=compression,
                                       backward_passes_per_step=passes,
                                       bucket_bytes=case.get("bucket"))
        if "bucket" in case:  # the big weights in their own .grad, the rest in a bucket
            solo = [b.solo for b in opt._buckets]
            assert any(solo) and not all(solo), solo
        _train(model, opt, batches, r * per_rank, (r + 1) * per_rank, passes,
               set_to_none=not case.get("keep_grads"))
        tol = 2e-3 if case.get("fp16") else 1e-5
        for (name, p), q in zip(model.named_parameters(), reference.parameters(),
                                strict=True):
            close(p.detach(), q.detach(), f"{case} {name}", tol)
        report(**{f"equivalent {json.dumps(case, sort_keys=True)}": True})


def optimizer_state(arg: dict) -> None:
    """broadcast_optimizer_state: scalar state, lr, and ranks whose state is empty."""
    hvd.init()
    r = hvd.rank()
    model = _model(3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1))
    if r == 0:  # only the root has state: a few steps taken
        for x, y in _batches(3, 4):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.01, opt.param_groups[0]["lr"]
    state = opt.state_dict()["state"]
    assert len(state) == 6, len(state)
    assert float(state[0]["step"]) == 3.0, state[0]["step"]
    digest = float(sum(s["exp_avg"].abs().sum() + s["exp_avg_sq"].sum() for s in state.values()))
    everyone = hvd.allgather_object(digest)
    assert len(set(everyone)) == 1, everyone
    # Root with empty state; a DistributedOptimizer is accepted too.
    fresh = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5 + r,
                                                     momentum=0.9),
                                     named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(fresh, root_rank=0)
    # Horovod's zero-gradient step created the momentum buffers before the broadcast.
    assert fresh.param_groups[0]["lr"] == 0.5
    assert len(fresh.state_dict()["state"]) == 6, fresh.state_dict()["state"]
    report(optimizer_state_ok=True)


def horovod_script(arg: dict) -> None:
    import runpy

    from totalreduce import runtime

    runpy.run_path(arg["path"], run_name="__main__")
    report(script_ranks=hvd.size(), coordination=runtime.current().config.coordination)


def overlap(arg: dict) -> None:
    """Hooks start reductions before backward ends; step() waits less than they take."""
    hvd.init()
    torch.manual_seed(0)
    width = 768
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    # Buckets of about one layer each (the default 16 MiB would hold the whole model).
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters(),
                                   bucket_bytes=2 << 20)
    x = torch.randn(256, width)
    early, waits, spans = 0, [], []
    for _ in range(4):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        t = opt.last_timings()
        assert len(t.launches) >= 6, t
        if min(t.launches) < t.backward_end:
            early += 1
        waits.append(t.waited)
        spans.append(max(t.completions) - min(t.launches))
    report(overlap_early=early, waited=waits, comm=spans)
    assert early == 4, "no reduction started before backward ended"
    assert sorted(w < s for w, s in zip(waits, spans, strict=True)).count(True) >= 3, \
        (waits, spans)


class _Branchy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def unused_and_join(arg: dict) -> None:
    """An unused parameter does not hang its bucket; join() with uneven shards, twice,
    with a different rank joining last each time."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = _Branchy()
    before = model.unused.weight.detach().clone()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    reference = _Branchy()
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(5)
    data = [torch.randn(4, 4, generator=g) for _ in range(2 + n)]
    for epoch in range(2):
        batches = [2 + (q + epoch) % n for q in range(n)]  # rank q's batch count
        for step in range(batches[r]):
            opt.zero_grad()
            model(data[step] * (r + 1)).sum().backward()
            opt.step()
        last = hvd.join()
        assert last == batches.index(max(batches)), (last, batches)
        # The ranks that joined early missed the last steps: the last one has the model
        # (Horovod's idiom, the reason join() returns that rank).
        hvd.broadcast_parameters(model.state_dict(), root_rank=last)
        # Reference: step s averages the gradients of the ranks that still had data.
        for step in range(max(batches)):
            ref_opt.zero_grad()
            loss = sum(reference(data[step] * (q + 1)).sum() for q in range(n)
                       if step < batches[q])
            (loss / n).backward()
            ref_opt.step()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(),
                                strict=True):
            close(p.detach(), q.detach(), f"epoch {epoch} {name}", 1e-5)
    assert torch.equal(model.unused.weight.detach(), before)
    assert torch.equal(model.unused.weight.grad, torch.zeros(4, 4))
    report(unused_and_join_ok=last)


def joined_rank_refuses(arg: dict) -> None:
    """A broadcast while a rank has joined fails on the others instead of hanging."""
    hvd.init()
    r = hvd.rank()
    if r == 0:
        hvd.join()
        report(joined=True)
        return
    try:
        hvd.broadcast(torch.ones(3), root_rank=1, name="after-join")
    except hvd.MismatchError as exc:
        assert "join()" in str(exc), exc
        report(refused=str(exc))
    else:
        raise AssertionError("a broadcast ran with a joined rank")
    hvd.join()


def model_mismatch(arg: dict) -> None:
    hvd.init()
    r = hvd.rank()
    hidden = 16 if r != 1 else 17
    model = _model(0, hidden)
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters())
    except hvd.MismatchError as exc:
        assert "2.weight" in str(exc) or "0.weight" in str(exc), exc
        report(mismatch=str(exc))
        return
    raise AssertionError("a model whose shapes differ was accepted")


def misuse(arg: dict) -> None:
    """Local mistakes get clear errors (one rank is enough)."""
    hvd.init()
    model = _model(0)
    params = list(model.named_parameters())
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    checks = [
        (lambda: hvd.DistributedOptimizer(sgd, named_parameters=params + params[:1]),
         ValueError, "unique"),
        (lambda: hvd.DistributedOptimizer(sgd, named_parameters=params[1:]), ValueError,
         "not in it"),
        (lambda: hvd.DistributedOptimizer(sgd, op=hvd.Max), ValueError, "Average, Sum or Adasum"),
        (lambda: hvd.DistributedOptimizer(sgd, backward_passes_per_step=0), ValueError,
         "backward_passes_per_step"),
        (lambda: hvd.allreduce([1, 2]), TypeError, "torch.Tensor"),
        (lambda: hvd.allreduce(torch.ones(2, dtype=torch.complex64)), TypeError,
         "not supported"),
        (lambda: hvd.broadcast(torch.ones(2), root_rank=5), ValueError, "root_rank"),
    ]
    for fn, exc_type, text in checks:
        try:
            fn()
        except exc_type as exc:
            assert text in str(exc), (text, exc)
        else:
            raise AssertionError(f"no {exc_type.__name__} for {text}")
    opt = hvd.DistributedOptimizer(sgd, named_parameters=params, backward_passes_per_step=2)
    x, y = _batches(1, 4)[0]
    torch.nn.functional.cross_entropy(model(x), y).backward()
    try:
        opt.step()
    except RuntimeError as exc:
        assert "1 of backward_passes_per_step=2" in str(exc), exc
    else:
        raise AssertionError("step() in the middle of accumulation was accepted")
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    try:
        torch.nn.functional.cross_entropy(model(x), y).backward()
    except RuntimeError as exc:
        assert "backward_passes_per_step" in str(exc), exc
    else:
        raise AssertionError("a third backward pass was accepted")
    report(misuse_ok=True)


def ddp_hook(arg: dict) -> None:
    """DDP under totalrun (env:// init) with our comm hook matches DDP with gloo."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    hvd.init()
    dist.init_process_group("gloo")
    r, n = dist.get_rank(), dist.get_world_size()
    assert (r, n) == (hvd.rank(), hvd.size())
    batches = _batches(4, 4 * n)
    weights = []
    for hooked in (False, True):
        model = DDP(_model(3))
        if hooked:
            model.register_comm_hook(None, hvd.ddp_comm_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        _train(model, opt, batches, r * 4, (r + 1) * 4, 1)
        weights.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*weights, strict=True):
        close(a, b, "hooked vs gloo", 1e-5)
    dist.destroy_process_group()
    report(ddp_hook_ok=True)


def cuda_tensors(arg: dict) -> None:
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x = torch.full((1000,), float(r + 1), device="cuda")
    out = hvd.allreduce(x, op=hvd.Sum)
    assert out.device.type == "cuda"
    close(out.cpu(), torch.full((1000,), float(n * (n + 1) // 2)), "cuda allreduce")
    hvd.allreduce_(x, op=hvd.Sum)
    close(x.cpu(), torch.full((1000,), float(n * (n + 1) // 2)), "cuda in place")
    report(cuda_ok=True)


def _fit_one_batch(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, r: int,
                   n: int) -> list[float]:
    """``steps`` SGD steps on one batch, rank r taking every n-th row: the loss must fall."""
    (x, y), = _batches(1, 16 * n)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[r::n]), y[r::n])
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def _assert_same_on_every_rank(model: torch.nn.Module) -> None:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = hvd.allgather(flat.reshape(1, -1))
    assert all(torch.equal(every[0], row) for row in every), "parameters differ by rank"


def sparse_optimizer(arg: dict) -> None:
    """DistributedOptimizer with each sparse compressor of ``algs`` in turn (one job, so
    the ranks import torch once): every rank ends with the same parameters, the loss
    falls, and the residuals survive state_dict()."""
    hvd.init()
    for alg in arg["algs"]:
        _sparse_optimizer_case(alg)
        report(**{f"sparse_ok:{alg}": True})


def _sparse_optimizer_case(alg: str) -> None:
    import io

    r, n = hvd.rank(), hvd.size()
    model = _model(0, hidden=64)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.2),
        named_parameters=model.named_parameters(),
        compression=getattr(hvd.Compression, alg)(density=0.05))
    losses = _fit_one_batch(model, opt, 30, r, n)
    _assert_same_on_every_rank(model)
    assert sum(losses[-5:]) < sum(losses[:5]), losses
    # Resume: a fresh optimizer that loads the state has the same residuals.
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    assert "totalreduce_sparse" in saved and saved["totalreduce_sparse"], list(saved)
    fresh = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.2),
        named_parameters=model.named_parameters(),
        compression=getattr(hvd.Compression, alg)(density=0.05))
    fresh.load_state_dict(saved)
    before = saved["totalreduce_sparse"]
    after = fresh.state_dict()["totalreduce_sparse"]
    assert before.keys() == after.keys() and all(
        np.array_equal(before[k]["residual"], after[k]["residual"]) for k in before)
    assert any(np.any(before[k]["residual"]) for k in before)  # there was something to keep
    # Buckets of other parameters (another bucket size): the residuals are dropped, with
    # a warning, rather than added to the wrong gradients.
    other = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.2),
        named_parameters=model.named_parameters(), bucket_bytes=1024,
        compression=getattr(hvd.Compression, alg)(density=0.05))
    assert other._layout() != fresh._layout()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other.load_state_dict(saved)
    assert any("residuals were saved with other gradient buckets" in str(w.message)
               for w in caught), [str(w.message) for w in caught]
    assert other.state_dict()["totalreduce_sparse"] == {}


def overlap_matches_step(arg: dict) -> None:
    """For dense and each sparse compression: 20 steps with buckets reduced while backward
    runs give the weights that reducing them all at step() gives (same seeds, same data,
    several buckets, every rank a different shard)."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    batches = _batches(20, 12 * n)
    compressions: dict[str, Any] = {
        "none": lambda: hvd.Compression.none,
        "oktopk": lambda: hvd.Compression.oktopk(density=0.05, warmup=2, tau_local=3,
                                                 tau_global=3, tau_region=5),
        "topka": lambda: hvd.Compression.topka(density=0.05),
        "gtopk": lambda: hvd.Compression.gtopk(density=0.05)}
    for label, make in compressions.items():
        weights = []
        for overlap in (True, False):
            model = _model(7, hidden=24)
            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.5),
                named_parameters=model.named_parameters(), compression=make(),
                bucket_bytes=1024, overlap=overlap)
            assert len(opt._buckets) >= 3, len(opt._buckets)
            for x, y in batches:
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x[r::n]), y[r::n]).backward()
                opt.step()
            weights.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        start = _model(7, hidden=24)
        moved = float((weights[0] - torch.cat([p.detach().reshape(-1)
                                               for p in start.parameters()])).abs().max())
        assert moved > 1e-3, f"{label}: the weights did not move ({moved})"
        diff = float((weights[0] - weights[1]).abs().max())
        assert torch.allclose(weights[0], weights[1], rtol=1e-5, atol=1e-6), \
            f"{label}: overlapped and at-step weights differ by up to {diff}"
        report(**{f"same:{label}": diff})


def autotune_agrees(arg: dict) -> None:
    """Autotuning tries every setting (rebuilding the buckets between trials), every rank
    keeps the same one, rank 0 logs the trials, and the weights are those of training
    without it (the bucket size and overlap change when reductions run, not what they
    compute)."""
    import csv

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    steps = 56

    def model() -> torch.nn.Module:
        torch.manual_seed(5)
        # 20 weights of 225 KiB, below every size's solo threshold (buckets.py), 4.4 MiB
        # in all: 1, 4 and 16 MiB buckets give different plans.
        layers: list[torch.nn.Module] = []
        for _ in range(20):
            layers += [torch.nn.Linear(240, 240), torch.nn.Tanh()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(240, 4))

    g = torch.Generator().manual_seed(9)
    batches = [(torch.randn(8 * n, 240, generator=g), torch.randint(0, 4, (8 * n,),
                                                                     generator=g))
               for _ in range(steps)]
    weights = []
    for tune in (True, False):
        m = model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05),
                                       named_parameters=m.named_parameters(),
                                       autotune=tune)
        for x, y in batches:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x[r::n]), y[r::n]).backward()
            opt.step()
        weights.append(torch.cat([p.detach().reshape(-1) for p in m.parameters()]))
        if tune:
            chosen = opt.autotuned
            assert chosen is not None, "still tuning after 56 steps"
            every = hvd.allgather_object((chosen.bucket_bytes, chosen.overlap))
            assert len(set(every)) == 1, f"ranks chose differently: {every}"
            tried = opt._autotuner.results  # type: ignore[union-attr]
            report(tried=[(s.bucket_bytes, s.overlap) for s, _ in tried])
    assert torch.allclose(weights[0], weights[1], rtol=1e-5, atol=1e-7), \
        float((weights[0] - weights[1]).abs().max())
    if r == 0:
        with open(arg["log"]) as f:
            rows = list(csv.DictReader(f))
        assert len(rows) == len(tried) and sum(int(row["chosen"]) for row in rows) == 1
    report(autotune_ok=True)


def sparse_ddp_hook(arg: dict) -> None:
    """DDP with oktopk_hook: the ranks' models stay identical and the loss falls."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    hvd.init()
    dist.init_process_group("gloo")
    r, n = dist.get_rank(), dist.get_world_size()
    model = DDP(_model(3, hidden=64))
    model.register_comm_hook(None, hvd.oktopk_hook(density=0.05, warmup=2))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = _fit_one_batch(model, opt, 20, r, n)
    _assert_same_on_every_rank(model)
    assert sum(losses[-5:]) < sum(losses[:5]), losses
    dist.destroy_process_group()
    report(hook_ok=True)


# --- what a new user trips on (issue 24) ------------------------------------------------


def autograd_and_scalars(arg: dict) -> None:
    """Gradients through allreduce, grouped_allreduce, allgather and broadcast against the
    derivative of the sum of every rank's loss; 0-d tensors keep their shape."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    g = torch.Generator().manual_seed(42)
    # Rank q's loss is (weight[q] * output).sum(): every rank knows every weight.
    weights = [torch.rand(5, 2, generator=g, dtype=torch.float64) for _ in range(n)]
    total_w = sum(weights)

    def leaf(rows: int) -> torch.Tensor:
        return (torch.arange(rows * 2, dtype=torch.float64).reshape(rows, 2) + r) \
            .requires_grad_()

    checked = []
    for op, factor in ((hvd.Sum, 1.0), (hvd.Average, 1.0 / n)):
        x = leaf(5)
        out = hvd.allreduce(x, op=op, prescale_factor=2.0, postscale_factor=0.5,
                            name=f"ar.{op.label}")
        assert out.grad_fn is not None
        (weights[r] * out).sum().backward()
        close(x.grad, total_w * factor, f"allreduce {op.label} gradient")
        checked.append(f"allreduce {op.label}")
    a, b = leaf(5), leaf(5)
    outs = hvd.grouped_allreduce([a, b], op=hvd.Sum, name="grp")
    (weights[r] * outs[0] + 3 * weights[r] * outs[1]).sum().backward()
    close(a.grad, total_w, "grouped_allreduce gradient 0")
    close(b.grad, 3 * total_w, "grouped_allreduce gradient 1")
    checked.append("grouped_allreduce")
    # allgather: rank q gives q + 1 rows; its gradient is its rows of the summed weights.
    rows = [q + 1 for q in range(n)]
    gathered_w = [torch.rand(sum(rows), 2, generator=g, dtype=torch.float64)
                  for _ in range(n)]
    x = leaf(rows[r])
    out = hvd.allgather(x, name="ag")
    assert out.shape == (sum(rows), 2), out.shape
    (gathered_w[r] * out).sum().backward()
    start = sum(rows[:r])
    close(x.grad, sum(gathered_w)[start:start + rows[r]], "allgather gradient")
    checked.append("allgather")
    # broadcast from the last rank: its gradient is the sum, the others' zero.
    x = leaf(5)
    out = hvd.broadcast(x, root_rank=n - 1, name="bc")
    (weights[r] * out).sum().backward()
    close(x.grad, total_w if r == n - 1 else torch.zeros(5, 2, dtype=torch.float64),
          "broadcast gradient")
    checked.append("broadcast")
    # Max has no gradient here: backward says so instead of returning a wrong one.
    x = leaf(2)
    out = hvd.allreduce(x, op=hvd.Max, name="max")
    try:
        out.sum().backward()
    except RuntimeError as exc:
        assert "op=Max" in str(exc), exc
        checked.append("max refused")
    # 0-d in, 0-d out, in every form.
    scalar = torch.tensor(float(r + 1))
    shapes = {
        "allreduce": hvd.allreduce(scalar, op=hvd.Sum, name="s0"),
        "allreduce_async": hvd.synchronize(hvd.allreduce_async(scalar, op=hvd.Sum,
                                                               name="s1")),
        "allreduce_": hvd.allreduce_(scalar.clone(), op=hvd.Sum, name="s2"),
        "broadcast": hvd.broadcast(scalar, root_rank=0, name="s3"),
        "broadcast_async": hvd.synchronize(hvd.broadcast_async(scalar, root_rank=0,
                                                               name="s4")),
        "broadcast_": hvd.broadcast_(scalar.clone(), root_rank=0, name="s5"),
        "allreduce with grad": hvd.allreduce(scalar.clone().requires_grad_(), op=hvd.Sum,
                                             name="s6"),
    }
    total = float(sum(range(1, n + 1)))
    for what, t in shapes.items():
        assert t.shape == (), f"{what}: shape {tuple(t.shape)}"
        assert float(t) == (1.0 if what.startswith("broadcast") else total), (what, t)
    report(gradients_ok=checked, scalars=sorted(shapes))


def ddp_errors(arg: dict) -> None:
    """DDP with the comm hook, two ways to fail.  ``buckets``: the ranks build DDP with
    different bucket sizes, so bucket 0 differs; backward() must raise MismatchError on
    every rank, and the ranks go on.  ``raise``: rank ``victim``'s hook raises at step 3
    and nobody catches it; with ``slow_victim`` the others leave at once and the victim
    a second later, so the launcher must tell who failed first by more than exit times."""
    import atexit

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    hvd.init()
    dist.init_process_group("gloo")
    r = dist.get_rank()
    if arg["case"] == "buckets":
        model = DDP(_model(3), bucket_cap_mb=25 if r == 0 else 0.0001,
                    find_unused_parameters=True)
        model.register_comm_hook(None, hvd.ddp_comm_hook)
        x, _y = _batches(1, 4)[0]
        try:
            model(x).sum().backward()
        except hvd.MismatchError as exc:
            report(error=str(exc), notes=getattr(exc, "__notes__", []))
        else:
            raise AssertionError("backward() returned with mismatched buckets")
        # A rank that caught it can go on (here with a model DDP agrees on).
        again = DDP(_model(3), find_unused_parameters=True)
        again.register_comm_hook("again", hvd.ddp_comm_hook)
        again(x).sum().backward()
        dist.destroy_process_group()
        report(went_on=True)
        return
    victim = arg["victim"]
    if arg.get("slow_victim"):
        import totalreduce.runtime

        totalreduce.runtime._FOLLOWER_DELAY = 0.0
        if r == victim:
            atexit.register(time.sleep, 1.5)  # runs before totalreduce's own exit work
    model = DDP(_model(3))
    step = 0

    def hook(state, bucket):  # unannotated: DDP checks real annotations, not strings
        if r == victim and step == 3:
            raise ValueError(f"rank {r}: bad gradient bucket at step {step}")
        return hvd.ddp_comm_hook(state, bucket)

    model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(_batches(10, 4)):  # noqa: B007  # the hook reads step
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def shared(arg: dict) -> None:
    """Several workers in turn in one job, ``arg["parts"]`` as [name, worker, its arg]
    or [name, worker, its arg, settings] (a torch job's start, four seconds of imports a
    rank, is most of its cost): each reports under its name (``Result.part``), in the one
    world they share (the workers' own init() is a no-op here; after one that shuts down,
    the ranks start a new one), and one that fails on a rank stops every rank there
    (checks.run_checks).  A part with settings (``init()``'s keywords, as
    ``{"coordination": "negotiated"}``) runs in a world of its own started with them."""
    import reporting
    from checks import run_checks

    def part(name: str, worker: str, worker_arg: dict,
             settings: dict | None = None) -> tuple[str, Any]:
        def run() -> None:
            reporting.section = name
            if settings:
                hvd.shutdown()
                hvd.init(**settings)
            try:
                globals()[worker](worker_arg)
            finally:
                reporting.section = None
                if settings and hvd.is_initialized():
                    hvd.shutdown()
                if not hvd.is_initialized():  # a worker that ends with shutdown()
                    hvd.init()
        return name, run

    hvd.init()
    run_checks([part(*p) for p in arg["parts"]], prefix="shared")
    hvd.barrier()


def first_use(arg: dict) -> None:
    """One job for the checks above that share it: gradients and 0-d tensors, then DDP
    with buckets that differ between ranks."""
    from checks import run_checks

    hvd.init()
    run_checks([("gradients and scalars", lambda: autograd_and_scalars(arg)),
                ("ddp buckets differ", lambda: ddp_errors({"case": "buckets"}))],
               prefix="first_use")


# --- Horovod parity (issue 27) -------------------------------------------------------------


def _launcher_env() -> dict[str, str]:
    """What horovodrun exports and scripts read before init()."""
    import os

    names = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
             "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")
    return {k: os.environ.get(k, "(unset)") for k in names}


def horovod_parity(arg: dict) -> None:
    """One job for the Horovod parity checks (issue 27), each reporting its outcome, run
    by ``checks.run_checks`` so that a check failing on one rank stops every rank there.
    ``arg["only"]`` runs just the checks of those labels."""
    from checks import run_checks

    env = _launcher_env()
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    checks = [
        ("launcher env", lambda: launcher_env(env, r, n)),
        ("capabilities", lambda: capabilities(r, n)),
        ("integers", lambda: integers(r, n)),
        ("misuse", lambda: misuse_like_horovod(r, n)),
        ("optimizer state broadcast", lambda: optimizer_state({})),
        ("optimizer", lambda: optimizer_like_horovod(r, n)),
        ("more gradients", lambda: more_gradients(r, n)),
        ("adasum", lambda: adasum(r, n)),
        ("adasum optimizer", lambda: adasum_optimizer(r, n)),
        ("sync batch norm", lambda: sync_batch_norm(r, n)),
    ]
    only = arg.get("only")
    run_checks([c for c in checks if only is None or c[0] in only], prefix="parity")
    hvd.barrier()


def launcher_env(env: dict[str, str], r: int, n: int) -> None:
    want = {"HOROVOD_RANK": str(r), "HOROVOD_SIZE": str(n), "HOROVOD_LOCAL_RANK": str(r),
            "HOROVOD_LOCAL_SIZE": str(n), "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1"}
    assert env == want, f"rank {r}: launcher env {env}, want {want}"
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)
    report(launcher_env=env)


def even_share(rows: int, r: int, n: int) -> tuple[int, int]:
    """Rank r's rows [lo, hi) of ``rows`` split over n ranks, lower ranks taking the extra."""
    lo = sum(rows // n + (1 if q < rows % n else 0) for q in range(r))
    return lo, lo + rows // n + (1 if r < rows % n else 0)


def capabilities(r: int, n: int) -> None:
    """Horovod's build queries, HorovodInternalError, the grouped allgather and
    reducescatter, sparse_allreduce_async and the timeline switched on from the program."""
    import importlib.util
    import os
    import tempfile

    answers = {q: getattr(hvd, q)() for q in (
        "mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "ddl_built",
        "ccl_built", "rocm_built", "cuda_built")}
    assert all(type(v) is bool for v in answers.values()), answers
    assert answers == {
        "mpi_built": importlib.util.find_spec("mpi4py") is not None, "mpi_enabled": False,
        "gloo_built": False, "gloo_enabled": False, "nccl_built": False, "ddl_built": False,
        "ccl_built": False, "rocm_built": False, "cuda_built": torch.backends.cuda.is_built(),
    }, answers
    try:
        hvd.mpi_threads_supported()
        raise AssertionError("mpi_threads_supported answered outside MPI")
    except ValueError as exc:
        assert "does not use MPI" in str(exc), exc
    assert issubclass(hvd.PeerFailureError, hvd.HorovodInternalError)
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    assert not issubclass(hvd.MismatchError, hvd.HorovodInternalError)
    # grouped_allgather: rank q gives q + 1 rows of each tensor, dtypes kept.
    mine = [torch.full((r + 1, 2), r, dtype=torch.int32), torch.full((r + 1,), r + 0.5)]
    want = [torch.cat([torch.full((q + 1, 2), q, dtype=torch.int32) for q in range(n)]),
            torch.cat([torch.full((q + 1,), q + 0.5) for q in range(n)])]
    for got, w in zip(hvd.grouped_allgather(mine, name="gag"), want, strict=True):
        close(got, w, "grouped_allgather")
    for got, w in zip(hvd.synchronize(hvd.grouped_allgather_async(mine)), want, strict=True):
        close(got, w, "grouped_allgather_async")
    # grouped_reducescatter: each tensor's rows split, lower ranks taking the extra one.
    xs = [torch.arange(6.0).reshape(3, 2) * (r + 1), torch.arange(4, dtype=torch.float64)]
    total = sum(q + 1 for q in range(n))
    lo3, hi3 = even_share(3, r, n)
    lo4, hi4 = even_share(4, r, n)
    got = hvd.grouped_reducescatter(xs, op=hvd.Sum, name="grs")
    close(got[0], (torch.arange(6.0).reshape(3, 2) * total)[lo3:hi3], "grouped_reducescatter 0")
    close(got[1], (torch.arange(4, dtype=torch.float64) * n)[lo4:hi4],
          "grouped_reducescatter 1")
    got = hvd.synchronize(hvd.grouped_reducescatter_async(xs, name="grs_avg"))
    close(got[1], torch.arange(4, dtype=torch.float64)[lo4:hi4],
          "grouped_reducescatter Average")
    # sparse_allreduce_async: ranks with different numbers of entries, some shared.
    idx = torch.tensor([[0, 2 + r, 5][: 2 + r]], dtype=torch.int64)
    vals = torch.tensor([1.0, 2.0, 3.0][: 2 + r]) * (r + 1)
    sp = torch.sparse_coo_tensor(idx, vals, (6,))
    dense_sum = sum(torch.sparse_coo_tensor(
        torch.tensor([[0, 2 + q, 5][: 2 + q]]), torch.tensor([1.0, 2.0, 3.0][: 2 + q]) * (q + 1),
        (6,)).to_dense() for q in range(n))
    got = hvd.synchronize(hvd.sparse_allreduce_async(sp, name="sp", op=hvd.Sum))
    assert got.is_sparse and got.shape == (6,), got
    close(got.to_dense(), dense_sum, "sparse_allreduce Sum")
    got = hvd.synchronize(hvd.sparse_allreduce_async(sp, name="sp_avg"))
    close(got.to_dense(), dense_sum / n, "sparse_allreduce Average")
    # Tensors of different sizes: a MismatchError on every rank, naming each rank's shape
    # (rank 0's entry lies within every rank's size, the others' only within their own).
    odd = torch.sparse_coo_tensor(torch.tensor([[3 * r]]), torch.tensor([1.0]), (4 + 3 * r,))
    try:
        hvd.synchronize(hvd.sparse_allreduce_async(odd, name="sp_odd"))
    except hvd.MismatchError as exc:
        assert "shapes differ" in str(exc) and "rank 0: (4,)" in str(exc) \
            and f"rank {n - 1}: ({4 + 3 * (n - 1)},)" in str(exc), str(exc)
    else:
        raise AssertionError("sparse_allreduce of different shapes did not fail")
    # start_timeline / stop_timeline: a trace of what ran in between, which loads.
    folder = tempfile.mkdtemp(prefix="trtest-timeline-")
    path = os.path.join(folder, "sub", "t.json")
    hvd.start_timeline(path, mark_cycles=True)
    hvd.allreduce(torch.ones(4), name="traced")
    hvd.stop_timeline()
    hvd.allreduce(torch.ones(4), name="untraced")
    mine_path = path if r == 0 else f"{path}.{r}"
    with open(mine_path) as f:
        events = json.load(f)
    names = {e.get("args", {}).get("name") for e in events if e.get("ph") == "M"}
    assert "traced" in names and "untraced" not in names, names
    report(capabilities=answers, parity_b=True)


def integers(r: int, n: int) -> None:
    """Integer tensors: scale factors scale and truncate back; Average truncates toward
    zero (-75 / 2 is -37), with a joined rank too, and in the numpy API."""
    import totalreduce as tr

    x = torch.tensor([-75, 75, -1, 7], dtype=torch.int32) if r == 0 else \
        torch.zeros(4, dtype=torch.int32)
    toward_zero = [int(v / n) for v in (-75, 75, -1, 7)]  # [-37, 37, 0, 3] at 2 ranks
    avg = hvd.allreduce(x, name="int_avg")
    close(avg, torch.tensor(toward_zero, dtype=torch.int32), "integer Average")
    got = tr.allreduce(x.numpy(), name="np_int_avg")
    assert got.dtype == np.int32 and got.tolist() == toward_zero, got
    y = torch.tensor([3, -3, 5], dtype=torch.int64)
    # Each rank: trunc(0.5 * [3, -3, 5]) = [1, -1, 2]; summed, then trunc(0.5 * 2 * ...).
    close(hvd.allreduce(y, op=hvd.Sum, prescale_factor=0.5, name="int_pre"),
          torch.tensor([n, -n, 2 * n], dtype=torch.int64), "integer prescale")
    close(hvd.allreduce(y, op=hvd.Sum, postscale_factor=0.5, name="int_post"),
          torch.tensor([3 * n // 2, -(3 * n // 2), 5 * n // 2], dtype=torch.int64),
          "integer postscale")
    inplace = y.clone()
    hvd.allreduce_(inplace, op=hvd.Sum, prescale_factor=0.5, postscale_factor=1.5,
                   name="int_inplace")
    close(inplace, torch.tensor([int(1.5 * n), -int(1.5 * n), 3 * n], dtype=torch.int64),
          "integer scale in place")
    grouped = hvd.grouped_allreduce([y, y.to(torch.int8)], op=hvd.Sum,
                                    postscale_factor=0.5, name="int_grp")
    close(grouped[1], torch.tensor([3 * n // 2, -(3 * n // 2), 5 * n // 2],
                                   dtype=torch.int8), "grouped integer postscale")
    rs = hvd.reducescatter(torch.tensor([[3], [-3]], dtype=torch.int16) * (r + 1),
                           op=hvd.Sum, postscale_factor=0.5, name="int_rs")
    total = sum(q + 1 for q in range(n))
    lo, hi = even_share(2, r, n)  # at 3 ranks the last one gets no row
    close(rs, torch.tensor([[int(1.5 * total)], [-int(1.5 * total)]],
                           dtype=torch.int16)[lo:hi], "reducescatter integer postscale")
    try:
        hvd.allreduce(torch.ones(2, dtype=torch.bool), op=hvd.Sum, postscale_factor=2.0)
        raise AssertionError("a bool tensor with a scale factor was accepted")
    except TypeError as exc:
        assert "postscale_factor" in str(exc) and "bool" in str(exc), exc
    # A joined rank adds zeros; the rest still truncate toward zero.
    if r == 0:
        close(hvd.allreduce(torch.tensor([-75, 75]), name="int_join"),
              torch.tensor([-75 // n + (1 if -75 % n else 0), 75 // n]), "Average with join")
    hvd.join()
    report(parity_c=True)


def misuse_like_horovod(r: int, n: int) -> None:
    """alltoall without splits of rows not divisible by the world size, and a second op
    under the name of one still in flight, raise ValueError as in Horovod."""
    import totalreduce as tr

    try:
        hvd.alltoall(torch.arange(2 * n + 1), name="a2a_uneven")
        raise AssertionError("an uneven alltoall without splits was accepted")
    except ValueError as exc:
        assert f"rank {r}: alltoall 'a2a_uneven'" in str(exc) and "divisible" in str(exc), exc
    # The numpy API keeps its documented even split, lower ranks taking the extra row.
    out, got_splits = tr.alltoall(np.arange(2 * n + 1), name="np_a2a_uneven")
    assert got_splits.tolist() == [2 + (1 if r == 0 else 0)] * n, got_splits
    # Rank r's op "dupr" cannot finish before the barrier: the other rank submits it after.
    h = hvd.allreduce_async(torch.ones(2), name=f"dup{r}", op=hvd.Sum)
    try:
        hvd.allreduce_async(torch.ones(2), name=f"dup{r}")
        raise AssertionError("a second op under a name in flight was accepted")
    except ValueError as exc:
        assert f"an op named 'dup{r}' is still in flight" in str(exc), exc
    try:
        hvd.broadcast_async(torch.ones(2), root_rank=0, name=f"dup{r}")
        raise AssertionError("a broadcast under a name in flight was accepted")
    except ValueError as exc:
        assert "still in flight" in str(exc), exc
    hvd.barrier()
    for q in range(n):
        if q != r:
            hvd.allreduce(torch.ones(2), name=f"dup{q}", op=hvd.Sum)
    close(hvd.synchronize(h), torch.full((2,), float(n)), "the op in flight")
    for q in range(n):  # every name is free again
        close(hvd.allreduce(torch.ones(2), name=f"dup{q}", op=hvd.Sum),
              torch.full((2,), float(n)), "a name reused")
    # The numpy API matches a name's k-th op with the other ranks' k-th op instead.
    hs = [tr.allreduce_async(np.full(2, k + r), op=tr.Sum, name="np_dup") for k in range(2)]
    assert [h_.wait().tolist() for h_ in hs] == [[sum(range(n))] * 2,
                                                 [n + sum(range(n))] * 2]
    report(parity_d=True)


def optimizer_like_horovod(r: int, n: int) -> None:
    """broadcast_optimizer_state creates a fresh optimizer's state with a zero-gradient
    step; DistributedOptimizer without named_parameters; sparse gradients stay sparse."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)
    before = [p.detach().clone() for p in model.parameters()]
    sgd = torch.optim.SGD(model.parameters(), lr=0.5 + r, momentum=0.9)
    hvd.broadcast_optimizer_state(sgd, root_rank=0)
    assert sgd.param_groups[0]["lr"] == 0.5
    state = sgd.state_dict()["state"]
    assert sorted(state) == [0, 2, 3], sorted(state)  # the frozen bias #1 has none
    assert all(torch.equal(s["momentum_buffer"], torch.zeros_like(s["momentum_buffer"]))
               for s in state.values())
    grads = [None if p.grad is None else float(p.grad.abs().sum()) for p in model.parameters()]
    assert grads == [0.0, None, 0.0, 0.0], grads
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    adam = torch.optim.Adam(model.parameters())
    hvd.broadcast_optimizer_state(adam, root_rank=0)
    assert [float(s["step"]) for s in adam.state_dict()["state"].values()] == [1.0] * 3
    # Without named_parameters: trains, and Horovod's _parameter_names is there.
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert len(opt._parameter_names) == 3 and all(
        isinstance(v, str) for v in opt._parameter_names.values()), opt._parameter_names
    m = _model(3)
    _fit_one_batch(m, hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1)),
                   3, r, n)
    _assert_same_on_every_rank(m)
    # Sparse gradients (Embedding(sparse=True) with SparseAdam), no sparse_as_dense: the
    # same weights as one process whose loss is the mean of every rank's.
    def embedding() -> torch.nn.Embedding:
        torch.manual_seed(1)
        return torch.nn.Embedding(10, 3, sparse=True)

    ids = [torch.tensor([[q, q + 2, 7]]) for q in range(n)]
    emb, ref = embedding(), embedding()
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(emb.parameters(), lr=0.1),
                                   named_parameters=emb.named_parameters())
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        (emb(ids[r]) * (step + 1 + r)).sum().backward()
        opt.step()
        assert emb.weight.grad.is_sparse, emb.weight.grad
        ref_opt.zero_grad()
        (sum((ref(ids[q]) * (step + 1 + q)).sum() for q in range(n)) / n).backward()
        ref_opt.step()
    close(emb.weight.detach(), ref.weight.detach(), "sparse gradients", 1e-6)
    report(parity_e=True)


def more_gradients(r: int, n: int) -> None:
    """Gradients through alltoall, reducescatter, grouped_allgather and
    grouped_reducescatter, against the same collectives simulated in one process (every
    rank's inputs as leaves; the loss is the sum of every rank's)."""
    g = torch.Generator().manual_seed(77)

    def inputs(rows: list[int]) -> list[torch.Tensor]:
        return [torch.rand(rows[q], 2, generator=g, dtype=torch.float64).requires_grad_()
                for q in range(n)]

    def check(what: str, xs: list[torch.Tensor], run: Any, simulate: Any) -> None:
        mine = xs[r].detach().clone().requires_grad_()
        outs = run(mine)
        sim = simulate(xs)  # every rank's outputs
        ws = [torch.rand(o.shape, generator=g, dtype=torch.float64) for o in sim]
        (ws[r] * outs).sum().backward()
        sum((w * o).sum() for w, o in zip(ws, sim, strict=True)).backward()
        close(mine.grad, xs[r].grad, what)
        checked.append(what)

    def even(rows: int) -> list[tuple[int, int]]:
        b = [0]
        for q in range(n):
            b.append(b[-1] + rows // n + (1 if q < rows % n else 0))
        return [(b[q], b[q + 1]) for q in range(n)]

    checked: list[str] = []
    # alltoall with splits: rank p sends splits[p][q] rows to q.
    splits = [[1 + (p + q) % 2 for q in range(n)] for p in range(n)]
    xs = inputs([sum(sp) for sp in splits])

    def a2a_sim(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        starts = [[sum(splits[p][:q]) for q in range(n)] for p in range(n)]
        return [torch.cat([xs[p][starts[p][q]:starts[p][q] + splits[p][q]] for p in range(n)])
                for q in range(n)]

    check("alltoall", xs, lambda x: hvd.alltoall(x, splits=torch.tensor(splits[r]),
                                                  name="ga2a")[0], a2a_sim)
    splits = [[2] * n for _ in range(n)]
    xs = inputs([2 * n] * n)
    check("alltoall without splits", xs, lambda x: hvd.alltoall(x, name="ga2a_even"), a2a_sim)
    for op, scale in ((hvd.Sum, 1.0), (hvd.Average, 1.0 / n)):
        xs = inputs([2 * n + 1] * n)

        def rs_sim(xs: list[torch.Tensor], scale: float = scale) -> list[torch.Tensor]:
            total = sum(x * 2.0 for x in xs) * 0.5 * scale
            return [total[a:b] for a, b in even(2 * n + 1)]

        check(f"reducescatter {op.label}", xs,
              lambda x, op=op: hvd.reducescatter(x, op=op, prescale_factor=2.0,
                                                 postscale_factor=0.5, name=f"grs{op.label}"),
              rs_sim)
    rows = [q + 1 for q in range(n)]
    xs = inputs(rows)
    check("grouped_allgather", xs,
          lambda x: (lambda o: o[0] + 2 * o[1])(hvd.grouped_allgather(
              [x, x * x], name="gag_grad")),
          lambda a: [torch.cat(a[:n]) + 2 * torch.cat([t * t for t in a[:n]])] * n)
    xs = inputs([2 * n] * n)
    check("grouped_reducescatter", xs,
          lambda x: (lambda o: o[0] * 3 + o[1])(hvd.grouped_reducescatter(
              [x, x * x], op=hvd.Sum, name="grs_grad")),
          lambda a: [(sum(a) * 3 + sum(t * t for t in a))[lo:hi] for lo, hi in even(2 * n)])
    report(more_gradients=checked)


# --- Adasum and SyncBatchNorm (issue 27) ---------------------------------------------------


def ref_adasum(vectors: list[np.ndarray]) -> np.ndarray:
    """Adasum as documented, written from the paper's formula: ranks p + i (p the largest
    power of two <= n) fold into rank i, then pairs at distance 1, 2, 4, ... combine."""
    def pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        dot, na, nb = (a * b).sum(), (a * a).sum(), (b * b).sum()
        return (a * (1 - dot / (2 * na)) if na else a) + (b * (1 - dot / (2 * nb)) if nb else b)

    vs = [v.astype(np.float64).ravel() for v in vectors]
    p = 1 << (len(vs).bit_length() - 1)
    vs = [pair(vs[i], vs[p + i]) if p + i < len(vs) else vs[i] for i in range(p)]
    step = 1
    while step < p:
        for i in range(0, p, 2 * step):
            vs[i] = pair(vs[i], vs[i + step])
        step *= 2
    return vs[0].reshape(vectors[0].shape)


def adasum(r: int, n: int) -> None:
    """op=Adasum in allreduce (blocking, async, in place), grouped_allreduce (each tensor
    its own coefficients) and with scale factors, against ref_adasum; every rank gets the
    bitwise same result; a zero vector and equal vectors; integers refused."""
    def inputs(seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        # Partly aligned vectors, so the coefficients are neither 1 nor 1/2.
        common = torch.randn(shape, generator=g, dtype=torch.float64)
        return [(common + torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)
                for _ in range(n)]

    def want(ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.from_numpy(ref_adasum([t.numpy() for t in ts])).to(ts[0].dtype)

    checked = []
    for seed, (dtype, shape) in enumerate([(d, s) for d in (torch.float32, torch.float64)
                                           for s in ((7,), (3, 5), (1,), (2, 3, 3))]):
        ts = inputs(seed, shape, dtype)
        what = f"Adasum {dtype} {shape}"
        got = hvd.allreduce(ts[r], op=hvd.Adasum, name=f"ada{seed}")
        close(got, want(ts), what)
        every = hvd.allgather(got.reshape(1, -1), name=f"ada{seed}.same")
        assert all(torch.equal(every[0], row) for row in every), f"{what}: differs by rank"
        close(hvd.synchronize(hvd.allreduce_async(ts[r], op=hvd.Adasum, name=f"adaa{seed}")),
              want(ts), what + " async")
        inplace = ts[r].clone()
        assert hvd.allreduce_(inplace, op=hvd.Adasum, name=f"ada_{seed}") is inplace
        close(inplace, want(ts), what + " in place")
        checked.append(what)
    # Scale factors: Adasum(c * x) = c * Adasum(x), then the postscale.
    ts = inputs(50, (9,), torch.float64)
    close(hvd.allreduce(ts[r], op=hvd.Adasum, prescale_factor=2.0, postscale_factor=0.25,
                        name="ada_scaled"), want(ts) * 0.5, "Adasum scaled")
    # grouped: per tensor, not over the concatenation (which would differ).
    a, b = inputs(51, (5,), torch.float32), inputs(52, (4, 2), torch.float64)
    got = hvd.grouped_allreduce([a[r], b[r]], op=hvd.Adasum, name="ada_grp")
    close(got[0], want(a), "grouped Adasum 0")
    close(got[1], want(b), "grouped Adasum 1")
    fused = ref_adasum([np.concatenate([a[q].double().numpy(), b[q].numpy().ravel()])
                        for q in range(n)])
    assert not np.allclose(fused[:5], want(a).double().numpy(), rtol=1e-3), \
        "grouped Adasum should not differ from fused Adasum only by chance"
    copies = [a[r].clone(), b[r].clone()]
    hvd.synchronize(hvd.grouped_allreduce_async_(copies, op=hvd.Adasum, name="ada_grp_"))
    close(copies[0], want(a), "grouped Adasum in place")
    # Equal vectors average (to themselves); a zero vector on rank 0 leaves the others'.
    same = torch.linspace(-1, 1, 11)
    close(hvd.allreduce(same, op=hvd.Adasum, name="ada_same"), same, "Adasum of equal vectors")
    zs = [torch.zeros(6, dtype=torch.float64)] + inputs(53, (6,), torch.float64)[1:]
    close(hvd.allreduce(zs[r], op=hvd.Adasum, name="ada_zero"), want(zs), "Adasum with a zero")
    if n == 2:
        close(hvd.allreduce(zs[r], op=hvd.Adasum, name="ada_zero2"), zs[1], "0 (+) b is b")
    try:
        hvd.allreduce(torch.ones(3, dtype=torch.int32), op=hvd.Adasum, name="ada_int")
        raise AssertionError("Adasum of an integer tensor was accepted")
    except TypeError as exc:
        assert "Adasum needs a floating-point tensor" in str(exc) and "ada_int" in str(exc), exc
    try:  # shapes that differ by rank: every rank is told, in terms of its allreduce
        hvd.allreduce(torch.ones(5 + r), op=hvd.Adasum, name="ada_mismatch")
        raise AssertionError("Adasum of different shapes was accepted")
    except hvd.MismatchError as exc:
        assert f"rank {r}: ranks disagree on allgather 'ada_mismatch'" in str(exc), exc
        assert "rank 1: kind=allgather, dtype=float32, shape=(1, 6)" in str(exc), exc
        assert any("op=Adasum" in note for note in exc.__notes__), exc.__notes__
    try:
        hvd.reducescatter(torch.ones(n), op=hvd.Adasum, name="ada_rs")
        raise AssertionError("a reducescatter with Adasum was accepted")
    except ValueError as exc:
        assert f"rank {r}: reducescatter 'ada_rs': op=Adasum" in str(exc), exc
    report(adasum=checked)


def adasum_optimizer(r: int, n: int) -> None:
    """DistributedOptimizer(op=Adasum): every parameter's gradient combined on its own
    (the parameters share one bucket), then plain SGD; against one process that computes
    each rank's gradients and applies ref_adasum per parameter."""
    model = _model(3)
    reference = _model(3)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    assert len(opt._buckets) == 1, "the parameters should share one bucket"
    batches = _batches(3, 8 * n)
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[r * 8:(r + 1) * 8]),
                                          y[r * 8:(r + 1) * 8]).backward()
        opt.step()
        grads = []
        for q in range(n):
            reference.zero_grad()
            torch.nn.functional.cross_entropy(reference(x[q * 8:(q + 1) * 8]),
                                              y[q * 8:(q + 1) * 8]).backward()
            grads.append([p.grad.numpy().copy() for p in reference.parameters()])
        with torch.no_grad():
            for i, p in enumerate(reference.parameters()):
                p -= 0.1 * torch.from_numpy(ref_adasum([g[i] for g in grads])).float()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        close(p.detach(), q.detach(), f"Adasum optimizer {name}", 1e-5)
    _assert_same_on_every_rank(model)
    for bad, text in (({"compression": hvd.Compression.oktopk(density=0.1)}, "sparse"),
                      ({"gradient_predivide_factor": 2.0}, "needs op=Average")):
        try:
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     op=hvd.Adasum, **bad)
            raise AssertionError(f"Adasum with {bad} was accepted")
        except ValueError as exc:
            assert text in str(exc), exc
    emb = torch.nn.Embedding(4, 2, sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                   named_parameters=emb.named_parameters(), op=hvd.Adasum)
    try:
        emb(torch.tensor([1, 2])).sum().backward()
        raise AssertionError("a sparse gradient under Adasum was accepted")
    except ValueError as exc:
        assert "weight got a sparse one; pass sparse_as_dense=True" in str(exc), exc
    report(adasum_optimizer=True)


def sync_batch_norm(r: int, n: int) -> None:
    """hvd.SyncBatchNorm, each rank a slice of a fixed global batch (slices of different
    sizes), against torch's BatchNorm over the whole batch in one process: outputs, input
    gradients, weight and bias gradients (summed over ranks: each rank holds its share),
    running statistics over two steps; one allreduce per forward and per backward; none
    in eval mode."""
    import totalreduce.torch.sync_batch_norm as sbn

    calls: list[str] = []
    real = sbn.allreduce

    def counting(t: torch.Tensor, **kw: Any) -> torch.Tensor:
        calls.append(kw["name"].rsplit(".", 1)[1])
        return real(t, **kw)

    sbn.allreduce = counting
    try:
        checked = _sync_batch_norm_cases(r, n, calls)
    finally:
        sbn.allreduce = real
    report(sync_batch_norm=checked)


def _sync_batch_norm_cases(r: int, n: int, calls: list[str]) -> list[str]:
    # Rows of each rank at each step: different sizes; a rank with a single row (its own
    # variance would be undefined) at the first, a rank with none at the second.
    steps = [[q + 2 for q in range(n - 1)] + [1], [0] + [q + 3 for q in range(n - 1)]]
    cases = [(torch.nn.BatchNorm1d, (3,), {}), (torch.nn.BatchNorm1d, (3, 5), {}),
             (torch.nn.BatchNorm2d, (3, 4, 2), {}),
             (torch.nn.BatchNorm2d, (2, 3, 3), {"momentum": None, "affine": False}),
             (torch.nn.BatchNorm1d, (4, 3), {"dtype": torch.float32})]
    checked = []
    for i, (cls, tail, kw) in enumerate(cases):
        g = torch.Generator().manual_seed(300 + i)
        channels = tail[0]
        dtype = kw.get("dtype", torch.float64)
        tol = 1e-10 if dtype == torch.float64 else 1e-5
        reference = cls(channels, **kw).to(dtype)
        mine = hvd.SyncBatchNorm(channels, **kw).to(dtype)
        if reference.affine:
            with torch.no_grad():
                reference.weight.uniform_(0.5, 1.5, generator=g)
                reference.bias.uniform_(-1, 1, generator=g)
            mine.load_state_dict(reference.state_dict())
        what = f"{cls.__name__}{tail} {kw}"
        for step, sizes in enumerate(steps):
            lo = sum(sizes[:r])
            x = (torch.randn(sum(sizes), *tail, generator=g, dtype=torch.float64) * 3
                 + step).to(dtype)
            w = torch.randn(x.shape, generator=g, dtype=torch.float64).to(dtype)
            xr, x_mine = x.clone().requires_grad_(), x[lo:lo + sizes[r]].clone().requires_grad_()
            want = reference(xr)
            (want * w).sum().backward()
            calls.clear()
            got = mine(x_mine)
            (got * w[lo:lo + sizes[r]]).sum().backward()
            assert calls == ["forward", "backward"], f"{what}: collectives {calls}"
            close(got, want[lo:lo + sizes[r]].detach(), f"{what} step {step} output", tol)
            close(x_mine.grad, xr.grad[lo:lo + sizes[r]], f"{what} input grad", tol)
            if reference.affine:
                for p_mine, p_ref, label in ((mine.weight, reference.weight, "weight"),
                                             (mine.bias, reference.bias, "bias")):
                    total = hvd.allreduce(p_mine.grad, op=hvd.Sum, name=f"sbn{i}.{label}")
                    close(total, p_ref.grad, f"{what} {label} grad summed over ranks", tol)
                    p_mine.grad = None
                    p_ref.grad = None
            close(mine.running_mean, reference.running_mean, f"{what} running_mean", tol)
            close(mine.running_var, reference.running_var, f"{what} running_var", tol)
            assert int(mine.num_batches_tracked) == step + 1
        # Eval: running statistics, no communication (ranks may run it unequally).
        mine.eval()
        reference.eval()
        x = torch.randn(4, *tail, generator=g, dtype=torch.float64).to(dtype)
        calls.clear()
        for _ in range(r + 1):
            close(mine(x), reference(x), f"{what} eval", tol)
        assert calls == [], f"{what}: eval made collectives {calls}"
        checked.append(what)
    try:
        hvd.SyncBatchNorm(3, process_group=object())
        raise AssertionError("a process group was accepted")
    except NotImplementedError as exc:
        assert "process_group" in str(exc), exc
    converted = hvd.SyncBatchNorm.convert_sync_batchnorm(
        torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3)))
    assert isinstance(converted[1], hvd.SyncBatchNorm), converted
    return checked


def checks_teardown(arg: dict) -> None:
    """Four checks of collectives; rank ``victim`` fails check ``fail_at``, after its
    collective (a wrong value) or before it (the others wait in it): every rank must stop
    there (checks.run_checks), and the report must name that check and that rank."""
    from checks import run_checks

    hvd.init()
    r, n = hvd.rank(), hvd.size()

    def check(i: int) -> None:
        if r == arg["victim"] and i == arg["fail_at"] and arg["when"] == "before":
            raise RuntimeError(f"rank {r} gives up before check {i}'s collective")
        got = hvd.allreduce(torch.full((3,), float(r)), op=hvd.Sum, name=f"teardown{i}")
        # Unnamed: matched by call order, so a rank that went on into the next check after
        # a failure here would pair this with another rank's next op and fail there too,
        # for no reason of its own.
        hvd.allreduce(torch.ones(i + 1))
        expected = float(sum(range(n)))
        if r == arg["victim"] and i == arg["fail_at"]:
            expected += 1  # this rank expects a wrong value
        close(got, torch.full((3,), expected), f"check {i} sum")

    run_checks([(f"sum {i}", lambda i=i: check(i)) for i in range(4)],
               agree_timeout=arg.get("agree_timeout", 20.0), prefix="teardown")


def process_set_training(arg: dict) -> None:
    """Two halves of the job train their own copies of a model with DistributedOptimizer
    on their own process sets, at once: within a set the weights agree and equal one
    process training on the set's whole batch; the sets' weights differ."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    halves = [hvd.add_process_set(list(range(0, n // 2))),
              hvd.add_process_set(list(range(n // 2, n)))]
    mine = halves[0] if halves[0].included() else halves[1]
    assert mine.size() == n // 2 and mine.rank() == r % (n // 2)
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    start = [p.detach().clone() for p in model.parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   process_set=mine)
    half = 0 if mine is halves[0] else 1
    g = torch.Generator().manual_seed(100 + half)
    xs = [torch.randn(4 * mine.size(), 5, generator=g) for _ in range(5)]
    for x in xs:
        part = x[mine.rank() * 4:(mine.rank() + 1) * 4]
        opt.zero_grad()
        model(part).pow(2).sum().backward()
        opt.step()
    # One process on the set's whole batch: the mean of the ranks' gradients is the
    # gradient of the mean of their losses.
    ref = torch.nn.Linear(5, 3)
    with torch.no_grad():
        for p, q in zip(ref.parameters(), start, strict=True):
            p.copy_(q)
    sgd = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x in xs:
        sgd.zero_grad()
        sum(ref(x[k * 4:(k + 1) * 4]).pow(2).sum() for k in range(mine.size())).div(
            mine.size()).backward()
        sgd.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), (p, q)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = hvd.allgather(flat.reshape(1, -1))
    same_set = [q for q in range(n) if (q < n // 2) == (r < n // 2)]
    other = [q for q in range(n) if q not in same_set]
    assert all(torch.equal(every[q], flat) for q in same_set)
    assert not any(torch.allclose(every[q], flat) for q in other)
    # Tensors on a set: an allreduce of its ranks only, a broadcast from a job rank in it.
    got = hvd.allreduce(torch.full((3,), float(r)), op=hvd.Sum, process_set=mine)
    assert got.tolist() == [float(sum(same_set))] * 3, got
    root = same_set[-1]
    got = hvd.broadcast(torch.full((2,), float(r)), root_rank=root, process_set=mine)
    assert got.tolist() == [float(root)] * 2, got
    hvd.shutdown()
    report(ok=True)


def messages(arg: dict) -> None:
    """send / recv on tensors around a ring, every dtype, received into a tensor (a
    non-contiguous one included); then rank 0 hears from every other rank."""
    hvd.init()
    rank, n = hvd.rank(), hvd.size()
    right, left = (rank + 1) % n, (rank - 1) % n
    for i, dtype in enumerate(TORCH_DTYPES):
        for j, shape in enumerate([(0,), (5,), (3, 7), (20_000,)]):
            sent = hvd.send_async(tensor(i, rank * 10 + j, shape, dtype), right, tag=j)
            into = torch.zeros(shape, dtype=dtype)
            got = hvd.recv(into, left, tag=j)
            assert got is into
            sent.wait()
            close(got, tensor(i, left * 10 + j, shape, dtype), f"{dtype} {shape}")
    if rank == 0:
        seen = []
        for _ in range(n - 1):
            into = torch.zeros(4, 2, dtype=torch.float32)[:, 1]  # not contiguous
            got, src = hvd.recv_async(into, tag=3).wait()
            assert got is into
            close(got, torch.full((4,), float(src)), f"from {src}")
            seen.append(src)
        report(seen=sorted(seen))
    else:
        hvd.send(torch.full((4,), float(rank)), 0, tag=3)
    report(ok=True)
    hvd.shutdown()


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def averaging(arg: dict) -> None:
    """Parameter averaging: at period 1 with plain SGD it ends with the weights of
    gradient averaging; at period 4 after 3 warm-up steps the ranks agree exactly after
    the steps that average (and the warm-up's), and differ after the local ones."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    per_rank, steps = 8, 20
    batches = _batches(steps, per_rank * n)
    lo, hi = r * per_rank, (r + 1) * per_rank

    dense = _model(3)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(dense.parameters(), lr=0.1),
                                   named_parameters=dense.named_parameters())
    _train(dense, opt, batches, lo, hi, 1)
    local = _model(3)
    opt = hvd.PostLocalSGDOptimizer(torch.optim.SGD(local.parameters(), lr=0.1),
                                    hvd.PeriodicAverager(local, period=1))
    _train(local, opt, batches, lo, hi, 1)
    close(_flat(local), _flat(dense), "period 1 against gradient averaging", 1e-5)
    # Not trivially equal: without averaging the ranks would have drifted apart.
    alone = _model(3)
    _train(alone, torch.optim.SGD(alone.parameters(), lr=0.1), batches, lo, hi, 1)
    report(drift=float((_flat(alone) - _flat(dense)).abs().max()))

    model = _model(3)
    averager = hvd.PeriodicAverager(model, period=4, warmup_steps=3)
    opt = hvd.PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), averager)
    agree = []
    for i, (x, y) in enumerate(batches[:12]):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[lo:hi]), y[lo:hi]).backward()
        opt.step()
        rows = hvd.allgather(_flat(model)[None], name=f"check.{i}")
        agree.append(bool((rows == rows[0]).all()))
    report(agree=agree, steps=averager.step, ok=True)
    hvd.shutdown()


def sparse_small_buckets_whole(arg: dict) -> None:
    """With a sparse compression, a bucket far smaller than the model (the output layer,
    3 KB of 261 KB) is reduced whole, exactly, while the big weight's bucket stays
    sparse."""
    hvd.init()
    r = hvd.rank()
    torch.manual_seed(11)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 2))
    plain = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        named_parameters=model.named_parameters(), bucket_bytes=64 << 10,
        compression=hvd.Compression.oktopk(density=0.05, warmup=0))
    whole = {name for b in opt._buckets if b.dense for name in b.names}
    assert whole == {"0.bias", "2.weight", "2.bias"}, \
        [(b.names, b.dense, b.solo) for b in opt._buckets]
    g = torch.Generator().manual_seed(100 + r)
    x, y = torch.randn(16, 256, generator=g), torch.randint(0, 2, (16,), generator=g)
    torch.nn.functional.cross_entropy(plain(x), y).backward()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.synchronize()
    for name, p in plain.named_parameters():
        every = hvd.allgather(p.grad.reshape(1, -1))
        mean = every.mean(dim=0).reshape(p.shape)
        got = dict(model.named_parameters())[name].grad
        if name in whole:
            close(got, mean, f"{name}, reduced whole", 1e-6)
        else:
            nonzero = int((got != 0).sum())
            assert 0 < nonzero < p.numel() // 5, f"{name}: {nonzero} of {p.numel()} nonzero"
    report(small_whole=True)
