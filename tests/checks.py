"""Many checks in one multi-process job, with the ranks brought back in step after each.

``run_checks([(label, fn), ...])`` runs the checks in order on every rank.  After each
one, every rank joins an agreement (an allgather of "did it pass here", under a name of
its own so that no op a failed check left behind can match it).  If any rank failed, every
rank stops there, reports ``failed_check`` and raises one message naming the check and
each rank that failed it with its error, so a failure on one rank never sends the other
ranks into the next check's collectives, where they would fail with errors that have
nothing to do with the cause.

A check can also fail on one rank before a collective that the others then wait in
forever.  The failing rank waits for the agreement only ``agree_timeout`` seconds, then
reports and raises anyway: its exit makes totalrun end the job (the others die inside
the check, with no later check started).

Reports (``reporting.py``): ``checks_started`` (the labels begun, in order) and, on a
failure, ``failed_check = {"index", "check", "errors": {rank: message}}``.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence

import numpy as np

import totalreduce as tr
from reporting import report

Check = tuple[str, Callable[[], None]]


class CheckFailed(AssertionError):
    """A check failed on some rank; raised on every rank that learned of it."""


def run_checks(checks: Sequence[Check], *, agree_timeout: float = 20.0,
               prefix: str = "checks") -> None:
    r = tr.rank()
    started: list[str] = []
    for index, (label, fn) in enumerate(checks):
        started.append(label)
        report(checks_started=list(started))
        error = None
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - every failure is reported below
            error = f"{type(exc).__name__}: {exc}"
            # The last lines name where it failed; the whole traceback goes to stderr.
            traceback.print_exc()
        handle = tr.allgather_async(np.array([0 if error is None else 1], np.int8),
                                    name=f"{prefix}.agree.{index}")
        try:
            failed = handle.wait(agree_timeout if error is not None else None)
        except TimeoutError:
            _fail(index, label, {r: error or ""},
                  f"rank {r} got no agreement within {agree_timeout:g} s: the other ranks "
                  "are still inside the check (waiting on a collective this rank never "
                  "submitted?)")
        if not failed.any():
            continue
        messages = tr.allgather_object(error, name=f"{prefix}.errors.{index}")
        _fail(index, label, {q: m for q, m in enumerate(messages) if m is not None}, "",
              everyone=True)


def _fail(index: int, label: str, errors: dict[int, str], note: str,
          everyone: bool = False) -> None:
    """Report and raise; with ``everyone`` (every rank is here too), only once every rank
    has reported, since a rank that raised and left first would fail
    the op the others are still finishing (a peer's exit fails its ops in flight)."""
    report(failed_check={"index": index, "check": label,
                         "errors": {str(q): m for q, m in errors.items()}})
    if everyone:
        tr.barrier()
    shown = "; ".join(f"rank {q}: {m}" for q, m in sorted(errors.items()))
    raise CheckFailed(f"check #{index} '{label}' failed on rank(s) "
                      f"{', '.join(map(str, sorted(errors)))}: {shown}"
                      + (f" ({note})" if note else ""))
