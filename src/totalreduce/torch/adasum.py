"""Adasum: adaptive summation of gradients (Maleki et al., "Scaling Distributed Training
with Adaptive Summation", MLSys 2021), as ``op=hvd.Adasum``.

Two vectors ``a`` and ``b`` combine as::

    (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

which is their sum when they are orthogonal and their average when they are equal, so a
job can keep one worker's learning rate as it adds workers.  A zero vector has no
direction to project out: its coefficient is taken as 1 (the combine of ``0`` and ``b``
is ``b``).

Ranks combine as a binary tree (what recursive halving/doubling computes): at distance 1
ranks (0, 1), (2, 3), ... combine, at distance 2 the pairs' results, and so on.  In a
world that is not a power of two, with ``p`` the largest power of two below ``size()``,
rank ``p + i`` is folded into rank ``i`` first (the reduction to the nearest power of two
that Horovod's MPI Adasum also makes), then the ``p`` results combine as above.  Each
tensor gets its own coefficients (Adasum is applied per tensor, per layer).

How it travels: every rank's tensor is allgathered and each rank runs the whole tree on
the gathered rows.  That costs ``size()`` times a tensor per rank, where a pairwise
exchange by recursive halving costs about two tensors, but the engine has no
point-to-point op to build that exchange from, and an allgather needs nothing new below
the torch layer.  Every rank runs the same float64 arithmetic on the same bytes in the
same order, so every rank gets the bitwise same result, which is what keeps the models
identical (given the same numpy build on the same kind of CPU: numpy picks its SIMD
kernels by CPU, and their rounding may differ in the last bit).  Dot products and norms
(and the combine itself) run in float64; the result is cast back to the tensor's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class AdasumOp:
    """The type of ``hvd.Adasum``: a reduction the torch layer runs itself."""

    label = "Adasum"

    def __repr__(self) -> str:
        return "Adasum"

    def __reduce__(self) -> str:
        return "Adasum"  # pickles as the module's singleton


Adasum = AdasumOp()


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    # Not np.dot: BLAS may split it over threads, which on a busy machine made a 30k-element
    # dot 100 times slower (2.6 ms against 25 us), and makes its rounding depend on the
    # thread count.  einsum runs in this thread, in one fixed order.
    return float(np.einsum("i,i->", a, b))


def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One pairwise Adasum step on float64 vectors: a new array."""
    dot = _dot(a, b)
    aa = _dot(a, a)
    bb = _dot(b, b)
    ca = 1.0 - dot / (2.0 * aa) if aa > 0.0 else 1.0
    cb = 1.0 - dot / (2.0 * bb) if bb > 0.0 else 1.0
    return ca * a + cb * b


def tree(rows: Sequence[np.ndarray]) -> np.ndarray:
    """Adasum of ``rows`` (one float64 vector per rank, in rank order) in the order the
    module docstring describes."""
    n = len(rows)
    if n == 0:
        raise ValueError("Adasum of no vectors")
    p = 1
    while p * 2 <= n:
        p *= 2
    level = [combine(rows[i], rows[p + i]) if p + i < n else rows[i] for i in range(p)]
    while len(level) > 1:
        level = [combine(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def reduce_gathered(gathered: np.ndarray, segments: Sequence[tuple[int, int]],
                    dtype: np.dtype) -> np.ndarray:
    """Adasum of each ``[start, stop)`` column range of ``gathered`` (one row per rank),
    each range a tensor of its own; a flat array of ``dtype``."""
    rows = gathered.astype(np.float64, copy=False)
    out = np.empty(gathered.shape[1], dtype=dtype)
    for start, stop in segments:
        out[start:stop] = tree([row[start:stop] for row in rows])
    return out


def check_dtype(dtype: np.dtype, what: str) -> None:
    if dtype.kind != "f":
        raise TypeError(f"{what}: Adasum needs a floating-point tensor (float16, bfloat16, "
                        f"float32 or float64), got {dtype}; use op=Sum or op=Average for "
                        "other dtypes")
