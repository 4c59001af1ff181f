"""Merge the ranks' raw timings into summary rows, print them, draw them.

A repetition's time is the slowest rank's (every rep starts after a barrier), and rounds
are pooled.  Bus bandwidth uses the nccl-tests factors, so numbers compare across ops and
world sizes: allreduce 2(n-1)/n, allgather / reducescatter / alltoall (n-1)/n, broadcast 1.
"""

from __future__ import annotations

from typing import Any

import numpy as np

Row = dict[str, Any]


def _bus_factor(op: str, n: int) -> float:
    if op == "allreduce":
        return 2 * (n - 1) / n
    if op == "broadcast":
        return 1.0
    return (n - 1) / n


def _slowest(per_rank: list[list[float]]) -> list[float]:
    return [max(ts) for ts in zip(*per_rank, strict=True)]


def _stats(times: list[float]) -> dict[str, float]:
    a = np.asarray(times)
    return {"median": float(np.median(a)), "p10": float(np.percentile(a, 10)),
            "p90": float(np.percentile(a, 90)), "reps": len(times)}


def summarize(test: str, raw: list[dict[str, Any]]) -> list[Row]:
    pooled: dict[tuple[Any, ...], dict[str, Any]] = {}
    for job in raw:
        backend, n = job["backend"], job["ranks"]
        per_rank = [r["results"] for r in job["per_rank"]]
        for i, first in enumerate(per_rank[0]):
            items = [pr[i] for pr in per_rank]
            who = backend
            if test == "collectives":
                key: tuple[Any, ...] = (first["op"], first["bytes"], n, backend)
                meta = {"op": first["op"], "bytes": first["bytes"], "count": first["count"]}
            elif test in ("replay", "train"):
                # Every train job times the bare model: one row for all of them.
                if first["mode"] == "compute only":
                    who = "any"
                key = (first["model"], first["mode"], n, who)
                meta = {"model": first["model"], "mode": first["mode"]}
                if test == "train":
                    meta["batch"] = first["batch"]
            elif test == "skew":
                key = (first["model"], n, backend)
                meta = {"model": first["model"]}
            else:
                key = (first["mode"], n, backend)
                meta = {"mode": first["mode"]}
            slot = pooled.setdefault(key, dict(meta, ranks=n, backend=who, times=[],
                                               last_ready=[], flat=[], alone=[]))
            if "unsupported" in first:
                slot["unsupported"] = first["unsupported"]
            elif test == "skew":
                its = [it["iterations"] for it in items]
                slot["times"] += _slowest([[x["elapsed"] for x in it] for it in its])
                slot["last_ready"] += _slowest([[x["last_ready"] for x in it] for it in its])
                slot["flat"] += _slowest([it["flat_times"] for it in items])
            else:
                slot["times"] += _slowest([it["times"] for it in items])
                if "alone" in first:
                    slot["alone"] += _slowest([it["alone"] for it in items])
                if "versus" in first:
                    slot["versus"] = first["versus"]
                if test == "sparse":
                    slot["words_per_k"] = max(it["words_per_k"] for it in items)
                    slot["recv_per_k"] = max(it["recv_per_k"] for it in items)
                    slot["nnz"] = first["nnz"]
    rows = list(pooled.values())
    for row in rows:
        if row["times"]:
            row.update(_stats(row["times"]))
        if row["alone"]:
            row["alone_median"] = float(np.median(row["alone"]))
        if row["flat"]:
            row["flat_median"] = float(np.median(row["flat"]))
            row["last_ready_median"] = float(np.median(row["last_ready"]))
    _add_ratios(test, rows)
    for row in rows:
        for k in ("times", "last_ready", "flat", "alone"):
            row.pop(k, None)
    return rows


def _add_ratios(test: str, rows: list[Row]) -> None:
    if test == "collectives":
        mpi = {(r["op"], r["bytes"], r["ranks"]): r for r in rows
               if r["backend"] == "mpi" and "median" in r}
        for r in rows:
            if "median" not in r:
                continue
            nbytes = r["count"] * 4
            r["algbw"] = nbytes / r["median"] / 1e9
            r["busbw"] = r["algbw"] * _bus_factor(r["op"], r["ranks"])
            base = mpi.get((r["op"], r["bytes"], r["ranks"]))
            r["speed_vs_mpi"] = base["median"] / r["median"] if base else None
    elif test == "replay":
        best: dict[tuple[str, int], float] = {}
        for r in rows:
            if r["backend"] == "mpi":
                k = (r["model"], r["ranks"])
                best[k] = min(best.get(k, float("inf")), r["median"])
        for r in rows:
            ref = best.get((r["model"], r["ranks"]))
            r["time_vs_best_mpi"] = r["median"] / ref if ref else None
    elif test == "train":
        ddp = {(r["model"], r["ranks"]): r["median"] for r in rows if r["mode"] == "DDP"}
        by_mode = {(r["model"], r["ranks"], r["backend"], r["mode"]): r["median"]
                   for r in rows}
        for r in rows:
            r["samples_per_s"] = r["batch"] * r["ranks"] / r["median"]
            ref = ddp.get((r["model"], r["ranks"]))
            r["speed_vs_ddp"] = ref / r["median"] if ref else None
            dense = by_mode.get((r["model"], r["ranks"], r["backend"], r.get("versus")))
            r["speed_vs_dense"] = dense / r["median"] if dense else None
            compute = by_mode.get((r["model"], r["ranks"], "any", "compute only"))
            if compute and r.get("alone_median"):
                # Unclipped: below 0 % the step costs more than its computation and its
                # communication one after the other.
                r["hidden"] = 1.0 - (r["median"] - compute) / r["alone_median"]
    elif test == "sparse":
        dense = {(r["ranks"], r["mode"].rsplit(" ", 1)[0]): r["median"] for r in rows
                 if r["mode"].endswith(" dense") and "median" in r}
        for r in rows:
            ref = dense.get((r["ranks"], r["mode"].rsplit(" ", 1)[0]))
            if ref and "median" in r:
                r["time_vs_dense"] = r["median"] / ref
    elif test == "latency":
        mpi_op = {(r["ranks"], r["mode"]): r["median"] for r in rows
                  if r["backend"] == "mpi" and "median" in r}
        for r in rows:
            ref = mpi_op.get((r["ranks"], r["mode"]))
            if ref and "median" in r:
                r["time_vs_mpi"] = r["median"] / ref
    elif test == "tiny":
        mpi = {r["ranks"]: r["median"] for r in rows if r["backend"] == "mpi" and "median" in r}
        for r in rows:
            if r["ranks"] in mpi and "median" in r:
                r["speed_vs_mpi"] = mpi[r["ranks"]] / r["median"]
    elif test == "preempt":
        alone = {(r["ranks"], r["backend"]): r["median"] for r in rows
                 if r["mode"] == "small alone after the delay" and "median" in r}
        for r in rows:
            ref = alone.get((r["ranks"], r["backend"]))
            if ref and "median" in r and r["mode"].startswith("during"):
                r["time_vs_alone"] = r["median"] / ref
    elif test == "skew":
        mpi_flat = {r["ranks"]: r["flat_median"] for r in rows if r["backend"] == "mpi"}
        for r in rows:
            ref = mpi_flat.get(r["ranks"], r["flat_median"])
            r["ideal"] = r["last_ready_median"] + ref
            r["time_vs_ideal"] = r["median"] / r["ideal"]


def _fmt_bytes(n: int) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return f"{n}"


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f}" if s < 0.01 else f"{s * 1e3:.1f}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _numeric(cell: str) -> bool:
    return bool(cell) and (cell[0].isdigit() or cell == "-")


def print_table(test: str, rows: list[Row]) -> None:
    if test == "collectives":
        head: tuple[str, ...] = ("op", "n", "size", "backend", "median ms", "p10-p90 ms",
                                 "algbw GB/s", "busbw GB/s", "speed vs mpi")
        body: list[tuple[Any, ...]] = []
        for r in sorted(rows, key=lambda r: (r["op"], r["ranks"], r["bytes"], r["backend"])):
            if "median" not in r:
                body.append((r["op"], r["ranks"], _fmt_bytes(r["bytes"]), r["backend"],
                             "unsupported", "", "", "", ""))
                continue
            body.append((r["op"], r["ranks"], _fmt_bytes(r["bytes"]), r["backend"],
                         _ms(r["median"]), f"{_ms(r['p10'])}-{_ms(r['p90'])}",
                         f"{r['algbw']:.3f}", f"{r['busbw']:.3f}", _ratio(r["speed_vs_mpi"])))
    elif test == "replay":
        head = ("model", "n", "backend", "mode", "median ms", "p10-p90 ms",
                "time / best MPI")
        body = [(r["model"], r["ranks"], r["backend"], r["mode"], _ms(r["median"]),
                 f"{_ms(r['p10'])}-{_ms(r['p90'])}", _ratio(r["time_vs_best_mpi"]))
                for r in sorted(rows, key=lambda r: (r["model"], r["ranks"], r["median"]))]
    elif test == "train":
        head = ("model", "n", "mode", "step ms", "p10-p90 ms", "samples/s",
                "speed vs DDP gloo", "speed vs dense", "comm alone ms", "comm hidden")
        body = [(r["model"], r["ranks"], r["mode"], _ms(r["median"]),
                 f"{_ms(r['p10'])}-{_ms(r['p90'])}", f"{r['samples_per_s']:.0f}",
                 _ratio(r["speed_vs_ddp"]), _ratio(r["speed_vs_dense"]),
                 _ms(r["alone_median"]) if "alone_median" in r else "-",
                 f"{100 * r['hidden']:.0f}%" if "hidden" in r else "-")
                for r in sorted(rows, key=lambda r: (r["model"], r["ranks"], r["median"]))]
    elif test == "skew":
        head = ("model", "n", "backend", "median ms", "last ready ms", "ideal ms",
                "time / ideal")
        body = [(r["model"], r["ranks"], r["backend"], _ms(r["median"]),
                 _ms(r["last_ready_median"]), _ms(r["ideal"]), _ratio(r["time_vs_ideal"]))
                for r in sorted(rows, key=lambda r: (r["ranks"], r["median"]))]
    elif test == "sparse":
        head = ("gradients", "density", "n", "algorithm", "median ms", "time / dense",
                "words sent / k", "words recv / k", "output nnz")
        body = []
        for r in sorted((r for r in rows if "median" in r),
                        key=lambda r: (r["mode"].rsplit(" ", 2)[0], r["ranks"], r["mode"])):
            source, density, alg = r["mode"].rsplit(" ", 2)
            body.append((source, density, r["ranks"], alg, _ms(r["median"]),
                         _ratio(r.get("time_vs_dense", 0.0)), f"{r['words_per_k']:.2f}",
                         f"{r['recv_per_k']:.2f}", r["nnz"]))
    elif test == "latency":
        head = ("n", "op", "backend", "median us", "p10-p90 us", "time / mpi")
        body = [(r["ranks"], r["mode"], r["backend"], f"{r['median'] * 1e6:.1f}",
                 f"{r['p10'] * 1e6:.1f}-{r['p90'] * 1e6:.1f}",
                 _ratio(r["time_vs_mpi"]) if "time_vs_mpi" in r else "")
                for r in sorted(rows, key=lambda r: (r["ranks"], r["mode"], r["median"]))]
    elif test == "tiny":
        head = ("n", "backend", "case", "median us/op", "p10-p90 us/op", "speed vs mpi")
        body = [(r["ranks"], r["backend"], r["mode"], f"{r['median'] * 1e6:.1f}",
                 f"{r['p10'] * 1e6:.1f}-{r['p90'] * 1e6:.1f}",
                 _ratio(r["speed_vs_mpi"]) if "speed_vs_mpi" in r else "")
                for r in sorted(rows, key=lambda r: (r["ranks"], r["median"]))]
    else:
        head = ("n", "backend", "small allreduce", "median ms", "p10-p90 ms",
                "time / alone after the delay")
        body = [(r["ranks"], r["backend"], r["mode"], _ms(r["median"]),
                 f"{_ms(r['p10'])}-{_ms(r['p90'])}",
                 _ratio(r["time_vs_alone"]) if "time_vs_alone" in r else "")
                for r in sorted(rows, key=lambda r: (r["ranks"], r["backend"], r["mode"]))]
    table = [tuple(str(c) for c in head)] + [tuple(str(c) for c in row) for row in body]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for i, row in enumerate(table):
        print("  ".join(c.rjust(w) if _numeric(c) else c.ljust(w)
                        for c, w in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    shown = {r.get("backend") for r in rows}
    if any(str(b).startswith("totalreduce-neg") for b in shown):
        print("coordination: totalreduce-shm/-tcp/-mpi self-guided (the default); "
              "totalreduce-neg negotiated (TOTALREDUCE_COORDINATION=negotiated), "
              "-nocache without its response cache, -nofusion without fusion")


def plot(test: str, rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if test == "collectives":
        ops = sorted({r["op"] for r in rows})
        n = min(r["ranks"] for r in rows)
        fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 4), squeeze=False)
        for ax, op in zip(axes[0], ops, strict=True):
            for backend in sorted({r["backend"] for r in rows}):
                pts = sorted((r["bytes"], r["busbw"]) for r in rows if r["op"] == op and
                             r["backend"] == backend and r["ranks"] == n and "busbw" in r)
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=backend)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{op}, {n} ranks")
            ax.set_xlabel("bytes")
            ax.set_ylabel("bus bandwidth GB/s")
            ax.legend(fontsize=7)
    else:
        labels, values = [], []
        for r in rows:
            if "median" not in r:
                continue
            what = r.get("mode") or r.get("model", "")
            if test == "replay":
                what = f"{r['model']} {r['mode']}"
            labels.append(f"{r['backend']} n={r['ranks']}\n{what}")
            values.append(r["median"] * 1e3)
        fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(labels)), 5))
        ax.bar(range(len(values)), values)
        ax.set_xticks(range(len(values)), labels, rotation=80, fontsize=6)
        ax.set_ylabel("median ms")
        ax.set_title(test)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
