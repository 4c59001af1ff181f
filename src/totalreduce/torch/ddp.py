"""A DDP communication hook that reduces DDP's gradient buckets through totalreduce.

Keep ``DistributedDataParallel`` (its bucketing, its ``no_sync()``, its unused-parameter
handling) and move only the reduction::

    model = DDP(model)
    model.register_comm_hook(None, totalreduce.torch.ddp_comm_hook)

Every rank must register it.  Buckets match across ranks by their index and call count,
which DDP keeps identical on every rank (it rebuilds its buckets once, after the first
iteration, in the same order everywhere).  torch's own wrappers compose with it, e.g.
``default_hooks.fp16_compress_wrapper(ddp_comm_hook)``.

Errors: when a bucket's reduction fails (ranks whose buckets differ, a lost peer),
``backward()`` raises totalreduce's own exception (``MismatchError`` naming the op, each
rank and what differs; ``PeerFailureError`` naming the rank), with a note naming the
bucket.  A failed future would reach the user as DDP's RuntimeError "Unable to cast
<message> to Tensor" instead, so the hook also queues an autograd callback per bucket,
which runs when the backward pass's graph is done, waits for its bucket and raises the
bucket's error.  It runs before DDP's own end-of-pass callback, so a rank raises as soon as
its first failed bucket is known, even while others wait for a peer that has stopped
sending.  DDP's reducer is then left mid-pass, so that model's next backward fails inside
DDP: to go on after catching the error, build the DDP model again.  Outside a backward
pass (a hook called by hand) the future carries the error instead.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations against the
# real GradBucket and Future types, and strings would fail that check.
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import totalreduce as _tr

from ..compression import GTopk, OkTopk, TopkA
from .sparse_worker import SparseWorker
from .tensors import stage

_NOTE = "raised in backward() by totalreduce.torch's DDP comm hook for DDP's gradient bucket"


def _raise_at_end_of_backward(index: int, settle: Callable[[], BaseException | None]) -> bool:
    """Queue the autograd callback that raises bucket ``index``'s error, if ``settle()``
    (which waits for the bucket) returns one; False outside a backward pass."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(
            functools.partial(_raise_error, index, settle))
    except RuntimeError:  # "Final callbacks can only be installed during backward pass"
        return False
    return True


def _raise_error(index: int, settle: Callable[[], BaseException | None]) -> None:
    error = settle()
    if error is None:
        return
    # A lost peer fails every later op with one and the same error: note it once.
    if not any(n.startswith(_NOTE) for n in getattr(error, "__notes__", ())):
        note = f"{_NOTE} {index}"
        if isinstance(error, _tr.MismatchError):
            note += (": DDP's buckets differ between ranks when the ranks build DDP with "
                     "different models, bucket_cap_mb or find_unused_parameters")
        error.add_note(note)
    raise error


def ddp_comm_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket.buffer()`` over all ranks, in place; a future of the buffer.

    Args:
        state: None, or a str that prefixes the op names (two DDP models in one job
            need different prefixes).
        bucket: the ``torch.distributed.GradBucket`` DDP hands to hooks.
    """
    prefix = state if isinstance(state, str) else "ddp"
    buffer = bucket.buffer()
    index = bucket.index()
    staged = stage(buffer, "ddp_comm_hook")
    handle = _tr.allreduce_async_(staged.array, op=_tr.Average, name=f"{prefix}.bucket{index}")
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    failed: list[BaseException] = []

    def settle() -> BaseException | None:
        try:
            handle.wait()
        except BaseException as exc:
            return exc
        return failed[0] if failed else None

    queued = _raise_at_end_of_backward(index, settle)

    def done(h: "_tr.Handle") -> None:
        # Runs on whichever thread finished the op: set the future, never raise here.
        error = h.error()
        if error is None:
            try:
                staged.write_back()
            except BaseException as exc:  # a CUDA copy failing must reach DDP, not the loop
                error = exc
                failed.append(exc)
        if error is None or queued:
            # A failure is the callback's to raise: DDP gets the buffer as it is.
            future.set_result(buffer)
        else:
            future.set_exception(error)  # type: ignore[arg-type]  # torch's stub is wrong

    handle.add_done_callback(done)
    return future


def _sparse_hook(algorithm: Any) -> Any:
    worker = SparseWorker(f"totalreduce.{algorithm.name}_hook")

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        prefix = state if isinstance(state, str) else "ddp"
        buffer = bucket.buffer()
        index = bucket.index()
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

        def reduce() -> None:
            # Staged here, so that a tensor it refuses fails the job like any other error
            # (raised by backward(), see the module docstring), not the hook itself.
            staged = stage(buffer, f"{algorithm.name}_hook")
            algorithm.allreduce(staged.array, f"{prefix}.bucket{index}", out=staged.array)
            staged.write_back()

        # DDP hands buckets over in index order on every rank: the worker keeps it.
        job = worker.submit(reduce)
        queued = _raise_at_end_of_backward(index, job.exception)

        def done(j: Any) -> None:
            error = j.exception()
            if error is None or queued:
                future.set_result(buffer)
            else:
                future.set_exception(error)  # type: ignore[arg-type]  # torch's stub is wrong

        job.add_done_callback(done)
        return future

    hook.algorithm = algorithm  # type: ignore[attr-defined]  # its residuals, for checkpoints
    return hook


def oktopk_hook(density: float = 0.01, **knobs: Any) -> Any:
    """A DDP comm hook that averages each bucket with Ok-Topk (residuals per bucket)::

        model.register_comm_hook(None, totalreduce.torch.oktopk_hook(density=0.01))

    Each bucket's sparse allreduce (several blocking collectives) runs on a thread of
    the hook's own while backward goes on; DDP waits for it at the end of the pass.  The
    residuals live in ``hook.algorithm``.  With ``momentum=`` (momentum correction) the
    optimizer must run without momentum."""
    return _sparse_hook(OkTopk(density, **knobs))


def topka_hook(density: float = 0.01, **knobs: Any) -> Any:
    """A DDP comm hook with TopkA (see :func:`oktopk_hook`)."""
    return _sparse_hook(TopkA(density, **knobs))


def gtopk_hook(density: float = 0.01, exact_sums: bool = False, **knobs: Any) -> Any:
    """A DDP comm hook with gTopk, as published unless ``exact_sums`` (see
    :func:`oktopk_hook` and totalreduce.compression.GTopk)."""
    return _sparse_hook(GTopk(density, exact_sums=exact_sums, **knobs))
