"""Which peers have left: links that ended, and peers that said GOODBYE (they send and take
nothing more).  An op that needs a departed peer cannot finish here, nor can any other
rank's copy of it that waits on ours: those ranks are told (OP_FAILED)."""

from __future__ import annotations

from ..transport.wire import Header, Kind
from .outbox import Outbox
from .payload import OpKey


class Departures:
    def __init__(self, outbox: Outbox) -> None:
        self._outbox = outbox
        self.closed = outbox.closed  # peers we can no longer write to (the same set)
        self.bye: set[int] = set()  # peers that said GOODBYE

    def departed(self) -> set[int]:
        return self._outbox.closed | self.bye

    def any(self) -> bool:
        """Whether some peer has left (no set built: asked on every small op)."""
        return bool(self._outbox.closed or self.bye)

    def tell_op_failed(self, key: OpKey, lost: int, reason: str) -> None:
        """Tell every peer still here that op ``key`` cannot finish because rank ``lost``
        left."""
        body = reason.encode()[:4096]
        self._outbox.tell_all(
            Header(Kind.OP_FAILED, step=lost + 1, name_key=key[0], seq=key[1],
                   nbytes=len(body)), body, skip=self.bye)
