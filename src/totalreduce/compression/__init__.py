"""Sparse gradient allreduce with error feedback: Ok-Topk, and the TopkA, gTopk and dense
baselines, all with one interface::

    from totalreduce.compression import OkTopk
    alg = OkTopk(density=0.01)
    out = alg.allreduce(grad, "layer1.weight")   # the average, the same on every rank
    alg.residual("layer1.weight")                # what this rank has not sent yet
    alg.stats("layer1.weight")                   # bytes and selections of the last call
"""

from .baselines import Dense, GTopk, TopkA
from .oktopk import OkTopk
from .sparse import SparseAllreduce

__all__ = ["Dense", "GTopk", "OkTopk", "SparseAllreduce", "TopkA"]
