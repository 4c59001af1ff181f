"""``python -m totalreduce.bench recovery``: how long a job takes to recover from a killed
worker, against the size of its checkpoint.

Each job runs under ``totalrun --max-restarts 1``: every rank checkpoints a state of the
given size, makes one more collective, and rank 1 then kills itself (SIGKILL).  Times
are wall-clock stamps from the ranks of one host:

* restart: the kill to the replacement's ``init()`` returning (the survivors notice the
  loss, totalrun starts the new process, it imports and meets the survivors),
* load: its ``load_checkpoint()`` (the checkpoint sent from a survivor's memory),
* total: the kill to the moment every rank has returned from the collective the
  survivors were waiting in: the job makes progress again.

The target is 2 s plus the checkpoint's size at 1 GB/s.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

VICTIM = 1


def worker(size_bytes: int, out_dir: str) -> None:
    t_start = time.time()
    import numpy as np

    import totalreduce as tr

    attempt = int(os.environ.get("TOTALREDUCE_ATTEMPT", "0"))
    tr.init()
    t_init = time.time()
    rank = tr.rank()
    version, state = tr.load_checkpoint()
    t_loaded = time.time()
    if state is None:
        state = {"w": np.ones(size_bytes // 4, np.float32)}
    stamps: dict[str, Any] = {"rank": rank, "attempt": attempt, "start": t_start,
                              "init": t_init, "loaded": t_loaded}
    for v in range(version, 3):
        tr.allreduce(np.ones(4), name="tick")
        if v == 1 and rank == VICTIM and attempt == 0:
            with open(os.path.join(out_dir, "killed"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), 9)
        tr.allreduce(np.ones(4), name="tock")  # where the survivors wait for the replacement
        if v == 1:
            stamps["resumed"] = time.time()
        tr.checkpoint(state)
    with open(os.path.join(out_dir, f"{rank}.{attempt}.json"), "w") as f:
        json.dump(stamps, f)
    tr.shutdown()


def run(n: int, size_bytes: int, timeout: float) -> dict[str, float]:
    """One job; the phases of its recovery in seconds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOTALREDUCE_")}
    with tempfile.TemporaryDirectory(prefix="trbench-recovery-") as out:
        cmd = [sys.executable, "-m", "totalreduce.run", "-np", str(n), "--max-restarts", "1",
               sys.executable, "-m", "totalreduce.bench.recovery", str(size_bytes), out]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"recovery job at {n} ranks failed (exit {proc.returncode}):"
                               f"\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        with open(os.path.join(out, "killed")) as f:
            killed = float(f.read())
        ranks = {}
        for name in os.listdir(out):
            if name.endswith(".json"):
                with open(os.path.join(out, name)) as f:
                    stamps = json.load(f)
                ranks[(stamps["rank"], stamps["attempt"])] = stamps
        new = ranks[(VICTIM, 1)]
        return {"restart": new["init"] - killed, "load": new["loaded"] - new["init"],
                "total": max(s["resumed"] for s in ranks.values()) - killed}


def bench(ranks: list[int], sizes: list[int], rounds: int, timeout: float
          ) -> list[dict[str, Any]]:
    rows = []
    for n in ranks:
        for size in sizes:
            runs = [run(n, size, timeout) for _ in range(rounds)]
            row: dict[str, Any] = {"ranks": n, "bytes": size, "rounds": rounds}
            for phase in ("restart", "load", "total"):
                row[phase] = statistics.median(r[phase] for r in runs)
            row["total_max"] = max(r["total"] for r in runs)
            row["target"] = 2.0 + size / 1e9
            rows.append(row)
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'n':>2}  {'checkpoint':>10}  {'restart s':>9}  {'load s':>7}  {'total s':>7}  "
          f"{'worst s':>7}  {'target s':>8}  met")
    for r in rows:
        print(f"{r['ranks']:>2}  {r['bytes'] / (1 << 20):>7.0f} MB  {r['restart']:>9.2f}  "
              f"{r['load']:>7.2f}  {r['total']:>7.2f}  {r['total_max']:>7.2f}  "
              f"{r['target']:>8.2f}  {'yes' if r['total_max'] <= r['target'] else 'NO'}")


if __name__ == "__main__":
    worker(int(sys.argv[1]), sys.argv[2])
