"""A model, its optimizer and a few scalars as one checkpoint, in the shape of Horovod
elastic's ``TorchState``, over totalreduce's in-memory checkpoints.

::

    state = hvd.TorchState(model, optimizer, epoch=1)
    state.load()                      # a restarted worker gets the survivors' copy
    for epoch in range(state.epoch, epochs + 1):
        train_one_epoch()
        state.epoch = epoch + 1
        state.checkpoint()            # a collective: every rank keeps it in memory

Tensors become numpy arrays and the nested structure of ``optimizer.state_dict()``
becomes JSON, so nothing is pickled.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

from .. import checkpoint as _checkpoint
from .. import load_checkpoint as _load_checkpoint

_MODEL = "model/"
_OPTIMIZER = "optimizer"
_SCALAR = "scalar/"


class TorchState:
    """``model`` and ``optimizer`` (either may be None) and keyword scalars (numbers,
    strings, None, or numpy arrays), readable and settable as attributes."""

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **scalars: Any) -> None:
        self.model = model
        self.optimizer = optimizer
        self._scalars = list(scalars)
        for key, value in scalars.items():
            setattr(self, key, value)

    def checkpoint(self) -> None:
        """Keep the current state as the job's next checkpoint (every rank calls it)."""
        _checkpoint(self.as_arrays())

    commit = checkpoint  # Horovod elastic's name

    def load(self) -> int:
        """Take the newest checkpoint, if there is one (nothing changes on a fresh
        start); returns its version (how many checkpoints the job has taken)."""
        version, state = _load_checkpoint()
        if state is not None:
            self.restore_arrays(state)
        return version

    # --- to and from a checkpoint's dict of arrays ---------------------------------------

    def as_arrays(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.model is not None:
            for name, tensor in self.model.state_dict().items():
                out[_MODEL + name] = _to_numpy(tensor)
        if self.optimizer is not None:
            skeleton, arrays = _flatten(self.optimizer.state_dict(), [])
            out[_OPTIMIZER] = json.dumps(skeleton)
            for i, arr in enumerate(arrays):
                out[f"{_OPTIMIZER}/{i}"] = arr
        for key in self._scalars:
            out[_SCALAR + key] = getattr(self, key)
        return out

    def restore_arrays(self, state: dict[str, Any]) -> None:
        if self.model is not None:
            own = self.model.state_dict()
            self.model.load_state_dict({
                name: _to_tensor(state[_MODEL + name], like) for name, like in own.items()})
        if self.optimizer is not None and _OPTIMIZER in state:
            arrays = [state[f"{_OPTIMIZER}/{i}"]
                      for i in range(sum(1 for k in state if k.startswith(_OPTIMIZER + "/")))]
            self.optimizer.load_state_dict(_unflatten(json.loads(state[_OPTIMIZER]), arrays))
        for key in self._scalars:
            if _SCALAR + key in state:
                setattr(self, key, state[_SCALAR + key])


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    t = tensor.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()  # numpy has no bfloat16; restored to the model's dtype on load
    return t.numpy().copy()


def _to_tensor(arr: Any, like: torch.Tensor | None = None) -> torch.Tensor:
    tensor = torch.from_numpy(np.array(arr, copy=True))
    return tensor.to(like.dtype) if like is not None else tensor


def _flatten(obj: Any, arrays: list[np.ndarray]) -> tuple[Any, list[np.ndarray]]:
    """``obj`` (dicts, lists, tuples, tensors and plain values) as JSON with each tensor
    replaced by its index in ``arrays``; dict keys keep their type (an optimizer's state
    is keyed by int)."""
    if isinstance(obj, torch.Tensor):
        arrays.append(_to_numpy(obj))
        return {"t": len(arrays) - 1, "dtype": str(obj.dtype).removeprefix("torch.")}, arrays
    if isinstance(obj, np.ndarray):  # a sparse compression's residuals and velocities
        arrays.append(np.array(obj, copy=True))
        return {"a": len(arrays) - 1}, arrays
    if isinstance(obj, dict):
        return {"d": [[k, _flatten(v, arrays)[0]] for k, v in obj.items()]}, arrays
    if isinstance(obj, list | tuple):
        return {"l": [_flatten(v, arrays)[0] for v in obj],
                "tuple": isinstance(obj, tuple)}, arrays
    if obj is None or isinstance(obj, bool | int | float | str):
        return {"v": obj}, arrays
    raise TypeError(f"TorchState: cannot keep a {type(obj).__name__} from the optimizer's "
                    "state_dict (tensors, numpy arrays, numbers, strings, lists and dicts "
                    "only)")


def _unflatten(node: dict[str, Any], arrays: list[np.ndarray]) -> Any:
    if "t" in node:
        tensor = torch.from_numpy(np.array(arrays[node["t"]], copy=True))
        return tensor.to(getattr(torch, node["dtype"]))
    if "a" in node:
        return np.array(arrays[node["a"]], copy=True)
    if "d" in node:
        return {k: _unflatten(v, arrays) for k, v in node["d"]}
    if "l" in node:
        items = [_unflatten(v, arrays) for v in node["l"]]
        return tuple(items) if node["tuple"] else items
    return node["v"]
