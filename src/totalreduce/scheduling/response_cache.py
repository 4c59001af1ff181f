"""The response cache of negotiated mode: responses remembered by tensor name, each at a
bit position, identical on every rank.

Every rank makes the same changes in the same order (puts in the order of the
coordinator's response list, touches in bit order of the cycle's ready set, evictions in
bit order), so the same name sits at the same bit everywhere and one bitwise-AND
allreduce of "which cached tensors I have ready" tells every rank which are ready on all.
Full: the least recently used entry goes and its bit is reused (lowest free bit first).
Recency is a stamp per bit, so that touching a cycle's thousands of tiny tensors is one
numpy assignment, not a dictionary move each.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .requests import Request, Response

# Ready sets whose response lists are kept (see ResponseCache.ready): a training step's
# few (its tensors, a barrier, a loss) recur every step.
_READY_SETS = 8


class ResponseCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._by_name: dict[str, int] = {}
        self._by_bit: list[Response | None] = [None] * capacity
        self._free = list(range(capacity - 1, -1, -1))  # pop() gives the lowest
        # When each bit's entry was last put or touched: the oldest goes when full.
        self._stamp = np.zeros(capacity, np.int64)
        self._clock = 0
        # The response lists of recent ready sets, by their bits, while nothing is put or
        # evicted: the same set gives the same list (the controller knows a repeated
        # cycle by it).
        self._ready_sets: dict[bytes, list[Response]] = {}
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._by_name)

    def classify(self, requests: Iterable[Request]
                 ) -> tuple[list[int], list[Request], list[int], list[Request]]:
        """Each request is a HIT (a response of that name and the same params is cached),
        INVALID (one with other params is) or a MISS; returns the hits' bits and the hits,
        the invalid requests' bits, and the misses.  One call for the whole cycle: it
        may hold thousands of tiny tensors."""
        by_name, by_bit = self._by_name, self._by_bit
        hit_bits: list[int] = []
        hits: list[Request] = []
        invalid: list[int] = []
        misses: list[Request] = []
        for request in requests:
            bit = by_name.get(request.name)
            if bit is None:
                misses.append(request)
                continue
            response = by_bit[bit]
            if response is None:
                invalid.append(bit)
                continue
            params = request.params
            if response.params is params:  # as it was last time (see below)
                hit_bits.append(bit)
                hits.append(request)
            elif response.params == params:
                # Requests of one (dtype, op, shape) share a params tuple (ParamsTable):
                # holding that very tuple, the response is known equal at once next time.
                response.params = params
                hit_bits.append(bit)
                hits.append(request)
            else:
                invalid.append(bit)
        self.hits += len(hits)
        self.misses += len(misses)
        return hit_bits, hits, invalid, misses

    def at(self, bit: int) -> Response | None:
        return self._by_bit[bit] if 0 <= bit < self.capacity else None

    def ready(self, bits: np.ndarray) -> list[Response]:
        """The responses at ``bits`` (int64, ready on every rank, ascending), each
        touched, in bit order.  The list is the caller's to read, not to change: the same
        bits, with nothing put or evicted since, give the same list again."""
        if not bits.size:
            return []
        clock = self._clock
        self._stamp[bits] = np.arange(clock, clock + bits.size)
        self._clock = clock + bits.size
        key = bits.tobytes()
        out = self._ready_sets.get(key)
        if out is None:
            by_bit = self._by_bit
            out = [r for r in map(by_bit.__getitem__, bits.tolist()) if r is not None]
            if len(self._ready_sets) >= _READY_SETS:
                del self._ready_sets[next(iter(self._ready_sets))]
            self._ready_sets[key] = out
        return out

    def _touch(self, bit: int) -> None:
        self._stamp[bit] = self._clock
        self._clock += 1

    def put(self, response: Response) -> None:
        if not self.capacity:
            return
        self._ready_sets.clear()
        old = self._by_name.get(response.name)
        if old is not None:
            self._by_bit[old] = response
            self._touch(old)
            return
        if not self._free:  # every bit holds an entry: the least recently used goes
            self.evict(int(np.argmin(self._stamp)))
        bit = self._free.pop()
        self._by_bit[bit] = response
        self._by_name[response.name] = bit
        self._touch(bit)

    def evict(self, bit: int) -> None:
        response = self._by_bit[bit]
        if response is None:
            return
        self.evictions += 1
        self._ready_sets.clear()
        self._by_bit[bit] = None
        del self._by_name[response.name]
        self._free.append(bit)
        self._free.sort(reverse=True)
