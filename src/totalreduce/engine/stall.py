"""The stall inspector (self-guided mode): ops that wait too long get a warning, then an
error.

A collective waits until every rank has submitted it, so a rank that skipped one, or
submitted ops in a different order under the same names, shows up here as a stall.  A
rank knows which peers have submitted an op from their READY (or the data they sent), so
the warning names the ranks that submitted it and the ranks that have not.  Every rank
that waits on the op runs the same clock, so with ``TOTALREDUCE_STALL_SHUTDOWN_TIME`` each
of them fails it rather than wait on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ..config import Config
from ..exceptions import OpTimeoutError
from .opstate import LiveOp

logger = logging.getLogger(__name__)


def waiting_on(rank: int, size: int, op: LiveOp) -> str:
    """Who has submitted ``op`` as far as this rank knows, and whose data is missing."""
    missing = sorted(p for p, left in op.pending_from.items() if left > 0)
    if not missing:
        return "all data arrived; its last sends are still leaving this rank"
    heard = op.ready_peers | {p for p, _step, _piece in op.got}
    submitted = sorted({rank} | heard)
    everyone = range(size) if op.spec.ranks is None else op.spec.ranks
    not_yet = sorted(set(everyone) - set(submitted))
    text = f"submitted by rank(s) {submitted}"
    if not_yet:
        text += f", not (yet) by rank(s) {not_yet}"
    return text + f"; waiting for data from rank(s) {missing}"


def overdue(rank: int, size: int, ops: Iterable[LiveOp], now: float, cfg: Config
            ) -> list[tuple[LiveOp, OpTimeoutError]]:
    """Warn (once per op) about ops waiting longer than ``stall_check_time``; return those
    past ``stall_shutdown_time`` or ``op_timeout`` with the error to fail them with."""
    limits = [(t, name) for t, name in ((cfg.stall_shutdown_time,
                                         "TOTALREDUCE_STALL_SHUTDOWN_TIME"),
                                        (cfg.op_timeout, "TOTALREDUCE_OP_TIMEOUT")) if t]
    limit, setting = min(limits) if limits else (0.0, "")
    failed = []
    for op in ops:
        waited = now - op.t_start
        if limit and waited > limit:
            failed.append((op, OpTimeoutError(
                op.spec.describe.get("name", ""),
                f"rank {rank}: {op.spec.label} did not complete within {setting}="
                f"{limit:g} s; {waiting_on(rank, size, op)}. Check that every rank "
                f"submits it, or raise {setting}.")))
        elif cfg.stall_check_time and waited > cfg.stall_check_time and not op.warned:
            op.warned = True
            logger.warning("rank %d: %s has waited %.0f s; %s "
                           "(TOTALREDUCE_STALL_CHECK_TIME=%g)", rank, op.spec.label, waited,
                           waiting_on(rank, size, op), cfg.stall_check_time)
    return failed
