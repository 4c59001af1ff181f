"""The error taxonomy.

Everything the library raises on purpose derives from :class:`TotalReduceError`, split by
cause (as anyio splits its stream errors): a broken link or dead peer, ranks that disagree
about an op, an op that waited too long, or use after shutdown.  Plain ``ValueError`` and
``TypeError`` are kept for local misuse that no other rank is involved in.

``recoverable`` marks the errors an elastic/fault-tolerant wrapper may catch and recover
from (a peer died); the others mean the program itself is wrong.
"""

from __future__ import annotations


class TotalReduceError(RuntimeError):
    """Base class of every error raised by totalreduce on purpose."""

    recoverable = False


class TransportClosedError(TotalReduceError):
    """The local side closed the transport (shutdown) while an op still needed it."""


class ShutdownError(TotalReduceError):
    """An op was submitted after ``shutdown()`` or before ``init()``."""


class HorovodInternalError(RuntimeError):
    """Horovod's name for a collective that failed because the job lost a rank: what
    elastic Horovod scripts catch to restore their state and go on.  Every
    :class:`PeerFailureError` is one; the errors that mean the program itself is wrong
    (a mismatch, a timeout, use after shutdown) are not, so such a handler never retries
    them."""


class PeerFailureError(TotalReduceError, HorovodInternalError):
    """A peer died or its link broke.  ``rank`` names the rank that was lost;
    ``orderly`` says it left by shutting down (while this rank still needed it)."""

    recoverable = True

    def __init__(self, rank: int, message: str, orderly: bool = False) -> None:
        super().__init__(message)
        self.rank = rank
        self.orderly = orderly

    def __reduce__(self) -> tuple[object, ...]:
        # Pickled with the constructor's arguments, not ``args`` (the message alone), so
        # that the error survives a trip between processes (a Ray task's error does).
        return type(self), (self.rank, str(self), self.orderly), self.__dict__


class MismatchError(TotalReduceError):
    """Ranks submitted the same op (by name and call count) with different arguments."""

    def __init__(self, op_name: str, message: str) -> None:
        super().__init__(message)
        self.op_name = op_name

    def __reduce__(self) -> tuple[object, ...]:
        return type(self), (self.op_name, str(self)), self.__dict__


class OpTimeoutError(TotalReduceError):
    """An op waited longer than ``TOTALREDUCE_OP_TIMEOUT`` seconds."""

    def __init__(self, op_name: str, message: str) -> None:
        super().__init__(message)
        self.op_name = op_name

    def __reduce__(self) -> tuple[object, ...]:
        return type(self), (self.op_name, str(self)), self.__dict__


class AuthenticationError(TotalReduceError):
    """A connection failed the job-secret handshake."""
