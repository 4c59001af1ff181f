"""Serving ops this rank never submitted, after it called join().

Every op a rank submits is stamped with its *epoch*: how many join rounds it had completed.
From its first join on, a rank builds its part of a peer's op from the op's first header
(the ``server`` callback; None: it cannot take part), for ops stamped below
``serve_below``: begun before this rank's current (or last) round ended.  Later ones are
this rank's own to submit.  The READYs of ops not submitted yet are kept for it, headers
and all, since a READY may be all that arrives before the peer waits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..lru import LRU
from ..transport.wire import Header
from .payload import OpFuture, OpKey, OpSpec

if TYPE_CHECKING:
    from .engine import Engine

_EARLY_HEADERS = 1 << 16

Server = Callable[[Header], OpSpec | None]


class JoinServer:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.epoch = 0
        self._serve_below = 0
        self._server: Server | None = None
        self._early_headers: LRU[OpKey, Header] = LRU(_EARLY_HEADERS)

    def joined(self) -> None:
        """This rank's join round is over."""
        self.epoch += 1

    def serves(self, header: Header) -> bool:
        """Whether the op of ``header``, not submitted here, is this rank's to serve."""
        return self._server is not None and header.epoch < self._serve_below

    def remember(self, header: Header) -> None:
        """A READY for an op not submitted here: kept in case this rank joins."""
        if header.recipe:
            self._early_headers.put(header.op_key, header)

    def forget(self, key: OpKey) -> None:
        self._early_headers.pop(key)

    def start(self, server: Server) -> None:
        """Serve from now on, beginning with the ops already waiting here."""
        engine = self._engine
        self._server = server
        self._serve_below = self.epoch + 1
        waiting = [header for _peer, header in engine.inbox.waiting()]
        waiting += [header for _key, header in self._early_headers.items()]
        for header in waiting:
            if not engine.ops.known(header.op_key) and header.epoch < self._serve_below:
                self.serve(header)

    def serve(self, header: Header) -> None:
        """Start this rank's part of an op only peers submitted, or refuse it."""
        assert self._server is not None
        engine = self._engine
        key = header.op_key
        self._early_headers.pop(key)
        spec = self._server(header)
        if spec is not None:
            engine.start(spec, OpFuture())
            return
        # Nothing here can take part: fail it on the peers now rather than let them wait.
        engine.ops.done.add(key)
        engine.ledger.pop_early(key)
        engine.inbox.drop_floating(key)
        engine.mismatches.tell_view(key, {
            "kind": "none: this rank has called join(), and only allreduce (and barrier) "
                    "run while a rank has joined"})
