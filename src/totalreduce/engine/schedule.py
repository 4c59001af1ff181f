"""What an algorithm produces: a schedule of sends and receives for one rank.

A schedule is the "step machine" of the Total Reduce design made concrete.  Every message
of an op is named by ``(step, piece)``; the receiver looks up ``(source, step, piece)`` to
learn where the body goes and whether to copy or reduce it, and which sends that unlocks.
Pieces are the pipelining unit: step ``s + 1`` of piece ``j`` may travel while piece
``j + 1`` of step ``s`` is still on the wire.

All offsets are element offsets into the op's flat working buffer (sends marked
``from_source`` read the op's separate source buffer instead, as alltoall does).
"""

from __future__ import annotations

import dataclasses

COPY = 0
REDUCE = 1


@dataclasses.dataclass(frozen=True, slots=True)
class Send:
    peer: int
    step: int
    piece: int
    lo: int
    hi: int
    from_source: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Recv:
    lo: int
    hi: int
    mode: int
    final: bool
    then: tuple[Send, ...]
    # Sends, as (peer, step, piece), that must have left before this body is reduced in:
    # they read the region it writes.  A COPY receive naming any lands at once (where they
    # do not read), but what it unlocks goes only after them: a step's message that
    # carries what earlier steps brought (algorithms/doubling.py's allgather).
    after: tuple[tuple[int, int, int], ...] = ()
    # Receives, as (source, step, piece), that must have been applied before this body is
    # reduced in: what it unlocks must carry theirs too (a hierarchical allreduce's
    # cross-host stage waits for this host's own sum).  Only REDUCE receives may name any.
    wait: tuple[tuple[int, int, int], ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Schedule:
    first: tuple[Send, ...]
    recvs: dict[tuple[int, int, int], Recv]   # (source rank, step, piece) -> Recv
    local_final: tuple[tuple[int, int], ...]  # regions finished without any receive
    # Derived once here rather than per op: schedules are cached and reused by every call.
    n_sends: int = dataclasses.field(init=False, repr=False, compare=False)
    first_peers: frozenset[int] = dataclasses.field(init=False, repr=False, compare=False)
    sources: frozenset[int] = dataclasses.field(init=False, repr=False, compare=False)
    _expected: tuple[tuple[int, int], ...] = dataclasses.field(init=False, repr=False,
                                                               compare=False)
    _sends_to: dict[int, int] = dataclasses.field(init=False, repr=False, compare=False)
    waits: bool = dataclasses.field(init=False, repr=False, compare=False)  # any Recv.wait

    def __post_init__(self) -> None:
        object.__setattr__(self, "waits", any(r.wait for r in self.recvs.values()))
        counts: dict[int, int] = {}
        for src, _step, _piece in self.recvs:
            counts[src] = counts.get(src, 0) + 1
        object.__setattr__(self, "_expected", tuple(counts.items()))
        object.__setattr__(self, "sources", frozenset(counts))
        object.__setattr__(self, "n_sends", len(self.first) + sum(
            len(r.then) for r in self.recvs.values()))
        object.__setattr__(self, "first_peers", frozenset(s.peer for s in self.first))
        sends_to: dict[int, int] = {}
        for send in (*self.first, *(s for r in self.recvs.values() for s in r.then)):
            sends_to[send.peer] = sends_to.get(send.peer, 0) + 1
        object.__setattr__(self, "_sends_to", sends_to)

    def sends_to(self, peer: int) -> int:
        """How many messages this rank sends ``peer`` in the whole op."""
        return self._sends_to.get(peer, 0)

    def expected_from(self) -> dict[int, int]:
        """How many receives come from each source (a fresh dict: the caller counts down)."""
        return dict(self._expected)


def even_bounds(total: int, parts: int) -> list[int]:
    """Boundaries that split ``total`` into ``parts`` ranges, the first ones one longer."""
    base, extra = divmod(total, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def pieces(lo: int, hi: int, count: int) -> list[tuple[int, int]]:
    """Split ``[lo, hi)`` into ``count`` contiguous pieces (some may be empty)."""
    b = even_bounds(hi - lo, count)
    return [(lo + b[i], lo + b[i + 1]) for i in range(count)]


def piece_count(longest: int, seg_elems: int) -> int:
    return max(1, -(-longest // max(1, seg_elems)))


def remap(schedule: Schedule, members: tuple[int, ...]) -> Schedule:
    """``schedule``, built for ranks ``0..len(members) - 1`` of a subset of the job, with
    each of those ranks replaced by its rank in the job, ``members[i]``."""
    def send(s: Send) -> Send:
        return dataclasses.replace(s, peer=members[s.peer])

    def keys(ks: tuple[tuple[int, int, int], ...]) -> tuple[tuple[int, int, int], ...]:
        return tuple((members[p], step, piece) for p, step, piece in ks)

    recvs = {(members[src], step, piece): dataclasses.replace(
        r, then=tuple(send(t) for t in r.then), after=keys(r.after), wait=keys(r.wait))
        for (src, step, piece), r in schedule.recvs.items()}
    return Schedule(tuple(send(s) for s in schedule.first), recvs, schedule.local_final)
