"""The numpy-level API, which the package re-exports (``import totalreduce as tr``).

The names mirror Horovod's, so porting a script means changing the import.  Every
collective has a blocking form that returns a new array, an in-place form ending in ``_``
where Horovod has one, and ``_async`` forms returning a :class:`Handle`.

Ops are matched across ranks by name and call count (see ``scheduling/selfguided.py``),
not by order of arrival, so ranks may submit async ops in different orders.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import runtime as _runtime
from .exceptions import (
    AuthenticationError,
    MismatchError,
    OpTimeoutError,
    PeerFailureError,
    ShutdownError,
    TotalReduceError,
    TransportClosedError,
)
from .objects import allgather_object, broadcast_object
from .scheduling import Handle, ReduceOp, Scheduler
from .scheduling.process_sets import ProcessSet, global_process_set
from .version import __version__ as __version__

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

__all__ = [
    "AuthenticationError", "Average", "Handle", "Max", "Min", "MismatchError",
    "OpTimeoutError", "PeerFailureError", "ProcessSet", "Product", "ReduceOp",
    "ShutdownError", "Sum", "add_process_set", "global_process_set", "remove_process_set",
    "TotalReduceError", "TransportClosedError", "allgather", "allgather_async",
    "allgather_object", "broadcast_object", "allreduce",
    "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async",
    "average",
    "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "checkpoint", "load_checkpoint", "version_number",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "init",
    "is_initialized", "join", "local_rank", "local_size", "poll", "rank", "reducescatter",
    "reducescatter_async", "recv", "recv_async", "send", "send_async", "shutdown", "size",
    "synchronize", "transport_stats",
]


# --- lifecycle ------------------------------------------------------------------------


def init(**config: Any) -> None:
    """Join the job: find the other ranks and connect to them.

    Reads rank and world size from totalrun, torchrun, SLURM or an MPI launcher (see
    ``rendezvous/env.py``); with none of them the process is a world of one.  Keyword
    arguments override ``TOTALREDUCE_*`` settings (see ``config.py``).  Calling it again
    while initialized does nothing, unless it asks for settings other than the live ones.

    Raises:
        ValueError: the launcher environment is incomplete (the message says what to set),
            or a second call asks for different settings.
        OSError: peers could not be reached within ``connect_timeout``.
        TypeError: an unknown setting was passed.
    """
    _runtime.init(**config)


def shutdown() -> None:
    """Leave the job in an orderly way.  Pending ops fail; later calls need ``init()``."""
    _runtime.shutdown()


def is_initialized() -> bool:
    return _runtime.is_initialized()


def rank() -> int:
    return _runtime.current().rank


def size() -> int:
    return _runtime.current().size


def local_rank() -> int:
    return _runtime.current().local_rank


def local_size() -> int:
    return _runtime.current().local_size


def transport_stats() -> dict[str, int]:
    """What this rank's transport has moved since ``init()``: ``messages_sent``,
    ``bytes_sent``, ``messages_received``, ``bytes_received`` (whole messages, 64-byte
    headers included, as they left or arrived), ``bodies_lent`` (bodies a same-host
    peer copied straight out of this process's memory instead of through a ring) and
    ``bodies_spread`` (lent bodies this rank copied half of, the idle lender the other
    half)."""
    return _runtime.current().transport.stats()


def _ops(process_set: ProcessSet | None = None, what: str = "") -> Scheduler:
    """What runs an op on ``process_set`` (the whole job's scheduler by default)."""
    rt = _runtime.current()
    if process_set is None or process_set is global_process_set:
        return rt.collectives
    return rt.process_sets.scheduler(process_set, what)


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set (a ``ProcessSet`` or a list of ranks) and return it.

    A collective of the whole job: every rank adds the same sets in the same order, and
    ranks outside a set register it too.  Ops on it (``process_set=``) run over its ranks
    only, concurrently with other sets' ops; ranks, ``root_rank`` included, stay the
    job's ranks.

    Raises:
        ValueError: the ranks asked for different sets (every rank's error says which
            rank asked for what), a rank outside the job, or a set already registered.
        NotImplementedError: negotiated coordination or recovery (totalrun
            --max-restarts) is on.
    """
    return _runtime.current().process_sets.add(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Forget ``process_set`` on every rank (a collective of the whole job); False if it
    was not registered."""
    return _runtime.current().process_sets.remove(process_set)


# --- allreduce ------------------------------------------------------------------------


def allreduce_async(x: Any, op: ReduceOp = Average, name: str | None = None,
                    priority: int = 0,
    process_set: ProcessSet = global_process_set) -> Handle:
    """Start an allreduce of ``x``; ``handle.wait()`` returns a new array.

    Args:
        x: array of bool, uint8, int8, uint16, int16, int32, int64, float16, float32 or
            float64, any shape, empty and 0-d included; non-contiguous arrays are copied.
        op: ``Average`` (default, as in Horovod), ``Sum``, ``Min``, ``Max`` or ``Product``.
            Integer averages are the wrapping sum divided and truncated toward zero
            (as in Horovod: -75 / 2 gives -37).  On bool arrays
            Sum and Max are a logical or, Min and Product a logical and (as numpy's).
        name: matches this op across ranks; unnamed ops match by call order.
        priority: higher runs first; a big op yields to a more urgent one between pieces.

    Raises:
        TypeError: unsupported dtype, an object array, an op that is not one, a name that
            is not a str, or Average of a bool array.
        ValueError: unknown op.
    """
    if process_set is global_process_set:  # _ops' answer, without the call
        return _runtime.current().collectives.allreduce(x, op, name, priority, False)
    return _ops(process_set, "allreduce").allreduce(x, op, name, priority, inplace=False)


def allreduce_async_(x: np.ndarray, op: ReduceOp = Average, name: str | None = None,
                     priority: int = 0,
    process_set: ProcessSet = global_process_set) -> Handle:
    """In-place :func:`allreduce_async`: ``x`` holds the result once the handle is done."""
    if process_set is global_process_set:  # _ops' answer, without the call: a training
        # step may submit thousands of tiny tensors, and this is most of what each costs
        return _runtime.current().collectives.allreduce(x, op, name, priority, True)
    return _ops(process_set, "allreduce_").allreduce(x, op, name, priority, inplace=True)


def allreduce(x: Any, op: ReduceOp = Average, name: str | None = None,
              priority: int = 0,
    process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Reduce ``x`` over all ranks and return the result as a new array.

    Raises:
        MismatchError: ranks disagree on the shape, dtype or op of this call.
        PeerFailureError: a rank died.
        OpTimeoutError: the op waited longer than ``TOTALREDUCE_OP_TIMEOUT``.
    """
    # At once on this thread where the scheduler can (a repeated small one), else
    # submitted and waited for.  _ops' answer inline, as in allreduce_async_: a blocking
    # 8-byte allreduce takes tens of microseconds, and each call on its way a share.
    ops = _runtime.current().collectives if process_set is global_process_set \
        else _ops(process_set, "allreduce")
    done = ops.allreduce_now(x, op, name, priority, False)
    return done if done is not None else _submit_and_wait(ops, x, op, name, priority, False)


def allreduce_(x: np.ndarray, op: ReduceOp = Average, name: str | None = None,
               priority: int = 0,
    process_set: ProcessSet = global_process_set) -> np.ndarray:
    """In-place :func:`allreduce`; returns ``x``."""
    ops = _runtime.current().collectives if process_set is global_process_set \
        else _ops(process_set, "allreduce_")
    done = ops.allreduce_now(x, op, name, priority, True)
    return done if done is not None else _submit_and_wait(ops, x, op, name, priority, True)


def _submit_and_wait(ops: Scheduler, x: Any, op: ReduceOp, name: str | None,
                     priority: int, inplace: bool) -> np.ndarray:
    """A blocking allreduce that the scheduler could not run at once."""
    with ops.caller_waits():
        return ops.allreduce(x, op, name, priority, inplace=inplace).wait()


def grouped_allreduce_async(xs: Sequence[Any], op: ReduceOp = Average,
                            name: str | None = None, priority: int = 0,
    process_set: ProcessSet = global_process_set) -> Handle:
    """Allreduce a list of arrays as one call (the small ones fused per dtype where ops
    cost more than the copies); ``wait()`` returns a list."""
    return _ops(process_set, "grouped_allreduce").grouped_allreduce(xs, op, name, priority,
                                                                 inplace=False)


def grouped_allreduce(xs: Sequence[Any], op: ReduceOp = Average, name: str | None = None,
                      priority: int = 0,
    process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    ops = _ops(process_set, "grouped_allreduce")
    with ops.caller_waits():
        return ops.grouped_allreduce(xs, op, name, priority, False).wait()


def grouped_allreduce_async_(xs: Sequence[np.ndarray], op: ReduceOp = Average,
                             name: str | None = None, priority: int = 0,
    process_set: ProcessSet = global_process_set) -> Handle:
    """In-place form of :func:`grouped_allreduce_async`: ``xs`` receive the results."""
    return _ops(process_set, "grouped_allreduce_").grouped_allreduce(xs, op, name, priority,
                                                                  inplace=True)


def grouped_allreduce_(xs: Sequence[np.ndarray], op: ReduceOp = Average,
                       name: str | None = None, priority: int = 0,
    process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    ops = _ops(process_set, "grouped_allreduce_")
    with ops.caller_waits():
        return ops.grouped_allreduce(xs, op, name, priority, True).wait()


# --- the others -----------------------------------------------------------------------


def allgather_async(x: Any, name: str | None = None, priority: int = 0,
    process_set: ProcessSet = global_process_set, out: np.ndarray | None = None,
    same_shape: bool = False) -> Handle:
    """Concatenate every rank's ``x`` along axis 0 (first dimensions may differ).

    ``out``: a writable C-contiguous array of ``x``'s dtype and trailing dimensions, with
    as many rows as the result, to write it to (and return) instead of a new array; as
    torch's ``all_gather_into_tensor`` and MPI's receive buffer.  A big result in a new
    array costs its pages' first touch on every call, about as much as the copies.

    ``same_shape=True``: every rank passes it and an ``x`` of the same shape (as
    MPI_Allgather's equal counts), so no rank needs to learn the others' rows first: the
    call skips that exchange, a round trip (half a small gather's time).  A rank that
    passes another shape or flag makes the call fail on every rank (MismatchError).

    ``x`` is read while the op runs (peers may copy it straight out of this process):
    leave it as it is until ``wait()`` returns, as with Horovod's and torch.distributed's
    async ops.

    Raises:
        ValueError: ``out`` does not fit (its rows only once the others' are known: the
            call then completes for every rank and raises on this one).
    """
    return _ops(process_set, "allgather").allgather(x, name, priority, out, same_shape)


def allgather(x: Any, name: str | None = None, priority: int = 0,
    process_set: ProcessSet = global_process_set, out: np.ndarray | None = None,
              same_shape: bool = False) -> np.ndarray:
    ops = _ops(process_set, "allgather")
    done = ops.allgather_now(x, name, priority, out, same_shape)
    if done is not None:
        return done
    with ops.caller_waits():
        return ops.allgather(x, name, priority, out, same_shape).wait()


def broadcast_async(x: Any, root_rank: int, name: str | None = None,
                    priority: int = 0,
    process_set: ProcessSet = global_process_set) -> Handle:
    """Every rank gets ``root_rank``'s ``x`` (all ranks pass the same shape and dtype).

    Raises:
        ValueError: ``root_rank`` is not a rank of the job.
    """
    return _ops(process_set, "broadcast").broadcast(x, root_rank, name, priority, inplace=False)


def broadcast_async_(x: np.ndarray, root_rank: int, name: str | None = None,
                     priority: int = 0,
    process_set: ProcessSet = global_process_set) -> Handle:
    return _ops(process_set, "broadcast_").broadcast(x, root_rank, name, priority, inplace=True)


def broadcast(x: Any, root_rank: int, name: str | None = None,
              priority: int = 0,
    process_set: ProcessSet = global_process_set) -> np.ndarray:
    ops = _ops(process_set, "broadcast")
    done = ops.broadcast_now(x, root_rank, name, priority, False)
    if done is not None:
        return done
    with ops.caller_waits():
        return ops.broadcast(x, root_rank, name, priority, inplace=False).wait()


def broadcast_(x: np.ndarray, root_rank: int, name: str | None = None,
               priority: int = 0,
    process_set: ProcessSet = global_process_set) -> np.ndarray:
    ops = _ops(process_set, "broadcast_")
    done = ops.broadcast_now(x, root_rank, name, priority, True)
    if done is not None:
        return done
    with ops.caller_waits():
        return ops.broadcast(x, root_rank, name, priority, inplace=True).wait()


def alltoall_async(x: Any, splits: Any = None, name: str | None = None,
                   priority: int = 0,
    process_set: ProcessSet = global_process_set, out: np.ndarray | None = None,
    same_shape: bool = False) -> Handle:
    """Send rows ``splits[i]`` of ``x`` (along axis 0) to rank ``i``.

    ``splits=None`` divides the rows as evenly as possible, lower ranks taking the extra
    rows.  ``wait()`` returns ``(output, received_splits)``.  ``out``: as allgather's
    (the received rows go there; it must not overlap ``x``).  ``same_shape=True``: as
    allgather's (MPI_Alltoall's equal counts), with ``splits=None``: every rank then
    receives as many rows from each rank as it sends itself.  ``x`` is read while the op
    runs: as allgather's, leave it as it is until ``wait()`` returns.

    Raises:
        ValueError: ``splits`` is not one non-negative count per rank summing to
            ``x.shape[0]`` (or given with ``same_shape=True``), or ``out`` does not fit.
    """
    return _ops(process_set, "alltoall").alltoall(x, splits, name, priority, out,
                                                  same_shape)


def alltoall(x: Any, splits: Any = None, name: str | None = None,
             priority: int = 0,
    process_set: ProcessSet = global_process_set, out: np.ndarray | None = None,
             same_shape: bool = False) -> tuple[np.ndarray, np.ndarray]:
    ops = _ops(process_set, "alltoall")
    done = ops.alltoall_now(x, splits, name, priority, out, same_shape)
    if done is not None:
        return done
    with ops.caller_waits():
        return ops.alltoall(x, splits, name, priority, out, same_shape).wait()


def reducescatter_async(x: Any, op: ReduceOp = Average, name: str | None = None,
                        priority: int = 0,
    process_set: ProcessSet = global_process_set) -> Handle:
    """Reduce ``x`` over all ranks and keep this rank's share of axis 0.

    Rows are split as evenly as possible; lower ranks take the extra rows.
    """
    return _ops(process_set, "reducescatter").reducescatter(x, op, name, priority)


def reducescatter(x: Any, op: ReduceOp = Average, name: str | None = None,
                  priority: int = 0,
    process_set: ProcessSet = global_process_set) -> np.ndarray:
    ops = _ops(process_set, "reducescatter")
    done = ops.reducescatter_now(x, op, name, priority)
    if done is not None:
        return done
    with ops.caller_waits():
        return ops.reducescatter(x, op, name, priority).wait()


def average(arrays: np.ndarray | Sequence[np.ndarray], name: str | None = None,
            process_set: ProcessSet = global_process_set) -> Any:
    """Average ``arrays`` (an array or a list of them: a model's parameters) over the
    ranks, in place, and return them: the step of parameter averaging (local SGD).  The
    arrays must be writable numpy arrays of the same shapes and dtypes on every rank.

    Raises:
        TypeError: not numpy arrays, or an unsupported dtype.
        MismatchError: ranks disagree on the shapes or dtypes.
    """
    single = isinstance(arrays, np.ndarray)
    group = [arrays] if single else list(arrays)  # type: ignore[list-item]
    ops = _ops(process_set, "average")
    with ops.caller_waits():
        ops.grouped_allreduce(group, Average, name, 0, inplace=True).wait()
    return arrays


# --- point-to-point -------------------------------------------------------------------


def send_async(x: Any, dest: int, tag: int = 0) -> Handle:
    """Start sending ``x`` to rank ``dest``; ``handle.wait()`` returns None once it is
    sent (``x`` is copied first, so it may change meanwhile).

    Messages of one ``tag`` (0..32767) from one rank to another are received in the order
    they were sent; a message sent before its receive is posted waits on the receiver,
    within ``TOTALREDUCE_FLOATING_CAP``, and beyond it on the sender.

    Raises:
        ValueError: ``dest`` is not another rank of the job, or a bad tag.
        TypeError: an unsupported dtype.
        NotImplementedError: recovery (``--max-restarts``) is on.
    """
    return _runtime.current().messages("send").send(x, dest, tag)


def send(x: Any, dest: int, tag: int = 0) -> None:
    """Send ``x`` to rank ``dest`` and return once it is sent (see :func:`send_async`).

    A receive of another size or dtype fails on the receiver, with a MismatchError
    naming both ranks; the send has usually completed by then (as MPI_Send may return
    before the receive is posted) and raises it only if it was still in flight.

    Raises:
        PeerFailureError: ``dest`` died or shut down first.
    """
    messages = _runtime.current().messages("send")
    with messages.caller_waits():
        messages.send(x, dest, tag).wait()


def recv_async(buf: Any, source: int | None = None, tag: int = 0) -> Handle:
    """Start receiving the next message of ``tag`` from rank ``source`` (None: from any
    rank) into ``buf``, a numpy array or a ``(shape, dtype)`` pair to allocate one.
    ``handle.wait()`` returns the array, or ``(array, source)`` when ``source`` is None.

    The message must have ``buf``'s dtype and number of elements (its shape may differ).

    Raises:
        ValueError: ``source`` is not another rank of the job, a bad tag, or a read-only
            ``buf``.
        TypeError: ``buf`` is neither an array nor a ``(shape, dtype)`` pair.
        NotImplementedError: recovery (``--max-restarts``) is on.
    """
    return _runtime.current().messages("recv").recv(buf, source, tag)


def recv(buf: Any, source: int | None = None, tag: int = 0) -> Any:
    """Receive a message (see :func:`recv_async`): the array filled, or ``(array,
    source)`` when ``source`` is None.

    Raises:
        MismatchError: the message has another size or dtype (naming both ranks).
        PeerFailureError: ``source`` (or, for any source, every other rank) died or
            shut down before sending it.
    """
    messages = _runtime.current().messages("recv")
    with messages.caller_waits():
        return messages.recv(buf, source, tag).wait()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank (of ``process_set``) has entered the barrier."""
    ops = _runtime.current().collectives if process_set is global_process_set \
        else _ops(process_set, "barrier")  # as allreduce's
    if not ops.barrier_now():
        with ops.caller_waits():
            ops.barrier().wait()


def join() -> int:
    """This rank has no more data: take part in the peers' allreduces with the identity
    of their op (zeros for Sum and Average) until every rank has joined.

    Returns:
        The rank that called ``join()`` last (by the wall clock of the calls).
    """
    return int(_ops().join())


# --- checkpoints (Rabit's model) --------------------------------------------------------


def load_checkpoint() -> tuple[int, dict[str, Any] | None]:
    """The newest checkpoint: ``(0, None)`` on a fresh start; in a worker that totalrun
    restarted (``--max-restarts``), the version and state its peers kept in memory.

    Call it first, and loop from the version it returns::

        version, state = tr.load_checkpoint()
        model = state["w"] if state else init_model()
        for epoch in range(version, epochs):
            ...collectives...
            tr.checkpoint({"w": model})

    Returns:
        ``(version, state)``: the number of checkpoints taken, and a copy of the last
        one's state (None before the first).
    """
    return _runtime.current().load_checkpoint()


def checkpoint(state: dict[str, Any]) -> None:
    """Keep ``state`` as the next checkpoint (a collective: every rank calls it).

    Every rank keeps a copy in memory; with ``totalrun --max-restarts`` a restarted worker
    gets it from a survivor, then the results of the collectives made since, so it
    catches up without anyone recomputing.  Nothing is written to disk.

    Args:
        state: a dict of numpy arrays and plain scalars (bool, int, float, str, None).

    Raises:
        TypeError: a value that is neither (nothing is ever pickled).
    """
    _runtime.current().checkpoint(state)


def version_number() -> int:
    """How many checkpoints this job has taken (the version ``load_checkpoint`` returns)."""
    return _runtime.current().version_number()


def synchronize(handle: Handle) -> Any:
    """Horovod's name for ``handle.wait()``."""
    return handle.wait()


def poll(handle: Handle) -> bool:
    """Horovod's name for ``handle.done()``."""
    return handle.done()
