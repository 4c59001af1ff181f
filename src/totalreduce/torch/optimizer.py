"""DistributedOptimizer: averages gradients over all ranks while backward still runs.

A hook on each parameter (``register_post_accumulate_grad_hook``) fires as its gradient
is accumulated.  When every gradient of a bucket (``buckets.py``) is in, the bucket's
flat buffer is reduced in place, asynchronously, while backward goes on with the earlier
layers; ``step()`` waits only for what is still in flight, then runs the wrapped
optimizer.  Buckets holding earlier layers get higher priority, so the gradients the next
forward pass needs first are the first to arrive.  The last bucket to fill (a small
model's only one) has no backward left to overlap: ``step()`` reduces it, blocking, once
the others are in.

A sparse compression (Ok-Topk, TopkA, gTopk) starts a bucket the same way, on a thread
of its own (``sparse_worker.py``), so that its selection and its exchanges overlap the
rest of backward; buckets go to that thread in index order, which every rank shares.

At the end of each backward pass (a callback autograd runs when the pass is over), any
bucket still waiting for a gradient is launched anyway: a parameter that got no gradient
this step is reduced as zeros and its ``.grad`` becomes a zero tensor, as in Horovod, so an
unused parameter never hangs its bucket (the last of them waits for ``step()``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

import totalreduce as _tr

from .. import runtime as _runtime
from ..exceptions import MismatchError
from . import adasum as _adasum
from . import autotune as _autotune
from . import buckets as _buckets
from .adasum import Adasum
from .collectives import (
    Average,
    ProcessSet,
    TorchHandle,
    global_process_set,
)
from .compression import Compression, Compressor, SparseCompressor
from .sparse_tensors import sparse_allreduce_async
from .sparse_worker import SparseWorker
from .tensors import stage

_instances = itertools.count()

# With a sparse compression, a bucket under this size and under 1/64 of the model's
# gradients is reduced whole: a sparse round is several latency-bound exchanges whatever
# its size, and a bucket that small (the MLP's biases, 28 KB of 50 MB) costs nothing
# measurable whole, as deep gradient compression leaves its small layers uncompressed.
_SPARSE_MIN_BYTES = 256 << 10


@dataclass(frozen=True)
class StepTimings:
    """When the last step's reductions ran (``time.monotonic()`` seconds).

    ``launches`` and ``completions`` hold one time per bucket, in bucket order;
    ``backward_end`` is when the last backward pass before the step finished;
    ``waited`` is how long ``synchronize()`` blocked for reductions still in flight.
    """

    launches: tuple[float, ...]
    completions: tuple[float, ...]
    backward_end: float
    waited: float



class _Reduced:
    """A bucket reduced at once, as its handle's result (:meth:`_launch` with ``now``)."""

    __slots__ = ("_array",)

    def __init__(self, array: Any) -> None:
        self._array = array

    def wait(self) -> Any:
        return self._array


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Constructing it is a collective: every rank must construct it, with the same
    parameters in the same order (checked: a parameter whose shape or dtype differs on
    some rank raises :class:`MismatchError` naming it, on every rank).

    ``zero_grad()`` zeroes the gradient buffers in place whatever ``set_to_none`` says:
    the gradients are views into the buffers the reduction works on, so the next backward
    accumulates into them without a copy.

    Args:
        optimizer: the local optimizer; its ``step()`` runs on the averaged gradients.
        named_parameters: ``model.named_parameters()``; names appear in error messages.
            Without it, parameters are named by their position.
        compression: ``Compression.none``, ``Compression.fp16`` (half the bytes on the
            wire, float16 precision and range), or a sparse allreduce:
            ``Compression.oktopk(density=0.01)``, ``topka(...)``, ``gtopk(...)`` (a
            fraction of the bytes; what is not sent waits in residuals, saved with
            ``state_dict()``).
        backward_passes_per_step: backward passes accumulated locally before the
            gradients are reduced (gradient accumulation); ``step()`` must come after
            exactly that many.
        op: ``Average`` (default), ``Sum`` or ``Adasum`` (``adasum.py``: each
            parameter's gradient combined by adaptive summation, so the learning rate
            stays one worker's; floating-point parameters only).  Horovod applies
            Adasum to the local optimizer's update instead of to the gradient: the two
            agree for plain SGD, not with momentum or Adam (docs/PORTING.md).
        gradient_predivide_factor: divides gradients by this before the sum and
            multiplies the average by it after (keeps float16 sums in range).
        sparse_as_dense: turn sparse gradients (``nn.Embedding(sparse=True)``) dense
            and reduce them in the buckets.  Without it (the default), as in Horovod, a
            sparse gradient is reduced by allgathering every rank's indices and values
            (:func:`sparse_allreduce_async`) and stays sparse (for ``SparseAdam``); every
            rank must then produce it in the same steps.
        bucket_bytes: gradient bucket size (default ``TOTALREDUCE_BUCKET_BYTES``); every
            rank must pass the same.
        overlap: reduce each bucket as soon as backward has filled it (the default).
            False reduces every bucket when the step synchronizes, after backward: the
            same results (bucket by bucket, in the same order, each as a blocking
            allreduce on the step's thread), without the overlap; faster where a rank has
            no core to spare for its communication.
        autotune: try bucket sizes and overlap on and off for the first steps (8 steps
            each), then keep the fastest (``autotune.py``; default
            ``TOTALREDUCE_AUTOTUNE``, or Horovod's ``HOROVOD_AUTOTUNE``; the trials go
            to ``TOTALREDUCE_AUTOTUNE_LOG``).  With a sparse compression only overlap
            is tuned: the residuals belong to the buckets.  Every rank must pass the same.

    Raises:
        ValueError: duplicate or missing parameter names, a bad
            ``backward_passes_per_step``, an op other than Average, Sum and Adasum, or
            Adasum with a sparse compression or a gradient_predivide_factor.
        MismatchError: ranks disagree on the parameters.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                 compression: type[Compressor] | SparseCompressor = Compression.none,
                 backward_passes_per_step: int = 1, op: Any = Average,
                 gradient_predivide_factor: float = 1.0, sparse_as_dense: bool = False,
                 process_set: ProcessSet = global_process_set, *,
                 bucket_bytes: int | None = None, overlap: bool = True,
                 autotune: bool | None = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("DistributedOptimizer wraps a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if process_set is not global_process_set:
            if op is Adasum or isinstance(compression, SparseCompressor):
                raise NotImplementedError(
                    "DistributedOptimizer: a process set other than global_process_set "
                    "works with op=Average or Sum and dense compression (Adasum and the "
                    "sparse compressions run over the whole job)")
            _tr._ops(process_set, "DistributedOptimizer")  # registered, and this rank in it
        self._process_set = process_set
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be an int >= 1, got "
                             f"{backward_passes_per_step!r}")
        if op is not Adasum and op not in (_tr.Average, _tr.Sum):
            raise ValueError("DistributedOptimizer: op must be Average, Sum or Adasum, got "
                             f"{op!r}")
        if op is Adasum and isinstance(compression, SparseCompressor):
            raise ValueError("DistributedOptimizer: op=Adasum cannot combine with a sparse "
                             "compression (Ok-Topk and co. sum what they select)")
        if gradient_predivide_factor != 1.0 and op != _tr.Average:
            raise ValueError("gradient_predivide_factor needs op=Average")
        if gradient_predivide_factor <= 0:
            raise ValueError("gradient_predivide_factor must be > 0")
        self._optimizer = optimizer
        self._constructing = True
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self._constructing = False
        # Share the wrapped optimizer's groups and state: changes to the learning rate
        # (LR schedulers) or loaded state must reach the optimizer that steps.
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state

        self._compression = compression
        # What a bucket reduced whole is compressed with.
        self._whole: type[Compressor] = \
            Compression.none if isinstance(compression, SparseCompressor) else compression
        self._passes_per_step = backward_passes_per_step
        self._op = op
        self._predivide = float(gradient_predivide_factor)
        self._sparse_as_dense = sparse_as_dense
        self._prefix = f"DistributedOptimizer{next(_instances)}"
        names, params = self._named(named_parameters)
        # Horovod's attribute of that name, which scripts read to name parameters.
        self._parameter_names = dict(zip(params, names, strict=True))
        # Parameters whose gradients come sparse.  SparseAdam's all do, and must from
        # the first step: a dense .grad (zero_grad()'s bucket view) would make backward
        # accumulate them densely.  Others join when their first sparse gradient comes.
        self._sparse_params: set[torch.Tensor] = \
            set(params) if isinstance(optimizer, torch.optim.SparseAdam) and \
            not sparse_as_dense else set()
        self._sparse_pending: dict[torch.Tensor, TorchHandle] = {}
        self._overlap = overlap
        self._sparse_worker = SparseWorker(f"{self._prefix}.sparse") \
            if isinstance(compression, SparseCompressor) else None
        self._sparse_next = 0  # the next bucket to go to the sparse worker
        self._check_same_everywhere(names, params)
        config = _runtime.current().config
        cap = config.bucket_bytes if bucket_bytes is None else bucket_bytes
        if cap < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {cap}")
        self._names, self._params = names, params
        # Big gradients are reduced in their own .grad (buckets.py); not for Adasum, which
        # combines a bucket's parameters one by one, or SparseAdam's sparse gradients.  A
        # sparse compression keeps its residuals per bucket, solo ones included.
        self._solo = op is not Adasum and not isinstance(optimizer, torch.optim.SparseAdam)
        self._buckets: list[_buckets.Bucket] = []
        self._slot: dict[torch.Tensor, tuple[_buckets.Bucket, int]] = {}
        self._rebuild(cap)
        self._autotuner: _autotune.Autotuner | None = None
        if bool(config.autotune) if autotune is None else autotune:
            self._autotuner = self._make_autotuner(_autotune.Setting(cap, overlap),
                                                   config.autotune_log)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        self._passes = 0
        self._in_backward = False
        self._backward_end = 0.0
        self._synchronized = False
        self._should_synchronize = True
        self._timings = StepTimings((), (), 0.0, 0.0)

    # --- set-up ---------------------------------------------------------------------

    def _named(self, named_parameters: Iterable[tuple[str, torch.Tensor]] | None
               ) -> tuple[list[str], list[torch.nn.Parameter]]:
        ordered = [p for group in self._optimizer.param_groups for p in group["params"]
                   if p.requires_grad]
        if named_parameters is None:
            return [f"parameter #{i}" for i in range(len(ordered))], ordered
        pairs = list(named_parameters)
        if any(not isinstance(t, tuple) or len(t) != 2 for t in pairs):
            raise ValueError("named_parameters must be a sequence of (name, parameter) "
                             "tuples, e.g. model.named_parameters()")
        seen: dict[str, int] = {}
        for n, _ in pairs:
            seen[n] = seen.get(n, 0) + 1
        dups = sorted(n for n, c in seen.items() if c > 1)
        if dups:
            raise ValueError(f"parameter names in named_parameters must be unique; "
                             f"repeated: {', '.join(dups)}")
        name_of = {id(p): n for n, p in pairs}
        unnamed = [i for i, p in enumerate(ordered) if id(p) not in name_of]
        if unnamed:
            shown = ", ".join(f"#{i} {tuple(ordered[i].shape)}" for i in unnamed[:5])
            raise ValueError(f"named_parameters was given but {len(unnamed)} of the "
                             f"optimizer's parameters are not in it ({shown}); pass "
                             "model.named_parameters() of the model the optimizer trains")
        return [name_of[id(p)] for p in ordered], ordered

    def _check_same_everywhere(self, names: list[str],
                               params: list[torch.nn.Parameter]) -> None:
        import numpy as np

        mine = _buckets.describe(names, params)
        digests = _tr.allgather(np.array([_buckets.digest(mine)], np.int64),
                                name=f"{self._prefix}.check", process_set=self._process_set)
        if len(set(digests.tolist())) == 1:
            return
        views = _tr.allgather_object(mine, name=f"{self._prefix}.describe",
                                     process_set=self._process_set)
        rank = _tr.rank()
        ranks = self._process_set.ranks or list(range(_tr.size()))
        longest = max(len(v) for v in views)
        for i in range(longest):
            row = [v[i] if i < len(v) else ("(none)", "(no parameter)") for v in views]
            if len(set(row)) > 1:
                if len({n for n, _ in row}) == 1:
                    what = f"parameter '{row[0][0]}'"
                    shown = "; ".join(f"rank {ranks[r]}: {d}" for r, (_, d) in enumerate(row))
                else:
                    what = f"parameter #{i}"
                    shown = "; ".join(f"rank {ranks[r]}: {n} {d}"
                                      for r, (n, d) in enumerate(row))
                raise MismatchError(row[ranks.index(rank)][0],
                                    f"rank {rank}: DistributedOptimizer: {what} differs "
                                    f"between ranks: {shown}")
        raise MismatchError("", f"rank {rank}: DistributedOptimizer: ranks have different "
                            "parameters")

    def _rebuild(self, cap: int) -> None:
        """(Re)form the buckets at ``cap`` bytes; gradients already there move along."""
        self._cap = cap
        old = {p: p.grad for b in self._buckets for p in b.params}
        self._buckets = _buckets.build(self._names, self._params, cap, self._solo)
        if isinstance(self._compression, SparseCompressor):
            small = min(_SPARSE_MIN_BYTES,
                        sum(p.numel() * p.element_size() for p in self._params) // 64)
            for b in self._buckets:
                b.dense = b.grad_bytes < small
        self._slot = {}
        for b in self._buckets:
            for i, p in enumerate(b.params):
                self._slot[p] = (b, i)
                grad = old.get(p)
                if grad is not None and p not in self._sparse_params and not b.solo:
                    b.views[i].copy_(grad)
                    p.grad = b.views[i]
        self._sparse_next = 0

    def _make_autotuner(self, default: _autotune.Setting,
                        log_path: str) -> _autotune.Autotuner:
        import numpy as np

        sizes = [(p.numel() * p.element_size(), p.dtype, p.device) for p in self._params]
        settings = _autotune.candidates(
            default, lambda cap: len(_buckets.plan(sizes, cap, self._solo)),
            tune_buckets=not isinstance(self._compression, SparseCompressor))

        def agree(seconds: float, trial: int) -> float:
            slowest = _tr.allreduce(np.array([seconds]), op=_tr.Max,
                                    name=f"{self._prefix}.autotune.{trial}",
                                    process_set=self._process_set)
            return float(slowest[0])

        return _autotune.Autotuner(settings, agree, log_path if _tr.rank() == 0 else "")

    @property
    def autotuned(self) -> _autotune.Setting | None:
        """The setting autotuning chose (None: not tuning, or still trying)."""
        return None if self._autotuner is None else self._autotuner.chosen

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._constructing:
            super().add_param_group(param_group)
            return
        raise RuntimeError("DistributedOptimizer: add parameter groups to the optimizer "
                           "before wrapping it (every rank's buckets are fixed then)")

    # --- backward ---------------------------------------------------------------------

    def _on_grad(self, p: torch.Tensor) -> None:
        bucket, i = self._slot[p]
        # The last pass over, every bucket is launched, or (the last to fill) waits for
        # synchronize() all the same.
        if bucket.pending is not None or (self._overlap
                                          and self._passes >= self._passes_per_step):
            raise RuntimeError(
                f"DistributedOptimizer: a gradient of {bucket.names[i]} was computed while "
                "its reduction was in flight: more than backward_passes_per_step="
                f"{self._passes_per_step} backward passes before step(); raise "
                "backward_passes_per_step to accumulate gradients locally")
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        grad = p.grad
        if grad is not None and grad.is_sparse:
            if not self._sparse_as_dense:
                self._on_sparse_grad(p, bucket, i, grad)
                return
            grad = grad.to_dense()
        if not bucket.solo and not bucket.owns(i, grad):
            # The gradient was set to None (model.zero_grad()) or replaced: move it into
            # the bucket once; from then on backward accumulates there directly.
            assert grad is not None  # the hook runs after accumulation: there is one
            view = bucket.views[i]
            view.copy_(grad)
            p.grad = view
        bucket.fired.add(i)
        bucket.touched.add(i)
        if (self._overlap and self._passes + 1 == self._passes_per_step
                and len(bucket.fired) == len(bucket.params) and not self._last_open(bucket)):
            self._launch(bucket)

    def _last_open(self, bucket: _buckets.Bucket) -> bool:
        """Whether every bucket but ``bucket`` has been launched: a dense one then waits for
        :meth:`synchronize`, which reduces it on its thread, from its Repeat.  Backward
        has no layer left to overlap it with, and an async reduction wakes the progress
        thread, which takes a core from backward and from the peer: at 2 ranks on 2 cores
        the digits example's MLP (one bucket) took 1.5-1.6 ms a step so against 1.0-1.1
        reduced at step()."""
        if not self._defers_last():
            return False
        return all(b is bucket or b.pending is not None for b in self._buckets)

    def _defers_last(self) -> bool:
        """Whether the last bucket to fill waits for :meth:`synchronize` (_last_open): a
        dense reduction's, whose blocking call runs from its Repeat."""
        return self._op is not Adasum and not isinstance(self._compression, SparseCompressor)

    def _on_sparse_grad(self, p: torch.Tensor, bucket: _buckets.Bucket, i: int,
                        grad: torch.Tensor) -> None:
        """A sparse gradient stays out of the bucket (its slot is reduced as zeros) and
        is reduced on its own, sparse, once the last accumulated pass has produced it."""
        if self._op is Adasum:
            raise ValueError(f"DistributedOptimizer: op=Adasum needs dense gradients, but "
                             f"{bucket.names[i]} got a sparse one; pass sparse_as_dense=True")
        self._sparse_params.add(p)
        bucket.fired.add(i)
        bucket.touched.add(i)
        last_pass = self._passes + 1 == self._passes_per_step
        if last_pass:
            self._sparse_pending[p] = sparse_allreduce_async(
                grad, name=f"{self._prefix}.sparse.{bucket.names[i]}", op=self._op,
                process_set=self._process_set)
            if self._overlap and len(bucket.fired) == len(bucket.params):
                self._launch(bucket)

    def _on_backward_end(self) -> None:
        self._in_backward = False
        self._backward_end = time.monotonic()
        self._passes += 1
        for b in self._buckets:
            b.fired.clear()
        if self._overlap and self._passes == self._passes_per_step:
            waiting = [b for b in self._buckets if b.pending is None]
            if waiting and self._defers_last():
                waiting.pop()  # left for synchronize(), as _last_open leaves it
            for b in waiting:
                self._launch(b)

    def _launch(self, bucket: _buckets.Bucket, now: bool = False) -> None:
        """Start reducing ``bucket``; with ``now``, reduce it to its end on this thread
        (a blocking allreduce: :meth:`synchronize` with nothing in flight)."""
        if bucket.solo:
            p = bucket.params[0]
            if p in self._sparse_params:  # its gradient is sparse: the bucket sends zeros
                bucket.flat = torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
            else:
                bucket.adopt()
        for i, p in enumerate(bucket.params):
            if p in self._sparse_params or bucket.solo:
                continue  # its gradient is sparse (not the bucket's), or is the bucket
            if i not in bucket.touched and not bucket.owns(i, p.grad):
                bucket.views[i].zero_()
                p.grad = bucket.views[i]
        flat = bucket.flat
        if self._sparse_bucket(bucket):
            bucket.launch_time = time.monotonic()
            bucket.pending = (None, None, None, None)
            self._start_sparse()
            return
        if self._predivide != 1.0:
            flat.div_(self._predivide)
        wire, ctx = self._whole.compress(flat)
        staged = stage(wire, "DistributedOptimizer")
        bucket.launch_time = time.monotonic()
        name = f"{self._prefix}.b{bucket.index}"
        if self._op is Adasum:
            _adasum.check_dtype(staged.array.dtype, f"DistributedOptimizer bucket of "
                                f"{', '.join(bucket.names)}")
            # Every rank's bucket gathered; _complete combines parameter by parameter.
            handle = _tr.allgather_async(staged.array.reshape(1, -1), name=name,
                                         priority=bucket.index)
        elif now:
            # Priority 0: nothing else is in flight to pass, and a blocking call of a
            # higher one takes the urgent lane, which holds only small ops.
            _tr.allreduce_(staged.array, op=self._op, name=name,
                           process_set=self._process_set)
            bucket.done_time = time.monotonic()
            bucket.pending = (_Reduced(staged.array), staged, wire, ctx)
            return
        else:
            handle = _tr.allreduce_async_(staged.array, op=self._op, name=name,
                                          priority=bucket.index,
                                          process_set=self._process_set)

        def finished(_h: Any) -> None:
            bucket.done_time = time.monotonic()

        handle.add_done_callback(finished)
        bucket.pending = (handle, staged, wire, ctx)

    def _sparse_bucket(self, bucket: _buckets.Bucket) -> bool:
        """Whether ``bucket`` goes through the sparse compression."""
        return isinstance(self._compression, SparseCompressor) and not bucket.dense

    def _start_sparse(self) -> None:
        """Hand launched buckets to the sparse worker, in index order: a bucket launched
        early waits for the buckets before it."""
        sparse, worker = self._compression, self._sparse_worker
        assert isinstance(sparse, SparseCompressor) and worker is not None
        while self._sparse_next < len(self._buckets):
            bucket = self._buckets[self._sparse_next]
            if bucket.dense:  # reduced whole, on the engine: not the worker's
                self._sparse_next += 1
                continue
            if bucket.pending is None:
                return
            job = worker.submit(functools.partial(self._sparse_reduce, bucket, sparse))
            bucket.pending = (job, None, None, None)
            self._sparse_next += 1

    def _complete(self, bucket: _buckets.Bucket) -> None:
        handle, staged, wire, ctx = bucket.pending
        bucket.pending = None
        if self._sparse_bucket(bucket):
            handle.result()
            return
        gathered = handle.wait()
        if self._op is Adasum:
            edges = list(itertools.accumulate((p.numel() for p in bucket.params), initial=0))
            staged.array[...] = _adasum.reduce_gathered(
                gathered, list(itertools.pairwise(edges)), staged.array.dtype)
        staged.write_back()
        if wire is not bucket.flat:
            bucket.flat.copy_(self._whole.decompress(wire, ctx))
        if self._predivide != 1.0:
            bucket.flat.mul_(self._predivide)

    def _sparse_reduce(self, bucket: _buckets.Bucket, sparse: SparseCompressor) -> None:
        staged = stage(bucket.flat, "DistributedOptimizer")
        # Named by bucket alone, so that a resumed run's optimizer finds the residuals.
        sparse.algorithm.allreduce(staged.array, f"sparse.b{bucket.index}",
                                   out=staged.array)
        if self._op == _tr.Sum:
            staged.array *= _tr.size()
        staged.write_back()
        bucket.done_time = time.monotonic()

    def _settle_sparse(self) -> None:
        """After a failed bucket: let the worker finish the later ones before their
        buffers are reused (they fail fast too when a peer is lost)."""
        self._sparse_next = 0
        for b in self._buckets:
            job = b.pending[0] if b.pending is not None else None
            if isinstance(job, Future):
                with contextlib.suppress(BaseException):
                    job.result()

    # --- the public surface -----------------------------------------------------------

    def synchronize(self, force: bool = False) -> None:
        """Finish reducing every gradient: launch what backward did not, wait for all.

        A second call with no backward in between does nothing, unless ``force`` (for
        gradients set by hand): every rank must then pass it.

        Raises:
            RuntimeError: called after fewer backward passes than
                ``backward_passes_per_step``.
            TotalReduceError: a reduction failed (mismatch, lost peer, timeout).
        """
        if 0 < self._passes < self._passes_per_step:
            raise RuntimeError(
                f"DistributedOptimizer: step() or synchronize() after {self._passes} of "
                f"backward_passes_per_step={self._passes_per_step} backward passes; "
                "call it after every backward_passes_per_step-th backward()")
        if self._synchronized and self._passes == 0 and not force:
            return  # already reduced, and no backward since
        # The buckets not launched yet (overlap off, no hook fired, or the last to fill:
        # _last_open) are reduced after those in flight, one after another as blocking
        # allreduces, each from its Repeat on this thread, rather than submitted to the
        # engine's loop and waited for: the loop's turns cost an op more
        # (docs/dev/perf-log.md, "What the loop costs").
        waiting = [b for b in self._buckets if b.pending is None]
        blocking = self._defers_last()
        if not blocking:
            for b in waiting:
                self._launch(b)
        start = time.monotonic()
        try:
            for b in self._buckets:
                if b.pending is not None:
                    self._complete(b)
            if blocking:
                for b in waiting:
                    self._launch(b, True)
                    self._complete(b)
            for p, handle in self._sparse_pending.items():
                p.grad = handle.wait()
        finally:
            self._settle_sparse()
            self._sparse_pending.clear()
            for b in self._buckets:
                b.pending = None
                b.touched.clear()
            self._passes = 0
        self._timings = StepTimings(tuple(b.launch_time for b in self._buckets),
                                    tuple(b.done_time for b in self._buckets),
                                    self._backward_end, time.monotonic() - start)
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within it, ``step()`` does not synchronize (call ``synchronize()`` before, e.g.
        to clip the averaged gradients)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if self._should_synchronize:
            if self._synchronized and self._passes == 0:
                warnings.warn("optimizer.step() called after optimizer.synchronize() "
                              "outside optimizer.skip_synchronize(): wrap step() in "
                              "skip_synchronize() when you synchronize yourself",
                              stacklevel=2)
            self.synchronize()
        self._synchronized = False
        result = self._optimizer.step(closure)
        if self._autotuner is not None and not self._autotuner.done:
            setting = self._autotuner.stepped()
            if setting is not None:
                if setting.bucket_bytes != self._cap:
                    self._rebuild(setting.bucket_bytes)
                self._overlap = setting.overlap
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        if any(b.pending is not None for b in self._buckets):
            raise RuntimeError("optimizer.zero_grad() was called after loss.backward() but "
                               "before optimizer.step() or optimizer.synchronize(): the "
                               "gradients are still being reduced")
        self._passes = 0
        for b in self._buckets:
            b.touched.clear()
            if b.solo:
                # Backward then makes a fresh gradient: no buffer to zero, nothing to add.
                p = b.params[0]
                if set_to_none or p.grad is None or p in self._sparse_params:
                    p.grad = None
                else:
                    p.grad.zero_()
                continue
            b.flat.zero_()
            for p, view in zip(b.params, b.views, strict=True):
                # A dense view would make the next sparse gradient accumulate densely.
                p.grad = None if p in self._sparse_params else view

    def last_timings(self) -> StepTimings:
        """When the last ``synchronize()``'s reductions were launched and finished."""
        return self._timings

    def state_dict(self) -> dict[str, Any]:
        state = self._optimizer.state_dict()
        if isinstance(self._compression, SparseCompressor):
            # The residuals are part of the model's progress: a resumed run that dropped
            # them would lose every gradient not sent yet.
            state = dict(state, totalreduce_sparse=self._compression.algorithm.state_dict(),
                         totalreduce_sparse_buckets=self._layout())
        return state

    def _layout(self) -> list[list[str]]:
        """Which parameters each bucket holds: what a bucket's residual belongs to."""
        return [list(b.names) for b in self._buckets]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sparse = state_dict.get("totalreduce_sparse")
        layout = state_dict.get("totalreduce_sparse_buckets")
        state_dict = {k: v for k, v in state_dict.items()
                      if k not in ("totalreduce_sparse", "totalreduce_sparse_buckets")}
        if sparse is not None and isinstance(self._compression, SparseCompressor):
            # A residual is a bucket's: loaded into buckets of other parameters it would
            # add one parameter's held-back gradient to another's.
            if layout is not None and [list(b) for b in layout] == self._layout():
                self._compression.algorithm.load_state_dict(sparse)
            else:
                warnings.warn(
                    "DistributedOptimizer.load_state_dict: the sparse residuals were saved "
                    "with other gradient buckets (another bucket_bytes, other parameters, "
                    "or an earlier totalreduce) and are dropped: the gradients they held "
                    "back are lost, and training goes on from the loaded weights",
                    stacklevel=2)
        self._optimizer.load_state_dict(state_dict)
        self.state = self._optimizer.state
        self.param_groups = self._optimizer.param_groups

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._optimizer!r})"

    def __getattr__(self, name: str) -> Any:
        # Attributes of the wrapped optimizer (e.g. Adam's own settings) stay reachable.
        if name == "_optimizer":
            raise AttributeError(name)
        return getattr(self._optimizer, name)
