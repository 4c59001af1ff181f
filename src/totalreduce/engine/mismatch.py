"""Collecting every rank's view of an op the ranks disagree on, and saying so clearly.

When a rank sees a header that does not match its own op, it sends its own description of
the op (JSON) to every rank, and so does every rank that hears of it, so each can name all
ranks and what differed before raising :class:`MismatchError`.
"""

from __future__ import annotations

import json
from typing import Any

from ..exceptions import MismatchError

_FIELDS = ("kind", "dtype", "shape", "same_shape", "op", "root", "count", "splits",
           "algorithm")
_MAX_DESC = 64 << 10
# Kinds whose views show the whole shape while the ranks agree on all but its first
# dimension.
_RAGGED = ("allgather", "alltoall")


class MismatchRecord:
    def __init__(self, label: str, ranks: frozenset[int], deadline: float) -> None:
        self.label = label
        self.ranks = ranks  # whose views complete it: the op's ranks, once known here
        self.deadline = deadline
        self.views: dict[int, dict[str, Any]] = {}
        self.announced = False
        # A message's sender never hears back (its send is done once the bytes left, as
        # MPI_Send's), so the header it sent is all the receiver will learn of its view.
        self.headers_suffice = False

    def add(self, rank: int, view: dict[str, Any], partial: bool = False) -> None:
        if partial and rank in self.views:
            return
        self.views[rank] = dict(view, partial=partial)

    def complete(self) -> bool:
        return self.ranks <= self.views.keys() and (self.headers_suffice or not any(
            v.get("partial") for v in self.views.values()))

    def error(self, rank: int, op_name: str) -> MismatchError:
        views = self.views.values()
        # Rows may differ unless every rank said its shape is the others' (same_shape).
        ragged = any(v.get("kind") in _RAGGED for v in views) and not all(
            v.get("same_shape") for v in views)
        differing = [f for f in _FIELDS
                     if len({json.dumps(_compared(f, v, ragged), sort_keys=True)
                             for v in views if f in v}) > 1]
        lines = [f"rank {rank}: ranks disagree on {self.label}"
                 + (f" (differs: {', '.join(differing)})" if differing else "") + ":"]
        for r in sorted(self.views):
            v = self.views[r]
            # The algorithm only where it differs: it follows from the rest otherwise.
            shown = ", ".join(f"{f}={_fmt(v[f])}" for f in _FIELDS
                              if f in v and (f != "algorithm" or f in differing))
            suffix = " (as seen in its message header)" if v.get("partial") else ""
            lines.append(f"  rank {r}: {shown}{suffix}")
        missing = sorted(self.ranks - set(self.views))
        if missing:
            lines.append(f"  ranks {missing}: not heard from (not submitted yet?)")
        if "algorithm" in differing:
            lines.append("The ranks chose different algorithms for it: their "
                         "TOTALREDUCE_SMALL_BYTES, TOTALREDUCE_HALVING_BYTES or "
                         "TOTALREDUCE_HIERARCHICAL settings differ.")
        lines.append("Every rank must call the same collectives, with the same names, "
                     "shapes, dtypes and arguments, in a matching sequence."
                     + (" Only the first dimension may differ between ranks." if ragged
                        else "")
                     + (" With same_shape=True every rank passes it, and the same shape."
                        if any(v.get("same_shape") for v in views) else ""))
        return MismatchError(op_name, "\n".join(lines))


def _compared(field: str, view: dict[str, Any], ragged: bool) -> Any:
    value = view.get(field)
    if (field == "shape" and ragged and view.get("kind") in _RAGGED
            and isinstance(value, list)):
        return value[1:]
    return value


def _fmt(value: Any) -> str:
    if isinstance(value, list) and all(isinstance(x, int) for x in value):
        return "(" + ", ".join(map(str, value)) + ("," if len(value) == 1 else "") + ")"
    return str(value)


def encode_view(view: dict[str, Any]) -> bytes:
    return json.dumps(view, sort_keys=True).encode()


def decode_view(body: bytes) -> dict[str, Any] | None:
    """Parse a peer's view; None for anything that is not a small JSON object."""
    if len(body) > _MAX_DESC:
        return None
    try:
        view = json.loads(bytes(body))
    except ValueError:
        return None
    if not isinstance(view, dict):
        return None
    return {k: v for k, v in view.items() if k in _FIELDS or k == "name"}
