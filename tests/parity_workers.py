"""Horovod parity checks for totalreduce.torch (issue 27): the launcher's variables,
capabilities, integer and misuse behaviour, the optimizer's options, Adasum and
SyncBatchNorm, run on every rank as parts of the shared torch jobs (shared_jobs.py).

Each rank computes the single-process reference itself (same seeds everywhere) and
compares its own distributed result with it.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

import totalreduce.torch as hvd
from reporting import report
from torch_workers import (
    _assert_same_on_every_rank,
    _batches,
    _fit_one_batch,
    _model,
    close,
    optimizer_state,
)

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
        ("repeated broadcasts", lambda: repeated_broadcasts(r, n)),
        ("repeated gathers", lambda: repeated_gathers(r, n)),
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
    import shutil
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
    shutil.rmtree(folder)
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
    try:  # blocking, like the op in flight (the scheduler has its template)
        hvd.allreduce(torch.ones(2), name=f"dup{r}", op=hvd.Sum)
        raise AssertionError("a blocking allreduce under a name in flight was accepted")
    except ValueError as exc:
        assert f"an op named 'dup{r}' is still in flight" in str(exc), exc
    try:
        hvd.broadcast_(torch.ones(2), root_rank=0, name=f"dup{r}")
        raise AssertionError("a blocking broadcast under a name in flight was accepted")
    except ValueError as exc:
        assert f"an op named 'dup{r}' is still in flight" in str(exc), exc
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


def repeated_broadcasts(r: int, n: int) -> None:
    """Blocking broadcasts repeated under one name, in place and not, of a float and an
    integer tensor, the root changing from call to call: from a template's second call
    on they run from its Repeat (engine/repeat.py).  Each result checked, and
    broadcast()'s input left as it was."""
    from totalreduce.runtime import current

    stats = current().engine.stats
    before = stats()
    for i in range(12):
        root = i % n
        f = torch.arange(5, dtype=torch.float32) + 10 * r + i
        assert hvd.broadcast_(f, root_rank=root, name="rep_f") is f
        close(f, torch.arange(5, dtype=torch.float32) + 10 * root + i, f"broadcast_ {i}")
        k = torch.full((2, 3), 7 * r + i, dtype=torch.int64)
        close(hvd.broadcast(k, root_rank=root, name="rep_i"),
              torch.full((2, 3), 7 * root + i, dtype=torch.int64), f"broadcast {i}")
        close(k, torch.full((2, 3), 7 * r + i, dtype=torch.int64), f"broadcast {i} input")
    after = stats()
    report(parity_f=sum(after[key] - before[key] for key in (
        "express_repeats", "express_repeats_handed_over")))


def repeated_gathers(r: int, n: int) -> None:
    """Blocking allgathers (rows by rank), alltoalls with splits and reducescatters
    repeated under their names, of float32, int64 and bfloat16 tensors (bfloat16 travels
    as float32), and an allreduce of a tensor that requires grad under no_grad: from a
    template's second call on they run from its Repeats, an allgather's and an alltoall's
    two phases each from its own.  Each result checked against one made here."""
    from totalreduce.runtime import current

    stats = current().engine.stats
    repeats = 0
    for i in range(12):
        before = stats()["express_repeats"]
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            label = f"{dtype} call {i}"
            parts = [torch.arange(2 * (q + 1), dtype=torch.float32).reshape(q + 1, 2).to(dtype)
                     + 10 * q + i for q in range(n)]
            got = hvd.allgather(parts[r], name=f"gather.{dtype}")
            close(got, torch.cat(parts), f"allgather {label}")
            splits = [[(q + k) % 3 for k in range(n)] for q in range(n)]
            sends = [torch.arange(sum(s), dtype=torch.float32).to(dtype) + 100 * q + i
                     for q, s in enumerate(splits)]
            starts = [[sum(s[:k]) for k in range(n + 1)] for s in splits]
            out, received = hvd.alltoall(sends[r], splits=splits[r], name=f"a2a.{dtype}")
            close(out, torch.cat([sends[q][starts[q][r]:starts[q][r + 1]] for q in range(n)]),
                  f"alltoall {label}")
            assert received.tolist() == [splits[q][r] for q in range(n)], received
            full = [torch.arange(2 * n + 1, dtype=torch.float32).to(dtype) + q + i
                    for q in range(n)]
            lo, hi = even_share(2 * n + 1, r, n)
            close(hvd.reducescatter(full[r], name=f"rs.{dtype}", op=hvd.Sum),
                  sum(full[1:], full[0])[lo:hi], f"reducescatter {label}")
        repeats += stats()["express_repeats"] - before
        w = torch.full((3,), float(r + i), requires_grad=True)
        with torch.no_grad():
            close(hvd.allreduce(w, name="no_grad", op=hvd.Sum),
                  torch.full((3,), float(sum(range(n)) + n * i)), f"no_grad allreduce {i}")
    report(parity_g=repeats)


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
