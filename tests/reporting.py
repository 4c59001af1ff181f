"""How a test rank reports its results: ``report(name=value, ...)`` merges them into a JSON
file of its own, which the harness reads back as ``result.report(rank)``.  Values are
JSON (numbers, strings, lists, dicts); stdout stays for what a user would see."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def rank() -> int:
    for name in ("TOTALREDUCE_RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID",
                 "RANK"):
        value = os.environ.get(name)
        if value:
            return int(value)
    return 0


# Set by a job that runs several workers in turn (torch_workers.shared): each one's
# reports go under its part's name, so that parts that report the same field keep apart.
section: str | None = None


def report(**fields: Any) -> None:
    folder = os.environ.get("WORKER_REPORT_DIR")
    if not folder:
        return  # run by hand: nobody is reading
    path = Path(folder) / f"{rank()}.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    if section is None:
        data.update(fields)
    else:
        data[section] = {**data.get(section, {}), **fields}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def read_reports(folder: str) -> dict[int, dict[str, Any]]:
    out = {}
    for path in Path(folder).glob("*.json"):
        out[int(path.stem)] = json.loads(path.read_text())
    return out


def wait_for_report(rank: int, key: str, timeout: float) -> bool:
    """Wait until rank ``rank`` has reported ``key`` (True), or ``timeout`` seconds pass
    (False).  Lets a test order events across ranks without guessing how long a step
    takes: a rank that must outlast a peer's step waits for the peer to report it."""
    folder = os.environ.get("WORKER_REPORT_DIR")
    if not folder:
        return True
    path = Path(folder) / f"{rank}.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if key in json.loads(path.read_text()):
                return True
        except (OSError, ValueError):
            pass  # not written yet
        time.sleep(0.05)
    return False
