"""A whole job in one process and one thread, for deterministic engine tests.

Every rank's engine runs unthreaded over the in-process transport, and a seeded random
generator decides, turn by turn, which rank acts next: submit its next op, or take one
turn of its loop (send what it can, read a random share of what arrived, on random
links).  The same seed replays the same interleaving exactly.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from totalreduce.config import Config
from totalreduce.engine.engine import Engine
from totalreduce.scheduling import SelfGuided
from totalreduce.scheduling.handle import Handle
from totalreduce.transport.inproc import InprocWorld

Plan = list[Callable[[SelfGuided], Handle]]


class Job:
    def __init__(self, n: int, seed: int, link_messages: int = 8, **config: Any) -> None:
        self.n = n
        self.rng = random.Random(seed)
        self.world = InprocWorld(n, seed=seed, link_messages=link_messages)
        self.config = Config(**config)
        self.engines = [Engine(t, self.config, threaded=False) for t in self.world.transports]
        self.ops = [SelfGuided(e, self.config) for e in self.engines]
        self.turns = 0

    def turn(self, rank: int) -> None:
        self.engines[rank].loop.step(0)
        self.turns += 1

    def run(self, plans: list[Plan], submit_chance: float | list[float] = 0.3,
            max_turns: int = 200_000, watch: Callable[[Job], None] | None = None
            ) -> list[list[Handle]]:
        """Submit every rank's plan in its order, at random moments (on a rank's turn, it
        submits with probability ``submit_chance``, one per rank if a list), and run every
        rank until all its handles are done; ``watch(job)`` is called after every turn."""
        chance = submit_chance if isinstance(submit_chance, list) else \
            [submit_chance] * self.n
        todo = [list(plan) for plan in plans]
        handles: list[list[Handle]] = [[] for _ in range(self.n)]
        while True:
            busy = [r for r in range(self.n)
                    if todo[r] or not all(h.done() for h in handles[r])]
            if not busy:
                return handles
            rank = self.rng.choice(busy)
            if todo[rank] and self.rng.random() < chance[rank]:
                handles[rank].append(todo[rank].pop(0)(self.ops[rank]))
            else:
                self.turn(rank)
            if watch is not None:
                watch(self)
            if self.turns > max_turns:
                raise AssertionError(f"not done after {max_turns} turns: "
                                     f"{[e.stats() for e in self.engines]}")

    def settle(self, until: Callable[[], bool], max_turns: int = 100_000) -> None:
        """Turn random ranks until ``until()`` holds."""
        for _ in range(max_turns):
            if until():
                return
            self.turn(self.rng.randrange(self.n))
        raise AssertionError("condition not reached")

    def close(self) -> None:
        for engine in self.engines:
            engine.transport.abort()
