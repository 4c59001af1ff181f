"""Collectives of Python objects: the only place where totalreduce pickles.

The transport moves raw bytes and never unpickles; these functions pickle on purpose,
because the caller asked to send an object.  Only use them between ranks of your own job
(every connection is authenticated with the job secret, so no stranger can feed them).
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from . import runtime as _runtime
from .scheduling.process_sets import ProcessSet

# An object collective's first op moves a head of this many bytes from each rank (the
# root): the pickle's length, then its first bytes, so that a small object (a metric, an
# epoch) takes one op, not one for its length and one for its bytes (2 ranks, a small
# dict: 55-60 us a broadcast_object the two ways, against 20 a broadcast).
_HEAD = 1024
_LENGTH_FIELD = struct.Struct("=q")  # the pickle's length, in the host's byte order
_LENGTH = _LENGTH_FIELD.size
_IN_HEAD = _HEAD - _LENGTH

# The rest of a pickle, up to this size, goes padded to a power of two (from
# _PADDED_FROM): a few sizes, each a repeated op that runs from its template's Repeat
# (scheduling/templates.py), where each new size would be an op of its own.  An allgather
# of them goes as one phase (same_shape), the padding costing each rank the longest
# rest's bytes per peer; past this size an allgather sends each rest as it is, after an
# exchange of rows.
_PADDED_UP_TO = 64 << 10
_PADDED_FROM = 64


def _padded(nbytes: int) -> int:
    return max(_PADDED_FROM, 1 << (nbytes - 1).bit_length())


def _head(payload: bytes | None) -> np.ndarray:
    """The first op's block of ``payload`` (None: a broadcast's receiver).  Built as
    bytes: framed with numpy's slices and views (here and in the reading back), a small
    object's allgather_object took 24.4 us at 2 ranks against 21.3 this way."""
    head = bytearray(_HEAD)
    if payload is not None:
        _LENGTH_FIELD.pack_into(head, 0, len(payload))
        first = payload[:_IN_HEAD]
        head[_LENGTH:_LENGTH + len(first)] = first
    return np.frombuffer(head, np.uint8)


def _length(heads: memoryview, at: int) -> int:
    """The pickle's length in the head at byte ``at`` of ``heads``."""
    length: int = _LENGTH_FIELD.unpack_from(heads, at)[0]
    return length


def _rest(payload: bytes, width: int) -> np.ndarray:
    """``payload`` past its head, padded with zeros to ``width`` bytes."""
    block = np.zeros(width, np.uint8)
    rest = payload[_IN_HEAD:]
    block[:len(rest)] = np.frombuffer(rest, np.uint8)
    return block


def _call(now: Callable[[Any], Any], start: Callable[[Any], Any],
          process_set: ProcessSet | None, what: str) -> Any:
    """``now(ops)``: the result of a blocking collective on ``process_set`` where the
    scheduler ran it to its end at once, else None; then ``start(ops)`` submits it, and
    this thread waits for it, driving the loop."""
    ops = _runtime.current().process_sets.scheduler(process_set, what)
    done = now(ops)
    if done is not None:
        return done
    with ops.caller_waits():
        return start(ops).wait()


def _broadcast(x: np.ndarray, root_rank: int, name: str, process_set: ProcessSet | None,
               inplace: bool) -> np.ndarray:
    result: np.ndarray = _call(
        lambda ops: ops.broadcast_now(x, root_rank, name, 0, inplace),
        lambda ops: ops.broadcast(x, root_rank, name, 0, inplace), process_set,
        "broadcast_object")
    return result


def _allgather(x: np.ndarray, name: str, process_set: ProcessSet | None, same_shape: bool
               ) -> np.ndarray:
    result: np.ndarray = _call(
        lambda ops: ops.allgather_now(x, name, 0, None, same_shape),
        lambda ops: ops.allgather(x, name, 0, None, same_shape), process_set,
        "allgather_object")
    return result


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
    payload = pickle.dumps(obj) if me == root_rank else None
    head = _broadcast(_head(payload), root_rank, f"{base}.head", process_set, True).data
    length = _length(head, 0)
    rest = length - _IN_HEAD
    if rest > 0:
        if rest <= _PADDED_UP_TO:
            block = _rest(payload, _padded(rest)) if payload is not None \
                else np.zeros(_padded(rest), np.uint8)
            tail = _broadcast(block, root_rank, f"{base}.data", process_set, True)
        else:
            block = np.empty(rest, np.uint8) if payload is None \
                else np.frombuffer(payload, np.uint8)[_IN_HEAD:]
            tail = _broadcast(block, root_rank, f"{base}.data", process_set, False)
    if me == root_rank:
        return obj
    if rest <= 0:
        return pickle.loads(head[_LENGTH:_LENGTH + length])
    return pickle.loads(bytes(head[_LENGTH:]) + tail[:rest].tobytes())


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet | None = None) -> list[Any]:
    """A list of every rank's (of ``process_set``'s) ``obj``, in rank order (each pickled
    by its owner)."""
    base = "allgather_object" if name is None else name
    payload = pickle.dumps(obj)
    heads = _allgather(_head(payload), f"{base}.head", process_set, True).data
    ats = range(0, heads.nbytes, _HEAD)
    lengths = [_length(heads, at) for at in ats]
    if max(lengths) <= _IN_HEAD:  # every object whole in its head
        return [pickle.loads(heads[at + _LENGTH:at + _LENGTH + n])
                for at, n in zip(ats, lengths, strict=True)]
    firsts = [bytes(heads[at + _LENGTH:at + _LENGTH + min(n, _IN_HEAD)])
              for at, n in zip(ats, lengths, strict=True)]
    rests = [max(0, n - _IN_HEAD) for n in lengths]
    longest = max(rests)
    if longest <= _PADDED_UP_TO:
        width = _padded(longest)
        data = _allgather(_rest(payload, width), f"{base}.data", process_set, True)
        starts = [r * width for r in range(len(rests))]
    else:
        mine = np.frombuffer(payload, np.uint8)[_IN_HEAD:]
        data = _allgather(mine, f"{base}.data", process_set, False)
        starts = [0]
        for n in rests[:-1]:
            starts.append(starts[-1] + n)
    return [pickle.loads(first + data[at:at + n].tobytes())
            for first, at, n in zip(firsts, starts, rests, strict=True)]
