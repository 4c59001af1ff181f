"""Horovod's ``sparse_allreduce_async``: a sparse COO tensor reduced through two
allgathers (its indices and its values), so what travels grows with the entries, not
with the dense size."""

from __future__ import annotations

from typing import Any

import torch

import totalreduce as _tr
from totalreduce import ProcessSet, global_process_set

from .collectives import (
    Average,
    Sum,
    TorchHandle,
    _check_process_set,
    _part_name,
    _Together,
    allgather_async,
    resolve_op,
)


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average,
                           process_set: ProcessSet = global_process_set) -> TorchHandle:
    """Start an allreduce of a sparse COO tensor; ``synchronize`` returns a sparse tensor.

    Every rank's indices and values are allgathered (ranks may hold different numbers of
    entries), so what travels grows with the entries, not with the dense size.  The result
    holds every rank's entries, coalesced (entries at one index summed); ``Average``
    divides the values by ``size()``.

    Raises:
        TypeError: ``tensor`` is not a sparse COO tensor.
        ValueError: ``op`` is neither ``Average`` nor ``Sum``.
    """
    what = "sparse_allreduce" + (f" '{name}'" if name else "")
    _check_process_set(process_set, what)
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise TypeError(f"{what}: expected a sparse COO tensor, got "
                        f"{getattr(tensor, 'layout', type(tensor).__name__)}")
    rop = resolve_op(op, None, what)
    if rop not in (Average, Sum):
        raise ValueError(f"{what}: op must be Average or Sum, got {rop.label}")
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    # Entries along dimension 0 for the allgather: indices as (nnz, sparse_dim) rows,
    # after a first row that gives this rank's sparse sizes as -(size + 1), which no index
    # can be: every rank learns every rank's shape from the same op.
    sparse_dim = t.sparse_dim()
    rows = [t.indices().t()]
    if sparse_dim:  # (a tensor with no sparse dimension has no sizes to send)
        rows.insert(0, torch.tensor([[-(s + 1) for s in t.shape[:sparse_dim]]],
                                    dtype=rows[0].dtype, device=t.device))
    indices = torch.cat(rows).contiguous()
    values = t.values().contiguous()
    handles = [allgather_async(indices, _part_name(name, 0), process_set),
               allgather_async(values, _part_name(name, 1), process_set)]

    def finish(parts: list[torch.Tensor]) -> torch.Tensor:
        every_index, every_value = parts
        shape_rows = (every_index < 0).all(dim=1) if sparse_dim else \
            torch.zeros(len(every_index), dtype=torch.bool, device=every_index.device)
        shapes = [tuple((-row - 1).tolist()) for row in every_index[shape_rows]]
        if len(set(shapes)) > 1:
            ranks = process_set.ranks or list(range(_tr.size()))
            shown = "; ".join(f"rank {ranks[i]}: {s + tuple(tensor.shape[len(s):])}"
                              for i, s in enumerate(shapes))
            raise _tr.MismatchError(name or "", f"rank {_tr.rank()}: {what}: the tensors' "
                                    f"shapes differ between ranks: {shown}")
        every_index = every_index[~shape_rows]
        # Checked all the same: an entry out of the shape would make a tensor that
        # crashes the process when used, rather than an error here.
        out = torch.sparse_coo_tensor(every_index.t(), every_value, tensor.shape,
                                      dtype=tensor.dtype, device=tensor.device,
                                      check_invariants=True).coalesce()
        if rop != Average:
            return out
        # Divided after the entries at one index are summed, as a dense Average would.
        v = out.values()
        n = process_set.size()
        v = v / n if v.is_floating_point() else torch.div(v, n, rounding_mode="trunc")
        return torch.sparse_coo_tensor(out.indices(), v, out.shape, is_coalesced=True,
                                       check_invariants=False)  # out's own, checked

    return TorchHandle(_Together(handles, what), finish)  # type: ignore[arg-type]
