"""Horovod's collective functions on torch tensors, run by totalreduce's engine.

Names, argument names and defaults follow ``horovod.torch``.  Async forms return a
:class:`TorchHandle`; ``synchronize(handle)`` returns what the blocking form would have,
``poll(handle)`` says whether it is done.  Tensor handling (zero-copy CPU views, bfloat16
carried as float32, CUDA staged through host memory) is described in ``tensors.py``.

As in Horovod, the blocking collectives are autograd functions when a tensor that requires
grad goes in (``gradients.py`` says which, and what their gradients are).

As in Horovod, an op submitted under the name of one of this rank's ops still in flight
raises ``ValueError``.  (The numpy API allows it: there the second op is matched with the
other ranks' second op of that name.)
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

import numpy as np
import torch

import totalreduce as _tr
from totalreduce import ProcessSet, global_process_set

from . import adasum as _adasum
from . import gradients as _grads
from .adasum import Adasum
from .compression import Compression, Compressor
from .tensors import Staged, stage

_HERE = os.path.dirname(os.path.abspath(__file__))
Average = _tr.Average
Sum = _tr.Sum
Min = _tr.Min
Max = _tr.Max
Product = _tr.Product


def _check_process_set(process_set: Any, what: str) -> None:
    """Fail now, not inside the op, where ``process_set`` is not registered here or this
    rank is not in it (Horovod's process sets; totalreduce.add_process_set)."""
    _tr._ops(process_set, what)


def _whole_job(process_set: ProcessSet, what: str) -> None:
    if process_set is not global_process_set:
        raise NotImplementedError(f"rank {_tr.rank()}: {what}: op=Adasum runs over the "
                                  "whole job only, not a process set")


class _LiveNames:
    """The names of this process's ops still in flight.  Horovod refuses a second op
    under the name of one that has not finished (ValueError); the engine itself would
    match it as the name's next call, so the refusal lives here, in the Horovod layer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, Any] = {}

    def submit(self, name: str | None, what: str, start: Callable[[], Any]) -> Any:
        if name is None:
            return start()
        self.check(name, what)
        handle = start()
        with self._lock:
            self._live[name] = handle
        # Outside the lock: the callback runs at once if the op is done already.
        handle.add_done_callback(lambda h: self._release(name, h))
        return handle

    def check(self, name: str, what: str) -> None:
        """Raise if an op named ``name`` is in flight here."""
        with self._lock:
            held = self._live.get(name)
            # A finished handle whose done-callback has not run yet is no longer in flight.
            if held is not None and not held.done():
                raise ValueError(
                    f"rank {_tr.rank()}: {what}: an op named '{name}' is still in flight on "
                    "this rank; synchronize() its handle first or use another name")

    def _release(self, name: str, handle: Any) -> None:
        with self._lock:
            if self._live.get(name) is handle:
                del self._live[name]


_live_names = _LiveNames()


def _ops(process_set: ProcessSet | None = None, what: str = "") -> Any:
    return _tr._ops(process_set, what)


class TorchHandle:
    """The pending result of an async collective on tensors."""

    __slots__ = ("_handle", "_finish", "_result", "_finished")

    def __init__(self, handle: _tr.Handle, finish: Callable[[Any], Any]) -> None:
        self._handle = handle
        self._finish = finish
        self._result: Any = None
        self._finished = False

    def done(self) -> bool:
        return self._handle.done()

    def wait(self, timeout: float | None = None) -> Any:
        value = self._handle.wait(timeout)
        if not self._finished:
            self._result = self._finish(value)
            self._finished = True
        return self._result

    def __repr__(self) -> str:
        return f"<TorchHandle {self._handle.label} {'done' if self.done() else 'pending'}>"


def synchronize(handle: TorchHandle) -> Any:
    """Wait for an async collective and return its result.

    Raises:
        TypeError: ``handle`` is not one an async collective returned.
        TotalReduceError: the op failed (mismatch, lost peer, timeout, shutdown).
    """
    if not isinstance(handle, TorchHandle | _tr.Handle):
        raise TypeError(f"synchronize: expected a handle from an *_async call, got "
                        f"{type(handle).__name__}")
    return handle.wait()


def _blocking(start: Any) -> Any:
    """A blocking form: ``start()`` submits the async form, and this thread waits for it,
    driving the engine's loop itself (the progress thread is not woken for it)."""
    with _ops().caller_waits():
        return start().wait()


def _start_or_run(blocking: bool, ops: Any, name: str | None, what: str,
                  start: Callable[[], TorchHandle], now: Callable[[], Any],
                  finish: Callable[[Any], Any]) -> Any:
    """An async form's handle (``start()``); ``blocking``: its result, ``finish(now())``
    where the scheduler ran the op to its end at once (``now()``: one of its ``*_now``
    methods, None where it did not), else ``start()``'s, waited for on this thread
    (driving the loop).  Horovod's refusal of a name still in flight holds either way."""
    if not blocking:
        return start()
    if name is not None:
        _live_names.check(name, what)
    done = now()
    if done is not None:
        return finish(done)
    with ops.caller_waits():
        return start().wait()


def poll(handle: TorchHandle) -> bool:
    """True once the async collective behind ``handle`` is done; never blocks."""
    return handle.done()


def _caller_level() -> int:
    """The ``stacklevel`` that names the first frame outside this package: the public
    functions reach the warning through different numbers of helpers."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_HERE):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level


def resolve_op(op: Any, average: bool | None, what: str) -> _tr.ReduceOp:
    """``op``, or Horovod's deprecated ``average`` flag, or the default Average."""
    if average is not None:
        if op is not None:
            raise ValueError(f"{what}: pass op= or the deprecated average=, not both")
        warnings.warn("average= is deprecated (as in Horovod): pass op=Average or op=Sum",
                      DeprecationWarning, stacklevel=_caller_level())
        return Average if average else Sum
    return Average if op is None else op


def _check_scale(staged: Staged, factor: float, label: str, what: str) -> None:
    if factor != 1.0 and staged.array.dtype.kind == "b":
        raise TypeError(f"{what}: {label}={factor} cannot scale a bool tensor")


def _scale(array: np.ndarray, factor: float) -> None:
    """``array *= factor`` in place.  Integers are scaled in float64 and truncated toward
    zero back into their dtype, as Horovod scales them."""
    if array.dtype.kind == "f":
        array *= factor
    else:
        array[...] = (array * float(factor)).astype(array.dtype)


def _scaled_stage(tensor: torch.Tensor, prescale: float, postscale: float, inplace: bool,
                  what: str) -> tuple[Staged, np.ndarray]:
    """The staged tensor and the array to reduce: prescaled (a copy unless in place)."""
    staged = stage(tensor, what)
    _check_scale(staged, postscale, "postscale_factor", what)
    _check_scale(staged, prescale, "prescale_factor", what)
    if prescale == 1.0:
        return staged, staged.array
    source = staged.array if inplace else staged.array.copy()
    _scale(source, prescale)
    return staged, source


# --- allreduce ------------------------------------------------------------------------


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: Any = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
                    priority: int = 0) -> TorchHandle:
    """Start an allreduce of ``tensor``; ``synchronize`` returns a new tensor.

    Args:
        tensor: a dense tensor of bool, uint8, int8, int16, int32, int64, float16,
            bfloat16, float32 or float64, on CPU or CUDA.
        average: deprecated (as in Horovod); True means ``op=Average``, False ``op=Sum``.
        name: matches the op across ranks; unnamed ops match by call order.
        op: ``Average`` (the default), ``Sum``, ``Min``, ``Max``, ``Product``, or
            ``Adasum`` (adaptive summation, floating-point tensors only; ``adasum.py``).
        prescale_factor: multiplies the input before the reduction (integer tensors
            are scaled in float64 and truncated back, as in Horovod).
        postscale_factor: multiplies the result after it (likewise).
        priority: higher runs first (a totalreduce extension).

    Raises:
        TypeError: unsupported tensor, a scale factor on a bool tensor, or Adasum of
            a tensor that is not floating-point.
        ValueError: both ``op`` and ``average`` given.
    """
    return _allreduce(tensor, average, name, op, prescale_factor, postscale_factor,
                      process_set, priority, inplace=False)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None,
                     name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set,
                     priority: int = 0) -> TorchHandle:
    """In-place :func:`allreduce_async`: ``tensor`` holds the result once it is done."""
    return _allreduce(tensor, average, name, op, prescale_factor, postscale_factor,
                      process_set, priority, inplace=True)


def _allreduce(tensor: torch.Tensor, average: bool | None, name: str | None, op: Any,
               prescale: float, postscale: float, process_set: ProcessSet, priority: int,
               inplace: bool) -> TorchHandle:
    return _allreduce_call(tensor, average, name, op, prescale, postscale, process_set,
                           priority, inplace, False)


def _blocking_allreduce(tensor: torch.Tensor, average: bool | None, name: str | None,
                        op: Any, prescale: float, postscale: float, process_set: ProcessSet,
                        inplace: bool) -> torch.Tensor:
    return _allreduce_call(tensor, average, name, op, prescale, postscale, process_set, 0,
                           inplace, True)


@overload
def _allreduce_call(tensor: torch.Tensor, average: bool | None, name: str | None, op: Any,
                    prescale: float, postscale: float, process_set: ProcessSet,
                    priority: int, inplace: bool, blocking: Literal[False]) -> TorchHandle:
    ...


@overload
def _allreduce_call(tensor: torch.Tensor, average: bool | None, name: str | None, op: Any,
                    prescale: float, postscale: float, process_set: ProcessSet,
                    priority: int, inplace: bool, blocking: Literal[True]) -> torch.Tensor:
    ...


def _allreduce_call(tensor: torch.Tensor, average: bool | None, name: str | None, op: Any,
                    prescale: float, postscale: float, process_set: ProcessSet,
                    priority: int, inplace: bool, blocking: bool
                    ) -> TorchHandle | torch.Tensor:
    """The async allreduce's handle; ``blocking``: its result, run to its end on this
    thread where the scheduler can (a small one like one made before: no handle and no
    hand-off, as the numpy API's blocking allreduce), else waited for."""
    what = ("allreduce_" if inplace else "allreduce") + (f" '{name}'" if name else "")
    _check_process_set(process_set, what)
    rop = resolve_op(op, average, what)
    ops = _ops(process_set, what)
    if blocking and rop is Adasum:
        with ops.caller_waits():
            return _allreduce_call(tensor, average, name, op, prescale, postscale,
                                   process_set, priority, inplace, False).wait()
    staged, source = _scaled_stage(tensor, prescale, postscale, inplace, what)
    if rop is Adasum:
        _whole_job(process_set, what)
        return _adasum_allreduce([staged], [source], name, postscale, priority, inplace,
                                 what, grouped=False)

    def finish(result: np.ndarray) -> torch.Tensor:
        if inplace:
            if postscale != 1.0:
                _scale(staged.array, postscale)
            staged.write_back()
            return tensor
        if postscale != 1.0:
            _scale(result, postscale)
        return staged.result(result)

    def start() -> TorchHandle:
        return TorchHandle(_live_names.submit(name, what, lambda: ops.allreduce(
            source, rop, name, priority, inplace=inplace)), finish)

    return _start_or_run(blocking, ops, name, what, start,
                         lambda: ops.allreduce_now(source, rop, name, priority, inplace), finish)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks and return the result as a new tensor.

    ``compression`` turns the tensor into what travels (``Compression.fp16``: half the
    bytes) and the result back.

    Raises:
        MismatchError: ranks disagree on the shape, dtype or op of this call.
        PeerFailureError: a rank died or left.
    """
    compressed, ctx = compression.compress(tensor)
    if _grads.differentiable([compressed]):
        what = "allreduce" + (f" '{name}'" if name else "")
        rop = resolve_op(op, average, what)
        out = _grads.AllreduceFn.apply(compressed, name, rop, prescale_factor, postscale_factor,
                                 process_set)
    else:
        out = _blocking_allreduce(compressed, average, name, op, prescale_factor,
                                  postscale_factor, process_set, inplace=False)
    return compression.decompress(out, ctx)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place :func:`allreduce`; returns ``tensor``."""
    return _blocking_allreduce(tensor, average, name, op, prescale_factor, postscale_factor,
                               process_set, inplace=True)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Allreduce a list of tensors together; ``synchronize`` returns a list of new ones."""
    return _grouped(tensors, average, name, op, prescale_factor, postscale_factor,
                    process_set, inplace=False)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> TorchHandle:
    """In-place :func:`grouped_allreduce_async`: the tensors receive the results."""
    return _grouped(tensors, average, name, op, prescale_factor, postscale_factor,
                    process_set, inplace=True)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None,
                      compression: type[Compressor] = Compression.none, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allreduce a list of tensors together and return a list of new tensors."""
    pairs = [compression.compress(t) for t in tensors]
    sent = [p[0] for p in pairs]
    if _grads.differentiable(sent):
        what = "grouped_allreduce" + (f" '{name}'" if name else "")
        rop = resolve_op(op, average, what)
        outs = list(_grads.GroupedAllreduceFn.apply(
            (name, rop, prescale_factor, postscale_factor, process_set), *sent))
    else:
        outs = _blocking(lambda: _grouped(sent, average, name, op, prescale_factor,
                                          postscale_factor, process_set, inplace=False))
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs, strict=True)]


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: Any = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """In-place :func:`grouped_allreduce`; returns ``tensors``."""
    return _blocking(lambda: _grouped(tensors, average, name, op, prescale_factor,
                                      postscale_factor, process_set, inplace=True))


def _grouped(tensors: Sequence[torch.Tensor], average: bool | None, name: str | None,
             op: Any, prescale: float, postscale: float, process_set: ProcessSet,
             inplace: bool) -> TorchHandle:
    what = ("grouped_allreduce_" if inplace else "grouped_allreduce") + \
        (f" '{name}'" if name else "")
    _check_process_set(process_set, what)
    rop = resolve_op(op, average, what)
    pairs = [_scaled_stage(t, prescale, postscale, inplace, what) for t in tensors]
    staged = [p[0] for p in pairs]
    sources = [p[1] for p in pairs]
    if rop is Adasum:
        _whole_job(process_set, what)
        return _adasum_allreduce(staged, sources, name, postscale, 0, inplace, what,
                                 grouped=True)
    handle = _live_names.submit(name, what, lambda: _ops(process_set, what).grouped_allreduce(
        sources, rop, name, 0, inplace=inplace))

    def finish(results: list[np.ndarray]) -> list[torch.Tensor]:
        out = []
        for s, r in zip(staged, results, strict=True):
            if postscale != 1.0:
                _scale(r, postscale)
            if inplace:
                s.write_back()
                out.append(s.tensor)
            else:
                out.append(s.result(r))
        return out

    return TorchHandle(handle, finish)


def _adasum_allreduce(staged: list[Staged], sources: list[np.ndarray], name: str | None,
                      postscale: float, priority: int, inplace: bool, what: str,
                      grouped: bool) -> TorchHandle:
    """Adasum (``adasum.py``) of each tensor: every rank's tensor allgathered as one row,
    the tree run here on the rows; a grouped call still combines each tensor alone."""
    for source in sources:
        _adasum.check_dtype(source.dtype, what)

    # Every rank's row has the same length (same_shape): no exchange of sizes first.
    def gather(source: np.ndarray, part: str | None) -> Any:
        return _live_names.submit(part, what, lambda: _ops().allgather(
            source.reshape(1, -1), part, priority, None, True))

    # A grouped call's parts are named as grouped_allgather's are (name.0, name.1, ...).
    handle: Any = _Together([gather(s, _part_name(name, i)) for i, s in enumerate(sources)],
                            what) if grouped else gather(sources[0], name)
    handle = _AdasumNoted(handle)

    def finish(gathered: Any) -> Any:
        rows = gathered if grouped else [gathered]
        out = []
        for s, source, g in zip(staged, sources, rows, strict=True):
            result = _adasum.reduce_gathered(g, [(0, source.size)], source.dtype) \
                .reshape(source.shape)
            if postscale != 1.0:
                _scale(result, postscale)
            if inplace:
                s.array[...] = result
                s.write_back()
                out.append(s.tensor)
            else:
                out.append(s.result(result))
        return out if grouped else out[0]

    return TorchHandle(handle, finish)


class _AdasumNoted:
    """An Adasum op's handle: a mismatch, which the engine reports for the allgather it
    ran, gets a note that says how that maps to the caller's allreduce."""

    __slots__ = ("_handle", "label")

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self.label = handle.label

    def done(self) -> bool:
        return bool(self._handle.done())

    def wait(self, timeout: float | None = None) -> Any:
        try:
            return self._handle.wait(timeout)
        except _tr.MismatchError as exc:
            exc.add_note("allreduce with op=Adasum runs as an allgather of each tensor as "
                         "one row: shape (1, N) there is a tensor of N elements here, and "
                         "every rank must pass op=Adasum")
            raise


# --- allgather, broadcast, alltoall, reducescatter -------------------------------------


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Concatenate every rank's ``tensor`` along dimension 0 (first dims may differ)."""
    return _allgather_call(tensor, name, process_set, False)


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0 (first dims may differ)."""
    if _grads.differentiable([tensor]):
        return _grads.AllgatherFn.apply(tensor, name, process_set)
    return _allgather_call(tensor, name, process_set, True)


def _allgather_call(tensor: torch.Tensor, name: str | None, process_set: ProcessSet,
                    blocking: bool) -> Any:
    """The async allgather's handle; ``blocking``: its result, from the scheduler's
    allgather_now where it can, as :func:`_allreduce_call`."""
    what = "allgather" + (f" '{name}'" if name else "")
    _check_process_set(process_set, what)
    staged = stage(tensor, what)
    ops = _ops(process_set, what)

    def start() -> TorchHandle:
        return TorchHandle(_live_names.submit(name, what, lambda: ops.allgather(
            staged.array, name, 0)), staged.result)

    return _start_or_run(blocking, ops, name, what, start,
                         lambda: ops.allgather_now(staged.array, name, 0, None, False),
                         staged.result)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Every rank gets ``root_rank``'s ``tensor`` as a new tensor.

    Raises:
        ValueError: ``root_rank`` is not a rank of the job.
    """
    return _broadcast_call(tensor, root_rank, name, process_set, False, False)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> TorchHandle:
    """In-place :func:`broadcast_async`: ``tensor`` receives the root's values."""
    return _broadcast_call(tensor, root_rank, name, process_set, True, False)


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every rank gets ``root_rank``'s ``tensor`` as a new tensor."""
    if _grads.differentiable([tensor]):
        return _grads.BroadcastFn.apply(tensor, root_rank, name, process_set)
    return _broadcast_call(tensor, root_rank, name, process_set, False, True)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    return _broadcast_call(tensor, root_rank, name, process_set, True, True)


@overload
def _broadcast_call(tensor: torch.Tensor, root_rank: int, name: str | None,
                    process_set: ProcessSet, inplace: bool, blocking: Literal[False]
                    ) -> TorchHandle:
    ...


@overload
def _broadcast_call(tensor: torch.Tensor, root_rank: int, name: str | None,
                    process_set: ProcessSet, inplace: bool, blocking: Literal[True]
                    ) -> torch.Tensor:
    ...


def _broadcast_call(tensor: torch.Tensor, root_rank: int, name: str | None,
                    process_set: ProcessSet, inplace: bool, blocking: bool
                    ) -> TorchHandle | torch.Tensor:
    """The async broadcast's handle; ``blocking``: its result, from the scheduler's
    broadcast_now where it can (a small one like one made before), as
    :func:`_allreduce_call`."""
    what = ("broadcast_" if inplace else "broadcast") + (f" '{name}'" if name else "")
    _check_process_set(process_set, what)
    staged = stage(tensor, what)
    ops = _ops(process_set, what)

    def finish(result: np.ndarray) -> torch.Tensor:
        if inplace:
            staged.write_back()
            return tensor
        return staged.result(result)

    def start() -> TorchHandle:
        return TorchHandle(_live_names.submit(name, what, lambda: ops.broadcast(
            staged.array, root_rank, name, 0, inplace=inplace)), finish)

    return _start_or_run(blocking, ops, name, what, start,
                         lambda: ops.broadcast_now(staged.array, root_rank, name, 0, inplace),
                         finish)


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set, *,
                   _both: bool = False) -> TorchHandle:
    """Send rows ``splits[i]`` of ``tensor`` (dimension 0) to rank ``i``.

    As in Horovod, the result is the received tensor alone when ``splits`` is None, and
    ``(received, received_splits)`` when it is given.

    Raises:
        ValueError: no ``splits`` and dimension 0 is not divisible by ``size()`` (as in
            Horovod), or ``splits`` that do not fit the tensor; an op of this ``name``
            still in flight (as for every collective here).
    """
    return _alltoall_call(tensor, splits, name, process_set, _both, False)


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    if _grads.differentiable([tensor]):
        out, received = _grads.AlltoallFn.apply(tensor, splits, name, process_set)
        return out if splits is None else (out, received)
    return _alltoall_call(tensor, splits, name, process_set, False, True)


def _alltoall_call(tensor: torch.Tensor, splits: Any, name: str | None,
                   process_set: ProcessSet, both: bool, blocking: bool) -> Any:
    """The async alltoall's handle (``both``: its result is the received tensor and
    splits, whether or not ``splits`` was given); ``blocking``: its result, from the
    scheduler's alltoall_now where it can, as :func:`_allreduce_call`."""
    what = "alltoall" + (f" '{name}'" if name else "")
    _check_process_set(process_set, what)
    staged = stage(tensor, what)
    if isinstance(splits, torch.Tensor):
        splits = splits.detach().cpu().numpy()
    n = process_set.size()
    if splits is None and tensor.dim() > 0 and tensor.shape[0] % n:
        # Horovod refuses what the numpy API would split unevenly (lower ranks first).
        raise ValueError(f"rank {_tr.rank()}: {what}: without splits, dimension 0 "
                         f"({tensor.shape[0]} rows) must be divisible by the world size "
                         f"({n}); pass splits= to send uneven parts")
    ops = _ops(process_set, what)

    def finish(result: tuple[np.ndarray, np.ndarray]) -> Any:
        out = staged.result(result[0])
        if splits is None and not both:
            return out
        return out, torch.from_numpy(result[1].astype(np.int32))

    def start() -> TorchHandle:
        return TorchHandle(_live_names.submit(name, what, lambda: ops.alltoall(
            staged.array, splits, name, 0)), finish)

    return _start_or_run(blocking, ops, name, what, start,
                         lambda: ops.alltoall_now(staged.array, splits, name, 0, None, False),
                         finish)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> TorchHandle:
    """Reduce ``tensor`` over all ranks and keep this rank's share of dimension 0
    (lower ranks take the extra rows)."""
    return _reducescatter_call(tensor, name, op, process_set, prescale_factor,
                               postscale_factor, False)


def _reducescatter_call(tensor: torch.Tensor, name: str | None, op: Any,
                        process_set: ProcessSet, prescale: float, postscale: float,
                        blocking: bool) -> Any:
    """The async reducescatter's handle; ``blocking``: its result, from the scheduler's
    reducescatter_now where it can, as :func:`_allreduce_call`."""
    what = "reducescatter" + (f" '{name}'" if name else "")
    _check_process_set(process_set, what)
    staged, source = _scaled_stage(tensor, prescale, postscale, False, what)
    rop = resolve_op(op, None, what)
    if rop is Adasum:
        raise ValueError(f"rank {_tr.rank()}: {what}: op=Adasum is only for allreduce and "
                         "grouped_allreduce; use Sum or Average")
    ops = _ops(process_set, what)

    def finish(result: np.ndarray) -> torch.Tensor:
        if postscale != 1.0:
            _scale(result, postscale)
        return staged.result(result)

    def start() -> TorchHandle:
        return TorchHandle(_live_names.submit(name, what, lambda: ops.reducescatter(
            source, rop, name, 0)), finish)

    return _start_or_run(blocking, ops, name, what, start,
                         lambda: ops.reducescatter_now(source, rop, name, 0), finish)


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: type[Compressor] = Compression.none, op: Any = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    compressed, ctx = compression.compress(tensor)
    if _grads.differentiable([compressed]):
        rop = resolve_op(op, None, "reducescatter" + (f" '{name}'" if name else ""))
        out = _grads.ReducescatterFn.apply(compressed, name, rop, process_set, prescale_factor,
                                     postscale_factor)
    else:
        out = _reducescatter_call(compressed, name, op, process_set, prescale_factor,
                                  postscale_factor, True)
    return compression.decompress(out, ctx)


class _Together:
    """Several engine handles waited on as one: what a grouped op that the engine runs as
    separate ops (one per tensor) hands to :class:`TorchHandle`."""

    __slots__ = ("_handles", "label")

    def __init__(self, handles: list[Any], label: str) -> None:
        self._handles = handles
        self.label = label

    def done(self) -> bool:
        return all(h.done() for h in self._handles)

    def wait(self, timeout: float | None = None) -> list[Any]:
        # Every handle is waited on even after one fails: none is left running unwatched.
        results, error = [], None
        for h in self._handles:
            try:
                results.append(h.wait(timeout))
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                error = error or exc
        if error is not None:
            raise error
        return results


def _part_name(name: str | None, i: int) -> str | None:
    return None if name is None else f"{name}.{i}"


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> TorchHandle:
    """:func:`allgather_async` of each tensor; ``synchronize`` returns a list."""
    what = "grouped_allgather" + (f" '{name}'" if name else "")
    _check_process_set(process_set, what)
    handles = [allgather_async(t, _part_name(name, i), process_set)
               for i, t in enumerate(tensors)]
    return TorchHandle(_Together(handles, what), lambda outs: outs)  # type: ignore[arg-type]


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather each of ``tensors`` (first dims may differ by rank); a list of results."""
    if _grads.differentiable(tensors):
        # One op per tensor either way: the differentiable form runs them one by one.
        return [allgather(t, _part_name(name, i), process_set)
                for i, t in enumerate(tensors)]
    return _blocking(lambda: grouped_allgather_async(tensors, name, process_set))


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: Any = Average,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> TorchHandle:
    """:func:`reducescatter_async` of each tensor; ``synchronize`` returns a list."""
    what = "grouped_reducescatter" + (f" '{name}'" if name else "")
    _check_process_set(process_set, what)
    handles = [reducescatter_async(t, _part_name(name, i), op, process_set, prescale_factor,
                                   postscale_factor) for i, t in enumerate(tensors)]
    return TorchHandle(_Together(handles, what), lambda outs: outs)  # type: ignore[arg-type]


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: type[Compressor] = Compression.none, op: Any = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reducescatter each of ``tensors``: this rank's share of each reduced tensor."""
    pairs = [compression.compress(t) for t in tensors]
    if _grads.differentiable([p[0] for p in pairs]):
        return [reducescatter(t, _part_name(name, i), compression, op, process_set,
                              prescale_factor, postscale_factor)
                for i, t in enumerate(tensors)]
    outs = _blocking(lambda: grouped_reducescatter_async([p[0] for p in pairs], name, op,
                                                         process_set, prescale_factor,
                                                         postscale_factor))
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs, strict=True)]


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank has entered the barrier."""
    _tr.barrier(process_set)
