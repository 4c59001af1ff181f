"""Who holds what: the ranks' roles, and which server owns which elements of a key.

The last ``servers`` ranks are servers, so worker ranks run 0..W-1 and rank 0, which
prints and evaluates in most scripts, is a worker.  Every key (a named array) is cut into
one contiguous range of elements per server, in server order, balanced by bytes; a key
smaller than the server count lives on the first servers only.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Roles:
    size: int
    servers: int

    @property
    def workers(self) -> int:
        return self.size - self.servers

    def is_server(self, rank: int) -> bool:
        return rank >= self.workers

    def server_rank(self, index: int) -> int:
        return self.workers + index


def key_id(name: str) -> int:
    """A name's key: the same on every rank, and non-negative to fit an int64 field."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(),
                          "little") >> 1


def shares(size: int, servers: int) -> list[tuple[int, int, int]]:
    """(server index, lo, hi) of each non-empty share of a key of ``size`` elements."""
    out = []
    for s in range(servers):
        lo, hi = s * size // servers, (s + 1) * size // servers
        if hi > lo:
            out.append((s, lo, hi))
    return out


@dataclass
class Key:
    """A key as a worker knows it."""
    name: str
    id: int
    shape: tuple[int, ...]
    dtype: np.dtype
    size: int
    shares: list[tuple[int, int, int]]
    residual: np.ndarray | None = field(default=None, repr=False)  # top-k pushes

    def overlapping(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """The shares that hold some of [lo, hi), cut to it."""
        return [(s, max(lo, a), min(hi, b)) for s, a, b in self.shares
                if max(lo, a) < min(hi, b)]
