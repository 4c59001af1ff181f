"""A DDP communication hook that reduces DDP's gradient buckets through totalreduce.

Keep ``DistributedDataParallel`` (its bucketing, its ``no_sync()``, its unused-parameter
handling) and move only the reduction::

    model = DDP(model)
    model.register_comm_hook(None, totalreduce.torch.ddp_comm_hook)

Every rank must register it.  Buckets match across ranks by their index and call count,
which DDP keeps identical on every rank (it rebuilds its buckets once, after the first
iteration, in the same order everywhere).  torch's own wrappers compose with it, e.g.
``default_hooks.fp16_compress_wrapper(ddp_comm_hook)``.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations against the
# real GradBucket and Future types, and strings would fail that check.
from typing import Any

import torch
import torch.distributed as dist

import totalreduce as _tr

from ..compression import GTopk, OkTopk, TopkA
from .tensors import stage


def ddp_comm_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket.buffer()`` over all ranks, in place; a future of the buffer.

    Args:
        state: None, or a str that prefixes the op names (two DDP models in one job
            need different prefixes).
        bucket: the ``torch.distributed.GradBucket`` DDP hands to hooks.
    """
    prefix = state if isinstance(state, str) else "ddp"
    buffer = bucket.buffer()
    staged = stage(buffer, "ddp_comm_hook")
    handle = _tr.allreduce_async_(staged.array, op=_tr.Average,
                                  name=f"{prefix}.bucket{bucket.index()}")
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def done(h: "_tr.Handle") -> None:
        # Runs on whichever thread finished the op: set the future, never raise here.
        error = h.error()
        if error is not None:
            future.set_exception(error)  # type: ignore[arg-type]  # torch's stub is wrong
            return
        try:
            staged.write_back()
        except BaseException as exc:  # a CUDA copy failing must reach DDP, not the loop
            future.set_exception(exc)  # type: ignore[arg-type]
            return
        future.set_result(buffer)

    handle.add_done_callback(done)
    return future


def _sparse_hook(algorithm: Any) -> Any:
    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        prefix = state if isinstance(state, str) else "ddp"
        buffer = bucket.buffer()
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        try:
            staged = stage(buffer, f"{algorithm.name}_hook")
            staged.array[...] = algorithm.allreduce(staged.array,
                                                    f"{prefix}.bucket{bucket.index()}")
            staged.write_back()
        except BaseException as exc:  # DDP raises it from backward()
            future.set_exception(exc)  # type: ignore[arg-type]
            return future
        future.set_result(buffer)
        return future

    hook.algorithm = algorithm  # type: ignore[attr-defined]  # its residuals, for checkpoints
    return hook


def oktopk_hook(density: float = 0.01, **knobs: Any) -> Any:
    """A DDP comm hook that averages each bucket with Ok-Topk (residuals per bucket)::

        model.register_comm_hook(None, totalreduce.torch.oktopk_hook(density=0.01))

    The hook runs the sparse allreduce to completion inside backward (it is several
    blocking collectives), and its residuals live in ``hook.algorithm``."""
    return _sparse_hook(OkTopk(density, **knobs))


def topka_hook(density: float = 0.01) -> Any:
    """A DDP comm hook with TopkA (see :func:`oktopk_hook`)."""
    return _sparse_hook(TopkA(density))


def gtopk_hook(density: float = 0.01) -> Any:
    """A DDP comm hook with gTopk (see :func:`oktopk_hook`)."""
    return _sparse_hook(GTopk(density))
