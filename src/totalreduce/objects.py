"""Collectives of Python objects: the only place where totalreduce pickles.

The transport moves raw bytes and never unpickles; these functions pickle on purpose,
because the caller asked to send an object.  Only use them between ranks of your own job
(every connection is authenticated with the job secret, so no stranger can feed them).
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from . import runtime as _runtime
from .scheduling.process_sets import ProcessSet


def _wait(start: Any, process_set: ProcessSet | None, what: str) -> Any:
    """``start(ops)`` submits a collective (on ``process_set``); this thread waits for it,
    driving the loop."""
    ops = _runtime.current().process_sets.scheduler(process_set, what)
    with ops.caller_waits():
        return start(ops).wait()


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet | None = None) -> Any:
    """Every rank gets ``root_rank``'s ``obj`` (pickled there, unpickled everywhere else).

    Other ranks' ``obj`` is ignored.

    Raises:
        ValueError: ``root_rank`` is not a rank of the job (or of ``process_set``).
        pickle.PicklingError: the root's object cannot be pickled (raised on the root;
            the others then wait for the root's next broadcast of this name).
    """
    me = _runtime.current().rank
    base = "broadcast_object" if name is None else name
    payload = np.frombuffer(pickle.dumps(obj), np.uint8) if me == root_rank else None
    mine = np.array([0 if payload is None else payload.size], np.int64)
    length = _wait(lambda ops: ops.broadcast(mine, root_rank, f"{base}.len", 0, False),
                   process_set, "broadcast_object")
    if payload is None:
        payload = np.empty(int(length[0]), np.uint8)
    out = payload
    data = _wait(lambda ops: ops.broadcast(out, root_rank, f"{base}.data", 0, False),
                 process_set, "broadcast_object")
    if me == root_rank:
        return obj
    return pickle.loads(data.tobytes())


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet | None = None) -> list[Any]:
    """A list of every rank's (of ``process_set``'s) ``obj``, in rank order (each pickled
    by its owner)."""
    base = "allgather_object" if name is None else name
    payload = np.frombuffer(pickle.dumps(obj), np.uint8)
    size = np.array([payload.size], np.int64)
    # One length a rank (same_shape): no exchange of sizes before the lengths.
    lengths = _wait(lambda ops: ops.allgather(size, f"{base}.len", 0, None, True),
                    process_set, "allgather_object")
    data = _wait(lambda ops: ops.allgather(payload, f"{base}.data", 0), process_set,
                 "allgather_object")
    out: list[Any] = []
    offset = 0
    for n in lengths.tolist():
        out.append(pickle.loads(data[offset:offset + n].tobytes()))
        offset += n
    return out
