"""What a joined rank runs for an allreduce it never submitted.

After ``join()`` a rank has no more data, but its peers may still allreduce (the last
batches of an uneven epoch).  It takes part in each such op with the identity of the op's
reduction (zeros for Sum and Average, so averages still divide by the full world size, as
in Horovod; +inf/max for Min, -inf/min for Max, ones for Product).  The peers describe the
op in its first header (``Header.recipe``: algorithm and reduction; dtype, element count and
signature), which is all it takes to rebuild this rank's part of the schedule.

Which ops a joined rank serves: every op carries its submitter's count of completed join
rounds (``Header.epoch``).  A rank in (or past) round ``e`` serves the ops stamped ``e`` or
less that it never submitted, including ones that arrive after its own join() returned
(a peer's last op may be slower than everyone's join); ops stamped ``e + 1`` were begun
after their submitter's round ended, so this rank will submit them itself.  The join op is
stamped ``e + 1`` too: no rank serves it in place of its own join() call.
"""

from __future__ import annotations

import numpy as np

from ..engine.algorithms import Algorithms
from ..engine.payload import OpSpec
from ..transport.wire import DTYPES, Header
from .ops import UFUNCS, ReduceOp, averager


def identity(op: ReduceOp, dtype: np.dtype) -> object:
    """The value that leaves any other unchanged under ``op``."""
    if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        return 0
    if op == ReduceOp.PRODUCT:
        return 1
    if dtype == np.bool_:
        return op == ReduceOp.MIN  # and-identity True, or-identity False
    if np.issubdtype(dtype, np.floating):
        return np.inf if op == ReduceOp.MIN else -np.inf
    info = np.iinfo(dtype)
    return info.max if op == ReduceOp.MIN else info.min


def served_spec(header: Header, algorithms: Algorithms) -> OpSpec | None:
    """This rank's part of the op ``header`` belongs to, or None if it cannot take part
    (not an allreduce)."""
    algorithm, code = header.recipe & 0xF, header.recipe >> 4
    dtype = DTYPES.get(header.dtype)
    if dtype is None:
        return None
    try:
        op = ReduceOp(code)
    except ValueError:
        return None
    count = header.count
    schedule = algorithms.allreduce_from_recipe(algorithm, count, dtype)
    if schedule is None:
        return None
    size = algorithms.size
    work = np.full(count, identity(op, dtype), dtype)
    finalize = averager(dtype, size) if op == ReduceOp.AVERAGE else None
    return OpSpec(header.op_key, f"allreduce {header.op_key} served after join()",
                  header.sig, header.dtype, count,
                  {"kind": "allreduce", "served": "after join()"},
                  schedule, work, ufunc=UFUNCS[op], finalize=finalize,
                  recipe=header.recipe, epoch=header.epoch)
