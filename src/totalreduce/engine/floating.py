"""Floating bodies: messages that came before this rank submitted their op.

Each is kept whole in a pooled buffer until the op is submitted here (then applied) or
ends (then dropped).  Their bytes are counted against the credit the sender spent on them
(ledger.py), so the bytes floating stay under ``TOTALREDUCE_FLOATING_CAP`` (the buffers
holding them under twice that: reducer.ScratchPool may hand a body a larger idle
buffer); the credit is owed back once a body leaves this store.

A *watch* waits for a floating body that its predicate accepts: a receive from any source
(point-to-point) learns which op to submit from the first body that arrives for it.
"""

from __future__ import annotations

from collections.abc import Callable

from ..exceptions import PeerFailureError, TotalReduceError
from ..transport.wire import Header
from .ledger import CreditLedger
from .opstate import FloatingBody
from .payload import OpFuture, OpKey
from .reducer import ScratchPool


class Watch:
    """A wait for the first floating body that ``match(sender, header)`` accepts.  The
    predicate records what it accepted itself (it runs on the loop's thread and is asked
    once per body until it accepts one).  ``sources``: the ranks a body may come from;
    the watch fails once all of them have left."""

    __slots__ = ("match", "sources", "future", "label")

    def __init__(self, match: Callable[[int, Header], bool], sources: set[int],
                 future: OpFuture, label: str) -> None:
        self.match = match
        self.sources = sources
        self.future = future
        self.label = label


class Floating:
    def __init__(self, ledger: CreditLedger, scratch: ScratchPool) -> None:
        self._ledger = ledger
        self._scratch = scratch
        # Public, as CreditLedger.early and JoinServer.early_headers: a repeated small
        # op (repeat.py) tests all three on every call, without a method call each.
        self.bodies: dict[OpKey, list[FloatingBody]] = {}
        self.bytes = 0  # credit charged for the bodies held now
        self.peak = 0
        self.floated = 0  # bytes of every body that has floated here (stats)
        self._watches: list[Watch] = []

    def __contains__(self, key: OpKey) -> bool:
        return key in self.bodies

    def receiving(self, charge: int) -> None:
        """A body of ``charge`` credit has begun to arrive into a floating buffer."""
        self.bytes += charge
        self.peak = max(self.peak, self.bytes)

    def keep(self, item: FloatingBody) -> None:
        """A floating body has arrived whole."""
        self.bodies.setdefault(item.header.op_key, []).append(item)
        self.floated += item.header.nbytes
        for watch in self._watches:
            if item.src in watch.sources and watch.match(item.src, item.header):
                self._watches.remove(watch)
                watch.future.resolve()
                return

    def release(self, item: FloatingBody) -> None:
        """``item`` floats no more (applied or dropped): its credit is owed back."""
        self.bytes -= item.charge
        self._ledger.owe(item.src, item.charge)

    def empty(self) -> bool:
        """Whether no body floats here, none arriving."""
        return not self.bodies and not self.bytes

    def only(self, key: OpKey) -> bool:
        """Whether every body here (none arriving) is op ``key``'s, or none is."""
        bodies = self.bodies
        if not bodies:
            return not self.bytes
        items = bodies.get(key)
        return items is not None and len(bodies) == 1 and \
            self.bytes == sum(item.charge for item in items)

    def recycle(self, buf: memoryview) -> None:
        """A taken body's buffer, no longer needed."""
        self._scratch.put(buf)

    def count_from(self, key: OpKey, peer: int) -> int:
        """How many bodies of op ``key`` from ``peer`` are here."""
        return sum(1 for item in self.bodies.get(key, ()) if item.src == peer)

    def first_arrival(self, key: OpKey) -> float:
        """When the first body of op ``key`` arrived (0.0: none floats)."""
        items = self.bodies.get(key)
        return min(item.t for item in items) if items else 0.0

    def take(self, key: OpKey) -> list[FloatingBody]:
        """The bodies of op ``key``, no longer floating (their credit now owed back)."""
        items = self.bodies.pop(key, [])
        for item in items:
            self.release(item)
        return items

    def drop(self, key: OpKey | None = None) -> None:
        """Throw away the bodies of op ``key`` (None: of every op)."""
        keys = list(self.bodies) if key is None else [key]
        for k in keys:
            for item in self.take(k):
                self._scratch.put(item.buf)

    def clear(self, error: TotalReduceError) -> None:
        """The job is broken: every body goes, and no credit is owed for it; every watch
        fails with ``error``."""
        for items in self.bodies.values():
            for item in items:
                self.bytes -= item.charge
        self.bodies.clear()
        self.end_watches(error)

    # --- watches -------------------------------------------------------------------------

    def watch(self, watch: Watch, gone: set[int] | None = None, rank: int = -1) -> None:
        """Resolve ``watch`` with the earliest floating body it accepts, or once one
        arrives; ``gone``: peers that have left already (``rank``: ours, for the error
        when every source has)."""
        firsts = sorted((items[0] for items in self.bodies.values() if items),
                        key=lambda item: item.t)
        for item in firsts:
            if item.src in watch.sources and watch.match(item.src, item.header):
                watch.future.resolve()
                return
        if not watch.sources:
            watch.future.resolve(TotalReduceError(f"{watch.label}: no rank to receive from"))
            return
        self._watches.append(watch)
        for peer in sorted(watch.sources & (gone or set())):
            self.left(peer, rank)

    def watched(self) -> bool:
        """Whether a watch waits (the transport must keep reading, the loop running)."""
        return bool(self._watches)

    def left(self, peer: int, rank: int) -> None:
        """``peer`` shut down: it sends nothing more, so a watch with no other source
        fails."""
        for watch in list(self._watches):
            watch.sources.discard(peer)
            if not watch.sources:
                self._watches.remove(watch)
                watch.future.resolve(PeerFailureError(
                    peer, f"rank {rank}: {watch.label}: rank {peer} shut down and no other "
                    "rank it could come from is left", orderly=True))

    def end_watches(self, error: BaseException) -> None:
        watches, self._watches = self._watches, []
        OpFuture.resolve_all((w.future for w in watches), error)

    def waiting(self) -> list[tuple[int, Header]]:
        """The first body of each op not submitted here: (sender, header)."""
        return [(items[0].src, items[0].header) for items in self.bodies.values() if items]
