"""Negotiated scheduling (Horovod's model): a collective starts only once every rank has
asked for it, as the coordination cycle (controller.py) finds out.

It has the self-guided scheduler's interface, so the numpy and torch APIs run over either
(``TOTALREDUCE_COORDINATION``).  A call becomes a request with a name (unnamed calls get
``kind.N`` from a per-rank counter, as in Horovod); the cycle answers it, and the op then
runs through the self-guided scheduler under that name, on every rank in the same order.
A request's handle is waited on like any other: a waiting thread drives the engine.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..config import Config
from ..engine.engine import Engine
from ..engine.payload import OpFuture
from ..timeline import Timeline
from .checks import (
    check_allreduce,
    check_alltoall,
    check_broadcast,
    check_grouped,
    check_name,
    check_out,
    check_reducescatter,
    check_rows,
    check_same_shape_splits,
)
from .controller import Controller
from .handle import FutureHandle, Handle
from .ops import ReduceOp
from .protocol import NothingAtOnce
from .requests import GatherRequest, ParamsTable, Request, params_of
from .selfguided import SelfGuided

_PARAMS_ENTRIES = 4096
_BARRIER = "barrier.noname"


class Negotiated(NothingAtOnce):
    def __init__(self, engine: Engine, config: Config, timeline: Timeline | None = None
                 ) -> None:
        self._engine = engine
        self.rank, self.size = engine.rank, engine.size
        self._ops = SelfGuided(engine, config)
        self._controller = Controller(self._ops, config, timeline)
        self._unnamed = itertools.count()
        self._params = ParamsTable(_PARAMS_ENTRIES)
        self._stop_timeout = config.shutdown_timeout + 10.0

    def caller_waits(self) -> Any:
        """Nothing to mark: a thread waiting for a request sleeps (the cycle thread does the
        work), so it must not count as driving the engine, or nobody would drive the data
        ops between cycles."""
        return contextlib.nullcontext()

    def stats(self) -> dict[str, int]:
        return dict(self._ops.stats(), **self._controller.stats(),
                    checked_params=len(self._params))

    def close(self) -> None:
        """Stop coordinating (every rank stops at the same cycle)."""
        self._controller.stop(self._stop_timeout)

    # --- requests ------------------------------------------------------------------------

    def _name(self, kind: str, name: str | None) -> str:
        if name is None:
            return f"{kind}.noname.{next(self._unnamed)}"
        check_name(name, kind)
        return name

    def _request(self, kind: str, name: str | None, arr: np.ndarray | None, op: int = -1,
                 root: int = -1, inplace: bool = False, priority: int = 0,
                 splits: Any = None, out: np.ndarray | None = None,
                 same_shape: bool = False) -> Request:
        """The request, submitted: it is also the handle the caller waits on."""
        params = params_of(kind, arr, op, root)
        if kind in ("allgather", "alltoall"):
            request: Request = GatherRequest(self._name(kind, name), params, arr, priority,
                                             splits, out, same_shape)
        else:
            request = Request(self._name(kind, name), params, arr, inplace, priority)
        self._controller.submit(request)
        return request

    def allreduce(self, x: Any, op: Any, name: str | None, priority: int,
                  inplace: bool) -> Request:
        params = self._params.get((x.dtype, op, x.shape)) if type(x) is np.ndarray and \
            type(op) is ReduceOp else None
        if params is None or (inplace and not x.flags.writeable):
            op, x = check_allreduce(x, op, name, inplace)
            params = params_of("allreduce", x, int(op), -1)
            self._params.add((x.dtype, op, x.shape), params)
        if type(name) is not str:
            name = self._name("allreduce", name)
        request = Request(name, params, x, inplace, priority)
        self._controller.submit(request)
        return request

    def grouped_allreduce(self, xs: Sequence[Any], op: Any, name: str | None,
                          priority: int, inplace: bool) -> Handle:
        check_grouped(xs, op, name, inplace)
        base = self._name("grouped_allreduce", name)
        requests = [self.allreduce(x, op, f"{base}.{i}", priority, inplace)
                    for i, x in enumerate(xs)]
        futures: list[OpFuture] = list(requests)
        return FutureHandle(futures, lambda: [r.result for r in requests], base)

    def broadcast(self, x: Any, root_rank: int, name: str | None, priority: int,
                  inplace: bool) -> Handle:
        arr, root = check_broadcast(x, root_rank, name, inplace, self.size)
        return self._request("broadcast", name, arr, root=root, inplace=inplace,
                             priority=priority)

    def reducescatter(self, x: Any, op: Any, name: str | None, priority: int) -> Handle:
        rop, arr = check_reducescatter(x, op, name)
        return self._request("reducescatter", name, arr, int(rop), priority=priority)

    def allgather(self, x: Any, name: str | None, priority: int,
                  out: np.ndarray | None = None, same_shape: bool = False) -> Handle:
        arr = check_rows(x, "allgather", name)
        check_out(out, arr, "allgather", name)
        return self._request("allgather", name, arr, priority=priority, out=out,
                             same_shape=same_shape)

    def alltoall(self, x: Any, splits: Any, name: str | None, priority: int,
                 out: np.ndarray | None = None, same_shape: bool = False) -> Handle:
        if same_shape:
            check_same_shape_splits(splits, name)
        arr, _rows = check_alltoall(x, splits, name, self.size)
        check_out(out, arr, "alltoall", name)
        return self._request("alltoall", name, arr, priority=priority, splits=splits,
                             out=out, same_shape=same_shape)

    def barrier(self) -> Handle:
        # One name for every barrier (the API's barrier blocks, so two are never pending
        # on a rank): after the first, each is a cache hit, not a trip to the coordinator.
        return self._request("barrier", _BARRIER, None)

    def join(self) -> int:
        """Stand in for this rank in every allreduce the others run (with the op's
        identity) until every rank has joined; return the rank that joined last."""
        return int(self._request("join", "\x00join", None).wait())
