"""Process sets, as in Horovod: subsets of the job's ranks that run collectives of their
own, concurrently with other sets' and the whole job's.

Every rank registers the same sets in the same order (``add_process_set`` is a collective
of the whole job, which checks that the ranks agree).  A set's ops are a self-guided
scheduler of their own over the job's engine: ranks, sizes and schedules count within the
set, and op identities carry the set's id, so its ops never match another set's.  Ranks
are always the job's ranks (``root_rank`` of a broadcast included), as in Horovod.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np


class ProcessSet:
    """A set of the job's ranks.  ``global_process_set`` is every rank; others come from
    :func:`totalreduce.add_process_set`, which gives them ``process_set_id``."""

    def __init__(self, ranks: Iterable[int] | None = None) -> None:
        self.ranks: list[int] | None = None if ranks is None else _ranks(ranks)
        self.process_set_id: int | None = 0 if ranks is None else None
        self._registry: ProcessSets | None = None

    def _live(self) -> ProcessSets:
        if self.process_set_id == 0:
            from .. import runtime

            return runtime.current().process_sets
        if self._registry is None or self._registry.closed:
            raise ValueError(f"{self!r} is not registered in this job: pass it to "
                             "add_process_set() after init(), on every rank")
        return self._registry

    def size(self) -> int:
        """How many ranks the set has."""
        return self._live().size if self.ranks is None else len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set, or None where it is not in it."""
        me = self._live().rank
        if self.ranks is None:
            return me
        return self.ranks.index(me) if me in self.ranks else None

    def included(self) -> bool:
        """Whether this process is in the set."""
        return self.rank() is not None

    def __repr__(self) -> str:
        if self.process_set_id == 0:
            return "global_process_set"
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet()


def _ranks(ranks: Iterable[int]) -> list[int]:
    out = []
    for r in ranks:
        if not isinstance(r, int | np.integer) or isinstance(r, bool):
            raise TypeError(f"process set ranks must be ints, got {r!r}")
        out.append(int(r))
    if not out:
        raise ValueError("a process set needs at least one rank")
    if len(set(out)) != len(out):
        raise ValueError(f"process set ranks {out} repeat a rank")
    return sorted(out)


class ProcessSets:
    """The sets registered in one job (one ``init()``), and their schedulers.

    ``agree(kind, values)`` is an allgather of one int64 vector per rank over the whole
    job (every rank passes one as long); ``make(members, id)`` builds a set's scheduler,
    or raises where this coordination mode has none.
    """

    def __init__(self, rank: int, size: int, everyone: Any,
                 agree: Callable[[str, np.ndarray], np.ndarray],
                 make: Callable[[tuple[int, ...], int], Any]) -> None:
        self.rank = rank
        self.size = size
        self.closed = False
        self._everyone = everyone
        self._agree = agree
        self._make = make
        self._sets: dict[int, tuple[ProcessSet, Any]] = {}
        self._next_id = 1

    def add(self, process_set: ProcessSet | Iterable[int]) -> ProcessSet:
        ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
        if ps.process_set_id is not None:
            raise ValueError(f"add_process_set: {ps!r} is registered already")
        assert ps.ranks is not None
        outside = [r for r in ps.ranks if not 0 <= r < self.size]
        if outside:
            raise ValueError(f"rank {self.rank}: add_process_set: ranks {outside} are not "
                             f"ranks of this job (0..{self.size - 1})")
        mine = np.full(self.size + 1, -1, np.int64)
        mine[0] = len(ps.ranks)
        mine[1:1 + len(ps.ranks)] = ps.ranks
        views = self._agree("add_process_set", mine).reshape(self.size, self.size + 1)
        asked = [[int(v) for v in row[1:1 + int(row[0])]] for row in views]
        if any(a != asked[0] for a in asked):
            lines = "; ".join(f"rank {r}: {a}" for r, a in enumerate(asked))
            raise ValueError(f"rank {self.rank}: add_process_set: the ranks asked for "
                             f"different sets ({lines}); every rank must add the same "
                             "sets in the same order")
        for other, _ in self._sets.values():
            if other.ranks == ps.ranks:
                raise ValueError(f"add_process_set: {other!r} has the same ranks")
        set_id = self._next_id
        members = tuple(ps.ranks)
        scheduler = self._make(members, set_id) if self.rank in members else None
        self._next_id += 1
        ps.process_set_id = set_id
        ps._registry = self
        self._sets[set_id] = (ps, scheduler)
        return ps

    def remove(self, process_set: ProcessSet) -> bool:
        """Forget a set on every rank; False where it was not registered here."""
        mine = np.array([-1 if process_set.process_set_id is None
                         else process_set.process_set_id], np.int64)
        ids = self._agree("remove_process_set", mine).tolist()
        if any(i != ids[0] for i in ids):
            raise ValueError(f"rank {self.rank}: remove_process_set: the ranks removed "
                             f"different sets (ids by rank: {ids})")
        if process_set.process_set_id == 0:
            raise ValueError("remove_process_set: global_process_set cannot be removed")
        entry = self._sets.pop(ids[0], None)
        if entry is None or entry[0] is not process_set:
            return False
        process_set.process_set_id = None
        process_set._registry = None
        return True

    def scheduler(self, process_set: ProcessSet | None, what: str) -> Any:
        """What runs ``what`` (an op, named) on ``process_set``."""
        if process_set is None or process_set.process_set_id == 0:
            return self._everyone
        if not isinstance(process_set, ProcessSet):
            raise TypeError(f"{what}: process_set must be a ProcessSet, got "
                            f"{type(process_set).__name__}")
        entry = self._sets.get(process_set.process_set_id or -1)
        if entry is None or entry[0] is not process_set:
            raise ValueError(f"rank {self.rank}: {what}: {process_set!r} is not registered "
                             "in this job (add_process_set() it after init(), on every rank)")
        if entry[1] is None:
            raise ValueError(f"rank {self.rank}: {what}: this rank is not in process set "
                             f"{process_set.process_set_id} (ranks {process_set.ranks})")
        return entry[1]

    def close(self) -> None:
        self.closed = True
        for ps, _ in self._sets.values():
            ps.process_set_id = None
            ps._registry = None
        self._sets.clear()
