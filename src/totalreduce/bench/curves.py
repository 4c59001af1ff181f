"""``bench convergence``'s report: the ranks' training curves merged into one per method,
a table of what each reached and at what cost, and the curves drawn."""

from __future__ import annotations

from typing import Any

import numpy as np

Row = dict[str, Any]


def summarize_curves(raw: list[dict[str, Any]]) -> list[Row]:
    """One row per (method, world size): accuracy per epoch (the same on every rank: it
    is measured on the whole test set) and bytes sent per rank (the ranks' mean), both
    averaged over rounds."""
    pooled: dict[tuple[str, int], list[list[dict[str, float]]]] = {}
    backend_of: dict[tuple[str, int], str] = {}
    for job in raw:
        n = job["ranks"]
        per_rank = [r["results"] for r in job["per_rank"]]
        for i, first in enumerate(per_rank[0]):
            curves = [pr[i]["curve"] for pr in per_rank]
            merged = [{"epoch": pts[0]["epoch"], "accuracy": pts[0]["accuracy"],
                       "bytes_sent": float(np.mean([p["bytes_sent"] for p in pts])),
                       "seconds": max(p["seconds"] for p in pts)}
                      for pts in zip(*curves, strict=True)]
            key = (first["mode"], n)
            pooled.setdefault(key, []).append(merged)
            backend_of[key] = job["backend"]
    rows: list[Row] = []
    for (mode, n), rounds in pooled.items():
        curve = [{k: float(np.mean([r[e][k] for r in rounds])) for k in rounds[0][e]}
                 for e in range(len(rounds[0]))]
        rows.append({"mode": mode, "ranks": n, "backend": backend_of[(mode, n)],
                     "rounds": len(rounds), "curve": curve})
    for n in {r["ranks"] for r in rows}:
        dense = next((r for r in rows if r["ranks"] == n and r["mode"] == "dense"), None)
        if dense is None:
            continue
        target = dense["curve"][-1]["accuracy"] - 0.01
        for r in rows:
            if r["ranks"] != n:
                continue
            r["target"] = target
            hit = next((p for p in r["curve"] if p["accuracy"] >= target), None)
            r["epochs_to_target"] = int(hit["epoch"]) if hit else None
            r["mb_to_target"] = hit["bytes_sent"] / 1e6 if hit else None
    return rows


def print_curves(rows: list[Row]) -> None:
    head = ("n", "method", "final acc", "best acc", "epochs to target", "MB/rank to target",
            "MB/rank/epoch (median)")
    body = []
    for r in sorted(rows, key=lambda r: (r["ranks"], r["mode"] != "dense", r["mode"])):
        c = r["curve"]
        # The median epoch: the first carries the dense warm-up of Ok-Topk and PowerSGD.
        sent = [0.0] + [p["bytes_sent"] for p in c]
        per_epoch = float(np.median(np.diff(sent))) / 1e6
        body.append((str(r["ranks"]), r["mode"], f"{100 * c[-1]['accuracy']:.2f}%",
                     f"{100 * max(p['accuracy'] for p in c):.2f}%",
                     str(r.get("epochs_to_target") or f"> {len(c)}"),
                     f"{r['mb_to_target']:.2f}" if r.get("mb_to_target") else "-",
                     f"{per_epoch:.3f}"))
    targets = sorted({(r["ranks"], r["target"]) for r in rows if "target" in r})
    for n, t in targets:
        print(f"target at {n} ranks: {100 * t:.2f}% (dense's final accuracy less 1 point)")
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    for i, row in enumerate([head, *body]):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def plot_curves(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(r["ranks"] for r in rows)
    fig, (by_epoch, by_bytes) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in sorted((r for r in rows if r["ranks"] == n), key=lambda r: r["mode"]):
        c = r["curve"]
        acc = [100 * p["accuracy"] for p in c]
        style = "k-" if r["mode"] == "dense" else "-"
        by_epoch.plot([p["epoch"] for p in c], acc, style, label=r["mode"], lw=1.2)
        by_bytes.plot([max(p["bytes_sent"], 1.0) / 1e6 for p in c], acc, style,
                      label=r["mode"], lw=1.2)
    for ax in (by_epoch, by_bytes):
        ax.set_ylim(80, 100)
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3)
    by_epoch.set_xlabel("epoch")
    by_bytes.set_xlabel("MB sent per rank (log)")
    by_bytes.set_xscale("log")
    by_epoch.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"digits MLP, {n} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
