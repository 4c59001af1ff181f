"""The engine as the transport sees it (:class:`..transport.base.MessageHandler`): messages
out come from the outbox, messages in go to the inbox, a link's end goes to peers.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .opstate import QueuedMsg

if TYPE_CHECKING:
    from .engine import Engine


class Handler:
    __slots__ = ("next_outgoing", "body_buffer", "received", "received_view", "can_defer",
                 "_engine")

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        # The hot calls go straight to their part, with no hop through this object.
        self.next_outgoing = engine.outbox.next_outgoing
        self.body_buffer = engine.inbox.body_buffer
        self.received = engine.inbox.received
        self.received_view = engine.inbox.received_view
        self.can_defer = engine.inbox.can_defer

    def sent(self, peer: int, token: object) -> None:
        if isinstance(token, QueuedMsg) and not token.op.finished:
            op = token.op
            op.sends_left -= 1
            send = token.send
            op.left.add((send.peer, send.step, send.piece))
            if op.held:
                self._engine.inbox.release_held(op)
            self._engine.ops.complete(op)

    def peer_lost(self, peer: int, reason: str, orderly: bool) -> None:
        self._engine.peers.lost(peer, reason, orderly)

