"""A dict with a size limit that forgets its least recently used entries.

Every table the library keeps per name, shape or size goes through this (or through a
byte-bounded pool built the same way), because a training job runs for days with shapes
and names that may change every step: memory must stay flat whatever arrives.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LRU(Generic[K, V]):
    """At most ``capacity`` entries; a lookup refreshes an entry, an insert past the limit
    evicts the stalest one (``on_evict(key, value)`` is told).  ``capacity`` 0 keeps
    nothing.  Not thread-safe: each owner guards it as it guards its other state."""

    __slots__ = ("entries", "capacity", "_on_evict", "evictions")

    def __init__(self, capacity: int,
                 on_evict: Callable[[K, V], None] | None = None) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        # The entries themselves: a hot path may test them (``key in lru.entries``, ``if
        # lru.entries``) without this class's Python-level __contains__ and __len__, a
        # share of a small op's cost; only the methods change them.
        self.entries: OrderedDict[K, V] = OrderedDict()
        self.capacity = capacity
        self._on_evict = on_evict
        self.evictions = 0

    def get(self, key: K) -> V | None:
        value = self.entries.get(key)
        if value is not None:
            self.entries.move_to_end(key)
        return value

    def peek(self, key: K) -> V | None:
        """The value without refreshing it."""
        return self.entries.get(key)

    def put(self, key: K, value: V) -> None:
        data = self.entries
        data[key] = value
        data.move_to_end(key)
        while len(data) > self.capacity:
            old_key, old_value = data.popitem(last=False)
            self.evictions += 1
            if self._on_evict is not None:
                self._on_evict(old_key, old_value)

    def pop(self, key: K) -> V | None:
        return self.entries.pop(key, None)

    def oldest(self) -> K | None:
        return next(iter(self.entries), None)

    def items(self) -> list[tuple[K, V]]:
        """A snapshot, stalest first (the caller may change the LRU while using it)."""
        return list(self.entries.items())

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def clear(self) -> None:
        self.entries.clear()
