"""Horovod's PyTorch API on totalreduce: change ``import horovod.torch as hvd`` to
``import totalreduce.torch as hvd``.

- Collectives on tensors with Horovod's names, arguments and defaults
  (``collectives.py``); CPU tensors travel without a copy (``tensors.py``).
- :class:`DistributedOptimizer`, whose gradient hooks start each bucket's reduction while
  backward is still running (``optimizer.py``, ``buckets.py``).
- ``broadcast_parameters``, ``broadcast_optimizer_state``, ``broadcast_object``,
  ``allgather_object`` to start every rank from the same state (``state.py``).
- ``join()`` for ranks that run out of data first (``join.py``).
- :func:`ddp_comm_hook` for DDP users who keep DDP and reduce through totalreduce, and
  :func:`oktopk_hook` (``topka_hook``, ``gtopk_hook``) to reduce DDP's buckets sparsely.

Needs the ``torch`` extra: ``pip install torch==2.13.0 && pip install "totalreduce[torch]"``.
"""

from __future__ import annotations

from totalreduce import ProcessSet, add_process_set, global_process_set, remove_process_set

from .. import (
    AuthenticationError,
    MismatchError,
    OpTimeoutError,
    PeerFailureError,
    ShutdownError,
    TotalReduceError,
    TransportClosedError,
    checkpoint,
    init,
    is_initialized,
    load_checkpoint,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
    version_number,
)
from ..exceptions import HorovodInternalError
from ..objects import allgather_object, broadcast_object
from .adasum import Adasum
from .averaging import PeriodicAverager, PostLocalSGDOptimizer
from .basics import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
    start_timeline,
    stop_timeline,
)
from .checkpoint import TorchState
from .collectives import (
    Average,
    Max,
    Min,
    Product,
    Sum,
    TorchHandle,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    poll,
    reducescatter,
    reducescatter_async,
    synchronize,
)
from .compression import Compression, Compressor
from .ddp import ddp_comm_hook, gtopk_hook, oktopk_hook, topka_hook
from .join import join
from .messages import recv, recv_async, send, send_async
from .optimizer import DistributedOptimizer, StepTimings
from .sparse_tensors import sparse_allreduce_async
from .state import broadcast_optimizer_state, broadcast_parameters
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    "Adasum", "AuthenticationError", "Average", "Compression", "Compressor",
    "DistributedOptimizer", "HorovodInternalError", "Max", "Min", "MismatchError",
    "OpTimeoutError", "PeerFailureError", "PeriodicAverager", "PostLocalSGDOptimizer",
    "ProcessSet", "Product", "ShutdownError",
    "StepTimings", "Sum", "SyncBatchNorm", "TorchHandle", "TorchState", "TotalReduceError",
    "TransportClosedError", "add_process_set", "allgather", "allgather_async",
    "allgather_object", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "ccl_built", "checkpoint", "cross_rank", "cross_size",
    "cuda_built", "ddl_built", "ddp_comm_hook", "global_process_set", "gloo_built",
    "gloo_enabled", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter", "grouped_reducescatter_async", "gtopk_hook", "init",
    "is_initialized", "join", "load_checkpoint", "local_rank", "local_size", "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "nccl_built", "oktopk_hook", "poll", "rank",
    "recv", "recv_async", "reducescatter", "reducescatter_async", "remove_process_set",
    "rocm_built", "send", "send_async", "shutdown",
    "size", "sparse_allreduce_async", "start_timeline", "stop_timeline", "synchronize",
    "topka_hook", "version_number",
]

