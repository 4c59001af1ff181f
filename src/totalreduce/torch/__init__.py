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

import importlib.util

import torch

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
from ..objects import allgather_object, broadcast_object
from .checkpoint import TorchState
from .collectives import (
    Average,
    Max,
    Min,
    ProcessSet,
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
    global_process_set,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    poll,
    reducescatter,
    reducescatter_async,
    synchronize,
)
from .compression import Compression, Compressor
from .ddp import ddp_comm_hook, gtopk_hook, oktopk_hook, topka_hook
from .join import join
from .optimizer import DistributedOptimizer, StepTimings
from .state import broadcast_optimizer_state, broadcast_parameters

__all__ = [
    "AuthenticationError", "Average", "Compression", "Compressor", "DistributedOptimizer",
    "Max", "Min", "MismatchError", "OpTimeoutError", "PeerFailureError", "ProcessSet",
    "Product", "ShutdownError", "StepTimings", "Sum", "TorchHandle", "TorchState",
    "TotalReduceError", "checkpoint", "load_checkpoint", "version_number",
    "TransportClosedError", "allgather", "allgather_async", "allgather_object", "allreduce",
    "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async",
    "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "cross_rank",
    "cross_size", "cuda_built", "ddp_comm_hook", "gloo_built", "global_process_set",
    "gtopk_hook", "oktopk_hook", "topka_hook",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "init", "is_initialized", "join", "local_rank", "local_size",
    "mpi_built", "nccl_built", "poll", "rank", "reducescatter", "reducescatter_async",
    "shutdown", "size", "synchronize",
]


def cross_rank() -> int:
    """Index of this rank's host among the job's hosts (hosts hold equal rank counts)."""
    return rank() // local_size()


def cross_size() -> int:
    """Number of hosts in the job (hosts hold equal rank counts)."""
    return size() // local_size()


def mpi_built() -> bool:
    """Whether the MPI transport is available (mpi4py imports)."""
    return importlib.util.find_spec("mpi4py") is not None


def gloo_built() -> bool:
    """False: totalreduce has its own transports, not Gloo."""
    return False


def nccl_built() -> bool:
    """False: CUDA tensors are staged through host memory, not reduced by NCCL."""
    return False


def cuda_built() -> bool:
    """Whether CUDA tensors can be passed (they are staged through host memory)."""
    return torch.cuda.is_available()
