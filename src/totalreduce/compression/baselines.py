"""The baselines Ok-Topk is measured against: dense allreduce, TopkA and gTopk."""

from __future__ import annotations

from typing import Any

import numpy as np

import totalreduce as tr

from .sparse import (
    SparseAllreduce,
    State,
    distinct,
    index_dtype,
    pack,
    sum_pairs,
    top_k,
    unpack,
)


class Dense(SparseAllreduce):
    """Plain averaging allreduce, with the same interface (its residual stays zero)."""

    name = "dense"

    def __init__(self) -> None:
        super().__init__(1.0)

    def _run(self, acc: np.ndarray, k: int, name: str, state: State, out: np.ndarray
             ) -> tuple[np.ndarray, int, int]:
        out[...] = tr.allreduce(acc, op=tr.Average, name=f"{name}.dense")
        return np.arange(acc.size), acc.size, acc.size


class TopkA(SparseAllreduce):
    """Every rank sends its own top-k (index, value) pairs to every other rank (one
    allgather) and sums what it gets: 2k(P-1) words received per rank, growing with P."""

    name = "topka"

    def _run(self, acc: np.ndarray, k: int, name: str, state: State, out: np.ndarray
             ) -> tuple[np.ndarray, int, int]:
        n, size = acc.size, tr.size()
        sel = top_k(acc, k)
        rows = tr.allgather(pack(sel, acc[sel], n), name=f"{name}.topka")
        idx, val = unpack(rows, n, acc.dtype)
        out.fill(0)
        np.add.at(out, idx, val)
        chosen = distinct(idx)
        out /= size
        return sel, sel.size, chosen  # every selected value reached the output


class GTopk(SparseAllreduce):
    """gTopk (Shi et al., ICDCS 2019): the ranks' top-k sets are merged pairwise up a
    binary tree in ceil(log2 P) rounds, each merge summing the two sets and keeping the
    top k of the sum, so that rank 0 ends with the global top-k indices and their merged
    values; rank 0 broadcasts them, and the output is those values divided by P.

    Round r (r = 0, 1, ...): rank p with p mod 2^(r+1) == 2^r sends its current set to
    rank p - 2^r, once, and is done; any P works (a rank whose partner would be past the
    last rank just waits for the next round).  Per rank: at most one tree send of k pairs
    and one broadcast of k pairs (a chain, in which every rank but the last forwards k
    pairs), so at most 2k pairs sent (4k words for float32) whatever P; rank 0 receives
    k pairs in each of ceil(log2 P) rounds, the O(k log P) the paper counts.

    A rank's residual is ``acc`` with zeros at its own selected indices that won, as
    published.  The conservation identity of sparse.py does not hold: a contribution
    dropped at an intermediate merge, at an index that still wins at the top, is neither
    in the output nor in its owner's residual; it is lost.  At 2 ranks nothing is (the
    only merge is the last); tests/test_compression.py computes the loss exactly against
    a numpy tree merge: 0.1-1% of what the winners consumed at 3 and 4 ranks on its
    heavy-tailed gradients.

    ``exact_sums=True`` keeps rank 0's winning indices but replaces the merged values
    with an exact sum at them (one allreduce of k values, after a broadcast of the k
    indices only), which restores the identity at about k more words per rank and one
    more collective.  The published algorithm is the default because it is what the
    name promises and what the baselines of other papers measure; the exact variant is
    ours.

    Args:
        density: k = density * n values per call (at least one).
        exact_sums: sum exactly at the winners (see above) instead of broadcasting the
            tree-merged values.
    """

    name = "gtopk"

    def __init__(self, density: float, warmup: int = 0, *, exact_sums: bool = False,
                 **knobs: Any) -> None:
        super().__init__(density, warmup, **knobs)
        self.exact_sums = exact_sums

    def _run(self, acc: np.ndarray, k: int, name: str, state: State, out: np.ndarray
             ) -> tuple[np.ndarray, int, int]:
        n, rank, size = acc.size, tr.rank(), tr.size()
        sel = top_k(acc, k)
        idx, val = self._tree_merge(sel, acc[sel], n, k, name)
        # One fixed-size broadcast of k rows, padded with index n (past the buffer), so
        # that no count needs its own broadcast first.
        if self.exact_sums:
            it = index_dtype(n)
            pad = np.full(k, n, it)
            if rank == 0:
                pad[:idx.size] = idx
            # As bytes: collectives take no uint32, and int64 would double the volume.
            got = tr.broadcast(pad.view(np.uint8), root_rank=0,
                               name=f"{name}.gtopk.winners").view(it)
            winners = got[got < n].astype(np.int64)
        else:
            pad = np.full(k, n, np.int64)
            pval = np.zeros(k, acc.dtype)
            if rank == 0:
                pad[:idx.size] = idx
                pval[:idx.size] = val
            got = tr.broadcast(pack(pad, pval, n), root_rank=0, name=f"{name}.gtopk.top")
            gidx, gval = unpack(got, n, acc.dtype)
            keep = gidx < n
            winners, merged = gidx[keep], gval[keep]
        # Both sorted: a binary search instead of np.isin's sort of both.
        at = np.minimum(np.searchsorted(sel, winners), max(sel.size - 1, 0))
        mine = sel[at] == winners if sel.size else np.zeros(winners.size, bool)
        if self.exact_sums:
            contrib = np.where(mine, acc[winners], 0).astype(acc.dtype)
            merged = tr.allreduce(contrib, op=tr.Sum, name=f"{name}.gtopk.values")
        out.fill(0)
        out[winners] = merged / size
        return winners[mine], sel.size, winners.size

    @staticmethod
    def _tree_merge(idx: np.ndarray, val: np.ndarray, n: int, k: int, name: str
                    ) -> tuple[np.ndarray, np.ndarray]:
        """Rank 0's merged (indices, values) after every round; other ranks' are
        meaningless.  Every rank joins every round's alltoall, but only a round's
        receivers wait for it: a rank that has nothing to receive submits the round and
        moves on, so one that has sent submits all its remaining (empty) rounds at once
        and waits for them together at the end."""
        rank, size = tr.rank(), tr.size()
        none = np.zeros(size, np.int64)
        empty = pack(idx[:0], val[:0], n)
        pending: list[tr.Handle] = []
        sent = False
        step = 1
        while step < size:
            tag = f"{name}.gtopk.{step}"
            if not sent and rank % (2 * step) == step:
                splits = none.copy()
                splits[rank - step] = idx.size
                pending.append(tr.alltoall_async(pack(idx, val, n), splits=splits, name=tag))
                sent = True
            elif sent or rank % (2 * step) != 0 or rank + step >= size:
                pending.append(tr.alltoall_async(empty, splits=none, name=tag))
            else:
                got, _counts = tr.alltoall(empty, splits=none, name=tag)
                if got.size:
                    idx, val = _merge(idx, val, *unpack(got, n, val.dtype), k)
            step *= 2
        for handle in pending:
            handle.wait()
        return idx, val


def _merge(i1: np.ndarray, v1: np.ndarray, i2: np.ndarray, v2: np.ndarray, k: int
           ) -> tuple[np.ndarray, np.ndarray]:
    """The top k of the sum of two sparse sets (each without repeated indices), on their
    union only: a dense buffer of n per round would cost more than the pairs."""
    union, summed = sum_pairs([i1, i2], [v1, v2], v1.dtype)
    keep = top_k(summed, k)
    return union[keep], summed[keep]
