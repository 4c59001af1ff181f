"""Torch tensors as the numpy arrays the engine moves, and back.

CPU tensors of a dtype numpy shares with torch go through as ``tensor.numpy()`` views: no
copy in, and in-place collectives write straight into the tensor.  ``bool`` is one of
them.  ``bfloat16`` has no numpy twin: it travels as float32 (a copy each way, and the
reduction runs in float32, so results can be more exact than a bfloat16 reduction).
CUDA tensors are staged through pinned host memory: copied to the host before the op and
back to the device after it; the engine itself never touches device memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Torch dtypes the engine moves as they are (their .numpy() view has the same layout).
_NATIVE = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.float32, torch.float64,
})
# Torch dtypes that travel as another dtype.
_CARRIER = {torch.bfloat16: torch.float32}


def check_tensor(tensor: object, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise TypeError(f"{what}: sparse tensors are not supported; pass tensor.to_dense()")
    if tensor.dtype not in _NATIVE and tensor.dtype not in _CARRIER:
        supported = ", ".join(str(d).removeprefix("torch.")
                              for d in sorted(_NATIVE | set(_CARRIER), key=str))
        raise TypeError(f"{what}: dtype {tensor.dtype} is not supported; use one of "
                        f"{supported}")
    return tensor


@dataclass
class Staged:
    """A tensor's host-side array for the engine and how to return a result to torch."""

    tensor: torch.Tensor   # the caller's tensor
    host: torch.Tensor     # CPU tensor the array views (the tensor itself when possible)
    array: np.ndarray      # what the engine reads and, in place, writes

    @property
    def zero_copy(self) -> bool:
        return self.host is self.tensor

    def result(self, array: np.ndarray) -> torch.Tensor:
        """A new tensor of the caller's dtype and device holding ``array``."""
        # Not np.ascontiguousarray: it makes a 0-d array 1-d, and a 0-d tensor must come
        # back 0-d.
        if not array.flags.c_contiguous:
            array = np.require(array, requirements="C")
        out = torch.from_numpy(array)
        if self.host is self.tensor:  # a CPU tensor of numpy's dtype: nothing to convert
            return out
        if out.dtype != self.tensor.dtype:
            out = out.to(self.tensor.dtype)
        if self.tensor.device.type != "cpu":
            out = out.to(self.tensor.device)
        return out

    def write_back(self) -> None:
        """After an in-place op on ``array``: make the caller's tensor hold it."""
        if not self.zero_copy:
            self.tensor.copy_(self.host)


def stage(tensor: torch.Tensor, what: str) -> Staged:
    """The array the engine should read (and, for in-place ops, write) for ``tensor``."""
    check_tensor(tensor, what)
    # Each torch call here costs a small op microseconds: between two ops the engine's
    # code has pushed torch's out of the caches (an 8-byte allreduce spent 11 us staging
    # a tensor and 9 making its result).  So no detach() unless numpy() needs it.
    t = tensor.detach() if tensor.requires_grad else tensor
    if t.is_cpu and t.dtype in _NATIVE:
        return Staged(tensor, tensor, t.numpy())
    carrier = _CARRIER.get(t.dtype, t.dtype)
    if t.device.type == "cpu":
        host = t.to(carrier)
    else:
        host = torch.empty(t.shape, dtype=carrier, pin_memory=torch.cuda.is_available())
        host.copy_(t)
    return Staged(tensor, host, host.numpy())
