"""Recursive halving and doubling: ``log2 n`` steps where the ring and the chain take
``n - 1``.  The allreduce (Rabenseifner's), and on their own the reduce-scatter, the
allgather and a broadcast as a scatter then an allgather; algorithms/select.py says
where each runs.

A reduce-scatter by recursive halving, then an allgather by recursive doubling.  At step
``k`` of the first half a rank sends its partner ``rank ^ p / 2^k`` the half of its
current range that the partner keeps and reduces the half it keeps, so after ``log2 p``
steps it holds one finished block; the allgather passes finished blocks back the other
way, doubling what each rank holds per step.  Every rank sends ``2 (p - 1) / p`` of the
buffer, as in the ring, in ``2 log2 p`` message latencies instead of the ring's
``2 (p - 1)``; recursive doubling takes ``log2 p`` latencies but sends and reduces the
whole buffer at every step.  So this fills the range between the two at more than two
ranks (at 2 ranks it is the ring).

Ranges halve by the high bits of a rank's (virtual) number first, so a rank's range is a
contiguous run of blocks at every step and each step's share goes out in few messages.
The buffer is cut into ``p`` blocks of ``m`` units each (``m`` a power of two, a unit at
most a segment), and messages are aligned runs of a power-of-two number of units, so each
message of a step lies inside one message of the step before: the receive of that one
unlocks it.  A reducing receive waits (``Recv.wait``) for the receive of the previous
step that covered its region, so what it unlocks carries every earlier contribution.  In
the allgather every block travels as its own messages, since a send there mixes blocks
finished at different steps.

With ``n`` not a power of two the allreduce's first ``2 * extra`` ranks fold in pairs, as
for recursive doubling (doubling.py); the other three need a power of two.  Every finished
block is reduced by one rank and copied everywhere else, so all ranks end bit-identical.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from functools import lru_cache

from ..schedule import COPY, REDUCE, Recv, Schedule, Send, even_bounds, piece_count, pieces
from .doubling import Fold

Key = tuple[int, int, int]  # a receive's (source, step, piece), or (peer, step, units)


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _units(blocks: list[int] | tuple[int, ...], seg_elems: int
           ) -> tuple[int, list[int], int]:
    """The cut of ``len(blocks) - 1`` blocks (bounds) into ``m`` units each (a power of
    two, a unit at most a segment): (m, unit bounds, units per message at most).  Unit
    ``u = b * m + q`` is piece ``q`` of block ``b``, elements ``ub[u]:ub[u + 1]``."""
    p = len(blocks) - 1
    m = _pow2_at_least(piece_count(max(blocks[b + 1] - blocks[b] for b in range(p)),
                                   seg_elems))
    ub = [blocks[0]]
    for b in range(p):
        ub.extend(hi for _lo, hi in pieces(blocks[b], blocks[b + 1], m))
    unit = max(1, max(ub[u + 1] - ub[u] for u in range(p * m)))
    # A power of two, so that messages nest across steps.
    group = 1 << max(0, (max(1, seg_elems // unit)).bit_length() - 1)
    return m, ub, group


def chunks(u0: int, u1: int, g: int) -> list[tuple[int, int]]:
    """Unit runs of ``g`` (the last one shorter) covering ``u0:u1``."""
    return [(u, min(u1, u + g)) for u in range(u0, u1, g)]


def _owner(key_step: tuple[int, int, int], u0: int) -> tuple[int, int, int]:
    """The receive of a step, given as (peer, step, units per message), whose message
    holds the unit run at ``u0``."""
    peer, step, g = key_step
    return (peer, step, (u0 // g) * g)


@lru_cache(maxsize=256)
def halving_allreduce(rank: int, size: int, count: int, seg_elems: int) -> Schedule:
    if size == 1:
        return Schedule((), {}, ((0, count),))
    fold = Fold.of(size)
    p, rounds, real = fold.p, fold.rounds, fold.real
    last = 2 * rounds + 1  # the step that returns results to the folded ranks
    m, ub, group = _units(even_bounds(count, p), seg_elems)
    per_block = min(group, m)  # units per allgather message (never spans blocks)

    if fold.folds_away(rank):
        first = tuple(Send(rank - 1, 0, u0, ub[u0], ub[u1])
                      for u0, u1 in chunks(0, p * m, group))
        back = {(rank - 1, last, u0): Recv(ub[u0], ub[u1], COPY, False, ())
                for u0, u1 in chunks(0, p * m, per_block)}
        return Schedule(first, back, ())

    v = fold.virtual(rank)
    folded = fold.absorbs(rank)  # rank + 1's buffer first, the result back to it last

    # The sends each receive unlocks, by the receive's key.
    unlocks: defaultdict[tuple[int, int, int], list[Send]] = defaultdict(list)
    opening: list[Send] = []
    folding = (rank + 1, 0, group) if folded else None
    halving, prev = _halve(v, p, m, group, ub, real, folding, unlocks, opening)

    def available(u0: int) -> tuple[int, int, int]:
        """The receive after which the allgather unit run at ``u0`` is here and final."""
        b = u0 // m
        if b == v:
            return _owner(prev, u0)
        t = (b ^ v).bit_length()  # the allgather step that brings block b
        return (real(v ^ (1 << (t - 1))), rounds + t, u0)

    for t in range(1, rounds + 1):
        h = 1 << (t - 1)
        mine = (v // h) * h
        peer = real(v ^ h)
        for u0, u1 in chunks(mine * m, (mine + h) * m, per_block):
            unlocks[available(u0)].append(Send(peer, rounds + t, u0, ub[u0], ub[u1]))
    if folded:
        for u0, u1 in chunks(0, p * m, per_block):
            unlocks[available(u0)].append(Send(rank + 1, last, u0, ub[u0], ub[u1]))

    # The receives, now that every one's unlocked sends are known.
    recvs: dict[tuple[int, int, int], Recv] = {}
    if folded:
        for u0, u1 in chunks(0, p * m, group):
            key = (rank + 1, 0, u0)
            recvs[key] = Recv(ub[u0], ub[u1], REDUCE, False, tuple(unlocks[key]))
    for key, u0, u1, wait in halving:
        recvs[key] = Recv(ub[u0], ub[u1], REDUCE, key[1] == rounds, tuple(unlocks[key]),
                          wait=wait)
    for t in range(1, rounds + 1):
        h = 1 << (t - 1)
        theirs = ((v // h) * h) ^ h
        peer = real(v ^ h)
        for u0, u1 in chunks(theirs * m, (theirs + h) * m, per_block):
            key = (peer, rounds + t, u0)
            recvs[key] = Recv(ub[u0], ub[u1], COPY, False, tuple(unlocks[key]))
    return Schedule(tuple(opening), recvs, ())


def _halving_steps(v: int, p: int, m: int, k: int
                   ) -> tuple[int, tuple[int, int], tuple[int, int]]:
    """Reduce-scatter step ``k`` of virtual rank ``v`` of ``p``: the partner's virtual rank
    and the unit ranges kept and given."""
    h = p >> k
    base = (v // (2 * h)) * 2 * h
    lower = (base * m, (base + h) * m)
    upper = ((base + h) * m, (base + 2 * h) * m)
    keep, give = (upper, lower) if v & h else (lower, upper)
    return v ^ h, keep, give


def _halve(v: int, p: int, m: int, group: int, ub: list[int], real: Callable[[int], int],
           before: Key | None, unlocks: dict[Key, list[Send]], opening: list[Send]
           ) -> tuple[list[tuple[Key, int, int, tuple[Key, ...]]], Key]:
    """Recursive halving (steps ``1 .. log2 p``) for virtual rank ``v``: its sends, into
    ``opening`` or the ``unlocks`` of the receive whose message holds their units; its
    reducing receives, as (key, first unit, end unit, what it waits for), for the caller
    to build once all they unlock is known; and the last step's receives, as (peer, step,
    units per message).  ``before``: the receives that come before the first step, in
    that form (a folded pair's), or None."""
    halving: list[tuple[Key, int, int, tuple[Key, ...]]] = []
    prev = before
    for k in range(1, p.bit_length()):
        partner, keep, give = _halving_steps(v, p, m, k)
        peer, g = real(partner), min(group, (p >> k) * m)
        for u0, u1 in chunks(*give, g):
            send = Send(peer, k, u0, ub[u0], ub[u1])
            if prev is None:
                opening.append(send)
            else:
                unlocks[_owner(prev, u0)].append(send)
        for u0, u1 in chunks(*keep, g):
            halving.append(((peer, k, u0), u0, u1,
                            (_owner(prev, u0),) if prev is not None else ()))
        prev = (peer, k, g)
    assert prev is not None
    return halving, prev


@lru_cache(maxsize=256)
def halving_reducescatter(rank: int, size: int, bounds: tuple[int, ...],
                          seg_elems: int) -> Schedule:
    """Recursive halving alone, ``size`` a power of two: leaves the reduced block ``rank``
    (``bounds[rank]:bounds[rank + 1]``) on each rank in ``log2 size`` steps."""
    if size & (size - 1):
        raise ValueError(f"recursive halving needs a power-of-two world, not {size}")
    if size == 1:
        return Schedule((), {}, ((bounds[0], bounds[1]),))
    rounds = size.bit_length() - 1
    m, ub, group = _units(bounds, seg_elems)
    unlocks: defaultdict[tuple[int, int, int], list[Send]] = defaultdict(list)
    opening: list[Send] = []
    halving, _last = _halve(rank, size, m, group, ub, lambda w: w, None, unlocks, opening)
    recvs = {key: Recv(ub[u0], ub[u1], REDUCE, key[1] == rounds, tuple(unlocks[key]),
                       wait=wait) for key, u0, u1, wait in halving}
    return Schedule(tuple(opening), recvs, ())


@lru_cache(maxsize=256)
def doubling_allgatherv(rank: int, size: int, bounds: tuple[int, ...],
                        seg_elems: int) -> Schedule:
    """Recursive doubling alone, ``size`` a power of two: every rank's block
    (``bounds[r]:bounds[r + 1]``, its own already in place) everywhere in ``log2 size``
    steps.  Each block travels as its own messages, so a rank forwards a block as soon as
    it has it."""
    if size & (size - 1):
        raise ValueError(f"recursive doubling needs a power-of-two world, not {size}")
    if size == 1:
        return Schedule((), {}, ())
    rounds = size.bit_length() - 1
    m, ub, group = _units(bounds, seg_elems)
    per_block = min(group, m)

    def piece(u0: int, sender: int) -> int:
        """A message's number: a rank gets block ``b`` after the blocks ``c`` with a
        smaller ``c ^ rank`` and forwards blocks in that order, so numbering them so makes
        each step's messages come in the order the express lane waits for them."""
        b = u0 // m
        return (b ^ sender) * m + u0 - b * m

    def sends_after(u0: int, u1: int, t: int) -> tuple[Send, ...]:
        """The unit run ``u0:u1``, here once step ``t`` is over, to the later partners."""
        return tuple(Send(rank ^ (1 << (s - 1)), s - 1, piece(u0, rank), ub[u0], ub[u1])
                     for s in range(t + 1, rounds + 1))

    opening = tuple(send for u0, u1 in chunks(rank * m, (rank + 1) * m, per_block)
                    for send in sends_after(u0, u1, 0))
    recvs: dict[tuple[int, int, int], Recv] = {}
    for t in range(1, rounds + 1):
        h = 1 << (t - 1)
        theirs = ((rank // h) * h) ^ h
        peer = rank ^ h
        for u0, u1 in chunks(theirs * m, (theirs + h) * m, per_block):
            recvs[(peer, t - 1, piece(u0, peer))] = Recv(ub[u0], ub[u1], COPY, False,
                                                         sends_after(u0, u1, t))
    return Schedule(opening, recvs, ())


@lru_cache(maxsize=256)
def scatter_allgather_broadcast(rank: int, size: int, root: int, count: int,
                                seg_elems: int) -> Schedule:
    """Broadcast as a scatter by recursive halving then an allgather by recursive doubling,
    ``size`` a power of two: ``2 log2 size`` steps, and every rank receives the buffer
    once where the chain forwards it ``size - 1`` hops.

    Ranks count from the root (``v = rank - root``); block ``b`` of ``size`` ends up with
    ``v = b`` after the scatter, where rank ``v`` also holds the blocks up to
    ``v + lowbit(v)`` that it passed on.  In the allgather a message for a block its
    receiver holds already carries nothing (the root holds them all), but it still goes:
    a rank finishes only after hearing from every other, through some chain of messages,
    so a rank that disagrees about the op fails it everywhere (so too the root forwards
    a block only once the message for it came, though it holds them all).
    """
    if size & (size - 1):
        raise ValueError(f"scatter-allgather needs a power-of-two world, not {size}")
    if size == 1:
        return Schedule((), {}, ())
    p = size
    rounds = p.bit_length() - 1
    v = (rank - root) % p
    m, ub, group = _units(even_bounds(count, p), seg_elems)
    per_block = min(group, m)

    def real(w: int) -> int:
        return (w + root) % p

    def held(w: int) -> tuple[int, int]:
        """The blocks virtual rank ``w`` holds once its scatter step is over."""
        return (w, w + (w & -w)) if w else (0, p)

    def piece(u0: int, sender: int) -> int:
        """As in doubling_allgatherv, the order the sender forwards blocks in; within a
        block last to first, the order its scatter brought them."""
        b = u0 // m
        return (b ^ sender) * m + m - 1 - (u0 - b * m)

    def gather_sends(u0: int, u1: int, t: int) -> list[Send]:
        """Allgather sends of the unit run ``u0:u1`` (within one block) after allgather
        step ``t`` (0: from the start of the allgather)."""
        out = []
        b = u0 // m
        for s in range(t + 1, rounds + 1):
            w = v ^ (1 << (s - 1))
            lo, hi = held(w)
            empty = lo <= b < hi
            out.append(Send(real(w), rounds + s - 1, piece(u0, v), ub[u0],
                            ub[u0] if empty else ub[u1]))
        return out

    unlocks: defaultdict[tuple[int, int, int], list[Send]] = defaultdict(list)
    opening: list[Send] = []
    scatter_step = 0 if v == 0 else rounds - (v & -v).bit_length() + 1  # 1-based; root: 0
    # The receive that brought a unit run here in the scatter, as (peer, step, units per
    # message); None at the root.
    came: tuple[int, int, int] | None = None
    if v:
        h = v & -v
        came = (real(v - h), scatter_step - 1, min(group, h * m))

    def scatter_key(u0: int) -> tuple[int, int, int]:
        """The scatter receive whose message holds the unit run at ``u0``."""
        assert came is not None
        peer, step, piece = _owner(came, u0)
        return (peer, step, p * m - piece)
    for k in range(scatter_step + 1, rounds + 1):
        h = p >> k
        g = min(group, h * m)
        # Last to first, so that a rank gets its own block last and forwards all it must
        # in the scatter before anything of the allgather (each pair's messages come in
        # order: the express lane waits for them by step).
        for u0, u1 in reversed(chunks((v + h) * m, (v + 2 * h) * m, g)):
            send = Send(real(v + h), k - 1, p * m - u0, ub[u0], ub[u1])
            if came is None:
                opening.append(send)
            else:
                unlocks[scatter_key(u0)].append(send)
    for u0, u1 in reversed(chunks(v * m, (v + 1) * m, per_block)):
        sends = gather_sends(u0, u1, 0)
        if came is None:
            opening.extend(sends)
        else:
            unlocks[scatter_key(u0)].extend(sends)
    recvs: dict[tuple[int, int, int], Recv] = {}
    if came is not None:
        peer, step, g = came
        for u0, u1 in chunks(v * m, held(v)[1] * m, g):
            key = (peer, step, p * m - u0)
            recvs[key] = Recv(ub[u0], ub[u1], COPY, False, tuple(unlocks[key]))
    mine = held(v)
    for t in range(1, rounds + 1):
        h = 1 << (t - 1)
        w = v ^ h
        theirs = ((v // h) * h) ^ h
        for u0, u1 in reversed(chunks(theirs * m, (theirs + h) * m, per_block)):
            empty = mine[0] <= u0 // m < mine[1]
            recvs[(real(w), rounds + t - 1, piece(u0, w))] = Recv(
                ub[u0], ub[u0] if empty else ub[u1], COPY, False,
                tuple(gather_sends(u0, u1, t)))
    return Schedule(tuple(opening), recvs, ())
