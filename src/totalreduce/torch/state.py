"""Making every rank start from the root's model and optimizer state."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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
    """Stands for a tensor in the broadcast skeleton of a state dict."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _split(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach().cpu().contiguous())
        return _TensorSlot(len(tensors) - 1, tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return {k: _split(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_split(v, tensors) for v in obj)
    return obj


def _join(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _TensorSlot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _join(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_join(v, tensors) for v in obj)
    return obj


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Give every rank ``root_rank``'s optimizer state.

    The whole ``state_dict()`` travels: per-parameter tensors (momentum buffers, Adam's
    moments) by the engine, everything else (step counts, learning rates and the other
    hyper-parameters) pickled.  Ranks whose state is still empty, or differently shaped,
    simply load the root's.  A :class:`DistributedOptimizer` is accepted too.

    Raises:
        ValueError: ``root_rank`` is not a rank of the job.
    """
    from .. import runtime

    me = runtime.current().rank
    tensors: list[torch.Tensor] = []
    skeleton = _split(optimizer.state_dict(), tensors) if me == root_rank else None
    skeleton = broadcast_object(skeleton, root_rank, name="broadcast_optimizer_state")
    if me != root_rank:
        slots: list[_TensorSlot] = []
        _collect_slots(skeleton, slots)
        tensors = [torch.empty(s.shape, dtype=s.dtype)
                   for s in sorted(slots, key=lambda s: s.index)]
    handles = [broadcast_async_(t, root_rank, name=f"broadcast_optimizer_state.{i}")
               for i, t in enumerate(tensors)]
    for h in handles:
        h.wait()
    if me != root_rank:
        optimizer.load_state_dict(_join(skeleton, tensors))


def _collect_slots(obj: Any, out: list[_TensorSlot]) -> None:
    if isinstance(obj, _TensorSlot):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect_slots(v, out)
    elif isinstance(obj, list | tuple):
        for v in obj:
            _collect_slots(v, out)
