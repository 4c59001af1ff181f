"""What repeated calls of one op share, built once.

A training loop makes the same few calls over and over: the same name, dtype and shape.
Everything an op's spec holds but its identity, buffers and priority (its signature, its
description for mismatch reports, its schedule) follows from those, and building it (the
argument checks, the algorithm's choice, the signature's lookup) cost a third to a half
of a small op's tens of microseconds.  A template keeps it; a repeated call only counts
its identity and fills in its buffers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..engine.payload import OpKey, OpSpec
from ..engine.repeat import Repeat
from ..lru import LRU
from .ops import ReduceOp

# Gathering ops' plans kept, and data-phase templates each keeps, by the ranks' rows: most
# jobs send the same rows every call, some (a sparse exchange) rows that vary, which only
# churns these.  Each template holds its schedule (at 16 ranks some kilobytes): a job whose
# rows never repeat keeps at most _GATHER_PLANS * _DATA_TEMPLATES of them.
GATHER_PLANS = 256
_DATA_TEMPLATES = 4


class OpTemplate:
    """An op's spec without its identity, buffers and priority."""

    __slots__ = ("sig", "describe", "code", "count", "schedule", "ufunc", "finalize",
                 "recipe", "lend", "lend_slow", "agree_slow", "fresh", "source_at", "repeat",
                 "repeat_tried")

    def __init__(self, spec: OpSpec) -> None:
        self.sig = spec.sig
        self.describe = spec.describe
        self.code = spec.dtype
        self.count = spec.count
        self.schedule = spec.schedule
        self.ufunc = spec.ufunc
        self.finalize = spec.finalize
        self.recipe = spec.recipe
        self.lend = spec.lend
        self.lend_slow = spec.lend_slow
        self.agree_slow = spec.agree_slow
        self.fresh = spec.fresh
        self.source_at = spec.source_at
        # What runs blocking calls of it at priority 0 (engine/repeat.py), once asked
        # for (None where they cannot run that way).
        self.repeat: Repeat | None = None
        self.repeat_tried = False

    def spec(self, key: OpKey, label: str, work: np.ndarray, priority: int,
             members: tuple[int, ...] | None, source: np.ndarray | None = None) -> OpSpec:
        """This op again, under a call's own identity (``key``, ``label``), buffers and
        priority (``work`` left undefined for ``source`` to fill where the template's
        op did so: OpSpec.fresh)."""
        return OpSpec(key, label, self.sig, self.code, self.count, self.describe,
                      self.schedule, work, source, self.ufunc, self.finalize, priority,
                      self.recipe, -1, members, self.fresh and source is not None,
                      self.lend, self.lend_slow, source_at=self.source_at,
                      agree_slow=self.agree_slow)


class GatherPlan:
    """A gathering op's (allgather, alltoall) two phases: the sizes phase's template,
    and the data phase's with its block bounds, by the rows every rank sent.
    ``send_rows``: an alltoall's rows for each rank (read only)."""

    __slots__ = ("sizes", "send_rows", "_data")

    def __init__(self, sizes: OpTemplate, send_rows: np.ndarray | None = None) -> None:
        self.sizes = sizes
        self.send_rows = send_rows
        self._data: LRU[tuple[int, ...], tuple[OpTemplate, tuple[int, ...],
                                               tuple[int, ...]]] = LRU(_DATA_TEMPLATES)

    def data(self, rows: tuple[int, ...]
             ) -> tuple[OpTemplate, tuple[int, ...], tuple[int, ...]] | None:
        """The data phase's template, send bounds and receive bounds for ``rows``, if
        kept (guard it as the plan's owner guards its table)."""
        return self._data.get(rows)

    def keep(self, rows: tuple[int, ...], template: OpTemplate, send: tuple[int, ...],
             recv: tuple[int, ...]) -> None:
        self._data.put(rows, (template, send, recv))


class SamePlan:
    """A gathering op whose ranks all pass the same shape (``same_shape=True``): one
    phase, the data's, whose template and block bounds follow from this rank's shape.
    ``recv_rows``: the rows from each rank (read only)."""

    __slots__ = ("template", "send", "recv", "recv_rows")

    def __init__(self, template: OpTemplate, send: tuple[int, ...], recv: tuple[int, ...],
                 recv_rows: np.ndarray) -> None:
        self.template = template
        self.send = send
        self.recv = recv
        self.recv_rows = recv_rows


def gather_key(kind: str, x: Any, name: Any, out: Any, splits: Any = None
               ) -> tuple[Any, ...] | None:
    """What decides every check of an allgather or alltoall call and its plan but the
    ranks' rows, if the call is one a plan may serve (a numpy array; ``out`` None or one;
    ``splits`` None, a numpy array or a list or tuple of ints); None otherwise.  Every
    part is compared by type as well as value, so that a call the checks would refuse
    never finds the plan of one they let through."""
    if type(x) is not np.ndarray or (name is not None and type(name) is not str):
        return None
    if out is None:
        shown = None
    elif type(out) is np.ndarray:
        flags = out.flags
        shown = (out.dtype, out.shape, flags.c_contiguous, flags.writeable)
    else:
        return None
    if splits is None:
        rows: Any = None
    elif type(splits) is np.ndarray:
        rows = (splits.dtype, splits.shape, tuple(splits.ravel().tolist()))
    elif type(splits) in (list, tuple) and all(type(s) is int for s in splits):
        rows = tuple(splits)
    else:
        return None
    return (kind, x.dtype, x.shape, name, shown, rows)


class ScatterPlan:
    """A reducescatter call's template and what this rank keeps of the result: the flat
    range [lo, hi) and its shape."""

    __slots__ = ("template", "lo", "hi", "shape")

    def __init__(self, template: OpTemplate, lo: int, hi: int, shape: tuple[int, ...]
                 ) -> None:
        self.template = template
        self.lo = lo
        self.hi = hi
        self.shape = shape


def scatter_key(x: Any, op: Any, name: Any) -> tuple[Any, ...] | None:
    """What decides every check of a reducescatter call and its plan, as
    :func:`gather_key` (an op of type ReduceOp only: a name or a number is checked
    afresh)."""
    if (type(x) is not np.ndarray or type(op) is not ReduceOp
            or (name is not None and type(name) is not str)):
        return None
    return (x.dtype, x.shape, op, name, x.flags.c_contiguous)


def broadcast_key(x: Any, root: Any, name: Any, inplace: bool) -> tuple[Any, ...] | None:
    """What decides every check of a broadcast call and its template, as
    :func:`gather_key` (a root of type int only: a bool or a numpy integer is checked
    afresh)."""
    if (type(x) is not np.ndarray or type(root) is not int
            or (name is not None and type(name) is not str)):
        return None
    flags = x.flags
    return (x.dtype, x.shape, root, name, inplace, flags.c_contiguous, flags.writeable)
