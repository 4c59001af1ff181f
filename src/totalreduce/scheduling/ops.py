"""Reduction operators, with Horovod's names."""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable

import numpy as np


class ReduceOp(enum.IntEnum):
    AVERAGE = 0
    SUM = 1
    MIN = 3
    MAX = 4
    PRODUCT = 5

    @property
    def label(self) -> str:
        return self.name.capitalize()


UFUNCS: dict[ReduceOp, np.ufunc] = {
    ReduceOp.AVERAGE: np.add,
    ReduceOp.SUM: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
}


@functools.lru_cache(maxsize=64)
def averager(dtype: np.dtype, size: int) -> Callable[[np.ndarray], None] | None:
    """Divides a finished region by the world size, in place.

    Integers get the (wrapping) sum divided and truncated toward zero, as Horovod's
    integer average does (-75 / 2 is -37), the same exact integers on every rank; floats
    use true division in their own precision, as numpy would.  Cached per (dtype,
    size): the dtype tests cost more than a small op's reduction.
    """
    if size == 1:
        return None
    if np.issubdtype(dtype, np.signedinteger):
        return lambda region: _truncating_divide(region, size)
    if np.issubdtype(dtype, np.integer):  # unsigned: floor and truncation agree
        return lambda region: np.floor_divide(region, size, out=region)
    return lambda region: np.divide(region, size, out=region)


def _truncating_divide(region: np.ndarray, size: int) -> None:
    # Taking the remainder (sign of the dividend) off first leaves an exact multiple,
    # which floor division divides exactly; the step toward zero cannot wrap.
    rest = np.fmod(region, size)
    np.subtract(region, rest, out=region)
    np.floor_divide(region, size, out=region)


def check_op_dtype(op: ReduceOp, dtype: np.dtype, kind: str, name: str | None) -> None:
    """Raises TypeError for Average of bools, which has no meaning (numpy's mean of bools
    is a float; ours would have to stay bool)."""
    if op == 0 and dtype.kind == "b":  # 0: ReduceOp.AVERAGE, without the enum lookup
        what = kind + (f" '{name}'" if name else "")
        raise TypeError(f"{what}: Average of a bool array is not defined; use Sum or Max "
                        "(logical or), or Min or Product (logical and)")


def as_reduce_op(op: object) -> ReduceOp:
    """``op`` as a :class:`ReduceOp`; Horovod's integer values are accepted too.

    Raises:
        TypeError: ``op`` is not an op at all (``True`` included, though it equals 1).
        ValueError: an integer that names no op.
    """
    if type(op) is ReduceOp:
        return op  # the usual case, without the enum's lookup
    if isinstance(op, bool) or not isinstance(op, int):
        raise TypeError(f"op must be one of Sum, Average, Min, Max, Product, got "
                        f"{type(op).__name__} {op!r}")
    try:
        return ReduceOp(op)
    except ValueError:
        raise ValueError(f"unknown reduction op {op!r}; use Sum, Average, Min, Max or "
                         "Product") from None
