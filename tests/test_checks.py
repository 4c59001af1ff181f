"""Every bad argument gets the same error, word for word, under both scheduling modes
(scheduling/checks.py), in a one-rank job."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import totalreduce as tr

x = np.arange(6.0).reshape(3, 2)
readonly = np.ones(3)
readonly.flags.writeable = False

CASES: dict[str, tuple[type[Exception], Callable[[], Any]]] = {
    "object array": (TypeError, lambda: tr.allreduce(np.array([object()], dtype=object))),
    "complex dtype": (TypeError, lambda: tr.allreduce(np.ones(3, np.complex64))),
    "op not an op": (TypeError, lambda: tr.allreduce(x, op="sum")),  # type: ignore[arg-type]
    "op bool": (TypeError, lambda: tr.allreduce(x, op=True)),  # type: ignore[arg-type]
    "op unknown": (ValueError, lambda: tr.allreduce(x, op=99)),  # type: ignore[arg-type]
    "average of bools": (TypeError, lambda: tr.allreduce(np.ones(2, bool))),
    "name not a str": (TypeError, lambda: tr.allreduce(x, name=123)),  # type: ignore[arg-type]
    "in place on a list": (TypeError, lambda: tr.allreduce_([1.0, 2.0])),  # type: ignore[arg-type]
    "in place read-only": (ValueError, lambda: tr.allreduce_(readonly)),
    "grouped object": (TypeError, lambda: tr.grouped_allreduce(
        [x, np.array([None], dtype=object)])),
    "grouped in place on a list": (TypeError, lambda: tr.grouped_allreduce_(
        [x, [1.0]])),  # type: ignore[list-item]
    "grouped average of bools": (TypeError, lambda: tr.grouped_allreduce([np.ones(2, bool)])),
    "root outside": (ValueError, lambda: tr.broadcast(x, root_rank=5)),
    "root negative": (ValueError, lambda: tr.broadcast(x, root_rank=-1)),
    "root a str": (ValueError, lambda: tr.broadcast(x, root_rank="0")),  # type: ignore[arg-type]
    "root a bool": (ValueError, lambda: tr.broadcast(x, root_rank=True)),
    "broadcast in place on a list": (TypeError, lambda: tr.broadcast_([1.0], 0)),  # type: ignore[arg-type]
    "reducescatter 0-d": (ValueError, lambda: tr.reducescatter(np.float64(3.0))),
    "reducescatter average of bools": (TypeError, lambda: tr.reducescatter(np.ones(2, bool))),
    "reducescatter named badly": (TypeError, lambda: tr.reducescatter(x, name=1)),  # type: ignore[arg-type]
    "allgather 0-d": (ValueError, lambda: tr.allgather(np.float64(1.0), name="g")),
    "alltoall 0-d": (ValueError, lambda: tr.alltoall(np.float64(1.0))),
    "alltoall splits too many": (ValueError, lambda: tr.alltoall(x, splits=[1, 2])),
    "alltoall splits negative": (ValueError, lambda: tr.alltoall(x, splits=[-1])),
    "alltoall splits short": (ValueError, lambda: tr.alltoall(x, splits=[2], name="a")),
    "alltoall splits not ints": (ValueError, lambda: tr.alltoall(x, splits=[3.0])),
}


def _errors(coordination: str) -> dict[str, tuple[type[Exception], str]]:
    tr.init(coordination=coordination)
    try:
        out = {}
        for case, (_kind, call) in CASES.items():
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - the type is what is compared
                out[case] = (type(exc), str(exc))
            else:
                out[case] = (type(None), "accepted")
        tr.barrier()  # the job still works after every refusal
        return out
    finally:
        tr.shutdown()


@pytest.fixture(scope="module")
def both() -> tuple[dict[str, Any], dict[str, Any]]:
    return _errors("selfguided"), _errors("negotiated")


@pytest.mark.parametrize("case", list(CASES))
def test_both_modes_refuse_alike(case: str, both: tuple[dict[str, Any], dict[str, Any]]
                                 ) -> None:
    selfguided, negotiated = both
    assert selfguided[case][0] is CASES[case][0], selfguided[case]
    assert selfguided[case] == negotiated[case]
