"""Whether this rank's part of the job can go on: closing (shutdown() began) or broken (a
failure that ends every op, here and on every peer).  Breaking is one act with several
parts (fail every op, tell every peer, drop what floats), so it lives here, with the
state it sets, rather than with any one of the parts it touches."""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..exceptions import TotalReduceError
from ..transport.wire import Header, Kind
from .floating import Floating
from .optable import OpTable
from .outbox import Outbox

logger = logging.getLogger(__name__)


class JobState:
    def __init__(self, rank: int, size: int, outbox: Outbox, ops: OpTable,
                 floating: Floating, resume: Callable[[], None]) -> None:
        """``resume()``: the transport reads again if it stopped (a broken job must read
        its peers' ABORTs and goodbyes)."""
        self.rank = rank
        self.size = size
        self.broken: TotalReduceError | None = None
        self.closing = False  # shutdown() began: a peer's leaving is news no more
        self._resume = resume
        self._outbox = outbox
        self._ops = ops
        self._floating = floating

    def usable(self) -> bool:
        """Neither closing nor broken."""
        return not self.closing and self.broken is None

    def break_job(self, error: TotalReduceError, lost: int | None = None) -> None:
        """The job cannot go on: fail every op, and tell every peer (an ABORT naming the
        rank that was lost, if any)."""
        if self.broken is not None:
            return
        self.broken = error
        self._resume()
        if lost != self.rank:
            logger.error("%s", error)
        body = str(error).encode()[:4096]
        outbox = self._outbox
        abort = Header(Kind.ABORT, step=0 if lost is None else lost + 1, nbytes=len(body))
        for peer in outbox.peers:
            if peer not in outbox.closed and peer != lost:
                outbox.drop_data(peer)
                outbox.control(peer, abort, body)
        for op in self._ops.live():
            self._ops.fail(op, error)
        self._floating.clear(error)
