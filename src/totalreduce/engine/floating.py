"""Floating bodies: messages that came before this rank submitted their op.

Each is kept whole in a pooled buffer until the op is submitted here (then applied) or
ends (then dropped).  Their bytes are counted against the credit the sender spent on them
(ledger.py), so floating memory stays under ``TOTALREDUCE_FLOATING_CAP``; the credit is
owed back once a body leaves this store.
"""

from __future__ import annotations

from ..transport.wire import Header
from .ledger import CreditLedger
from .opstate import FloatingBody
from .payload import OpKey
from .reducer import ScratchPool


class Floating:
    def __init__(self, ledger: CreditLedger, scratch: ScratchPool) -> None:
        self._ledger = ledger
        self._scratch = scratch
        self._bodies: dict[OpKey, list[FloatingBody]] = {}
        self.bytes = 0  # credit charged for the bodies held now
        self.peak = 0

    def __contains__(self, key: OpKey) -> bool:
        return key in self._bodies

    def receiving(self, charge: int) -> None:
        """A body of ``charge`` credit has begun to arrive into a floating buffer."""
        self.bytes += charge
        self.peak = max(self.peak, self.bytes)

    def keep(self, item: FloatingBody) -> None:
        """A floating body has arrived whole."""
        self._bodies.setdefault(item.header.op_key, []).append(item)

    def release(self, item: FloatingBody) -> None:
        """``item`` floats no more (applied or dropped): its credit is owed back."""
        self.bytes -= item.charge
        self._ledger.owe(item.src, item.charge)

    def count_from(self, key: OpKey, peer: int) -> int:
        """How many bodies of op ``key`` from ``peer`` are here."""
        return sum(1 for item in self._bodies.get(key, ()) if item.src == peer)

    def first_arrival(self, key: OpKey) -> float:
        """When the first body of op ``key`` arrived (0.0: none floats)."""
        items = self._bodies.get(key)
        return min(item.t for item in items) if items else 0.0

    def take(self, key: OpKey) -> list[FloatingBody]:
        """The bodies of op ``key``, no longer floating (their credit now owed back)."""
        items = self._bodies.pop(key, [])
        for item in items:
            self.release(item)
        return items

    def drop(self, key: OpKey | None = None) -> None:
        """Throw away the bodies of op ``key`` (None: of every op)."""
        keys = list(self._bodies) if key is None else [key]
        for k in keys:
            for item in self.take(k):
                self._scratch.put(item.buf)

    def clear(self) -> None:
        """The job is broken: every body goes, and no credit is owed for it."""
        for items in self._bodies.values():
            for item in items:
                self.bytes -= item.charge
        self._bodies.clear()

    def waiting(self) -> list[tuple[int, Header]]:
        """The first body of each op not submitted here: (sender, header)."""
        return [(items[0].src, items[0].header) for items in self._bodies.values() if items]
