"""Draw a totalreduce timeline (TOTALREDUCE_TIMELINE) with matplotlib: one row per tensor,
one colour per phase, every rank's file side by side.

    python docs/timeline/plot_trace.py trace.json OUT.png [--window START_MS END_MS]

Without ``--window`` it shows ``--span`` ms (40) from the middle of the run.

It reads ``trace.json`` (rank 0) and ``trace.json.1``, ``.2``, ... beside it; a file cut off
mid-run (no closing bracket) is read up to its last whole event.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

_PARTS = {"WAIT_FOR_PEER", "FLOATING", "MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER"}


def load(path: Path) -> list[dict]:
    text = path.read_text()
    if not text.rstrip().endswith("]"):
        text = text[:text.rstrip().rfind("}") + 1] + "]"
    return json.loads(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("out")
    ap.add_argument("--window", nargs=2, type=float, metavar=("START_MS", "END_MS"))
    ap.add_argument("--span", type=float, default=40.0, help="ms shown without --window")
    ap.add_argument("--rows", type=int, default=12, help="tensors shown per rank")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = Path(args.trace)
    files = [first] + sorted(first.parent.glob(first.name + ".*"),
                             key=lambda p: int(p.suffix[1:]))
    ranks = [load(p) for p in files]
    if not args.window:
        starts = [e["ts"] for events in ranks for e in events if e["ph"] == "X"]
        mid = (min(starts) + max(starts)) / 2 / 1e3
        args.window = (mid, mid + args.span)
    lo, hi = (w * 1e3 for w in args.window)
    shown = [[e for e in events if e["ph"] == "X" and e["ts"] + e["dur"] >= lo
              and e["ts"] <= hi] for events in ranks]
    phases = sorted({e["name"] for spans in shown for e in spans})
    colours = dict(zip(phases, plt.get_cmap("tab10").colors, strict=False))
    rows_per_rank = [sorted({e["tid"] for e in spans})[: args.rows] for spans in shown]
    height = 1.0 + sum(0.6 + 0.3 * len(rows) for rows in rows_per_rank)
    fig, axes = plt.subplots(len(ranks), 1, figsize=(12, height), squeeze=False,
                             sharex=True,
                             gridspec_kw={"height_ratios": [max(1, len(r)) for r in
                                                            rows_per_rank]})
    for ax, events, spans, rows, path in zip(axes[:, 0], ranks, shown, rows_per_rank,
                                             files, strict=True):
        names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
        y = {tid: i for i, tid in enumerate(rows)}
        for e in spans:
            if e["tid"] in y:
                # Parts of an op (its wait, its copies) sit in the lower half of the row,
                # so the op's own bar stays visible behind them.
                part = e["name"] in _PARTS
                ax.broken_barh([(e["ts"] / 1e3, max(e["dur"] / 1e3, 0.01))],
                               (y[e["tid"]] + (0.0 if part else -0.4), 0.4 if part else 0.8),
                               color=colours[e["name"]])
        ax.set_yticks(range(len(rows)), [names.get(t, str(t)) for t in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(path.name, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("ms since init()")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    fig.legend(handles, list(colours), loc="upper right", fontsize=7, ncol=len(colours))
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
