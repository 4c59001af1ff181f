"""What one recovery round does, decided alike on every rank from what every rank said.

After a rank dies and its replacement has joined, every rank takes part in rounds until
all of them are back in step.  In a round each rank states its checkpoint version,
whether it needs the checkpoint (a replacement starting over), and the collectives it
waits for (``pending``: submitted, not yet resolved); then each says which of all those
collectives it holds a result of.  From these two exchanges every rank computes the same
:class:`Plan`:

1. the checkpoint goes from a rank with the newest version to the ranks that need it;
2. a pending collective that some rank holds a result of (it finished there before the
   failure, or was served to it earlier) is sent from the lowest such rank: nobody
   recomputes it;
3. a pending collective that every rank waits for and nobody holds is run anew, by all;
4. anything else waits for a later round (a replacement still replaying up to it).

The round is *final* when, after its plan, no rank waits for anything: every rank then
leaves recovery at the same point.  A plan that resolves nothing while ranks still wait
means the ranks' call sequences disagree (or a rank is still computing and will state
more next round); the caller bounds how long it goes on.
"""

from __future__ import annotations

import dataclasses

# (checkpoint version, op name, call number of that name within the version)
OpId = tuple[int, str, int]


@dataclasses.dataclass(frozen=True)
class Statement:
    version: int
    wants_checkpoint: bool
    pending: tuple[OpId, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    checkpoint_from: int | None   # the rank that sends its checkpoint, if any is needed
    serve: tuple[tuple[OpId, int], ...]  # (op, the rank whose result is sent), in order
    run: tuple[OpId, ...]         # ops every rank waits for and none holds: run by all
    final: bool                   # after this round, no rank waits for anything

    def progress(self) -> bool:
        return self.checkpoint_from is not None or bool(self.serve or self.run)


def wanted(statements: list[Statement]) -> list[OpId]:
    """Every op some rank waits for, in the order every rank uses (sorted)."""
    return sorted({op for s in statements for op in s.pending})


def decide(statements: list[Statement], holdings: list[set[OpId]]) -> Plan:
    """The round's plan: ``statements[r]`` and ``holdings[r]`` (which of
    :func:`wanted` rank ``r`` holds a result of) are what rank ``r`` said."""
    size = len(statements)
    needy = [r for r, s in enumerate(statements) if s.wants_checkpoint]
    checkpoint_from = None
    if needy:
        keepers = [r for r, s in enumerate(statements) if not s.wants_checkpoint]
        if keepers:
            newest = max(statements[r].version for r in keepers)
            if newest > 0:
                checkpoint_from = min(r for r in keepers if statements[r].version == newest)
    serve: list[tuple[OpId, int]] = []
    run: list[OpId] = []
    waiting = False
    for op in wanted(statements):
        holders = [r for r in range(size) if op in holdings[r]]
        if holders:
            serve.append((op, holders[0]))
        elif all(op in s.pending for s in statements):
            run.append(op)
        else:
            waiting = True
    return Plan(checkpoint_from, tuple(serve), tuple(run), final=not waiting)
