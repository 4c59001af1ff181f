"""Horovod's questions about the build and the job, answered for totalreduce, and the
timeline switched on and off from the program.

The ``*_built`` queries say what this installation can use (Horovod's answer is about how
its C++ core was compiled); the ``*_enabled`` ones what the running job uses.  Each takes
Horovod's ``verbose`` argument and ignores it.
"""

from __future__ import annotations

import importlib.util

import torch

from .. import local_size, rank, runtime, size
from ..timeline import timeline_path


def cross_rank() -> int:
    """Index of this rank's host among the job's hosts (hosts hold equal rank counts)."""
    return rank() // local_size()


def cross_size() -> int:
    """Number of hosts in the job (hosts hold equal rank counts)."""
    return size() // local_size()


def mpi_built(verbose: bool = False) -> bool:
    """Whether the MPI transport is available (mpi4py imports)."""
    return importlib.util.find_spec("mpi4py") is not None


def mpi_enabled() -> bool:
    """Whether this job's ranks talk over MPI (launched by mpiexec with mpi4py)."""
    return runtime.current().transport_name == "mpi"


def mpi_threads_supported() -> bool:
    """Whether MPI runs with ``MPI_THREAD_MULTIPLE``, as Horovod answers it.

    Raises:
        ValueError: the job does not talk over MPI (as Horovod raises when its MPI is not
            enabled).
    """
    if not mpi_enabled():
        raise ValueError("mpi_threads_supported: this job does not use MPI (launch it with "
                         "mpiexec and TOTALREDUCE_TRANSPORT=mpi)")
    from mpi4py import MPI

    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)


def gloo_built(verbose: bool = False) -> bool:
    """False: totalreduce has its own transports, not Gloo."""
    return False


def gloo_enabled() -> bool:
    """False: totalreduce has its own transports, not Gloo."""
    return False


def nccl_built(verbose: bool = False) -> bool:
    """False: CUDA tensors are staged through host memory, not reduced by NCCL."""
    return False


def ddl_built(verbose: bool = False) -> bool:
    """False: IBM DDL is not used."""
    return False


def ccl_built(verbose: bool = False) -> bool:
    """False: Intel oneCCL is not used."""
    return False


def rocm_built(verbose: bool = False) -> bool:
    """False: no ROCm collectives (ROCm tensors are not staged either)."""
    return False


def cuda_built(verbose: bool = False) -> bool:
    """Whether this torch was built with CUDA, so CUDA tensors can be passed (they are
    staged through host memory)."""
    return bool(torch.backends.cuda.is_built())


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing the timeline (as ``TOTALREDUCE_TIMELINE`` does from ``init()``) to
    ``file_path`` on rank 0 and ``file_path.r`` on rank r; a trace being written is
    closed first.  Call it on every rank.

    Args:
        file_path: where the trace goes (its folder is made if missing).
        mark_cycles: accepted for Horovod compatibility; no cycle marks are written.
    """
    del mark_cycles
    rt = runtime.current()
    rt.timeline.start(timeline_path(file_path, rt.rank))


def stop_timeline() -> None:
    """Close the timeline's file (it loads as it is); nothing more is traced until
    :func:`start_timeline`."""
    runtime.current().timeline.close()
