"""Worker functions for the totalreduce.torch tests (run on every rank by harness.py).

Each rank computes the single-process reference itself (same seeds everywhere) and
compares its own distributed result with it.
"""

from __future__ import annotations

import copy
import importlib
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


# Whether this process has made a gloo group from the variables totalrun exports (env://).
_gloo_env_used = False


def _gloo_world() -> None:
    """``dist.init_process_group("gloo")``: the job's first group from the variables
    totalrun exports (env://, as a user's script does), later ones on a port rank 0 has
    just found free.

    Not again on the MASTER_PORT totalrun exports: made there after an earlier part had
    destroyed its group, the group failed to form in 2 of 26 runs of the 2-rank shared
    job (one rank's gloo was refused a connection, the other's timed out), and gloo gave
    up only after 100 s, whatever the timeout; on a fresh port each time, in none of 85.
    gloo's TCP pair set-up has also been seen to hang on one rank while the other got
    through (a flaw of gloo's, not what these checks test): the group gets a bounded
    timeout, a barrier proves it works on every rank, and the ranks agree through
    totalreduce whether to try again on a fresh port."""
    import datetime
    import socket

    import torch.distributed as dist

    global _gloo_env_used
    timeout = datetime.timedelta(seconds=20)
    for attempt in range(3):
        ok = 1
        # Every rank runs the same parts in the same order, so all agree on this.
        from_env = not _gloo_env_used
        _gloo_env_used = True
        port = 0
        if not from_env:
            if hvd.rank() == 0:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
            port = hvd.broadcast_object(port, 0, name=f"gloo_port.{attempt}")
        try:
            if from_env:
                dist.init_process_group("gloo", timeout=timeout)
            else:
                dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                        rank=hvd.rank(), world_size=hvd.size(),
                                        timeout=timeout)
            dist.barrier()
        except (RuntimeError, dist.DistError) as exc:
            warnings.warn(f"gloo's process group failed to form (try {attempt + 1}): {exc}",
                          stacklevel=2)
            ok = 0
        if hvd.allreduce(torch.tensor([ok]), op=hvd.Min, name=f"gloo_ok.{attempt}").item():
            return
        if dist.is_initialized():
            dist.destroy_process_group()
        # torch names each new group by a counter, which destroying the default group
        # sets back to 0, but which an init that failed part way has already advanced:
        # one rank then looked for keys under group 1 while the other wrote them under
        # group 0, and every later try timed out (seen in a slow suite run).
        world = getattr(dist.distributed_c10d, "_world", None)
        if world is not None and hasattr(world, "group_count"):
            world.group_count = 0
    raise AssertionError("gloo's process group did not form in 3 tries")


def ddp_hook(arg: dict) -> None:
    """DDP under totalrun with our comm hook matches DDP with gloo (the job's first gloo
    group forms from the variables totalrun exports: _gloo_world)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    hvd.init()
    _gloo_world()
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
    several buckets, every rank a different shard).  Reports how many ops ran on the
    caller's thread in the dense run at step() (each bucket a blocking allreduce there).
    Overlapped and dense, the bucket that fills last is reduced at step(), blocking."""
    from totalreduce.runtime import current

    hvd.init()
    stats = current().engine.stats
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
            direct = stats()["direct_ops"]
            model = _model(7, hidden=24)
            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.5),
                named_parameters=model.named_parameters(), compression=make(),
                bucket_bytes=1024, overlap=overlap)
            assert len(opt._buckets) >= 3, len(opt._buckets)
            launches: list[bool] = []  # each launch's now= (a blocking reduction)
            launch = opt._launch
            opt._launch = lambda b, now=False, launch=launch, seen=launches: (  # type: ignore[method-assign]
                seen.append(now), launch(b, now))[1]
            for x, y in batches:
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x[r::n]), y[r::n]).backward()
                in_backward = len(launches)
                opt.step()
                if label == "none" and overlap:
                    # Every bucket but the last to fill went while backward ran; that one
                    # at step(), blocking.
                    assert launches[:in_backward] == [False] * (len(opt._buckets) - 1), \
                        launches
                    assert launches[in_backward:] == [True], launches
                launches.clear()
            weights.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
            if label == "none" and not overlap:
                report(at_step_direct=stats()["direct_ops"] - direct,
                       at_step_buckets=len(opt._buckets) * len(batches))
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
    _gloo_world()
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
    _gloo_world()
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
    or [name, worker, its arg, settings], a worker being a function of this module or
    ``"module:function"`` (a torch job's start, four seconds of imports a rank, is most of
    its cost): each reports under its name (``Result.part``), in the one world they share
    (the workers' own init() is a no-op here; after one that shuts down, the ranks start a
    new one), and one that fails on a rank stops every rank there (checks.run_checks).  A
    part with settings (``init()``'s keywords, as ``{"coordination": "negotiated"}``) runs
    in a world of its own started with them."""
    import reporting
    from checks import run_checks

    def part(name: str, worker: str, worker_arg: dict,
             settings: dict | None = None) -> tuple[str, Any]:
        module, _, func = worker.rpartition(":")
        def run() -> None:
            reporting.section = name
            if settings:
                hvd.shutdown()
                hvd.init(**settings)
            try:
                # "module:function" (imported here: such modules import this one), or a
                # function of this module.
                fn = getattr(importlib.import_module(module), func) if module else \
                    globals()[func]
                fn(worker_arg)
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


def digits(arg: dict) -> None:
    """examples/train_digits.py's ``main(arg["argv"])`` in this job's world, as a part of
    the shared job (test_examples: one start of the ranks, their torch imports, for the
    runs of each world size): reports its return value, the final accuracy, and what the
    rank printed (``out``; rank 0's is the example's output).  Only ``skipped`` where
    scikit-learn, the examples extra, is not installed."""
    import contextlib
    import importlib.util
    import io
    import sys
    from pathlib import Path

    if importlib.util.find_spec("sklearn") is None:
        report(skipped="scikit-learn is not installed")
        return
    example = sys.modules.get("train_digits")
    if example is None:
        path = Path(__file__).resolve().parent.parent / "examples" / "train_digits.py"
        spec = importlib.util.spec_from_file_location("train_digits", path)
        assert spec is not None and spec.loader is not None, path
        example = sys.modules["train_digits"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            accuracy = example.main(arg["argv"])
    finally:
        report(out=out.getvalue())  # what it printed before it failed, if it did
    report(accuracy=accuracy)


def first_use(arg: dict) -> None:
    """One job for the checks above that share it: gradients and 0-d tensors, then DDP
    with buckets that differ between ranks."""
    from checks import run_checks

    hvd.init()
    run_checks([("gradients and scalars", lambda: autograd_and_scalars(arg)),
                ("ddp buckets differ", lambda: ddp_errors({"case": "buckets"}))],
               prefix="first_use")


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
