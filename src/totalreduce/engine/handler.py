"""The engine as the transport sees it (:class:`..transport.base.MessageHandler`): messages
out come from the outbox, messages in go to the inbox, a link's end goes to peers.py."""

from __future__ import annotations

from collections.abc import Callable

from .applier import Applier
from .inbox import Inbox
from .outbox import Outbox
from .peers import PeerEvents


class Handler:
    __slots__ = ("next_outgoing", "body_buffer", "received", "received_view", "can_defer",
                 "lane_claims", "overtaking", "received_ahead", "pressing", "_outbox",
                 "_inbox", "_applier", "_peers")

    def __init__(self, outbox: Outbox, inbox: Inbox, applier: Applier, peers: PeerEvents,
                 pressing: Callable[[], bool]) -> None:
        """``pressing()``: whether the loop has commands waiting (a submitted op)."""
        self._outbox = outbox
        self._inbox = inbox
        self._applier = applier
        self._peers = peers
        # The hot calls go straight to their part, with no hop through this object.
        self.next_outgoing = outbox.next_outgoing
        self.body_buffer = inbox.body_buffer
        self.received = inbox.received
        self.received_view = inbox.received_view
        self.can_defer = inbox.can_defer
        self.lane_claims = inbox.lane_claims
        self.overtaking = inbox.overtaking
        self.received_ahead = inbox.received_ahead
        self.pressing = pressing

    def sent(self, peer: int, token: object) -> None:
        op = self._outbox.sent(token)
        if op is not None:
            self._applier.send_left(op)

    def peer_lost(self, peer: int, reason: str, orderly: bool) -> None:
        self._inbox.lost(peer)
        self._peers.lost(peer, reason, orderly)
