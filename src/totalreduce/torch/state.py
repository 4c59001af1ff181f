"""Making every rank start from the root's model and optimizer state."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..objects import broadcast_object
from .collectives import broadcast_async_


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, Any]],
                         root_rank: int) -> None:
    """Overwrite every rank's tensors with ``root_rank``'s, in place.

    Args:
        params: ``model.state_dict()`` (taken in sorted key order) or
            ``model.named_parameters()`` (taken in its order).
        root_rank: the rank whose values everyone gets.

    Raises:
        ValueError: ``params`` is neither a mapping nor (name, tensor) pairs.
        TypeError: a value is not a tensor.
        MismatchError: ranks disagree on a tensor's shape or dtype.
    """
    if isinstance(params, Mapping):
        pairs = sorted(params.items())
    else:
        pairs = list(params)
        if any(not isinstance(p, tuple) or len(p) != 2 for p in pairs):
            raise ValueError("broadcast_parameters: params must be a state_dict or "
                             "(name, tensor) pairs such as model.named_parameters()")
    for name, value in pairs:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"broadcast_parameters: {name} is a {type(value).__name__}, "
                            "not a tensor")
    handles = [broadcast_async_(t, root_rank, name=f"broadcast_parameters.{n}")
               for n, t in pairs]
    for h in handles:
        h.wait()


@dataclass(frozen=True)
class _TensorSlot:
    """Stands for a tensor in the broadcast skeleton of a state dict (the tensors follow
    in the order a walk of the skeleton meets their slots)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _replace(obj: Any, kind: type, fn: Callable[[Any], Any]) -> Any:
    """``obj`` with every ``kind`` inside its dicts, lists and tuples replaced by
    ``fn(leaf)``, leaves visited in the same order every time."""
    if isinstance(obj, kind):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _replace(v, kind, fn) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_replace(v, kind, fn) for v in obj)
    return obj


def _create_state(optimizer: torch.optim.Optimizer) -> None:
    local = getattr(optimizer, "_optimizer", optimizer)  # a DistributedOptimizer's own
    sparse = isinstance(local, torch.optim.SparseAdam)
    for group in local.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            if sparse:  # SparseAdam refuses dense gradients
                p.grad = torch.sparse_coo_tensor(
                    torch.empty((p.dim(), 0), dtype=torch.int64, device=p.device),
                    torch.empty((0,), dtype=p.dtype, device=p.device), p.shape,
                    check_invariants=False)  # no entries: nothing to check
            else:
                p.grad = torch.zeros_like(p)
    local.step()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Give every rank ``root_rank``'s optimizer state.

    The whole ``state_dict()`` travels: per-parameter tensors (momentum buffers, Adam's
    moments) by the engine, everything else (step counts, learning rates and the other
    hyper-parameters) pickled.  As in Horovod, an optimizer whose state is still empty
    first takes one step with zero gradients to create it (momentum buffers, Adam's
    moments, step counts): parameters that require grad are left with a zero ``.grad``,
    the others with none, and a step that applies weight decay moves the parameters as
    any step would.  Ranks whose state is differently shaped simply load the root's.  A
    :class:`DistributedOptimizer` is accepted too (its wrapped optimizer takes the step,
    so no gradient is reduced).

    Raises:
        ValueError: ``root_rank`` is not a rank of the job.
    """
    from .. import runtime

    me = runtime.current().rank
    if not optimizer.state_dict()["state"]:
        _create_state(optimizer)
    tensors: list[torch.Tensor] = []

    def to_slot(t: torch.Tensor) -> _TensorSlot:
        tensors.append(t.detach().cpu().contiguous())
        return _TensorSlot(tuple(t.shape), t.dtype)

    def to_empty(slot: _TensorSlot) -> torch.Tensor:
        tensors.append(torch.empty(slot.shape, dtype=slot.dtype))
        return tensors[-1]

    skeleton = _replace(optimizer.state_dict(), torch.Tensor, to_slot) \
        if me == root_rank else None
    skeleton = broadcast_object(skeleton, root_rank, name="broadcast_optimizer_state")
    # Elsewhere the same walk meets the slots in the root's order: each empty tensor is
    # broadcast into below, in place.
    received = _replace(skeleton, _TensorSlot, to_empty) if me != root_rank else None
    handles = [broadcast_async_(t, root_rank, name=f"broadcast_optimizer_state.{i}")
               for i, t in enumerate(tensors)]
    for h in handles:
        h.wait()
    if received is not None:
        optimizer.load_state_dict(received)
