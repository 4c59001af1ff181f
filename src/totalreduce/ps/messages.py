"""How workers and servers talk: a fixed header of int64 fields, then, when the header
says so, a payload of raw bytes, both carried by the point-to-point messages
(``totalreduce.send``/``recv``).

Headers and payloads travel on separate tags because a server receives headers from any
worker but must then take that worker's payload, whose size only the header tells.
Messages of one tag between two ranks keep their order, so a payload always follows its
own header and a worker's clock always arrives after the pushes it sent before it.

With recovery on (``--max-restarts``) the messages run on a world that a lost rank's
replacement rebuilds; whatever was in flight then is gone, and both sides send again
(requests carry what makes a second copy harmless, see :class:`Request`).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, NamedTuple

import numpy as np

import totalreduce as tr

from .. import runtime as _runtime

# Tags the parameter server uses; the rest of 0..32767 stays free for the job's own
# messages.
REQUEST, PAYLOAD, REPLY, DATA = 32760, 32761, 32762, 32763


class Op(IntEnum):
    INIT = 1
    PUSH = 2
    PULL = 3
    CLOCK = 4
    FINISH = 5
    ACKED = 6    # replica to primary: the oldest forward not yet acknowledged is held
    RECOVER = 7  # a server's replacement to a peer server: send me a snapshot (amount)
    RESUME = 8   # a worker's replacement to a server: where did I stop?
    SNAPSHOT = 9  # the answer to RECOVER: a store, encoded (extra 1: this server has none)


class Codec(IntEnum):
    """How a pushed gradient is encoded."""
    RAW = 0    # the key's dtype, hi - lo values
    FP16 = 1   # float16, hi - lo values
    TOPK = 2   # count int64 offsets (from lo), then count values of the key's dtype


class Request(NamedTuple):
    """Worker to server.  ``key``: the name's hash; [lo, hi): the elements of the key
    this request is about (within the server's share); ``size``: the key's element count;
    ``amount``: INIT, the name's length in bytes; TOPK, the values sent; CLOCK, iterations
    finished; RECOVER and SNAPSHOT, which store (PRIMARY or REPLICA).  ``extra``: CLOCK, the delay
    bound (-1: none); PUSH, 0 to apply it on arrival, or the worker's iteration + 1 to
    hold it until every worker has finished that iteration.  ``seq``: PUSH, the worker's
    count of pushes (a push sent again after a rebuild has the same one, and a server
    that holds it already only acknowledges it).  ``origin``: on a request a primary
    forwards to its replica, the worker it came from; else -1."""
    op: int
    key: int
    lo: int = 0
    hi: int = 0
    size: int = 0
    dtype: int = 0
    codec: int = 0
    amount: int = 0
    nbytes: int = 0
    extra: int = 0
    seq: int = 0
    origin: int = -1


class Reply(NamedTuple):
    """Server to worker.  ``status`` OK or ERROR (the payload is then the message);
    ``value``: CLOCK, the iterations every worker has finished; RESUME, the iterations
    this worker had finished.  ``extra``: RESUME, its last push's ``seq``."""
    status: int
    value: int = 0
    nbytes: int = 0
    extra: int = 0


OK, ERROR = 0, 1
PRIMARY, REPLICA = 0, 1  # a server's own share of the keys, and its predecessor's copy
_REQUEST_FIELDS, _REPLY_FIELDS = len(Request._fields), len(Reply._fields)


def encode_dtype(dtype: np.dtype) -> int:
    """A dtype as an int64 field: its ``str`` ('<f4'), which means the same on any host."""
    return int.from_bytes(dtype.str.encode(), "little")


def decode_dtype(code: int) -> np.dtype:
    return np.dtype(code.to_bytes(8, "little").rstrip(b"\0").decode())


def as_bytes(array: np.ndarray) -> np.ndarray:
    """``array``'s bytes as a flat uint8 array (a view where it is contiguous)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _send(x: np.ndarray, dest: int, tag: int) -> tr.Handle:
    return _runtime.current().messages("ps", retried=True).send(x, dest, tag)


def _recv(buf: tuple[tuple[int, ...], type] | np.ndarray, source: int | None, tag: int
          ) -> Any:
    messages = _runtime.current().messages("ps", retried=True)
    with messages.caller_waits():
        return messages.recv(buf, source, tag).wait()


def _post(fields: tuple[int, ...], payload: np.ndarray | None, dest: int, header_tag: int,
          payload_tag: int) -> list[tr.Handle]:
    handles = [_send(np.array(fields, dtype=np.int64), dest, header_tag)]
    if payload is not None and payload.size:
        handles.append(_send(payload, dest, payload_tag))
    return handles


def post_request(request: Request, payload: np.ndarray | None, server: int
                 ) -> list[tr.Handle]:
    """Start sending ``request`` (its ``nbytes`` must be ``payload``'s size)."""
    return _post(tuple(request), payload, server, REQUEST, PAYLOAD)


def post_reply(reply: Reply, payload: np.ndarray | None, worker: int) -> list[tr.Handle]:
    return _post(tuple(reply), payload, worker, REPLY, DATA)


def next_request() -> tuple[Request, np.ndarray | None, int]:
    """The next request from any worker: (request, payload bytes or None, its rank)."""
    fields, source = _recv(((_REQUEST_FIELDS,), np.int64), None, REQUEST)
    request = Request(*(int(f) for f in fields))
    payload = _recv(((request.nbytes,), np.uint8), source, PAYLOAD) \
        if request.nbytes else None
    return request, payload, int(source)


def reply_from(server: int) -> Reply:
    return Reply(*(int(f) for f in _recv(((_REPLY_FIELDS,), np.int64), server, REPLY)))


def data_from(server: int, buf: np.ndarray) -> None:
    """The bytes that follow an accepted reply, into ``buf``."""
    _recv(buf, server, DATA)


def error_text(reply: Reply, server: int) -> str:
    """The message of an ERROR reply (its payload, which the caller has not taken)."""
    raw = _recv(((reply.nbytes,), np.uint8), server, DATA) if reply.nbytes else b""
    return bytes(raw).decode(errors="replace")

