"""Shared fixtures: which transports the multi-process tests run over."""

from __future__ import annotations

import pytest

from harness import TRANSPORTS, mpiexec


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    if request.param == "mpi" and mpiexec() is None:
        pytest.skip("mpi transport: mpi4py/mpiexec not installed (pip install '.[mpi]')")
    return request.param
