"""Ok-Topk (Li and Hoefler, PPoPP 2022): a sparse allreduce whose volume per rank stays
under 6k(P-1)/P words however many ranks there are.

One call on ``acc = input + residual`` (the input: the gradient, or with momentum
correction the velocity; after ``warmup`` dense calls):

1. Local selection: the indices with |acc| at or above the local threshold.  The
   threshold is the exact k-th largest magnitude every ``tau_local`` calls and is reused
   in between, with feedback: scaled by sqrt(last count / k), since residuals pile up
   under a fixed threshold and the count drifts.  A reused threshold that still selects
   more than ``max_ratio`` * k (or fewer than k / ``max_ratio``) is replaced by the exact
   one at once, which keeps the volume bound.
2. Regions: the index space is cut into P regions holding about equal numbers of
   selected indices over all ranks (a histogram of selections, summed over ranks),
   recomputed every ``tau_region`` calls.  Rank j owns region j.
3. Split and reduce: every rank sends its selected pairs in region j to rank j, in P - 1
   rotation steps all in flight at once, and rank j sums each step's pairs for its region
   as it arrives, while the later steps travel.
4. Global selection: rank j keeps the entries of its region whose summed magnitude
   reaches the global threshold: the exact k-th largest over all regions every
   ``tau_global`` calls (from every rank's top candidates), reused in between, scaled by
   sqrt(last global count / k) (every rank knows it), at most 25% per call; a region
   never keeps more than its share of ``max_ratio`` * k.
5. Allgatherv of the kept pairs: every rank has the same ~k global entries; the output
   is their sums divided by P.

A rank's residual is ``acc`` with zeros where its value reached the output: its own
selected indices that won globally.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import totalreduce as tr

from .sparse import (
    SparseAllreduce,
    State,
    add_select,
    kth_largest,
    narrow,
    pack,
    select,
    sum_pairs,
    top_k,
    top_threshold,
    unpack,
)

_BINS_PER_RANK = 64  # histogram resolution of the region cut


class OkTopk(SparseAllreduce):
    """``OkTopk(density)``; every knob has the published implementation's default.

    Args:
        density: k = density * n values per call (at least one).
        warmup: calls reduced densely first (the model moves fastest then, and residuals
            of early gradients would be stale by the time they are sent); with
            ``warmup_mode="exponential"``, calls at a falling density instead.
        tau_local: calls between exact local thresholds; larger is cheaper (no
            selection sort) but lets the local count drift from k.
        tau_global: calls between exact global thresholds; larger saves the candidates'
            allgather, smaller keeps the output closer to exactly k entries.
        tau_region: calls between region cuts; larger saves the histogram allreduce,
            smaller keeps the ranks' reduce work balanced as the selection moves.
        max_ratio: how far a reused local threshold's count may stray from k before
            the exact threshold replaces it; larger saves sorts, smaller keeps the
            volume closer to the ideal.
        pipeline: split-and-reduce in P - 1 rotation steps, summing one step's pairs
            while the next travel (as published); False sends all in one alltoall,
            which costs fewer messages and nothing to overlap.
        knobs: the base's ``warmup_mode``, ``momentum``, ``momentum_masking`` and
            ``clip_norm`` (:class:`~totalreduce.compression.SparseAllreduce`; all off
            by default).
    """

    name = "oktopk"

    def __init__(self, density: float, warmup: int = 10, tau_local: int = 32,
                 tau_global: int = 32, tau_region: int = 64, max_ratio: float = 1.5,
                 pipeline: bool = True, **knobs: Any) -> None:
        super().__init__(density, warmup, **knobs)
        for knob, value in (("tau_local", tau_local), ("tau_global", tau_global),
                            ("tau_region", tau_region)):
            if value < 1:
                raise ValueError(f"{knob} must be >= 1, got {value}")
        if max_ratio < 1.0:
            raise ValueError(f"max_ratio must be >= 1, got {max_ratio}")
        self.tau_local, self.tau_global = tau_local, tau_global
        self.tau_region, self.max_ratio = tau_region, max_ratio
        self.pipeline = pipeline

    def _run(self, acc: np.ndarray, k: int, name: str, state: State, out: np.ndarray
             ) -> tuple[np.ndarray, int, int]:
        n, size = acc.size, tr.size()
        sel = self._local(acc, k, state)
        bounds = self._regions(sel, n, size, state, name)
        ridx, rsum = self._split_and_reduce(acc, sel, bounds, name)
        # Global selection in my region (only its entries some rank selected are nonzero).
        if (state.calls - self.dense_calls) % self.tau_global == 0:
            state.global_threshold = self._global_threshold(rsum, k, name)
        elif state.stats.get("global_selected"):
            ratio = state.stats["global_selected"] / k
            state.global_threshold *= float(np.clip(np.sqrt(ratio), 0.8, 1.25))
        keep = select(rsum, state.global_threshold)
        cap = -(-int(self.max_ratio * k) // size)
        if keep.size > cap:  # the threshold lagged: keep the region's largest share
            keep = np.sort(keep[np.argpartition(np.abs(rsum[keep]), keep.size - cap)
                                [keep.size - cap:]])
        gathered = tr.allgather(pack(ridx[keep], rsum[keep], n),
                                name=f"{name}.oktopk.gather")
        gidx, gval = unpack(gathered, n, acc.dtype)
        if state.preselected is None:
            out.fill(0)
        out[gidx] = gval / size
        # Both sorted (gidx: the regions in rank order, each sorted): a binary search
        # instead of np.isin's sort of both.
        at = np.minimum(np.searchsorted(gidx, sel), max(gidx.size - 1, 0))
        won = sel[gidx[at] == sel] if gidx.size else sel[:0]
        return won, sel.size, gidx.size

    def _split_and_reduce(self, acc: np.ndarray, sel: np.ndarray, bounds: np.ndarray,
                          name: str) -> tuple[np.ndarray, np.ndarray]:
        """My region's sums of every rank's selected pairs in it, as (indices, sums) over
        the indices some rank selected: my selected pairs in region j go to rank j.
        Pipelined, in P - 1 steps: at step s rank r sends to r + s and receives from
        r - s, every step in flight at once, and each step's pairs are taken as it
        arrives, while the later steps still travel.

        Sparse, not a dense region: about k of the region's n / P entries are selected
        anywhere, and zeroing a dense region, then scanning it for the global selection,
        cost more than the rest of this step (12.6 M values, 2 ranks)."""
        n, size, rank = acc.size, tr.size(), tr.rank()
        cuts = np.searchsorted(sel, bounds)
        rows = pack(sel, acc[sel], n)
        if not self.pipeline:
            got, _counts = tr.alltoall(rows, splits=np.diff(cuts), name=f"{name}.oktopk.split")
            idx, val = unpack(got, n, acc.dtype)
            return sum_pairs([idx], [val], acc.dtype)
        mine = sel[cuts[rank]:cuts[rank + 1]]
        idxs, vals = [mine], [acc[mine]]
        steps = []
        for s in range(1, size):
            to = (rank + s) % size
            splits = np.zeros(size, np.int64)
            splits[to] = cuts[to + 1] - cuts[to]
            steps.append(tr.alltoall_async(rows[cuts[to]:cuts[to + 1]], splits=splits,
                                           name=f"{name}.oktopk.split{s}"))
        for step in steps:
            got, _counts = step.wait()
            idx, val = unpack(got, n, acc.dtype)
            idxs.append(idx)
            vals.append(val)
        return sum_pairs(idxs, vals, acc.dtype)

    def _exact_due(self, state: State) -> bool:
        return (state.calls - self.dense_calls) % self.tau_local == 0 \
            or state.local_threshold <= 0

    def _accumulate(self, acc: np.ndarray, inp: np.ndarray, k: int, state: State,
                    out: np.ndarray) -> None:
        # A reused threshold is known before the input is added: select at it in the
        # same pass (and zero the output there), which saves two passes over the bucket.
        threshold = 0.0 if self._exact_due(state) else self._reused_threshold(state, k)
        if threshold > 0:
            state.preselected = (threshold, add_select(acc, inp, threshold, out))
        else:
            acc += inp

    @staticmethod
    def _reused_threshold(state: State, k: int) -> float:
        """The last local threshold, scaled by sqrt(last count / k): residuals pile up
        under a fixed threshold, and the count drifts."""
        return state.local_threshold * float(np.sqrt(max(state.last_local, 1) / k))

    def _local(self, acc: np.ndarray, k: int, state: State) -> np.ndarray:
        exact = self._exact_due(state)
        if not exact:
            if state.preselected is not None:
                state.local_threshold, sel = state.preselected
            else:  # not selected while added (a threshold gone to NaN)
                state.local_threshold = self._reused_threshold(state, k)
                sel = select(acc, state.local_threshold)
            if sel.size > self.max_ratio * k:
                # Too many: the exact threshold is among those selected.
                state.local_threshold, sel = narrow(acc, sel, k)
            else:
                exact = bool(sel.size * self.max_ratio < k
                             and int(np.count_nonzero(acc)) > sel.size)
        if exact:
            state.local_threshold, sel = top_threshold(acc, k)
        state.last_local = sel.size
        return sel

    def _regions(self, sel: np.ndarray, n: int, size: int, state: State,
                 name: str) -> np.ndarray:
        """Region boundaries (P + 1 of them, the same on every rank)."""
        due = (state.calls - self.dense_calls) % self.tau_region == 0
        if state.boundaries is not None and state.boundaries[-1] == n and not due:
            return state.boundaries
        bins = min(n, _BINS_PER_RANK * size)
        edges = np.linspace(0, n, bins + 1).astype(np.int64)
        hist = np.histogram(sel, bins=edges)[0].astype(np.int64)
        hist = tr.allreduce(hist, op=tr.Sum, name=f"{name}.oktopk.regions")
        total = int(hist.sum())
        bounds = np.zeros(size + 1, np.int64)
        bounds[-1] = n
        if total:
            cum = np.cumsum(hist)
            for j in range(1, size):
                b = int(np.searchsorted(cum, total * j / size))
                bounds[j] = edges[min(b + 1, bins)]
        else:
            bounds[1:-1] = [n * j // size for j in range(1, size)]
        bounds = np.maximum.accumulate(bounds)
        state.boundaries = bounds
        return bounds

    def _global_threshold(self, sums: np.ndarray, k: int, name: str) -> float:
        """The exact k-th largest summed magnitude over every region: each rank offers
        its region's top k (no more can win), every rank picks the same k-th."""
        mine = np.sort(np.abs(sums[top_k(sums, k)]))[::-1].astype(np.float64)
        candidates = tr.allgather(mine, name=f"{name}.oktopk.candidates")
        return kth_largest(candidates, k)

