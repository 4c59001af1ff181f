"""The coordinator of negotiated mode (rank 0): which ranks have asked for which tensor.

It keeps a message table of the requests not answered yet.  When every rank has asked for
a name it turns the requests into a response: the tensor's params if every rank gave the
same, else an error naming each rank's view, which every rank raises.  Responses come out
in the order their last request arrived, and every rank runs them in that order.

It is also the stall inspector of this mode: a name some ranks asked for and others not,
for longer than ``stall_check_time``, gets one warning naming both sets of ranks; past
``stall_shutdown_time`` (if set) it becomes an error response, so the ranks waiting on it
raise instead of hanging.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .ops import ReduceOp
from .requests import Params, Response

logger = logging.getLogger(__name__)

_FIELDS = ("kind", "dtype", "shape", "op", "root")
STALLED = "stalled"  # the error text of a stall response starts with this


class _Entry:
    __slots__ = ("by_rank", "first", "warned")

    def __init__(self, now: float) -> None:
        self.by_rank: dict[int, Params] = {}
        self.first = now
        self.warned = False


def _view(params: Params) -> dict[str, Any]:
    kind, dtype, shape, op, root = params
    view: dict[str, Any] = {"kind": kind, "dtype": dtype}
    if kind != "barrier":
        view["shape"] = "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") \
            + ")" + (" (after the first dimension)" if kind in ("allgather", "alltoall")
                     else "")
    if kind in ("allreduce", "reducescatter"):
        view["op"] = ReduceOp(op).label if op in ReduceOp._value2member_map_ else op
    if kind == "broadcast":
        view["root"] = root
    return view


def describe_mismatch(name: str, by_rank: dict[int, Params]) -> str:
    views = {r: _view(p) for r, p in sorted(by_rank.items())}
    differing = [f for f in _FIELDS if len({str(v.get(f)) for v in views.values()}) > 1]
    kind = views[min(views)]["kind"]
    lines = [f"ranks disagree on {kind} '{name}' (differs: {', '.join(differing)}):"]
    for r, v in views.items():
        lines.append(f"  rank {r}: " + ", ".join(f"{k}={v[k]}" for k in _FIELDS if k in v))
    lines.append("Every rank must call the same collectives, with the same names, shapes, "
                 "dtypes and arguments.")
    return "\n".join(lines)


class Coordinator:
    def __init__(self, size: int, stall_check_time: float, stall_shutdown_time: float) -> None:
        self._size = size
        self._stall_check = stall_check_time
        self._stall_shutdown = stall_shutdown_time
        self._table: dict[str, _Entry] = {}
        self._ready: list[Response] = []
        self._joined: set[int] = set()
        self.requests_received = 0

    def stats(self) -> dict[str, int]:
        return {"coordinator_received": self.requests_received,
                "coordinator_table": len(self._table)}

    def add(self, rank: int, requests: list[tuple[str, Params]]) -> None:
        now = time.monotonic()
        for name, params in requests:
            self.requests_received += 1
            if params[0] == "join":
                self._joined.add(rank)
                for other in list(self._table):
                    self._answer_if_ready(other)
                continue
            entry = self._table.get(name)
            if entry is None:
                entry = self._table[name] = _Entry(now)
            entry.by_rank[rank] = params
            self._answer_if_ready(name)

    def end_join(self) -> None:
        """Every rank has joined: the next round starts with none."""
        self._joined.clear()

    def _answer_if_ready(self, name: str) -> None:
        """Answer ``name`` once every rank has asked for it, a joined rank counting as
        having asked (joining.py: it stands in with the identity) for an allreduce."""
        entry = self._table[name]
        waiting = set(range(self._size)) - set(entry.by_rank)
        if waiting - self._joined:
            return
        del self._table[name]
        if not waiting:
            self._ready.append(self._respond(name, entry.by_rank))
            return
        first = next(iter(entry.by_rank.values()))
        if first[0] == "allreduce" and len(set(entry.by_rank.values())) == 1:
            self._ready.append(Response(name, first))
        elif first[0] != "allreduce":
            self._ready.append(Response(name, first, (
                f"{first[0]} '{name}': rank(s) {sorted(waiting)} have called join(), and "
                "only allreduce runs until every rank has joined")))
        else:
            self._ready.append(self._respond(name, entry.by_rank))

    def check(self) -> None:
        """The stall inspector's turn (every cycle): warn about names some ranks asked
        for and others not; past the shutdown time, answer them with an error."""
        now = time.monotonic()
        for name, entry in list(self._table.items()):
            waited = now - entry.first
            if self._stall_shutdown and waited > self._stall_shutdown:
                del self._table[name]
                params = next(iter(entry.by_rank.values()))
                self._ready.append(Response(name, params, self._stall_text(
                    name, entry, waited, f"{STALLED}: ", "TOTALREDUCE_STALL_SHUTDOWN_TIME",
                    self._stall_shutdown)))
            elif self._stall_check and waited > self._stall_check and not entry.warned:
                entry.warned = True
                logger.warning("%s", self._stall_text(name, entry, waited, "", "TOTALREDUCE_"
                                                      "STALL_CHECK_TIME", self._stall_check))

    def due(self) -> bool:
        """Whether responses wait to be sent (the cycle then negotiates even if no rank
        has a new request)."""
        return bool(self._ready)

    def responses(self) -> list[Response]:
        """The responses made since the last call, in order."""
        out, self._ready = self._ready, []
        return out

    def _respond(self, name: str, by_rank: dict[int, Params]) -> Response:
        first = next(iter(by_rank.values()))
        if all(p == first for p in by_rank.values()):
            return Response(name, first)
        return Response(name, first, describe_mismatch(name, by_rank))

    def _stall_text(self, name: str, entry: _Entry, waited: float, prefix: str,
                    setting: str, limit: float) -> str:
        kind = next(iter(entry.by_rank.values()))[0]
        asked = sorted(entry.by_rank)
        missing = sorted(set(range(self._size)) - set(asked))
        return (f"{prefix}{kind} '{name}' has waited {waited:.1f} s: submitted by rank(s) "
                f"{asked}, not (yet) by rank(s) {missing} ({setting}={limit:g})")
