"""The mismatch tracker: spots a message that does not fit this rank's op, gathers every
rank's view of that op, and fails it once all views are in (or the grace period ends).

A rank that sees such a message sends its own view to every peer, and so does every rank
that hears of it, so each rank's error can name all ranks and what differed.
"""

from __future__ import annotations

import time
from typing import Any

from ..lru import LRU
from ..transport.wire import DTYPES, Header, Kind
from .mismatch import MismatchRecord, decode_view, encode_view
from .opstate import LiveOp
from .optable import OpTable
from .outbox import Outbox
from .payload import OpKey
from .schedule import Recv

# Views of mismatched ops, kept until the op fails here (or, for ops this rank never
# submits, until they are the stalest of this many).
_MISMATCH_ENTRIES = 4096


class MismatchTracker:
    def __init__(self, rank: int, size: int, ops: OpTable, outbox: Outbox, grace: float
                 ) -> None:
        """``grace``: how long to wait for every rank's view once the first arrives."""
        self._rank = rank
        self._size = size
        self._everyone = frozenset(range(size))
        self._ops = ops
        self._outbox = outbox
        self._grace = grace
        self.records: LRU[OpKey, MismatchRecord] = LRU(_MISMATCH_ENTRIES)

    def __len__(self) -> int:
        return len(self.records)

    def check(self, op: LiveOp, peer: int, header: Header) -> Recv | None:
        """The schedule entry this message fills, or None (after starting a mismatch)."""
        if op.mismatch is not None:
            return None
        spec = op.spec
        if header.sig != spec.sig or header.dtype != spec.dtype or header.count != spec.count:
            problem = "header"
        else:
            rkey = (peer, header.step, header.piece)
            recv = spec.schedule.recvs.get(rkey)
            if (recv is not None and rkey not in op.got
                    and header.nbytes == (recv.hi - recv.lo) * op.itemsize):
                return recv
            problem = "layout"
        seen: dict[str, Any] = {"count": header.count}
        dtype = DTYPES.get(header.dtype)
        if dtype is not None:
            seen["dtype"] = str(dtype)
        if problem == "layout":
            seen["detail"] = (f"sent step {header.step} piece {header.piece} of "
                              f"{header.nbytes} bytes, which rank {self._rank} does not expect")
        record = self._record(spec.key, spec.label)
        record.add(peer, seen, partial=True)
        self._join(op, record)
        return None

    def heard(self, peer: int, key: OpKey, view: dict[str, Any]) -> None:
        """``peer`` sent its view of op ``key`` (a MISMATCH message)."""
        ops = self._ops
        op = ops.active.get(key)
        if op is None and key in ops.done:
            return
        if op is not None and _sends_message(op, self._rank):
            # A receiver's mismatch fails the receive only: whether the send had finished
            # here when the word came would otherwise decide whether it fails too.
            return
        record = self._record(key, op.spec.label if op is not None else f"op {key}")
        record.add(peer, view)
        if op is not None:
            self._join(op, record)

    def started(self, op: LiveOp) -> bool:
        """``op`` was just submitted here: if peers already reported a mismatch on it, join
        in (the rest get a grace period to answer) and return True."""
        record = self.records.get(op.spec.key)
        if record is None:
            return False
        record.deadline = max(record.deadline, time.monotonic() + self._grace)
        self._join(op, record)
        return True

    def due(self, now: float) -> list[tuple[LiveOp, BaseException]]:
        """Mismatched ops whose views are all in, or whose grace period is over, with
        the error to fail each with."""
        out: list[tuple[LiveOp, BaseException]] = []
        active = self._ops.active
        for key, record in self.records.items():
            op = active.get(key)
            if op is not None and op.mismatch is record and (
                    record.complete() or now >= record.deadline):
                out.append((op, record.error(self._rank, op.spec.describe.get("name", ""))))
        return out

    def forget(self, key: OpKey) -> None:
        self.records.pop(key)

    def tell_view(self, key: OpKey, view: dict[str, Any],
                  ranks: tuple[int, ...] | None = None) -> None:
        """Tell every live peer (of ``ranks``, the op's, if given) this rank's view of op
        ``key`` (a MISMATCH)."""
        body = encode_view(view)
        skip = None if ranks is None else set(range(self._size)) - set(ranks)
        self._outbox.tell_all(
            Header(Kind.MISMATCH, name_key=key[0], seq=key[1], nbytes=len(body)), body, skip)

    def _record(self, key: OpKey, label: str) -> MismatchRecord:
        """The mismatch record of op ``key``, begun now if this is the first word of it
        (waiting for every rank's view until the op, if it starts here, says whose)."""
        record = self.records.get(key)
        if record is None:
            record = MismatchRecord(label, self._everyone, time.monotonic() + self._grace)
            self.records.put(key, record)
        return record

    def _join(self, op: LiveOp, record: MismatchRecord) -> None:
        op.mismatch = record
        record.label = op.spec.label
        if op.spec.ranks is not None:
            record.ranks = frozenset(op.spec.ranks)
        if op.spec.describe.get("kind") == "message":
            record.headers_suffice = True
        record.add(self._rank, {k: v for k, v in op.spec.describe.items() if k != "name"})
        if not record.announced:
            record.announced = True
            self.tell_view(op.spec.key, op.spec.describe, op.spec.ranks)
        if record.complete():
            self._ops.fail(op, record.error(self._rank, op.spec.describe.get("name", "")))


def _sends_message(op: LiveOp, rank: int) -> bool:
    describe = op.spec.describe
    return describe.get("kind") == "message" and describe.get("from") == rank


def read_view(body: bytes) -> dict[str, Any]:
    return decode_view(body) or {"detail": "unreadable description"}
