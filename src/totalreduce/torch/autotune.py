"""Autotuning of the DistributedOptimizer (``TOTALREDUCE_AUTOTUNE=1``, or Horovod's
``HOROVOD_AUTOTUNE``): which bucket size, and whether to reduce while backward runs.

Neither has one right answer.  Small buckets start reducing sooner but pay a per-op cost
more often; overlapping with backward hides the communication where a rank has a core to
spare for it, and costs more than it hides where it has not (one core per rank: the
reduction's copies then compete with backward, and every hand-off between the ranks'
progress threads waits for the scheduler).  So the optimizer measures: for its first
steps it tries each setting in turn, a few steps each, and keeps the one whose steps were
fastest on the slowest rank.

Every rank must decide the same, or their buckets (one op each) would no longer match:
each trial's time is the maximum over the ranks of the median time between successive
``step()`` calls (one small allreduce per trial), so every rank holds the same numbers and
picks the same setting.  The time between steps is what the user's throughput is made
of: forward, backward, the reductions it did not hide, the optimizer.
"""

from __future__ import annotations

import csv
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

WARMUP_STEPS = 2   # steps after a switch that are not timed (first use of new buckets)
TIMED_STEPS = 5    # steps timed per setting
BUCKET_SIZES = (1 << 20, 4 << 20, 16 << 20, 64 << 20)


@dataclass(frozen=True)
class Setting:
    bucket_bytes: int
    overlap: bool


def candidates(default: Setting, bucket_counts: Callable[[int], int],
               tune_buckets: bool) -> list[Setting]:
    """The settings to try, the default first.  Bucket sizes that give the same number of
    buckets as a smaller one are left out (the model has fewer bytes than the cap)."""
    sizes = [default.bucket_bytes]
    if tune_buckets:
        seen = {bucket_counts(default.bucket_bytes)}
        for size in BUCKET_SIZES:
            count = bucket_counts(size)
            if count not in seen:
                seen.add(count)
                sizes.append(size)
    out = [Setting(size, overlap) for size in sizes
           for overlap in (default.overlap, not default.overlap)]
    return out


class Autotuner:
    """Steps through ``settings``; :meth:`stepped` after each ``step()`` says which
    setting to switch to (None: stay)."""

    def __init__(self, settings: list[Setting], agree: Callable[[float, int], float],
                 log_path: str = "", *, warmup: int = WARMUP_STEPS,
                 timed: int = TIMED_STEPS, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        """``agree(seconds, trial)``: the maximum of ``seconds`` over the ranks (a
        collective every rank calls with the same ``trial``)."""
        self._settings = settings
        self._agree = agree
        self._log_path = log_path
        self._warmup, self._timed = warmup, timed
        self._clock = clock
        self._trial = 0
        self._last: float | None = None
        self._steps = 0
        self._intervals: list[float] = []
        self.results: list[tuple[Setting, float]] = []
        self.chosen: Setting | None = None

    @property
    def done(self) -> bool:
        return self.chosen is not None

    def stepped(self) -> Setting | None:
        now = self._clock()
        last, self._last = self._last, now
        if self.chosen is not None or last is None:
            return None
        self._steps += 1
        if self._steps > self._warmup:
            self._intervals.append(now - last)
        if len(self._intervals) < self._timed:
            return None
        seconds = self._agree(float(np.median(self._intervals)), self._trial)
        self.results.append((self._settings[self._trial], seconds))
        self._trial += 1
        self._steps = 0
        self._intervals = []
        self._last = None  # the switch itself is not a step
        if self._trial < len(self._settings):
            return self._settings[self._trial]
        self.chosen = min(self.results, key=lambda r: r[1])[0]
        self._write_log()
        return self.chosen

    def _write_log(self) -> None:
        if not self._log_path:
            return
        folder = os.path.dirname(os.path.abspath(self._log_path))
        os.makedirs(folder, exist_ok=True)
        with open(self._log_path, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["trial", "bucket_bytes", "overlap", "seconds_per_step", "chosen"])
            for i, (setting, seconds) in enumerate(self.results):
                out.writerow([i, setting.bucket_bytes, int(setting.overlap), f"{seconds:.6f}",
                              int(setting == self.chosen)])
