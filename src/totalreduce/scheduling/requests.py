"""What a rank asks the coordinator for (a request) and what it answers (a response), in
negotiated mode.

A request names one tensor and says what every rank must agree on: the kind of
collective, the dtype, the shape (for allgather and alltoall only the trailing
dimensions: the first may differ), the reduction and the root.  That tuple is its
``params``: equal params on every rank make a response, and a cached response is reused
while a rank's params for the name stay equal.  Requests and responses travel as JSON
(never pickle), in engine ops with reserved names.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np

from ..engine.payload import OpFuture
from ..interrupts import deferred as ctrl_c
from .handle import Handle, raise_failure

Params = tuple[Any, ...]  # (kind, dtype, shape, op, root)

# Kinds whose first dimension may differ between ranks.
RAGGED = frozenset({"allgather", "alltoall"})


# str(dtype) costs ~2 us, so once per dtype; only dtypes totalreduce moves get here.
_DTYPE_NAMES: dict[np.dtype, str] = {}


def params_of(kind: str, arr: np.ndarray | None, op: int, root: int) -> Params:
    if arr is None:
        return (kind, "", (), op, root)
    dtype = arr.dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return (kind, name, arr.shape[1:] if kind in RAGGED else arr.shape, op, root)


ParamsKey = tuple[np.dtype, int, tuple[int, ...]]  # an allreduce's (dtype, op, shape)


class ParamsTable:
    """The params of allreduces already checked, by (dtype, op, shape), at most
    ``capacity``, first in first out.  A tensor seen before skips the argument checks, and
    its requests share one params tuple: a step's many tiny tensors then make one new
    object each for the garbage collector to count, not three."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._by_key: dict[ParamsKey, Params] = {}
        self.get = self._by_key.get  # the submit path's one lookup, without a method call

    def __len__(self) -> int:
        return len(self._by_key)

    def add(self, key: ParamsKey, params: Params) -> None:
        if len(self._by_key) >= self.capacity:
            del self._by_key[next(iter(self._by_key))]
        self._by_key[key] = params


class Request(OpFuture, Handle):
    """One tensor submitted on this rank, waiting for its response.  It is also the
    future the cycle resolves and the handle the application waits on: one object per
    tensor, since a training step may submit thousands of tiny ones."""

    __slots__ = ("name", "params", "kind", "array", "inplace", "priority", "result",
                 "t_submit", "t_ready")

    # An allgather's and an alltoall's own arguments (GatherRequest sets them): class
    # defaults, so that a step's thousands of tiny allreduces do not store them each.
    splits: Any = None
    out: np.ndarray | None = None  # where the result goes (out=)
    same_shape = False  # every rank's shape alike

    def __init__(self, name: str, params: Params, array: np.ndarray | None, inplace: bool,
                 priority: int) -> None:
        # OpFuture's fields, set here rather than through super().__init__(): one call
        # less for each tiny tensor.  No waiter: the cycle thread does the work, so a
        # waiting thread sleeps.
        self._done = False
        self._event = None
        self._error = None
        self._callbacks = None
        self._waiter = None
        self.name = name
        self.params = params
        self.kind: str = params[0]
        self.array = array
        self.inplace = inplace
        self.priority = priority
        self.result: Any = array if inplace else None
        self.t_submit = time.monotonic()
        self.t_ready = 0.0

    # --- the handle ----------------------------------------------------------------------

    @property
    def label(self) -> str:
        return f"{self.kind} '{self.name}'"

    @property
    def futures(self) -> list[OpFuture]:
        return [self]

    def wait(self, timeout: float | None = None) -> Any:
        if not self._done and not self.wait_done(timeout):
            raise TimeoutError(f"{self.label} is not done after {timeout} s")
        if ctrl_c.pending:  # kept while the op finished: the application must see it
            ctrl_c.raise_if_pending()
        if self._error is not None:
            raise_failure(self._error)
        return self.result

    def result_now(self) -> Any:
        return self.result

    # --- the wire ------------------------------------------------------------------------

    def wire(self) -> list[Any]:
        kind, dtype, shape, op, root = self.params
        return [self.name, kind, dtype, list(shape), op, root]


class GatherRequest(Request):
    """An allgather's or alltoall's request: its splits, ``out`` and ``same_shape``."""

    __slots__ = ("splits", "out", "same_shape")

    def __init__(self, name: str, params: Params, array: np.ndarray | None, priority: int,
                 splits: Any, out: np.ndarray | None, same_shape: bool) -> None:
        super().__init__(name, params, array, False, priority)
        self.splits = splits
        self.out = out
        self.same_shape = same_shape


def params_from_wire(item: list[Any]) -> tuple[str, Params]:
    """(name, params) of a request as sent; ValueError if it is not one."""
    if not (isinstance(item, list) and len(item) == 6 and isinstance(item[0], str)):
        raise ValueError(f"not a request: {item!r}")
    name, kind, dtype, shape, op, root = item
    return name, (str(kind), str(dtype), tuple(int(d) for d in shape), int(op), int(root))


class Response:
    """What every rank runs for one tensor (or the error every rank raises for it)."""

    __slots__ = ("name", "params", "kind", "error")

    def __init__(self, name: str, params: Params, error: str = "") -> None:
        self.name = name
        self.params = params
        self.kind: str = params[0]
        self.error = error

    def wire(self) -> list[Any]:
        kind, dtype, shape, op, root = self.params
        return [self.name, kind, dtype, list(shape), op, root, self.error]


def encode(items: list[list[Any]]) -> np.ndarray:
    return np.frombuffer(json.dumps(items, separators=(",", ":")).encode(), np.uint8).copy()


def decode_requests(buf: np.ndarray) -> list[tuple[str, Params]]:
    return [params_from_wire(item) for item in json.loads(buf.tobytes() or b"[]")]


def decode_responses(buf: np.ndarray) -> list[Response]:
    out = []
    for item in json.loads(buf.tobytes() or b"[]"):
        name, params = params_from_wire(item[:6])
        out.append(Response(name, params, str(item[6])))
    return out
