"""What a failed :meth:`RayExecutor.run` raises, and which rank it blames."""

from __future__ import annotations

from typing import Any

from ..exceptions import PeerFailureError, TotalReduceError


class WorkerFailedError(TotalReduceError):
    """A rank's function raised, or its actor died.

    ``rank`` is the rank that failed first on its own (not because another rank did);
    ``errors`` maps every failed rank to its error (the exception the function raised,
    where Ray could bring it back), ``results`` every rank that finished to its result.
    """

    def __init__(self, rank: int, size: int, errors: dict[int, BaseException],
                 results: dict[int, Any], hosts: list[str]) -> None:
        lines = [f"rank {rank} of {size} failed on {hosts[rank]}: {_brief(errors[rank])}"]
        for r in sorted(errors):
            if r != rank:
                lines.append(f"  rank {r}: {_brief(errors[r])}")
        if results:
            lines.append(f"  finished: rank(s) {', '.join(map(str, sorted(results)))}")
        super().__init__("\n".join(lines))
        self.rank = rank
        self.size = size
        self.errors = errors
        self.results = results
        self.hosts = hosts

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.rank, self.size, self.errors, self.results, self.hosts),
                self.__dict__)


def _brief(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def followed(exc: BaseException) -> int | None:
    """The rank whose failure ``exc`` follows from, if it does: a PeerFailureError in its
    chain (applications often wrap it)."""
    seen: set[int] = set()
    chained: BaseException | None = exc
    while chained is not None and id(chained) not in seen:
        seen.add(id(chained))
        if isinstance(chained, PeerFailureError):
            return chained.rank
        chained = chained.__cause__ or chained.__context__
    return None


def root_cause(errors: dict[int, BaseException], killed: set[int]) -> int:
    """The rank to blame among ``errors`` (in the order they were seen): the first that
    failed on its own, else the first rank another names as lost.  Ranks the executor
    ``killed`` are victims, never the cause.  The order seen alone would not do: a
    survivor learns of a dead peer from its broken link sooner than Ray reports the
    death."""
    for rank, exc in errors.items():
        if rank not in killed and followed(exc) is None:
            return rank
    for exc in errors.values():
        lost = followed(exc)
        if lost is not None and lost in errors:
            return lost
    return next(iter(errors))
