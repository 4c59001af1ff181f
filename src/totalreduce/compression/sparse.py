"""What every sparse allreduce here shares: per-name state with residuals (error
feedback), the (index, value) pair format, top-k thresholds, measured volume, and the
options the sparse designs use to train as well as dense (warm-up, DGC's momentum
correction, momentum factor masking and local clipping).

Every algorithm keeps, per gradient name, a residual: what it has not sent yet.  A call
works on ``acc = input + residual``, where the input is the gradient (clipped to
``clip_norm / sqrt(P)`` when that is set) or, with momentum correction, the velocity
``u = momentum * u + gradient``; afterwards rank p's residual is ``acc`` with zeros
exactly where p's value reached the output, so for every call

    P * out + sum_p new_residual_p == sum_p (input_p + old_residual_p)

and nothing a rank put in is ever lost, only delayed (published gTopk is the exception,
as published: baselines.GTopk says what it loses).  With momentum correction the
residual is DGC's accumulated velocity ``v``: held-back values come out with the momentum
they would have had under momentum SGD, and the optimizer must run without its own.
Momentum factor masking zeroes ``u`` where the value was sent (never during dense warm-up,
which is thereby exactly momentum SGD), and the identity above holds as it stands because
``u`` is updated before the call and masked after it.

Which of these to use was measured on the digits example (4 ranks, density 1%, seeds
0-4, docs/DESIGN-NOTES.md): Ok-Topk's 10 dense steps (one epoch there), then plain SGD at
5x dense's rate with the residual standing in for momentum, reached 96.9% after 20
epochs against dense momentum SGD's 97.7% (TopkA and gTopk, without warm-up: 97.3% and
97.1%).  Momentum correction (with and without masking, after 0, 1 or 3 dense warm-up
epochs or an exponential one, at dense's rate or half of it, with local clipping)
trained less steadily there and did no better on seeds 0-2, so every option is off by
default and the example leaves momentum correction off.

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

    __slots__ = ("residual", "velocity", "calls", "local_threshold", "global_threshold",
                 "boundaries", "last_local", "stats", "preselected")

    def __init__(self, n: int, dtype: np.dtype) -> None:
        self.residual = np.zeros(n, dtype)
        self.velocity: np.ndarray | None = None  # kept only with momentum correction
        self.calls = 0
        self.local_threshold = 0.0
        self.global_threshold = 0.0
        self.boundaries: np.ndarray | None = None
        self.last_local = 0
        self.stats: dict[str, int] = {}
        # This call only: (threshold, indices reaching it) found while the input was
        # added, the output already zeroed (SparseAllreduce._accumulate).
        self.preselected: tuple[float, np.ndarray] | None = None

    def as_dict(self) -> dict[str, Any]:
        # A copy: the residual is the next call's accumulator, updated in place.
        return {"residual": self.residual.copy(), "velocity": self.velocity,
                "calls": self.calls,
                "local_threshold": self.local_threshold,
                "global_threshold": self.global_threshold,
                "boundaries": self.boundaries, "last_local": self.last_local,
                "stats": dict(self.stats)}  # Ok-Topk's threshold feedback reads them

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> State:
        residual = np.asarray(data["residual"])
        state = cls(residual.size, residual.dtype)
        state.residual[...] = residual
        v = data.get("velocity")  # absent from checkpoints older than momentum correction
        state.velocity = None if v is None else np.array(v, residual.dtype)
        state.calls = int(data["calls"])
        state.local_threshold = float(data["local_threshold"])
        state.global_threshold = float(data["global_threshold"])
        b = data.get("boundaries")
        state.boundaries = None if b is None else np.asarray(b, np.int64)
        state.last_local = int(data.get("last_local", 0))
        state.stats = {k: int(v) for k, v in data.get("stats", {}).items()}
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


def sum_pairs(idxs: list[np.ndarray], vals: list[np.ndarray], dtype: np.dtype
              ) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct indices, sorted; the sum of the values at each, in ``dtype``) of
    several sets of pairs, each sorted by index.  A stable sort merges the sorted runs
    (np.unique sorts from scratch: 12.8 ms against 0.35 for 84 k indices here), and
    equal indices keep the sets' order in their sums."""
    idx = np.concatenate(idxs).astype(np.int64, copy=False)
    if not idx.size:
        return idx, np.zeros(0, dtype)
    order = np.argsort(idx, kind="stable")
    ordered = idx[order]
    starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
    sums = np.add.reduceat(np.concatenate(vals)[order].astype(np.float64), starts)
    return ordered[starts], sums.astype(dtype)


def distinct(idx: np.ndarray) -> int:
    """How many different indices ``idx`` holds (sets of sorted indices, concatenated)."""
    if not idx.size:
        return 0
    ordered = np.sort(idx, kind="stable")
    return int(np.count_nonzero(ordered[1:] != ordered[:-1])) + 1


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


def add_select(acc: np.ndarray, inp: np.ndarray, threshold: float, zero: np.ndarray
               ) -> np.ndarray:
    """``acc += inp``, ``zero[...] = 0`` and ``select(acc, threshold)`` (threshold above 0)
    in one pass, block by block: each block is read from memory once and added, zeroed
    and compared while it is in the cache, where three whole-array passes stream 50 MB
    through memory for a 4 M-value bucket.  ``zero`` may be ``inp`` itself (each block is
    zeroed after it is added)."""
    n = acc.size
    scratch = np.empty(min(n, _BLOCK), acc.dtype)
    parts = []
    for lo in range(0, n, _BLOCK):
        hi = min(lo + _BLOCK, n)
        block = acc[lo:hi]
        block += inp[lo:hi]
        zero[lo:hi] = 0
        hit = np.flatnonzero(np.abs(block, out=scratch[:hi - lo]) >= threshold)
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
    (the same array on every rank) and keeps the name's residual (and velocity).

    Args:
        density: k = density * n values per call (at least one).
        warmup: calls per name before the sparse calls proper; see ``warmup_mode``.
        warmup_mode: ``"dense"``: the warm-up calls are dense allreduces of
            ``input + residual`` (the residual is emptied, the velocity kept whole, so
            with momentum correction they are exactly momentum SGD).  ``"exponential"``:
            they are sparse at a density falling geometrically from about 1 to
            ``density`` (DGC's warm-up), which sends far less but is never exact.
        momentum: momentum correction (DGC) when above 0: each rank keeps a velocity
            ``u = momentum * u + grad`` and the residual accumulates ``u`` instead of
            ``grad``, so a value held back for many steps comes out with the momentum it
            would have had, not as a burst of raw gradients.  The optimizer must then
            run without momentum of its own (it would apply it twice).
        momentum_masking: zero the velocity where this rank's value was sent (DGC's
            momentum factor masking): the residual there is emptied, and a velocity left
            whole would keep pushing the sent direction for many more steps, a stale
            update on top of the one that went out.
        clip_norm: when set, each rank scales its gradient for the name down to L2
            norm ``clip_norm / sqrt(P)`` before it enters the velocity (DGC's local
            clipping: clipping the averaged output cannot bound what waits in the
            residuals, and P independent gradients of that norm sum to about
            ``clip_norm``).
    """

    name = "base"

    def __init__(self, density: float, warmup: int = 0, *, warmup_mode: str = "dense",
                 momentum: float = 0.0, momentum_masking: bool = True,
                 clip_norm: float | None = None) -> None:
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density!r}")
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        if warmup_mode not in ("dense", "exponential"):
            raise ValueError(f"warmup_mode must be 'dense' or 'exponential', got "
                             f"{warmup_mode!r}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0, got {clip_norm!r}")
        self.density = density
        self.warmup, self.warmup_mode = warmup, warmup_mode
        self.momentum, self.momentum_masking = momentum, momentum_masking
        self.clip_norm = clip_norm
        self._states: LRU[str, State] = LRU(_NAMES)

    @property
    def dense_calls(self) -> int:
        """Calls per name reduced densely before the first sparse one."""
        return self.warmup if self.warmup_mode == "dense" else 0

    def density_at(self, calls: int) -> float:
        """The density of a name's call after ``calls`` earlier ones."""
        if self.warmup_mode == "exponential" and calls < self.warmup:
            return float(self.density ** ((calls + 1) / (self.warmup + 1)))
        return self.density

    def k(self, n: int, calls: int | None = None) -> int:
        density = self.density if calls is None else self.density_at(calls)
        return max(1, int(n * density))

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

    def velocity(self, name: str) -> np.ndarray | None:
        """The name's momentum-correction velocity (None without momentum)."""
        state = self._states.peek(name)
        if state is None:
            raise KeyError(f"no gradient named {name!r} has been reduced yet")
        return state.velocity

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
        inp = self._input(arr, state)
        # The residual becomes the accumulator in place: no n-element allocation a call.
        # (``out`` may be ``grad``: everything below reads ``acc``, not ``grad``.)
        acc = state.residual
        k = self.k(arr.size, state.calls)
        state.preselected = None
        if state.calls < self.dense_calls:
            acc += inp
            dest[...] = tr.allreduce(acc, op=tr.Average, name=f"{name}.{self.name}.dense")
            acc.fill(0)
            local = chosen = arr.size
        else:
            self._accumulate(acc, inp, k, state, dest)
            sent, local, chosen = self._run(acc, k, name, state, dest)
            state.preselected = None
            acc[sent] = 0  # every sent value reached the output
            if state.velocity is not None and self.momentum_masking:
                state.velocity[sent] = 0
        after = tr.transport_stats()
        state.calls += 1
        state.stats = {"bytes_sent": after["bytes_sent"] - before["bytes_sent"],
                       "bytes_received": after["bytes_received"] - before["bytes_received"],
                       "messages_sent": after["messages_sent"] - before["messages_sent"],
                       "messages_received": (after["messages_received"]
                                             - before["messages_received"]),
                       "local_selected": local, "global_selected": chosen, "k": k}
        return dest.reshape(np.shape(grad)) if out is None else out

    def _input(self, grad: np.ndarray, state: State) -> np.ndarray:
        """What this call adds to the residual: the (clipped) gradient, or with momentum
        correction the velocity it updates."""
        if self.clip_norm is not None:
            limit = self.clip_norm / np.sqrt(tr.size())
            norm = float(np.linalg.norm(grad.astype(np.float64)))
            if norm > limit:
                grad = (grad * (limit / norm)).astype(grad.dtype)
        if self.momentum == 0:
            state.velocity = None
            return grad
        # A new array every call (never updated in place), as the residual is: a
        # state_dict taken earlier keeps the values it had.
        if state.velocity is None:
            state.velocity = grad.copy()
        else:
            state.velocity = (self.momentum * state.velocity + grad).astype(grad.dtype)
        return state.velocity

    def _accumulate(self, acc: np.ndarray, inp: np.ndarray, k: int, state: State,
                    out: np.ndarray) -> None:
        """``acc += inp`` before a sparse call; an algorithm that knows its threshold
        already may select at it meanwhile and zero ``out`` (``state.preselected``)."""
        acc += inp

    def _run(self, acc: np.ndarray, k: int, name: str, state: State, out: np.ndarray
             ) -> tuple[np.ndarray, int, int]:
        """One sparse call on ``acc = input + residual`` at ``k`` values: writes the
        averaged output to ``out`` (every element) and returns (this rank's indices whose
        value reached it, local selection size, global selection size).  The caller
        empties the residual and velocity at those indices; ``acc`` is the residual
        itself, so leave it whole."""
        raise NotImplementedError
