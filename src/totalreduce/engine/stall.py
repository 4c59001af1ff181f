"""The stall inspector: ops that wait too long get a warning, then an error.

A collective waits until every rank has submitted it, so a rank that skipped one, or
submitted ops in a different order under the same names, shows up here as a stall; the
messages say which ranks this one is still waiting for.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ..config import Config
from ..exceptions import OpTimeoutError
from .opstate import LiveOp

logger = logging.getLogger(__name__)


def waiting_on(op: LiveOp) -> str:
    ranks = sorted(p for p, left in op.pending_from.items() if left > 0)
    if not ranks:
        return "all data arrived; its last sends are still leaving this rank"
    return f"waiting for data from rank(s) {ranks}"


def overdue(rank: int, ops: Iterable[LiveOp], now: float, cfg: Config
            ) -> list[tuple[LiveOp, OpTimeoutError]]:
    """Warn (once per op) about ops waiting longer than ``stall_warning``; return those
    past ``op_timeout`` with the error to fail them with."""
    failed = []
    for op in ops:
        waited = now - op.t_start
        if cfg.op_timeout and waited > cfg.op_timeout:
            failed.append((op, OpTimeoutError(
                op.spec.describe.get("name", ""),
                f"rank {rank}: {op.spec.label} did not complete within "
                f"TOTALREDUCE_OP_TIMEOUT={cfg.op_timeout:g} s; {waiting_on(op)}. "
                "Check that every rank submits it, or raise TOTALREDUCE_OP_TIMEOUT.")))
        elif cfg.stall_warning and waited > cfg.stall_warning and not op.warned:
            op.warned = True
            logger.warning("rank %d: %s has waited %.0f s; %s. Some rank may not have "
                           "submitted it (TOTALREDUCE_STALL_WARNING=%g)", rank,
                           op.spec.label, waited, waiting_on(op), cfg.stall_warning)
    return failed
