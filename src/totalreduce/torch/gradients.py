"""The collectives' gradients (collectives.py calls these autograd functions).

As in Horovod, the blocking ``allreduce``, ``grouped_allreduce``, ``allgather``,
``grouped_allgather``, ``broadcast``, ``alltoall``, ``reducescatter`` and
``grouped_reducescatter`` are autograd functions when a tensor that requires grad goes in
(the in-place and async forms are not).  Their gradients are those of the sum of every rank's
loss, so that averaging the parameters' gradients over ranks afterwards (the
DistributedOptimizer) gives the gradient of the mean loss:

- ``allreduce``: the same allreduce (op, prescale and postscale factors) of the incoming
  gradient; only ``Sum`` and ``Average`` have a gradient (``Min``, ``Max`` and ``Product``
  raise in backward).
- ``allgather``: this rank's rows of the sum of every rank's incoming gradient.
- ``broadcast``: on the root, the sum of every rank's incoming gradient; zero elsewhere.
- ``alltoall``: the incoming gradient sent back the way the rows came (an alltoall
  with the received splits).
- ``reducescatter``: every rank's incoming gradient of its share, allgathered, times the
  scale factors (and divided by ``size()`` for ``Average``; only ``Sum`` and ``Average``
  have a gradient).  The grouped forms are those of their tensors, one op each.

Recent Horovod averages instead of summing in the last two, which makes them ``size()``
times smaller than the derivative.  The ops of a backward pass are named after the
forward's (``name + ".grad"``), or unnamed when it was, and every rank must run them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import totalreduce as _tr
from totalreduce import ProcessSet

# The collectives call these classes and these call the collectives: a module reference,
# read at call time, lets each import the other.
from . import collectives as _c

Average = _tr.Average
Sum = _tr.Sum


def differentiable(tensors: Sequence[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _grad_name(name: str | None, suffix: str = "") -> str | None:
    return None if name is None else f"{name}.grad{suffix}"


def _check_grad_op(rop: _tr.ReduceOp, what: str) -> None:
    if rop not in (Sum, Average):
        raise RuntimeError(f"{what} with op={rop.label} has no gradient here: only Sum and "
                           "Average are differentiable (detach the tensor, or reduce it "
                           "with one of those)")


class AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, rop: _tr.ReduceOp,
                prescale: float, postscale: float, process_set: ProcessSet) -> torch.Tensor:
        ctx.args = (name, rop, prescale, postscale, process_set)
        return _c._blocking(lambda: _c._allreduce(tensor, None, name, rop, prescale, postscale,
                                            process_set, 0, inplace=False))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        name, rop, prescale, postscale, process_set = ctx.args
        _check_grad_op(rop, "allreduce" + (f" '{name}'" if name else ""))
        out = _c._blocking(lambda: _c._allreduce(grad.contiguous(), None, _grad_name(name), rop,
                                           prescale, postscale, process_set, 0,
                                           inplace=False))
        return out, None, None, None, None, None


class GroupedAllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, args: tuple[Any, ...], *tensors: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        name, rop, prescale, postscale, process_set = ctx.args = args
        return tuple(_c._blocking(lambda: _c._grouped(tensors, None, name, rop, prescale, postscale,
                                                process_set, inplace=False)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        name, rop, prescale, postscale, process_set = ctx.args
        _check_grad_op(rop, "grouped_allreduce" + (f" '{name}'" if name else ""))
        outs = _c._blocking(lambda: _c._grouped([g.contiguous() for g in grads], None,
                                          _grad_name(name), rop, prescale, postscale,
                                          process_set, inplace=False))
        return (None, *outs)


class AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None,
                process_set: ProcessSet) -> torch.Tensor:
        ctx.args = (tensor.shape[0] if tensor.dim() else 0, name, process_set)
        return _c._blocking(lambda: _c.allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        rows, name, process_set = ctx.args
        total = _c._blocking(lambda: _c._allreduce(grad.contiguous(), None, _grad_name(name), Sum,
                                             1.0, 1.0, process_set, 0, inplace=False))
        every = _c._blocking(lambda: _c.allgather_async(torch.tensor([rows], dtype=torch.int64),
                                                  _grad_name(name, ".rows"), process_set))
        start = int(every[:_tr.rank()].sum())
        return total.narrow(0, start, rows), None, None


class BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None,
                process_set: ProcessSet) -> torch.Tensor:
        ctx.args = (root_rank, name, process_set)
        return _c._blocking(lambda: _c.broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        root_rank, name, process_set = ctx.args
        total = _c._blocking(lambda: _c._allreduce(grad.contiguous(), None, _grad_name(name), Sum,
                                             1.0, 1.0, process_set, 0, inplace=False))
        if _tr.rank() != root_rank:
            total = torch.zeros_like(total)
        return total, None, None, None


class AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None,
                process_set: ProcessSet) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.args = (name, process_set)
        out, received = _c._blocking(lambda: _c.alltoall_async(tensor, splits, name, process_set,
                                                         _both=True))
        ctx.mark_non_differentiable(received)
        ctx.received = received
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _grad_splits: Any) -> tuple[Any, ...]:
        # What came from rank q goes back to rank q, which finds it where it sent it from.
        name, process_set = ctx.args
        back, _ = _c._blocking(lambda: _c.alltoall_async(grad.contiguous(), ctx.received,
                                                   _grad_name(name), process_set))
        return back, None, None, None


class ReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, rop: _tr.ReduceOp,
                process_set: ProcessSet, prescale: float, postscale: float) -> torch.Tensor:
        ctx.args = (name, rop, process_set, prescale * postscale)
        return _c._blocking(lambda: _c.reducescatter_async(tensor, name, rop, process_set,
                                                     prescale, postscale))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # Every rank's input reached every rank's share: each rank's gradient is all the
        # shares' incoming gradients, gathered, times the factors applied on the way.
        name, rop, process_set, factor = ctx.args
        _check_grad_op(rop, "reducescatter" + (f" '{name}'" if name else ""))
        if rop == Average:
            factor /= process_set.size()
        every = _c._blocking(lambda: _c.allgather_async(grad.contiguous(), _grad_name(name),
                                                  process_set))
        return every * factor, None, None, None, None, None
