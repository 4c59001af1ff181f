"""Gradient compression applied around an allreduce, with Horovod's interface.

A compressor turns a tensor into what travels (``compress``) and the reduced result back
(``decompress``), with a context the first hands to the second.  ``Compression.fp16``
halves the bytes of float32/float64 tensors at the cost of float16's range and precision
(sums beyond 65504 overflow to inf); other dtypes pass through unchanged.
"""

from __future__ import annotations

from typing import Any

import torch


class Compressor:
    """Interface: ``compress(t) -> (t', ctx)``, ``decompress(t', ctx) -> t``."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16; the context is the original dtype."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """The compressors, under Horovod's names."""

    none = NoneCompressor
    fp16 = FP16Compressor
