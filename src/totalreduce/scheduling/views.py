"""What ranks must agree on about an op (its view): the engine compares their hashes
(OpSpec.sig), and a mismatch report shows the views."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def with_algorithm(view: dict[str, Any] | Callable[[], dict[str, Any]], algorithm: str
                    ) -> Callable[[], dict[str, Any]]:
    """``view`` (or the function making it) naming the algorithm that runs the op: ranks
    configured to choose differently then disagree on the op, and a mismatch says so."""
    return lambda: dict(view() if callable(view) else view, algorithm=algorithm)


def gathering_views(kind: str, arr: np.ndarray
                     ) -> tuple[Callable[[], dict[str, Any]], Callable[[], dict[str, Any]]]:
    """What ranks agree on for an allgather or alltoall (all but the rows) and what a
    mismatch shows of this rank's call (its whole shape), made only when not cached."""
    def view() -> dict[str, Any]:
        return {"kind": kind, "dtype": str(arr.dtype), "shape": list(arr.shape[1:]),
                "same_shape": False}

    def shown() -> dict[str, Any]:
        return dict(view(), shape=list(arr.shape))

    return view, shown
