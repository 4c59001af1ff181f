"""What every collective checks before it is scheduled, written once for both scheduling
modes (self-guided and negotiated), so that a bad argument gets the same error, with the
same text, whichever mode the job runs in.

Each function returns what the call will work with (the array, the op, the root within
the set, the splits) or raises; none of them communicates, so the error is this rank's
alone and immediate.  Errors that need the other ranks (a shape that differs) are the
engine's mismatch reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..engine.schedule import even_bounds
from ..transport.wire import dtype_code
from .ops import ReduceOp, as_reduce_op, check_op_dtype


def what(kind: str, name: str | None) -> str:
    """How messages name a call: ``allreduce 'grad.w'``, or the kind alone."""
    return kind + (f" '{name}'" if name else "")


def check_name(name: Any, kind: str) -> None:
    if name is not None and not isinstance(name, str):
        raise TypeError(f"{kind}: name must be a str or None, got {type(name).__name__} "
                        f"{name!r}")


def check_array(x: Any, kind: str, name: str | None) -> np.ndarray:
    """``x`` as a numpy array of a dtype the wire carries."""
    check_name(name, kind)
    arr = x if type(x) is np.ndarray else np.asarray(x)
    try:
        dtype_code(arr.dtype)
    except TypeError as exc:
        if arr.dtype.kind == "O":
            raise TypeError(f"{what(kind, name)}: object arrays cannot be communicated; "
                            "pass a numeric array") from None
        raise TypeError(f"{what(kind, name)}: {exc}") from None
    return arr


def check_inplace(x: Any, arr: np.ndarray, kind: str) -> None:
    """The in-place forms write into the caller's array: it must be a writable one."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{kind}_: the in-place form needs a numpy array")
    if not arr.flags.writeable:
        raise ValueError("in-place collective on a read-only array")


def check_allreduce(x: Any, op: Any, name: str | None,
                    inplace: bool) -> tuple[ReduceOp, np.ndarray]:
    """The reduction and the array of an allreduce call, or the error it deserves."""
    rop = as_reduce_op(op)
    arr = check_array(x, "allreduce", name)
    check_op_dtype(rop, arr.dtype, "allreduce", name)
    if inplace:
        check_inplace(x, arr, "allreduce")
    return rop, arr


def check_grouped(xs: Sequence[Any], op: Any, name: str | None,
                  inplace: bool) -> tuple[ReduceOp, list[np.ndarray]]:
    rop = as_reduce_op(op)
    arrs = [check_array(x, "grouped_allreduce", name) for x in xs]
    for a in arrs:
        check_op_dtype(rop, a.dtype, "grouped_allreduce", name)
    if inplace:
        for x, a in zip(xs, arrs, strict=True):
            check_inplace(x, a, "grouped_allreduce")
    return rop, arrs


def check_root(root: Any, kind: str, name: str | None, size: int,
               members: tuple[int, ...] | None = None) -> int:
    """``root`` (a rank of the job) as a rank of the set the call runs on: the whole job
    of ``size`` ranks, or the process set of ``members``."""
    if members is None:
        if not isinstance(root, int | np.integer) or isinstance(root, bool) \
                or not 0 <= root < size:
            raise ValueError(f"{what(kind, name)}: root_rank {root!r} is not a rank of this "
                             f"job (0..{size - 1})")
        return int(root)
    if not isinstance(root, int | np.integer) or isinstance(root, bool) \
            or int(root) not in members:
        raise ValueError(f"{what(kind, name)}: root_rank {root!r} is not in this process "
                         f"set (ranks {list(members)})")
    return members.index(int(root))


def check_broadcast(x: Any, root: Any, name: str | None, inplace: bool, size: int,
                    members: tuple[int, ...] | None = None) -> tuple[np.ndarray, int]:
    arr = check_array(x, "broadcast", name)
    index = check_root(root, "broadcast", name, size, members)
    if inplace:
        check_inplace(x, arr, "broadcast")
    return arr, index


def check_rows(x: Any, kind: str, name: str | None) -> np.ndarray:
    """Ops that split or join along the first dimension need one."""
    arr = check_array(x, kind, name)
    if arr.ndim == 0:
        raise ValueError(f"{what(kind, name)} needs an array with at least one dimension")
    return arr


def check_out(out: Any, arr: np.ndarray, kind: str, name: str | None) -> np.ndarray | None:
    """``out=`` of a gathering op (allgather, alltoall): where its result goes instead of
    a new array.  Its dtype, trailing dimensions and layout are checked here; its first
    dimension only once the ranks' sizes are known (:func:`check_out_rows`)."""
    if out is None:
        return None
    shown = what(kind, name)
    if type(out) is not np.ndarray:
        raise TypeError(f"{shown}: out must be a numpy array, got {type(out).__name__}")
    if out.dtype != arr.dtype or out.shape[1:] != arr.shape[1:] or out.ndim != arr.ndim:
        raise ValueError(f"{shown}: out must be a {arr.dtype} array of shape "
                         f"(rows, {', '.join(map(str, arr.shape[1:]))}) like the input "
                         f"{arr.dtype} {arr.shape}, got {out.dtype} {out.shape}")
    if not (out.flags.c_contiguous and out.flags.writeable):
        raise ValueError(f"{shown}: out must be a writable C-contiguous array")
    check_apart(out, arr, kind, name)
    return out


def check_apart(out: np.ndarray | None, arr: np.ndarray, kind: str, name: str | None
                ) -> None:
    """An alltoall's ``out`` must not overlap its input: its rows for the peers are read
    from the input while theirs are written into ``out``."""
    if kind == "alltoall" and out is not None and np.may_share_memory(out, arr):
        raise ValueError(f"{what(kind, name)}: out must not overlap the input")


def check_out_rows(out: np.ndarray | None, rows: int, rank: int, kind: str,
                   name: str | None) -> None:
    """``out=`` against the result's first dimension, known after the sizes exchange.
    A wrong one is found after every rank took part in the data exchange (into a buffer
    of its own), so that the peers' calls finish."""
    if out is not None and out.shape[0] != rows:
        raise ValueError(f"rank {rank}: {what(kind, name)}: out has {out.shape[0]} rows, "
                         f"the result has {rows}")


def check_same_shape_splits(splits: Any, name: str | None) -> None:
    """An alltoall told that every rank passes the same shape divides its rows evenly:
    only then does each rank know what the others send it."""
    if splits is not None:
        raise ValueError(f"{what('alltoall', name)}: same_shape=True divides the rows "
                         f"evenly; it takes no splits (got {splits!r})")


def check_reducescatter(x: Any, op: Any, name: str | None) -> tuple[ReduceOp, np.ndarray]:
    rop = as_reduce_op(op)
    arr = check_rows(x, "reducescatter", name)
    check_op_dtype(rop, arr.dtype, "reducescatter", name)
    return rop, arr


def check_alltoall(x: Any, splits: Any, name: str | None,
                   size: int) -> tuple[np.ndarray, np.ndarray]:
    """The array and the rows it sends each rank: ``splits``, or an even split with the
    lower ranks taking the extra rows."""
    arr = check_rows(x, "alltoall", name)
    shown = what("alltoall", name)
    if splits is None:
        b = even_bounds(arr.shape[0], size)
        return arr, np.array([b[i + 1] - b[i] for i in range(size)], np.int64)
    rows = np.asarray(splits)
    if rows.ndim != 1 or rows.size != size or not np.issubdtype(rows.dtype, np.integer):
        raise ValueError(f"{shown}: splits must be {size} integers (one per rank), got "
                         f"{splits!r}")
    rows = rows.astype(np.int64)
    if (rows < 0).any() or int(rows.sum()) != arr.shape[0]:
        raise ValueError(f"{shown}: splits {rows.tolist()} must be non-negative and sum "
                         f"to the first dimension {arr.shape[0]}")
    return arr, rows
