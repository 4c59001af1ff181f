"""Where ``mpiexec`` is: the one next to this interpreter (the ``mpich`` wheel's), else PATH."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path


def find_mpiexec() -> str | None:
    """Path of an ``mpiexec`` usable with mpi4py, or None when mpi4py is not installed."""
    if importlib.util.find_spec("mpi4py") is None:
        return None
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")
