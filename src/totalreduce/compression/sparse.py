"""What every sparse allreduce here shares: per-name state with residuals (error
feedback), the (index, value) pair format, top-k thresholds, and measured volume.

Every algorithm keeps, per gradient name, a residual: what it has not sent yet.  A call
works on ``acc = grad + residual``; afterwards rank p's residual is ``acc`` with zeros
exactly where p's value reached the output, so for every call

    P * out + sum_p new_residual_p == sum_p (grad_p + old_residual_p)

and nothing a rank computed is ever lost, only delayed.  Published gTopk is the
exception, as published (baselines.GTopk says what it loses).

Pairs travel as one byte row each: the index (uint32 while the buffer has fewer than 2^32
elements, else int64: never packed into a float), then the value's bytes.  Volume is read
from the transport's counters (``tr.transport_stats()``) around the call, so it includes
message headers (64 bytes each) and whatever else the process sent meanwhile.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import totalreduce as tr

from ..lru import LRU

_NAMES = 1024  # gradient names whose state is kept; the least recently used go first


class State:
    """One gradient name's state between calls."""

    __slots__ = ("residual", "calls", "local_threshold", "global_threshold", "boundaries",
                 "last_local", "stats")

    def __init__(self, n: int, dtype: np.dtype) -> None:
        self.residual = np.zeros(n, dtype)
        self.calls = 0
        self.local_threshold = 0.0
        self.global_threshold = 0.0
        self.boundaries: np.ndarray | None = None
        self.last_local = 0
        self.stats: dict[str, int] = {}

    def as_dict(self) -> dict[str, Any]:
        return {"residual": self.residual, "calls": self.calls,
                "local_threshold": self.local_threshold,
                "global_threshold": self.global_threshold,
                "boundaries": self.boundaries, "last_local": self.last_local}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> State:
        residual = np.asarray(data["residual"])
        state = cls(residual.size, residual.dtype)
        state.residual[...] = residual
        state.calls = int(data["calls"])
        state.local_threshold = float(data["local_threshold"])
        state.global_threshold = float(data["global_threshold"])
        b = data.get("boundaries")
        state.boundaries = None if b is None else np.asarray(b, np.int64)
        state.last_local = int(data.get("last_local", 0))
        return state


def index_dtype(n: int) -> np.dtype:
    return np.dtype(np.uint32) if n < (1 << 32) else np.dtype(np.int64)


def pack(idx: np.ndarray, val: np.ndarray, n: int) -> np.ndarray:
    """(index, value) pairs as rows of bytes."""
    it = index_dtype(n)
    rec = np.dtype([("i", it), ("v", val.dtype)])
    out = np.empty(idx.size, rec)
    out["i"] = idx
    out["v"] = val
    return out.view(np.uint8).reshape(idx.size, rec.itemsize)


def unpack(rows: np.ndarray, n: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    rec = np.dtype([("i", index_dtype(n)), ("v", dtype)])
    flat = np.ascontiguousarray(rows).reshape(-1).view(rec)
    return flat["i"].astype(np.int64), flat["v"]


def kth_largest(mag: np.ndarray, k: int) -> float:
    """The k-th largest of ``mag`` (0.0 for an empty array)."""
    if mag.size == 0 or k <= 0:
        return 0.0
    k = min(k, mag.size)
    return float(np.partition(mag, mag.size - k)[mag.size - k])


# select() works through big arrays in blocks this long: each block's magnitudes and
# comparison stay in the cache, where a whole-array pass would stream every temporary
# through memory (5 ms instead of 7 for 4 M float32 here).
_BLOCK = 1 << 16
# Every _STRIDE-th magnitude estimates a threshold (a prime, so that the sample does not
# line up with a weight matrix's rows).
_STRIDE = 61


def select(acc: np.ndarray, threshold: float) -> np.ndarray:
    """Indices whose magnitude reaches ``threshold`` (never zeros: nothing to send)."""
    # flatnonzero() of a float array is 10x slower than of the comparison's booleans.
    nonzero = threshold <= 0  # NaN selects nothing, as a comparison with it does
    if acc.size <= _BLOCK:
        return np.flatnonzero(acc != 0 if nonzero else np.abs(acc) >= threshold)
    scratch = np.empty(_BLOCK, acc.dtype)
    parts = []
    for lo in range(0, acc.size, _BLOCK):
        block = acc[lo:lo + _BLOCK]
        if nonzero:
            hit = np.flatnonzero(block != 0)
        else:
            hit = np.flatnonzero(np.abs(block, out=scratch[:block.size]) >= threshold)
        if hit.size:
            parts.append(hit + lo)
    return np.concatenate(parts) if parts else np.empty(0, np.intp)


def narrow(acc: np.ndarray, sel: np.ndarray, k: int) -> tuple[float, np.ndarray]:
    """(the k-th largest magnitude, the indices reaching it), given ``sel``: indices that
    hold at least the top k.  Costs a partition of ``sel``, not of ``acc``."""
    mag = np.abs(acc[sel])
    threshold = kth_largest(mag, k)
    return threshold, sel[mag >= threshold] if sel.size > k else sel


def top_threshold(acc: np.ndarray, k: int) -> tuple[float, np.ndarray]:
    """(the exact k-th largest magnitude of ``acc``, ``select(acc, it)``).

    For a big array and a small k, a partition of the whole array (38 ms for 12.6 M
    float32 here) is most of a sparse allreduce's time.  Instead a strided sample's
    quantile gives a threshold just below the k-th largest; one select() at it keeps a
    little more than k indices, and the exact threshold is the k-th largest of those.  A
    sample that guessed too high (fewer than k selected) is retried lower; the answer is
    exact either way, only its cost depends on the guess.
    """
    n = acc.size
    if n <= 16 * _BLOCK or k * 32 > n:
        # Small, or k a large share: partition the nonzeros (few, when most are zero).
        nz = select(acc, 0.0)
        if nz.size <= k:
            return 0.0, nz
        return narrow(acc, nz, k)
    sample = np.abs(acc[::_STRIDE])
    want = int(1.25 * k * sample.size / n) + 16  # the sample's rank of a 25% margin
    guess = kth_largest(sample, want)
    for _ in range(4):
        sel = select(acc, guess)
        if sel.size > n // 4:
            break  # ties at the guess: narrowing would cost more than a partition
        if sel.size >= k or guess <= 0:
            return narrow(acc, sel, k) if sel.size >= k else (0.0, sel)
        want *= 4
        guess = kth_largest(sample, want)
    threshold = kth_largest(np.abs(acc), k)
    return threshold, select(acc, threshold)


def top_k(acc: np.ndarray, k: int) -> np.ndarray:
    """Exactly min(k, nonzeros) indices of the largest magnitudes, sorted; ties at the
    k-th magnitude are broken by position."""
    threshold, sel = top_threshold(acc, k)
    if sel.size <= k:
        return sel
    mag = np.abs(acc[sel])
    above = sel[mag > threshold]
    tied = sel[mag == threshold][: k - above.size]
    return np.sort(np.concatenate([above, tied]))


class SparseAllreduce:
    """Base of the algorithms: ``allreduce(grad, name)`` returns the average over ranks
    (the same array on every rank) and keeps the name's residual."""

    name = "base"

    def __init__(self, density: float) -> None:
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density!r}")
        self.density = density
        self._states: LRU[str, State] = LRU(_NAMES)

    def k(self, n: int) -> int:
        return max(1, int(n * self.density))

    def _state(self, name: str, grad: np.ndarray) -> State:
        state = self._states.get(name)
        if state is None or state.residual.size != grad.size \
                or state.residual.dtype != grad.dtype:
            state = State(grad.size, grad.dtype)
            self._states.put(name, state)
        return state

    def residual(self, name: str) -> np.ndarray:
        state = self._states.peek(name)
        if state is None:
            raise KeyError(f"no gradient named {name!r} has been reduced yet")
        return state.residual.copy()  # the live one is the next call's accumulator

    def stats(self, name: str) -> dict[str, int]:
        state = self._states.peek(name)
        return {} if state is None else dict(state.stats)

    def state_dict(self) -> dict[str, Any]:
        return {name: state.as_dict() for name, state in self._states.items()}

    def load_state_dict(self, data: dict[str, Any]) -> None:
        for name, item in data.items():
            self._states.put(name, State.from_dict(item))

    def allreduce(self, grad: Any, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """The average of ``grad`` over the ranks, the same array on every rank.

        ``out``: a C-contiguous array of ``grad``'s size and dtype to write it to (it may
        be ``grad`` itself: the algorithms read all of ``grad`` before they write).
        """
        arr = np.ascontiguousarray(grad).reshape(-1)
        if arr.dtype.kind != "f":
            raise TypeError(f"{self.name}: gradients must be floating point, got {arr.dtype}")
        if out is not None and (out.size != arr.size or out.dtype != arr.dtype
                                or not out.flags.c_contiguous):
            raise ValueError(f"{self.name}: out must be a C-contiguous {arr.dtype} array of "
                             f"{arr.size} elements, got {out.dtype} {out.shape}")
        if arr.size == 0:
            return np.array(grad, copy=True) if out is None else out
        state = self._state(name, arr)
        dest = np.empty_like(arr) if out is None else out.reshape(-1)
        before = tr.transport_stats()
        local, chosen = self._run(arr, name, state, dest)
        after = tr.transport_stats()
        state.calls += 1
        state.stats = {"bytes_sent": after["bytes_sent"] - before["bytes_sent"],
                       "bytes_received": after["bytes_received"] - before["bytes_received"],
                       "messages_sent": after["messages_sent"] - before["messages_sent"],
                       "messages_received": (after["messages_received"]
                                             - before["messages_received"]),
                       "local_selected": local, "global_selected": chosen,
                       "k": self.k(arr.size)}
        return dest.reshape(np.shape(grad)) if out is None else out

    def _run(self, grad: np.ndarray, name: str, state: State, out: np.ndarray
             ) -> tuple[int, int]:
        """Write the average to ``out`` (every element; it may be ``grad``, so read
        ``grad`` first) and update the residual; return (local selection size, global
        selection size)."""
        raise NotImplementedError
