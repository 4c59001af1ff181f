"""``--compare OLD.json``: each cell of this run against the same cell of a saved run.

A cell is one row of the summary, named by everything in it that is not a measurement
(op, size, ranks, backend; model and mode; ...).  Where the row has a ratio against a
reference measured in the same run (MPI, DDP, ideal), that ratio is compared: it cancels
most of a noisy host's drift between the two runs.  Otherwise the median time is.  A cell
more than ``SLOWER`` worse than before is flagged, and the command exits with
``EXIT_SLOWER`` so a script can stop on it.
"""

from __future__ import annotations

import json
from typing import Any

SLOWER = 0.20
EXIT_SLOWER = 3

# Measurements, never part of a cell's name.
_METRICS = {"median", "p10", "p90", "reps", "algbw", "busbw", "speed_vs_mpi",
            "time_vs_best_mpi", "time_vs_mpi", "samples_per_s", "speed_vs_ddp", "time_vs_dense",
            "words_per_k", "recv_per_k", "nnz", "ideal", "time_vs_ideal", "flat_median",
            "last_ready_median", "unsupported", "count", "batch"}
# Higher is better for these; for the others (times and time ratios) lower is.
_SPEEDS = ("speed_vs_mpi", "speed_vs_ddp")
_TIME_RATIOS = ("time_vs_best_mpi", "time_vs_ideal", "time_vs_dense", "time_vs_mpi")


def _cell(row: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, v) for k, v in row.items() if k not in _METRICS))


def _measure(row: dict[str, Any]) -> tuple[str, float, bool] | None:
    """(what, value, higher is better) for the row's most robust measurement."""
    for key in _SPEEDS:
        if row.get(key):
            return key, float(row[key]), True
    for key in _TIME_RATIOS:
        if row.get(key):
            return key, float(row[key]), False
    if row.get("median"):
        return "median", float(row["median"]), False
    return None


def compare(rows: list[dict[str, Any]], old_path: str) -> list[dict[str, Any]]:
    """One entry per cell found in both runs: what was compared, old, new, and the
    change as a slowdown (0.25: a quarter slower; negative: faster)."""
    with open(old_path) as f:
        saved = json.load(f)
    old_rows = saved.get("summary", saved.get("rows", []))
    old = {_cell(r): r for r in old_rows}
    out = []
    for row in rows:
        before = old.get(_cell(row))
        if before is None:
            continue
        now, then = _measure(row), _measure(before)
        if now is None or then is None or now[0] != then[0]:
            continue
        what, value, higher_better = now
        slowdown = then[1] / value - 1 if higher_better else value / then[1] - 1
        out.append({"cell": ", ".join(f"{k}={v}" for k, v in _cell(row)), "what": what,
                    "old": then[1], "new": value, "slowdown": slowdown,
                    "flagged": slowdown > SLOWER})
    return out


def print_comparison(entries: list[dict[str, Any]], old_path: str) -> bool:
    """Print the comparison; True if any cell is flagged."""
    print(f"\ncompared with {old_path} ({len(entries)} cells in both runs; flagged: more "
          f"than {SLOWER:.0%} slower)")
    for e in entries:
        mark = "  SLOWER" if e["flagged"] else ""
        print(f"  {e['cell']}: {e['what']} {e['old']:.4g} -> {e['new']:.4g} "
              f"({-e['slowdown']:+.0%} speed){mark}")
    return any(e["flagged"] for e in entries)
