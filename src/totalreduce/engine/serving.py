"""Which ops this rank serves after it called join(), though it never submitted them.

Every op a rank submits is stamped with its *epoch*: how many join rounds it had completed.
From its first join on, a rank builds its part of a peer's op from the op's first header
(the ``server`` callback; None: it cannot take part), for ops stamped below
``serve_below``: begun before this rank's current (or last) round ended.  Later ones are
this rank's own to submit.  The READYs of ops not submitted yet are kept for it, headers
and all, since a READY may be all that arrives before the peer waits.  Starting a served
op is the starter's (starter.py).
"""

from __future__ import annotations

from collections.abc import Callable

from ..lru import LRU
from ..transport.wire import Header
from .payload import OpKey, OpSpec

_EARLY_HEADERS = 1 << 16

Server = Callable[[Header], OpSpec | None]


class JoinServer:
    def __init__(self) -> None:
        self.epoch = 0
        self._serve_below = 0
        self._server: Server | None = None
        self.early_headers: LRU[OpKey, Header] = LRU(_EARLY_HEADERS)

    def joined(self) -> None:
        """This rank's join round is over."""
        self.epoch += 1

    def serves(self, header: Header) -> bool:
        """Whether the op of ``header``, not submitted here, is this rank's to serve."""
        return self._server is not None and header.epoch < self._serve_below

    def remember(self, header: Header) -> None:
        """A READY for an op not submitted here: kept in case this rank joins."""
        if header.recipe:
            self.early_headers.put(header.op_key, header)

    def forget(self, key: OpKey) -> None:
        headers = self.early_headers
        if headers.entries:  # nearly always empty, and this is asked on every small op
            headers.pop(key)

    def begin(self, server: Server) -> list[Header]:
        """Serve from now on; returns the READYs kept so far (ops that may wait on us)."""
        self._server = server
        self._serve_below = self.epoch + 1
        return [header for _key, header in self.early_headers.items()]

    def spec_for(self, header: Header) -> OpSpec | None:
        """This rank's part of the op of ``header`` (None: it cannot take part)."""
        assert self._server is not None
        self.early_headers.pop(header.op_key)
        return self._server(header)
