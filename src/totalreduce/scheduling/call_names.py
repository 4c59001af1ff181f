"""Which call of which name an op is: every rank counts its calls of each name, and the
pair (hash of the name, call count) is the op's identity on the wire.

The table is bounded (``name_capacity`` names, least recently used forgotten); a name
forgotten here is forgotten by the engine too (``forget``), so its next call starts
afresh at 0.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable

from ..engine.payload import OpKey
from ..lru import LRU

# The name counted for calls made without one; the leading NUL keeps it apart from the
# names users give.
UNNAMED = "\x00unnamed"


def hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class CallNames:
    def __init__(self, capacity: int, forget: Callable[[int], None]) -> None:
        """``forget(name_hash)``: told of each name this table forgets."""
        self._forget_hash = forget
        self._lock = threading.Lock()
        # name (+ phase) -> [hash, calls so far, generation].
        self._names: LRU[str, list[int]] = LRU(capacity, self._forget)
        # How often each forgotten name was forgotten: its next use gets another hash, so
        # that a rank still holding the old use's calls as finished cannot take a faster
        # peer's call 0 of the new use for one of them and drop it.
        self._generations: LRU[str, int] = LRU(capacity)
        # The same entries by hash, and the next call count of names this rank has not
        # used yet but served while joined (join.py): a served call counts as made.
        self._by_hash: dict[int, list[int]] = {}
        self._served_next: LRU[int, int] = LRU(capacity)

    def __len__(self) -> int:
        return len(self._names)

    @property
    def evictions(self) -> int:
        return self._names.evictions

    def next_call(self, key: str) -> OpKey:
        """This rank's next call of ``key`` (any thread): (name hash, call count)."""
        names = self._names.entries
        with self._lock:
            entry = names.get(key)  # LRU.get, inline: every call of every op
            if entry is not None:
                names.move_to_end(key)
            else:
                generation = self._generations.pop(key) or 0
                h = hash64(f"{key}\x00{generation}" if generation else key)
                entry = [h, self._served_next.pop(h) or 0, generation]
                self._names.put(key, entry)
                self._by_hash[h] = entry
            h, seq = entry[0], entry[1]
            entry[1] = seq + 1
        return h, seq

    def count_served(self, name_key: int, seq: int) -> None:
        """A peer's call ``seq`` of name ``name_key`` ran here without a submit (join):
        this rank's next call of that name is ``seq + 1`` at least (any thread)."""
        with self._lock:
            entry = self._by_hash.get(name_key)
            if entry is not None:
                entry[1] = max(entry[1], seq + 1)
            else:
                self._served_next.put(name_key, max(seq + 1,
                                                    self._served_next.peek(name_key) or 0))

    def _forget(self, name: str, entry: list[int]) -> None:
        self._generations.put(name, entry[2] + 1)
        self._by_hash.pop(entry[0], None)
        self._forget_hash(entry[0])


class Ident:
    """A call's identity on the wire (``key``), its name and its label for messages."""

    __slots__ = ("key", "name", "label")

    def __init__(self, key: OpKey, name: str | None, label: str) -> None:
        self.key = key
        self.name = "" if name is None else name
        self.label = label
