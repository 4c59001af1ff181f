"""The baselines Ok-Topk is measured against: dense allreduce, TopkA and gTopk."""

from __future__ import annotations

import numpy as np

import totalreduce as tr

from .sparse import SparseAllreduce, State, pack, top_k, unpack


class Dense(SparseAllreduce):
    """Plain averaging allreduce, with the same interface (its residual stays zero)."""

    name = "dense"

    def __init__(self) -> None:
        super().__init__(1.0)

    def _run(self, acc: np.ndarray, k: int, name: str, state: State
             ) -> tuple[np.ndarray, np.ndarray, int, int]:
        out = tr.allreduce(acc, op=tr.Average, name=f"{name}.dense")
        return out, np.arange(acc.size), acc.size, acc.size


class TopkA(SparseAllreduce):
    """Every rank sends its own top-k (index, value) pairs to every other rank (one
    allgather) and sums what it gets: 2k(P-1) words received per rank, growing with P."""

    name = "topka"

    def _run(self, acc: np.ndarray, k: int, name: str, state: State
             ) -> tuple[np.ndarray, np.ndarray, int, int]:
        n, size = acc.size, tr.size()
        sel = top_k(acc, k)
        rows = tr.allgather(pack(sel, acc[sel], n), name=f"{name}.topka")
        idx, val = unpack(rows, n, acc.dtype)
        out = np.zeros(n, acc.dtype)
        np.add.at(out, idx, val)
        chosen = int(np.unique(idx).size)
        out /= size
        return out, sel, sel.size, chosen  # every selected value reached the output


class GTopk(SparseAllreduce):
    """gTopk: the ranks' top-k sets are merged pairwise up a binary tree to rank 0, each
    merge keeping the top k of the sum, so that rank 0 holds k global indices; they are
    broadcast, and the values at them are reduced exactly (a dense allreduce of k).

    The last step is ours: a tree merge drops some ranks' contributions at indices that
    still win overall, and summing exactly at the winning indices keeps the conservation
    identity (every contribution either reaches the output or stays in its owner's
    residual) at the cost of one allreduce of k values."""

    name = "gtopk"

    def _run(self, acc: np.ndarray, k: int, name: str, state: State
             ) -> tuple[np.ndarray, np.ndarray, int, int]:
        n, rank, size = acc.size, tr.rank(), tr.size()
        sel = top_k(acc, k)
        idx, val = sel, acc[sel]
        step = 1
        while step < size:
            # Round: ranks that are odd multiples of ``step`` send to rank - step.
            splits = np.zeros(size, np.int64)
            if rank % (2 * step) == step:
                splits[rank - step] = idx.size
                rows = pack(idx, val, n)
            else:
                rows = pack(idx[:0], val[:0], n)
            got, _counts = tr.alltoall(rows, splits=splits, name=f"{name}.gtopk.{step}")
            if rank % (2 * step) == 0 and got.size:
                i2, v2 = unpack(got, n, acc.dtype)
                merged = np.zeros(n, acc.dtype)
                np.add.at(merged, idx, val)
                np.add.at(merged, i2, v2)
                idx = top_k(merged, k)
                val = merged[idx]
            step *= 2
        count = np.array([idx.size if rank == 0 else 0], np.int64)
        count = tr.broadcast(count, root_rank=0, name=f"{name}.gtopk.count")
        winners = idx.astype(np.int64) if rank == 0 else np.empty(int(count[0]), np.int64)
        winners = tr.broadcast(winners, root_rank=0, name=f"{name}.gtopk.winners")
        mine = np.isin(winners, sel, assume_unique=True)
        contrib = np.where(mine, acc[winners], 0).astype(acc.dtype)
        summed = tr.allreduce(contrib, op=tr.Sum, name=f"{name}.gtopk.values")
        out = np.zeros(n, acc.dtype)
        out[winners] = summed / size
        return out, winners[mine], sel.size, winners.size
