"""``python -m totalreduce.bench ps``: the three ways of combining workers on the digits
MLP, with and without a straggler: synchronous gradient allreduce
(``examples/train_digits.py``), parameter averaging every H steps (the same, with
``--average-period H``), and the parameter server at several delay bounds
(``examples/train_digits_ps.py``; its servers are extra ranks, as they are extra machines
in a cluster); "replicated" runs the server with ``--max-restarts 1``, where each
server's share has a copy on the next server.  Every method trains the same number of
workers for the same epochs.

Per cell: the job's training throughput (samples over the slowest worker's training time)
and the test accuracy at the end, medians over ``--rounds`` jobs run interleaved.  The
straggler is the last worker, sleeping in each step as long as its previous step took
(half speed).
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

_THROUGHPUT = re.compile(r"training took [\d.]+ s: ([\d,]+) samples/s")
_ACCURACY = re.compile(r"test accuracy ([\d.]+)%")


def examples_dir() -> Path:
    """The repository's examples (the bench runs them as a user would)."""
    return Path(__file__).resolve().parents[3] / "examples"


def methods(workers: int, servers: int) -> list[tuple[str, int, list[str], list[str]]]:
    """(label, ranks, totalrun options, script and its arguments) of each method."""
    digits, ps = "train_digits.py", "train_digits_ps.py"
    out: list[tuple[str, int, list[str], list[str]]] = [("allreduce", workers, [], [digits])]
    out += [(f"averaging H={h}", workers, [], [digits, "--average-period", str(h)])
            for h in (1, 4, 16)]
    out += [(f"server tau={d}", workers + servers, ["--servers", str(servers)],
             [ps, "--max-delay", d]) for d in ("0", "1", "4", "none")]
    # What surviving a server's loss costs: every push waits for the replica's copy.
    out.append(("server tau=0 replicated", workers + servers,
                ["--servers", str(servers), "--max-restarts", "1"], [ps, "--max-delay", "0"]))
    return out


def run_one(ranks: int, options: list[str], script: list[str], epochs: int,
            straggler: bool, timeout: float, where: Path) -> tuple[float, float]:
    """(samples/s, test accuracy %) of one job."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TOTALREDUCE_")}
    cmd = [sys.executable, "-m", "totalreduce.run", "-np", str(ranks), *options,
           sys.executable, str(where / script[0]), *script[1:], "--epochs", str(epochs),
           *(["--straggler"] if straggler else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=clean)
    throughput = _THROUGHPUT.search(proc.stdout)
    accuracies = _ACCURACY.findall(proc.stdout)
    if proc.returncode != 0 or throughput is None or not accuracies:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return float(throughput.group(1).replace(",", "")), float(accuracies[-1])


def bench(workers: int, servers: int, epochs: int, rounds: int, timeout: float
          ) -> list[dict[str, Any]]:
    where = examples_dir()
    if not (where / "train_digits_ps.py").exists():
        raise SystemExit(f"bench ps runs the repository's examples; none at {where}")
    cells: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    for _ in range(rounds):
        for straggler in (False, True):
            for label, ranks, options, script in methods(workers, servers):
                cells.setdefault((label, straggler), []).append(
                    run_one(ranks, options, script, epochs, straggler, timeout, where))
    rows = []
    for label, *_ in methods(workers, servers):
        row: dict[str, Any] = {"method": label}
        for straggler, suffix in ((False, ""), (True, "_straggler")):
            runs = cells[(label, straggler)]
            row["samples_per_s" + suffix] = statistics.median(r[0] for r in runs)
            row["accuracy" + suffix] = statistics.median(r[1] for r in runs)
        rows.append(row)
    return rows


def print_rows(rows: list[dict[str, Any]], workers: int, servers: int, epochs: int) -> None:
    print(f"digits MLP, {workers} workers ({servers} more ranks as servers), {epochs} epochs")
    print(f"{'method':<24} {'samples/s':>10} {'accuracy':>9} {'straggler: samples/s':>21} "
          f"{'accuracy':>9}")
    for r in rows:
        print(f"{r['method']:<24} {r['samples_per_s']:>10,.0f} {r['accuracy']:>8.2f}% "
              f"{r['samples_per_s_straggler']:>21,.0f} {r['accuracy_straggler']:>8.2f}%")


def plot_rows(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["method"] for r in rows]
    y = range(len(rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for offset, suffix, name in ((-0.2, "", "no straggler"), (0.2, "_straggler",
                                                               "one worker at half speed")):
        left.barh([i + offset for i in y], [r["samples_per_s" + suffix] for r in rows],
                  height=0.4, label=name)
        right.barh([i + offset for i in y], [r["accuracy" + suffix] for r in rows],
                   height=0.4, label=name)
    left.set(yticks=list(y), yticklabels=labels, xlabel="samples/s (slowest worker)")
    left.invert_yaxis()
    lowest = min(min(r["accuracy"], r["accuracy_straggler"]) for r in rows)
    right.set(xlabel="test accuracy (%)", xlim=(max(0.0, lowest - 3), 100))
    right.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot written to {path}", file=sys.stderr)
