"""Gradient compression applied around an allreduce, with Horovod's interface.

A compressor turns a tensor into what travels (``compress``) and the reduced result back
(``decompress``), with a context the first hands to the second.  ``Compression.fp16``
halves the bytes of float32/float64 tensors at the cost of float16's range and precision
(sums beyond 65504 overflow to inf); other dtypes pass through unchanged.

``Compression.oktopk(density=0.01)`` (and ``topka``, ``gtopk``) are not of that kind: they
replace the allreduce itself with a sparse one that keeps what it did not send in
residuals (totalreduce.compression).  The DistributedOptimizer runs them on its fused
gradient buckets when it synchronizes, and saves their state with its own.  With
``momentum=`` (DGC's momentum correction) the sparse allreduce applies the momentum, and
the wrapped optimizer must have none of its own.
"""

from __future__ import annotations

from typing import Any

import torch

from ..compression import GTopk, OkTopk, SparseAllreduce, TopkA


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


class SparseCompressor:
    """A sparse allreduce algorithm for the DistributedOptimizer's buckets (one instance
    per optimizer: it holds the buckets' residuals)."""

    def __init__(self, algorithm: SparseAllreduce) -> None:
        self.algorithm = algorithm

    def __repr__(self) -> str:
        return f"SparseCompressor({self.algorithm.name}, density={self.algorithm.density})"


class Compression:
    """The compressors, under Horovod's names, and the sparse allreduces."""

    none = NoneCompressor
    fp16 = FP16Compressor

    @staticmethod
    def oktopk(density: float = 0.01, **knobs: Any) -> SparseCompressor:
        """Ok-Topk: under 6k(P-1)/P words per rank (knobs: totalreduce.compression.OkTopk)."""
        return SparseCompressor(OkTopk(density, **knobs))

    @staticmethod
    def topka(density: float = 0.01, **knobs: Any) -> SparseCompressor:
        """Every rank's top-k to every rank: 2k(P-1) words per rank (knobs: the warm-up,
        momentum correction and clipping of totalreduce.compression.SparseAllreduce)."""
        return SparseCompressor(TopkA(density, **knobs))

    @staticmethod
    def gtopk(density: float = 0.01, exact_sums: bool = False, **knobs: Any
              ) -> SparseCompressor:
        """gTopk as published: top-k sets merged pairwise up a tree in log2(P) rounds,
        rank 0's k merged pairs broadcast (a contribution dropped at a merge may be lost);
        ``exact_sums=True`` sums exactly at the winners instead, losing nothing
        (totalreduce.compression.GTopk; knobs: as ``topka``'s)."""
        return SparseCompressor(GTopk(density, exact_sums=exact_sums, **knobs))
