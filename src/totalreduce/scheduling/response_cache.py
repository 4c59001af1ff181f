"""The response cache of negotiated mode: responses remembered by tensor name, each at a
bit position, identical on every rank.

Every rank makes the same changes in the same order (puts in the order of the
coordinator's response list, touches in bit order of the cycle's ready set, evictions in
bit order), so the same name sits at the same bit everywhere and one bitwise-AND
allreduce of "which cached tensors I have ready" tells every rank which are ready on all.
Full: the least recently used entry goes and its bit is reused (lowest free bit first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from .requests import Request, Response


class ResponseCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._by_name: OrderedDict[str, int] = OrderedDict()  # LRU order, oldest first
        self._by_bit: list[Response | None] = [None] * capacity
        self._free = list(range(capacity - 1, -1, -1))  # pop() gives the lowest
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
            if response is not None and response.params == request.params:
                hit_bits.append(bit)
                hits.append(request)
            else:
                invalid.append(bit)
        self.hits += len(hits)
        self.misses += len(misses)
        return hit_bits, hits, invalid, misses

    def at(self, bit: int) -> Response | None:
        return self._by_bit[bit] if 0 <= bit < self.capacity else None

    def ready(self, bits: list[int]) -> list[Response]:
        """The responses at ``bits`` (ready on every rank), each touched, in bit order."""
        out = []
        by_bit, by_name = self._by_bit, self._by_name
        for bit in bits:
            response = by_bit[bit]
            if response is not None:
                by_name.move_to_end(response.name)
                out.append(response)
        return out

    def put(self, response: Response) -> None:
        if not self.capacity:
            return
        old = self._by_name.get(response.name)
        if old is not None:
            self._by_bit[old] = response
            self._by_name.move_to_end(response.name)
            return
        if not self._free:
            oldest, bit = next(iter(self._by_name.items()))
            self.evict(bit)
        bit = self._free.pop()
        self._by_bit[bit] = response
        self._by_name[response.name] = bit

    def evict(self, bit: int) -> None:
        response = self._by_bit[bit]
        if response is None:
            return
        self.evictions += 1
        self._by_bit[bit] = None
        del self._by_name[response.name]
        self._free.append(bit)
        self._free.sort(reverse=True)
