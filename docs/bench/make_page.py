"""Build docs/BENCHMARKS.md from the tables ``python -m totalreduce.bench`` printed.

    python docs/bench/make_page.py

Each section names the command whose output it shows (the file in docs/bench/), so a
reader can rerun it; the environment line comes from the bench's own output.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

from bench_tables import Row, find, num, rows, span
from regenerate import command  # run as a script: this folder is on sys.path

HERE = Path(__file__).resolve().parent
PAGE = HERE.parent / "BENCHMARKS.md"
CMD_16_LOGSTEPS = ("python -m totalreduce.bench collectives -n 4,8,16 "
                   "--ops allgather,reducescatter,broadcast --sizes 64K,1M,4M,16M,64M "
                   "--rounds 2 --reps-scale 0.5")


def table(name: str, keep: Callable[[list[str]], bool] | None = None) -> tuple[str, str]:
    """(environment line, table) of docs/bench/NAME.txt, rows filtered by ``keep``."""
    lines = (HERE / f"{name}.txt").read_text().splitlines()
    env = next((ln for ln in lines if ln.startswith("environment:")), "")
    # The arrays line (bench --arrays) is in the command the page shows with the table.
    rows = [ln for ln in lines if ln and not ln.startswith(("environment:", "arrays:"))]
    if keep is not None:
        rows = rows[:2] + [ln for ln in rows[2:] if keep(ln.split())]
    return env, "```\n" + "\n".join(rows) + "\n```" + _measured(env)


def _allreduce_barrier(cells: list[str]) -> bool:
    """A latency table's rows of the 8-byte allreduce and the barrier (its op column),
    and its notes (a line that is no row)."""
    return not cells[0].isdigit() or cells[1] in ("allreduce", "barrier")


def _small_calls(cells: list[str]) -> bool:
    """A latency table's rows of Backend.small_calls' modes."""
    return cells[1] in ("allgather", "allgather_object", "broadcast_object")


def log_steps_table() -> str:
    """Median ms of the ring or chain (HALVING_BYTES=0) against the log-step algorithms
    (HALVING_BYTES=1G), from the two runs in docs/bench/cores16-logsteps-*.txt."""
    ms: dict[tuple[str, str, str, str], str] = {}
    for name, tag in (("cores16-logsteps-off", "off"), ("cores16-logsteps-on", "on")):
        for line in (HERE / f"{name}.txt").read_text().splitlines():
            c = line.split()
            if len(c) > 4 and c[0] in ("allgather", "reducescatter", "broadcast"):
                ms[(c[0], c[1], c[2], "mpi" if c[3] == "mpi" else tag)] = c[4]
    sizes = ("64K", "1M", "4M", "16M", "64M")
    rows = ["op             n  " + "  ".join(f"{s:>17}" for s in sizes),
            "                   " + "  ".join(f"{'off / on / mpi':>17}" for _ in sizes)]
    for op in ("allgather", "reducescatter", "broadcast"):
        for n in ("4", "8", "16"):
            cells = ["/".join(ms.get((op, n, s, k), "-") for k in ("off", "on", "mpi"))
                     for s in sizes]
            rows.append(f"{op:<13} {n:>2}  " + "  ".join(f"{c:>17}" for c in cells))
    return "```\n" + "\n".join(rows) + "\n```" + _measured(
        table("cores16-logsteps-off")[0])


def small_gather_table() -> str:
    """Median ms of allgathers whose size exchange and (up to 1 MiB) data took the ring
    against one whole message a step, from docs/bench/cores16-smallgather-*.txt."""
    ms: dict[tuple[str, str, str], str] = {}
    for tag in ("ring", "doubling"):
        for line in (HERE / f"cores16-smallgather-{tag}.txt").read_text().splitlines():
            c = line.split()
            if len(c) > 4 and c[0] == "allgather":
                ms[(c[1], c[2], "mpi" if c[3] == "mpi" else tag)] = c[4]
    sizes = ("4K", "64K", "1M", "4M")
    rows = ["n   " + "  ".join(f"{s:>21}" for s in sizes),
            "    " + "  ".join(f"{'ring / doubling / mpi':>21}" for _ in sizes)]
    for n in ("4", "8", "16"):
        cells = ["/".join(ms.get((n, s, k), "-") for k in ("ring", "doubling", "mpi"))
                 for s in sizes]
        rows.append(f"{n:>2}  " + "  ".join(f"{c:>21}" for c in cells))
    return "```\n" + "\n".join(rows) + "\n```" + _measured(
        table("cores16-smallgather-doubling")[0])


def _fields(env: str) -> dict[str, str]:
    """An environment line's fields: "cpu AMD EPYC, cpus 2, ..." -> {"cpu": "AMD EPYC"}."""
    return dict(part.strip().split(" ", 1) for part in
                env.removeprefix("environment: ").split(",") if " " in part.strip())


def reflow(page: str) -> str:
    """``page`` with each prose paragraph and list item filled to 90 columns: the
    sentences that quote the tables are built from pieces of any length.  Code blocks,
    tables, headings, images and notes stay as they are."""
    out: list[str] = []
    block: list[str] = []
    fenced = False

    def flush() -> None:
        if not block:
            return
        if block[0].startswith(("|", "#", "![", "<sub>", "    ")):
            out.extend(block)
        else:
            items: list[list[str]] = []
            for line in block:
                if line.startswith("- ") or not items:
                    items.append([line])
                else:
                    items[-1].append(line)
            for item in items:
                text = " ".join(part.strip() for part in item)
                bullet = item[0].startswith("- ")
                out.extend(textwrap.wrap(text, 90, subsequent_indent="  " if bullet else "",
                                         break_long_words=False, break_on_hyphens=False))
        block.clear()

    for line in page.splitlines():
        if line.startswith("```"):
            flush()
            fenced = not fenced
            out.append(line)
        elif fenced:
            out.append(line)
        elif not line.strip():
            flush()
            out.append(line)
        else:
            block.append(line)
    flush()
    return "\n".join(out) + "\n"


def _measured(env: str) -> str:
    """Where a table was measured, from its environment line: the 16-core tables come
    from other machines, at other commits."""
    fields = _fields(env)
    if "cpu" not in fields:
        return ""
    return f"\n\n<sub>{fields['cpu']}, commit {fields.get('commit', '?')}</sub>"


# --- Sentences computed from the tables they stand beside --------------------------------

OPS = ("allgather", "allreduce", "alltoall", "broadcast", "reducescatter")
BIG = ("1M", "4M", "16M", "64M", "256M")
SHM = "totalreduce-shm"


def _x(value: float) -> str:
    return f"{value:.2f}x"


def _speed(name: str, op: str, size: str, backend: str = SHM, n: str = "2") -> float:
    return num(find(name, op=op, n=n, size=size, backend=backend)["speed vs mpi"])


def _ms(name: str, op: str, size: str, backend: str = SHM, n: str = "2") -> str:
    return find(name, op=op, n=n, size=size, backend=backend)["median ms"]


def _size(size: str) -> str:
    """A table's size as prose: "16M" -> "16 MB"."""
    return f"{size.strip()[:-1]} {size.strip()[-1]}B" if size.strip()[-1:] in "KMG" else size


def _paren(cell: str) -> float:
    """The ratio in a floor cell's brackets: "0.075 (1.58x)" -> 1.58."""
    return num(cell.split("(", 1)[1])


def _cells2(backend: str = SHM) -> list[tuple[str, str, float]]:
    """(op, size, speed vs MPI) of ``backend``'s 2-rank cells from 1 MB."""
    return [(op, s, _speed("collectives-2", op, s, backend)) for op in OPS for s in BIG]


def _behind2() -> str:
    """The 2-rank cells from 1 MB where totalreduce over the rings trails MPI."""
    return ", ".join(f"{op} {_size(s)} ({_x(v)})" for op, s, v in _cells2() if v < 1.0) \
        or "none"


def glance(name: str, n: str, ops: tuple[str, ...], sizes: tuple[str, ...]) -> str:
    """A table of every backend's speed vs MPI per op and size, out of ``name``."""
    backends = sorted({r["backend"] for r in rows(name)} - {"mpi"})
    head = "| op | backend | " + " | ".join(sizes) + " |"
    lines = [head, "|" + "---|" * (len(sizes) + 2)]
    for op in ops:
        for b in backends:
            cells = [_x(_speed(name, op, s, b, n)) for s in sizes]
            lines.append(f"| {op} | {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def collectives_notes() -> str:
    ahead = sum(v >= 1.0 for _op, _s, v in _cells2())
    gloo = [v for _op, _s, v in _cells2("gloo")]
    return f"""Speed against MPI from 1 MB, every backend (MPI's median time over the backend's):

{glance("collectives-2", "2", OPS, BIG)}

From 1 MB, totalreduce over the shared-memory rings is at or above MPI in
{ahead} of {len(OPS) * len(BIG)} cells; below it in {_behind2()}.
gloo runs at {span(gloo)}x MPI's speed over the same sizes."""


def huge_notes() -> str:
    def mpi_ms(name: str, op: str, size: str) -> str:
        return _ms(name, op, size, "mpi")
    ours = {op: [_speed("collectives-2-huge", op, s) for s in BIG] for op in OPS}
    return f"""The table above hands every library arrays made by `np.ones` and `np.empty`, as a
user makes them, and what backs their pages differs: numpy asks for huge pages only from
4 MiB, and even then only the 2 MiB-aligned middle of an array gets them, where malloc
put it. Here every backend gets arrays that start on a 2 MiB boundary, advised for huge
pages. MPICH's 1 MB broadcast takes {mpi_ms("collectives-2-huge", "broadcast", "1M")} ms
here against {mpi_ms("collectives-2", "broadcast", "1M")} ms out of numpy's arrays, its 1
MB alltoall {mpi_ms("collectives-2-huge", "alltoall", "1M")} against
{mpi_ms("collectives-2", "alltoall", "1M")}, its 4 MB broadcast
{mpi_ms("collectives-2-huge", "broadcast", "4M")} against
{mpi_ms("collectives-2", "broadcast", "4M")}. Ours against MPI from 1 MB, here:
{"; ".join(f"{op} {span(v)}x" for op, v in ours.items())}. Torch's CPU tensors get small
pages, as numpy's arrays under 4 MiB do; on a host whose `transparent_hugepage` setting
is `always`, big arrays get huge pages without asking."""


def floor_notes() -> str:
    floor = rows("floor-2")
    best = ", ".join(f"{_x(max(_paren(r['bare ring']), _paren(r['bare cma'])))} at "
                     f"{_size(r['size'])}" for r in floor)
    def ms(r: Row, col: str) -> float:
        return num(r[col])
    slower = [r for r in floor if ms(r, "totalreduce") > ms(r, "bare ring")]
    faster = [r for r in floor if r not in slower]
    gaps = ", ".join(f"{r['totalreduce'].split()[0]} against {r['bare ring'].split()[0]} ms "
                     f"at {_size(r['size'])}" for r in slower)
    ahead = " and ".join(_size(r["size"]) for r in faster)
    beats = (f" At {ahead} it beats the bare ring, whose pieces are 1 MiB (totalreduce's are "
             "2 MiB, lent out of huge pages from 8 MiB while its rings copy slowly).") \
        if ahead else ""
    return f"""The bare exchanges are what copying through memory allows here; the faster of the
two against MPI: {best}. No engine on these copies gets much further. Where totalreduce
trails the bare ring, the gap is the engine's own cost (its headers, credit, handlers and
turns of the loop): {gaps or "nowhere"}.{beats}
In its own job (the collectives table) a 16 MB allreduce takes
{_ms("collectives-2", "allreduce", "16M")} ms against MPI's
{_ms("collectives-2", "allreduce", "16M", "mpi")}."""


def four_notes() -> str:
    sizes = ("1M", "4M", "16M", "64M")
    ours = ", ".join(f"{_x(_speed('collectives-4', 'allreduce', s, n='4'))} at {_size(s)}"
                     for s in sizes)
    return f"""totalreduce over the rings against MPI from 1 MB: {ours}."""


def latency_notes() -> str:
    def ratio(name: str, n: str, op: str, backend: str) -> str:
        return find(name, n=n, op=op, backend=backend)["time / mpi"]

    def us(name: str, n: str, op: str, backend: str) -> str:
        return find(name, n=n, op=op, backend=backend)["median us"]
    others = sorted({r["backend"] for r in rows("latency")} - {"mpi", SHM})
    more = "; ".join(
        f"`{b}` {ratio('latency', '2', 'allreduce 8 B', b)} and "
        f"{ratio('latency', '2', 'barrier', b)}" for b in others)
    return f"""At 2 ranks the 8-byte allreduce takes {us("latency", "2", "allreduce 8 B", SHM)}
us over the rings, {ratio("latency", "2", "allreduce 8 B", SHM)} MPI's time, and the
barrier {us("latency", "2", "barrier", SHM)} us ({ratio("latency", "2", "barrier", SHM)});
{more}. At 4 ranks on 2 cores every hop waits for a peer to get a core: the allreduce
takes {us("latency", "4", "allreduce 8 B", SHM)} us
({ratio("latency", "4", "allreduce 8 B", SHM)} MPI's
{us("latency", "4", "allreduce 8 B", "mpi")})."""


def replay_notes() -> str:
    table_rows = [r for r in rows("replay-2-optimizer") if r["backend"] == SHM]
    fastest = min(table_rows, key=lambda r: num(r["median ms"]))
    mpi = {r["mode"]: r["median ms"] for r in rows("replay-2-optimizer")
           if r["backend"] == "mpi"}
    return f"""Here the fastest of ours is `{fastest["mode"]}`, {fastest["median ms"]} ms,
{fastest["time / best MPI"]} the time of MPI's best mode ({", ".join(
        f"`{m}` {t} ms" for m, t in mpi.items())}). At 2 ranks,
async allreduces like ones made before that are submitted together wait for the first
`wait()`, which runs them one after another, each as a blocking call would run
(DESIGN-NOTES, queued async calls); so do a grouped call's parts, whose arrays under 128
KiB are fused."""


def training_notes() -> str:
    def mode(model: str, n: str, name: str) -> dict[str, str]:
        return find(f"train-{model}", model=model, n=n, mode=name)
    vs = ", ".join(f"{mode(m, n, 'optimizer 16MB')['speed vs DDP gloo']} its speed at {n} "
                   f"ranks ({m})" for m in ("mlp", "convnet") for n in ("2", "4"))
    hidden = ", ".join(f"{mode('mlp', n, 'optimizer 16MB')['comm hidden']} at {n} ranks"
                       for n in ("2", "4"))
    return f"""Against DDP over gloo, the optimizer's 16 MiB buckets run at {vs}. The mlp's
`comm hidden` for them is {hidden}."""


def skew_notes() -> str:
    ratio = {r["backend"]: r["time / ideal"] for r in rows("skew-2")}
    return "Time against the ideal: " + ", ".join(f"`{b}` {t}" for b, t in ratio.items()) + "."


def preempt_notes() -> str:
    def cell(backend: str, case: str) -> str:
        return find("preempt-2", backend=backend, small_allreduce=case)[
            "time / alone after the delay"]

    def ms(backend: str, case: str) -> str:
        return find("preempt-2", backend=backend, small_allreduce=case)["median ms"]
    ours = [b for b in ("totalreduce-shm", "totalreduce-tcp", "totalreduce-mpi")
            if any(r["backend"] == b for r in rows("preempt-2"))]
    on = "; ".join(f"`{b}` {ms(b, 'during big, priority on')} ms against "
                   f"{ms(b, 'small alone after the delay')} alone after the delay "
                   f"({cell(b, 'during big, priority on')}; priority off "
                   f"{cell(b, 'during big, priority off')})" for b in ours)
    return f"""With priority on: {on}. MPI's small op waits for the whole big one
({cell("mpi", "during big (no priorities)")}), gloo's runs beside it on its own thread
({cell("gloo", "during big (no priorities)")})."""


def tiny_notes() -> str:
    def us(n: str, b: str) -> str:
        return find("tiny-neg", n=n, backend=b)["median us/op"]
    return f"""Fusion is what wins here: 1,000 ops become a few. Without fusion, negotiated mode
costs more per tensor than self-guided mode (`-nofusion` against `totalreduce-shm`:
{us("2", "totalreduce-neg-nofusion")} against {us("2", SHM)} us at 2 ranks). Without the
cache every tensor's request goes to rank 0 and back each time (`-nocache`:
{us("2", "totalreduce-neg-nocache")} us). Self-guided mode pays an op per tensor: at 2
ranks its calls wait for the first `wait()`, which runs them one after another each as a
blocking call, and at 4 ranks each is a whole engine op on the loop ({us("4", SHM)} us).
Negotiated with cache and fusion takes {us("2", "totalreduce-neg")} us per op at 2 ranks,
against {us("2", "mpi")} for 1,000 of MPI's `Iallreduce`, and {us("4", "totalreduce-neg")}
us at 4 ranks (four processes on two cores) against MPI's {us("4", "mpi")}. The whole
cost is Python on the submitting thread and the cycle thread: per tensor, the
submission (a tensor whose dtype, op and shape were seen before skips the argument checks
and makes one new object); the cycle's taking, classifying, fusion copies and
completion (a cycle that readies the same cached tensors as a recent one reuses that
cycle's fusion runs and the views of its buffer; DESIGN-NOTES, negotiated coordination);
and the two small allreduces of the cycle, most of it waiting for the other rank."""


def latency_neg_notes() -> str:
    def us(n: str, op: str, b: str) -> str:
        return find("latency-neg", n=n, op=op, backend=b)["median us"]
    return f"""{us("2", "allreduce 8 B", "totalreduce-neg")} and
{us("2", "barrier", "totalreduce-neg")} us for the allreduce and the barrier at 2 ranks,
against {us("2", "allreduce 8 B", SHM)} and {us("2", "barrier", SHM)} self-guided; at 4
ranks on 2 cores, where each hand-off also waits for a core,
{us("4", "allreduce 8 B", "totalreduce-neg")} and {us("4", "barrier", "totalreduce-neg")}
us."""


def skew_neg_notes() -> str:
    def t(n: str, b: str) -> str:
        return find("skew-neg", n=n, backend=b)["time / ideal"]
    return f"""Self-guided mode starts each gradient's reduction the moment every rank has
submitted it: {t("2", SHM)} of the ideal at 2 ranks, {t("4", SHM)} at 4. Negotiated mode
first waits for a cycle to notice ({t("2", "totalreduce-neg")} and
{t("4", "totalreduce-neg")}); without fusion each of the 161 tensors then runs as an
engine op of its own behind that wait ({t("2", "totalreduce-neg-nofusion")} and
{t("4", "totalreduce-neg-nofusion")}); MPI, in one common order, {t("2", "mpi")} and
{t("4", "mpi")}."""


def replay_neg_notes() -> str:
    def ms(n: str, b: str, mode: str) -> str:
        return find("replay-neg", n=n, backend=b, mode=mode)["median ms"]
    modes = sorted({r["mode"] for r in rows("replay-neg") if r["backend"] == SHM})
    pairs = "; ".join(f"`{m}` {ms('2', SHM, m)} against {ms('2', 'totalreduce-neg', m)}"
                      for m in modes)
    return f"""With all 102 MB ready at once, self-guided against negotiated, in ms at 2 ranks:
{pairs}."""


def sparse_notes() -> str:
    table_rows = [r for r in rows("sparse") if r["algorithm"] != "dense"]
    faster = [r for r in table_rows if num(r["time / dense"]) < 1.0]
    listed = "; ".join(f"{r['algorithm']} on the {r['gradients']} values at "
                       f"{r['density']}, {r['n']} ranks ({r['time / dense']})"
                       for r in faster) or "none"
    ok = [num(r["words sent / k"]) for r in table_rows if r["algorithm"] == "oktopk"]
    ms = {(r["gradients"], r["density"], r["n"], r["algorithm"]): num(r["median ms"])
          for r in table_rows}
    cases = sorted({k[:3] for k in ms})
    one = sum(ms[(*k, "oktopk-1a2a")] < ms[(*k, "oktopk")] for k in cases)
    topka = {n: span([num(r["words sent / k"]) for r in table_rows
                      if r["algorithm"] == "topka" and r["n"] == n]) for n in ("2", "3", "4")}
    return f"""On one host, where a dense allreduce moves memory at memory speed, selection
costs more than the bytes it saves and the sparse algorithms are mostly slower than
dense; faster in {len(faster)} of {len(table_rows)} cells: {listed}. The point is the
volume, which is what a network between hosts pays for: Ok-Topk sends {span(ok)} words
per k, under its bound at every size, while TopkA's grows with the ranks ({", ".join(
        f"{v} at {n}" for n, v in topka.items())}). Its pipelined exchange has nothing to
overlap with on 2 cores, so one alltoall (`oktopk-1a2a`) is faster here in {one} of
{len(cases)} cases; with a
core per rank and a real network between them, summing one step while the next travels
is what the pipeline is for."""


def convergence_notes() -> str:
    table_rows = rows("convergence-4")
    dense = next(r for r in table_rows if r["method"] == "dense")
    epochs = num(dense["epochs to target"])
    slow = [f"{r['method']} ({r['epochs to target']} epochs)" for r in table_rows
            if r["method"] != "dense" and not (
                r["epochs to target"][:1].isdigit()
                and num(r["epochs to target"]) <= 1.5 * epochs)]
    per_epoch = ", ".join(f"{r['method']} {r['MB/rank/epoch (median)']}" for r in table_rows)
    to_target = ", ".join(f"{r['method']} {r['MB/rank to target']}" for r in table_rows)
    return f"""Dense reaches the target in {dense["epochs to target"]} epochs; every other
method within 1.5x of that but {", ".join(slow) or "none"}. MB sent per rank per epoch
(median): {per_epoch}. MB sent per rank until the target, the dense warm-up of Ok-Topk
and PowerSGD (10 steps) included: {to_target}. The sparse methods' volume advantage
grows with the model, which the words-per-k table above measures."""


def ps_notes() -> str:
    table = {r["method"]: r for r in rows("ps")}

    def rate(method: str, col: str = "samples/s") -> float:
        return num(table[method][col])
    allreduce = rate("allreduce")
    servers = [m for m in table if m.startswith("server")]
    vs = ", ".join(f"{m} {rate(m) / allreduce:.2f}x" for m in servers)
    strag = "straggler: samples/s"
    fastest = max(table, key=rate)
    unbounded = rate("server tau=none", strag) / rate("server tau=0", strag)
    return f"""On one host the server pays for its extra processes and for a round trip per push
and per pull, so it trains at a fraction of allreduce's rate ({vs}). With the straggler,
removing the bound buys {unbounded:.2f}x tau = 0's throughput, at an accuracy of
{table["server tau=none"]["accuracy 2"]} against {table["server tau=0"]["accuracy 2"]}.
The fastest is {fastest} ({rate(fastest):,.0f} samples/s), which ends at
{table[fastest]["accuracy"]} (allreduce: {rate("allreduce"):,.0f} samples/s,
{table["allreduce"]["accuracy"]}).
Replicated servers run at {rate("server tau=0 replicated") / rate("server tau=0"):.2f}x
tau = 0's throughput (a push waits for a second server's round trip)."""


def hosts_notes() -> str:
    def bound(name: str, mode: str, nbytes: str = "67108864") -> str:
        return find(name, bytes=nbytes, mode=mode)["x bound"]
    return f"""At 64 MiB the flat ring takes {bound("hosts-1gbit", "flat")}x the 1 Gbit/s bound
and the hierarchical allreduce {bound("hosts-1gbit", "hierarchical")}x; at 10 Gbit/s
{bound("hosts-10gbit", "flat")}x and {bound("hosts-10gbit", "hierarchical")}x, where the
2 cores, not the link, set the time (100 Gbit/s: `docs/bench/hosts-100gbit.txt`,
{find("hosts-100gbit", bytes="67108864", mode="hierarchical")["median s"]} s
hierarchical against {find("hosts-10gbit", bytes="67108864", mode="hierarchical")[
        "median s"]} s at 10 Gbit/s). One rank per host has no local stages and a core to
itself: {bound("hosts-10gbit-1", "flat")}x the 10 Gbit/s bound (`--per-host 1 --modes
flat`, `docs/bench/hosts-10gbit-1.txt`)."""


def hosts_train_notes() -> str:
    table = {r["method"]: r for r in rows("hosts-train")}
    dense = table["dense"]
    lead = [num(r["samples/s"]) / num(dense["samples/s"]) for m, r in table.items()
            if m != "dense"]
    to = [num(dense["s to"]) / num(r["s to"]) for m, r in table.items() if m != "dense"]
    return f"""With two ranks per host, four ranks share the 2 cores. The forward and backward
passes and the sparse selection then take most of a step, and the sparse methods' lead
in samples/s ({span(lead)}x) turns into {span(to)}x dense's speed to 95 %."""


def glance_notes() -> str:
    """The page's headline figures, each from the section that has its table."""
    two = [v for _op, _s, v in _cells2()]
    big = [_speed("collectives-2", op, s) for op in ("allreduce", "reducescatter")
           for s in ("64M", "256M")]
    lat = find("latency", n="2", op="allreduce 8 B", backend=SHM)
    tiny = find("tiny-neg", n="2", backend="totalreduce-neg")
    skew = {r["backend"]: r["time / ideal"] for r in rows("skew-2")}
    rec = rows("recovery")
    worst = max(num(r["worst s"]) for r in rec)
    pre = find("preempt-2", backend=SHM, small_allreduce="during big, priority on")
    train = find("train-mlp", model="mlp", n="2", mode="optimizer 16MB")
    return f"""- 2 ranks over shared memory, from 1 MB: at or above MPI's speed in
  {sum(v >= 1.0 for v in two)} of {len(two)} cells (op x size); allreduce and
  reducescatter at 64-256 MB {span(big)}x MPI; gloo's cells {span(
        [v for _op, _s, v in _cells2("gloo")])}x MPI.
- A blocking 8-byte allreduce: {lat["median us"]} us, {lat["time / mpi"]} MPI's time.
- 1,000 tiny async allreduces, negotiated (cached and fused): {tiny["median us/op"]} us
  each, {tiny["speed vs mpi"]} MPI's speed.
- ResNet-50's gradients ready at random times on each rank: {skew[SHM]} of the ideal
  (MPI, in one common order: {skew["mpi"]}).
- A 1 KB urgent op during a 64 MB allreduce: {pre["time / alone after the delay"]} its
  time alone after the same sleep; MPI's waits for the whole big op ({find(
        "preempt-2", backend="mpi", small_allreduce="during big (no priorities)")[
        "time / alone after the delay"]}).
- Training a 50 MB MLP with the DistributedOptimizer: {train["speed vs DDP gloo"]} the
  speed of DDP over gloo at 2 ranks.
- A killed worker replaced and its checkpoint restored from a peer: at most {worst:.2f} s
  in every cell of the recovery table."""


def weak_spots() -> str:
    mid = [_speed("collectives-2", "allreduce", s) for s in ("1M", "4M", "16M")]
    four = [_speed("collectives-4", "allreduce", s, n="4") for s in ("1M", "4M", "16M")]
    lat = find("latency", n="2", op="allreduce 8 B", backend=SHM)
    bar = find("latency", n="2", op="barrier", backend=SHM)
    lat4 = find("latency", n="4", op="allreduce 8 B", backend=SHM)
    pre = find("preempt-2", backend=SHM, small_allreduce="during big, priority on")
    return f"""- Small messages: a blocking 8-byte allreduce takes {lat["median us"]} us at 2
  ranks ({lat["time / mpi"]} MPI's time), a barrier {bar["median us"]} us
  ({bar["time / mpi"]}): nearly all of it Python per op, even from a Repeat. At 4 ranks on
  2 cores it takes {lat4["median us"]} us ({lat4["time / mpi"]}): every hop waits for a
  peer to get a core. An allgather whose ranks' rows may differ is two such exchanges
  (the small-allgather table); `same_shape=True` makes it one. Batch small tensors
  (`grouped_allreduce`, the optimizer's buckets), or run many of them negotiated.
- The 2-rank collectives below MPI from 1 MB: {_behind2()}. Allreduce
  runs at {", ".join(_x(v) for v in mid)} MPI at 1, 4 and 16 MB; the floor table's bare
  exchanges, with no engine, show how much room copying through memory leaves there.
- 4 ranks on 2 cores: allreduce at {", ".join(_x(v) for v in four)} MPI at 1, 4 and 16
  MB. Every hop waits for a peer to get a core.
- 8 to 16 ranks (the 16-core tables, at their own commits): at 1-4 MB most cells trail
  MPI.
- Preemption over the rings: the urgent op takes {pre["time / alone after the delay"]} its
  time alone after the same sleep; what is left is the caller's Python running slower
  while the big op's copies take the cores. An urgent op the loop runs (an async one)
  waits much longer."""


def main() -> None:
    env, coll2 = table("collectives-2")
    host = _fields(env)
    cpus = f"{host.get('cpus', '?')} {host.get('cpu', '')}".strip()
    _, small2 = table("collectives-2", lambda c: c[0] == "allreduce" and c[2] in
                      ("4", "64", "1K", "16K"))
    parts = [f"""# Benchmarks

Every number on this page comes from `python -m totalreduce.bench` (install:
`pip install torch==2.13.0 && pip install -e ".[dev,mpi,torch]"`). Each section shows the
command and the file in `docs/bench/` holding its full output. `python
docs/bench/regenerate.py` reruns every command and rebuilds the page from those files
(`--list` shows them; `--cores16` runs the 16-core ones). How the numbers got here, and
the experiments behind the defaults, are in `docs/dev/perf-log.md`.

## At a glance

On the 2-core VM of the next section (4 ranks share its 2 cores; the 16-core tables are
further down), from the tables below:

{glance_notes()}

Where we trail: "Known weak spots" at the end.

## Environment

A virtual machine with {cpus} cores and no GPU; every rank on the same host, so
same-host transports (shared-memory rings, MPICH's shared memory) carry all traffic.
Every table but the 16-core ones comes from one run of `regenerate.py` on this machine,
at the commit named under each table; the 16-core tables come from machines with 16
Intel Xeon cores, at the commits named under them. The bench printed:

    {env.removeprefix("environment: ")}

The host is shared and noisy: medians move by 10-50 % from one run to the next, MPI's
too, so compare ratios within a table, not absolute times across tables. Such VMs also
move, for minutes at a time, between placements of their two virtual cores where the
cores share a cache and where they do not; copies slow down in the second, MPI's too
(`TOTALREDUCE_COPY_PIECE` and `TOTALREDUCE_SLOW_RING_GBPS` in "Why the defaults are what
they are"). The measurements behind the defaults, in that section, come from 2-core VMs:
AMD EPYC ones unless a paragraph names an Intel Xeon one.

## Method

- Backends run one after another in the same invocation, interleaved round by round
  (`--rounds`), so a change of the host's state hits all of them: `totalreduce-shm` (TCP plus
  shared-memory rings, the default), `totalreduce-tcp` (sockets only),
  `totalreduce-mpi` (totalreduce's MPI transport under `mpiexec`), `mpi` (mpi4py's own
  collectives under MPICH's `mpiexec`), `gloo` (torch.distributed).
- Every timed call starts right after a barrier; a repetition's time is the slowest
  rank's. Tables give the median and the 10th-90th percentiles over all repetitions.
- Bus bandwidth uses the nccl-tests factors: allreduce 2(n-1)/n, allgather,
  reducescatter and alltoall (n-1)/n, broadcast 1. "speed vs mpi" is MPI's median time over
  the backend's, in the same run.
- Sizes are bytes of float32 per rank (allgather: of the gathered result).
- Results go into arrays made once, for every library: MPI's receive buffers,
  totalreduce's in-place forms (`allreduce_`, `broadcast_`) and `out=` (allgather,
  alltoall). Reducescatter returns a new array (its result is a slice of the op's own
  buffer).
- Every rank's block has the same size, as MPI's `Allgather` and `Alltoall` and gloo's
  `all_gather_into_tensor` and `all_to_all_single` require; totalreduce's allgather and
  alltoall are told so (`same_shape=True`) and skip the exchange of sizes.

## Collectives, 2 ranks

`{command("collectives-2")}` (`docs/bench/collectives-2.txt`, `collectives-2.png`). Six short
rounds rather than two long ones: the host's state (see Environment) changes within a
round, and with two rounds one backend could run a size wholly in one state and another
wholly in the other.

![bus bandwidth per op, 2 ranks](bench/collectives-2.png)

{collectives_notes()}

The whole table:

{coll2}

### The same with huge-page arrays

`{command("collectives-2-huge")}` (`docs/bench/collectives-2-huge.txt`).

{huge_notes()}

{table("collectives-2-huge", lambda c: c[2] in ("64K", "1M", "4M", "16M", "64M", "256M"))[1]}

## The floor: a 2-rank allreduce with no engine

`{command("floor-2")}` (`docs/bench/floor-2.txt`). One job of two ranks under `mpiexec`
runs four allreduces of the same array in turn, op by op, so that all four see the same
state of the host: MPI's, totalreduce's `allreduce_` over the rings, and two bare
exchanges with no engine (numpy and a few shared counters, no headers, credit or
loop): `bare ring` copies each piece into a shared ring and reduces straight out of it,
as the rings do; `bare cma` reads each piece out of the peer's memory
(`process_vm_readv`) and adds it in, then reads the peer's reduced half straight into
place, one copy a piece as lending does. Every result is checked against the sum,
element by element. Since each op follows the others, whose buffers evict its own from
the cache, totalreduce reads lower here than in its own job (the collectives table).

{table("floor-2")[1]}

{floor_notes()}

## Allreduce, 4 ranks (4 processes on 2 cores)

`{command("collectives-4")}`
(`docs/bench/collectives-4.txt`). Four ranks share two cores, so every library is
oversubscribed; spinning waiters cost the peers' CPU time.

![allreduce bus bandwidth, 4 ranks](bench/collectives-4.png)

{table("collectives-4")[1]}

{four_notes()}

## 16 cores: 4 to 16 ranks

A virtual machine with 16 Intel Xeon cores and one rank per core; MPI is Open MPI 4.1.6
(its `mpiexec`, mpi4py 4.1.2), gloo is torch 2.11's. The three tables below come from one
run of `regenerate.py --cores16` at one commit (under each table), which this page's
other tables postdate. Such machines differ from one to the next and from one sitting to
the next (64 MB cells by 10-25 %, MPI's and gloo's too), so again compare within a
table. Shared-memory rings carry all of totalreduce's traffic.

Allreduce:

`{command("cores16-allreduce")}`
(`docs/bench/cores16-allreduce.txt`). Up to 1 MiB it is recursive doubling; above, from
8 ranks, recursive halving then doubling (up to 8 MiB at 8 ranks, every size at 16),
else the ring. Blocking calls whose sends to a peer fit its ring run on the caller's
thread (the express lane), recursive halving included. Neither recursive halving at 16
ranks for 1 MB or at 4 ranks for 1-4 MB, nor the ring from 512 KiB, was faster than these
choices (docs/dev/perf-log.md).

4 ranks:

{table("cores16-allreduce", lambda c: c[1] == "4")[1]}

8 ranks:

{table("cores16-allreduce", lambda c: c[1] == "8")[1]}

16 ranks:

{table("cores16-allreduce", lambda c: c[1] == "16")[1]}

The other collectives:

`{command("cores16-others")}`
(`docs/bench/cores16-others.txt`). From 8 ranks broadcast is a scatter then an
allgather at every size; allgather and reducescatter take recursive doubling and halving
above 1 MiB up to n MiB, else the ring, but allgathers up to 1 MiB (and every
allgather's exchange of sizes) take recursive doubling with one message a step;
alltoall is a pairwise exchange.

8 ranks:

{table("cores16-others", lambda c: c[1] == "8")[1]}

16 ranks:

{table("cores16-others", lambda c: c[1] == "16")[1]}

Blocking 8-byte allreduce and barrier:

`{command("cores16-latency")}`
(`docs/bench/cores16-latency.txt`, timed as in the latency section below). Recursive
doubling takes `log2 n` steps.
At 4 ranks the steps cost what they cost at 2 (the call, posting, and per step a short
wait for the partner and the reduction); from 8 ranks the waits grow instead: every step
waits for its partner's previous one, and one slow rank delays all of its partners.

{table("cores16-latency", _allreduce_barrier)[1]}

## Latency: blocking 8-byte allreduce and barrier

`{command("latency")}`
(`docs/bench/latency.txt`): 3,000 calls of each back to back (no barrier between two, as
a training loop makes them), each call timed alone; a call's time is the slowest rank's.
`time / mpi` is the median over MPI's median for the same op in the same run. A blocking
op with nothing else in flight runs to its end on the caller's thread, which reads its
peers' messages straight out of the shared-memory rings (over the MPI transport, out of
the header receive it posted for each peer, tested in place; over sockets, out of the
link's staging buffer, into which it receives what the kernel holds); one whose schedule
is a chain
(recursive doubling: every small allreduce and barrier) takes the express lane
(engine/express.py), which keeps only its position in that chain, and a call like one
made before runs from its template's Repeat (engine/repeat.py), which binds everything
the calls share, so a call brings only its buffer and identity.  What is left is Python
per call (about 1,300 bytecodes for an 8-byte allreduce at 2 ranks, 1,220 for a barrier:
checks, identity, the engine's idleness, the credit, the header, the ring, the
reduction), many times MPI's C: half of a call is what
a bare loop over the same rings takes (post, poll, add, release), the other half the
engine's and the API's bookkeeping (docs/dev/perf-log.md, small messages). {latency_notes()}

{table("latency", _allreduce_barrier)[1]}

The same ops inside the 2-rank collectives table (each call after a barrier):

{small2}

## Small allgathers and object collectives

`{command("latency-small")}`
(`docs/bench/latency-small.txt`), timed as the latency table above: a blocking allgather
of 8 bytes whose ranks' rows may differ (`allgather(x)`, Horovod's `hvd.allgather`; MPI:
`Allgather` of the rows, then `Allgatherv`, as Horovod does over MPI), and
`allgather_object` and `broadcast_object` of a small dict (MPI: mpi4py's `allgather` and
`bcast` of the object; gloo: `all_gather_object` and `broadcast_object_list`). A repeated
allgather of rows runs its two ops (the rows, then the data) each from its template's
Repeat. An object collective moves a 1 KiB head first (the pickle's length and first
bytes), which is the whole of a small object's pickle; a longer one's rest goes in a
second op, padded to a power of two up to 64 KiB, so that calls whose pickles vary in
size still find their templates.

{table("latency-small", _small_calls)[1]}

## Replay: one training iteration's gradients (ResNet-50, 2 ranks)

161 ResNet-50 tensors (25.6 M parameters, 102 MB of float32), reduced in backward order.
`per-tensor`: one async allreduce per tensor, then wait for all. `grouped NMB`:
`grouped_allreduce_async_` over buckets of N MB (arrays of 128 KiB and more go as ops of
their own, smaller ones are fused). `flat`: one buffer of which the gradients are views.
`optimizer NMB`: the torch DistributedOptimizer's buckets at `synchronize()`, as if
backward had just ended with no hook fired: each bucket a blocking allreduce in turn.
MPI: `Iallreduce` per tensor, or one `Allreduce` of the flat buffer. Modes interleaved rep
by rep.

`{command("replay-2-optimizer")}`
(`docs/bench/replay-2-optimizer.txt`):

{table("replay-2-optimizer")[1]}

{replay_notes()}

## Training with PyTorch: DistributedOptimizer against DDP

`bench train`: samples/s of one SGD step (fixed random batch of 32 per rank, one torch
thread per rank) under totalreduce's DistributedOptimizer (16 MiB buckets, reduced while
backward runs, or with `overlap=False` at `step()`), the same optimizer with each sparse
compression at density 1 %, DDP over gloo (its default 25 MB buckets), and the same DDP
with `totalreduce.torch.ddp_comm_hook`. A repetition is 5 steps; its time is the slowest
rank's. A job builds all its modes first and times them in turns, a repetition of each per
round in an order that alternates, so that the host's drift from minute to minute falls on
every mode alike. Every mode runs 3 steps before it is timed, a sparse mode its dense
warm-up calls too (Ok-Topk's first 10), so its rows show sparse steps only, and `compute
only` 12 (a fresh process's first ten steps run 1.3-1.5x slower).

- `compute only` is the same step with no communication at all, every rank computing at
  once: no mode can beat it.
- `comm alone` is the mode's communication with nothing else running: the optimizer's
  buckets reduced after backward (for the sparse modes, the whole sparse allreduce,
  selection included), or DDP's bucket sizes allreduced over gloo.
- `comm hidden` is `1 - (step - compute only) / comm alone`: 100 % when the communication
  costs the step nothing, 0 % when it costs all of its time alone, below 0 when running
  it alongside backward costs more than running it after.
- `speed vs dense` compares a sparse mode (or `overlap=False`) with the dense optimizer.

With one core per rank, as here, a rank has no core to spare for its communication: the
copies and sums of a reduction take CPU time from backward, and every hand-off between
two ranks' progress threads waits for the scheduler. Overlap therefore hides little of
it, or costs more than it hides; `overlap=False` and `TOTALREDUCE_AUTOTUNE=1` are there for
such machines. Sparse modes run their selection on a worker thread of their own, on the
same core.

`mlp`, 12.6 M parameters (50 MB of gradients), little compute per sample:
`{command("train-mlp")}` (`docs/bench/train-mlp.txt`):

{table("train-mlp")[1]}

![median step time per mode, mlp](bench/train-mlp.png)

`convnet`, 1.2 M parameters, compute-heavy:
`{command("train-convnet")}` (`docs/bench/train-convnet.txt`):

{table("train-convnet")[1]}

![median step time per mode, convnet](bench/train-convnet.png)

The convnet's communication is a few percent of its step, less than the run-to-run spread
of the step itself, so its `comm hidden` column is noise.

{training_notes()}

Whole training runs: `totalrun -np N python examples/torch_synthetic_benchmark.py` (a
ResNet-18-shaped network on synthetic images) prints images per second, and
`examples/train_digits.py` trains the digits MLP and prints its test accuracy; both are
bound by the host's cores here.

## Skew: ranks ready at random times, each in its own order (ResNet-50, 2 ranks)

Each rank draws a ready time in [0, 50 ms) for every tensor and submits each as soon as
it is ready, in its own order (totalreduce); MPI and gloo need one common order, so they
take the tensors in backward order, each once ready. Ideal = the last ready time (max over
ranks) + MPI's flat allreduce time in the same run.

`{command("skew-2")}` (`docs/bench/skew-2.txt`):

{table("skew-2")[1]}

{skew_notes()}

## Preemption: a 1 KB allreduce issued 2 ms into a 64 MB one (2 ranks)

`{command("preempt-2")}` (`docs/bench/preempt-2.txt`):

{table("preempt-2")[1]}

{preempt_notes()}

The urgent op here is blocking, issued after a barrier, the big op's start and a 2 ms
sleep. `small alone after the delay` is the same call after the same barrier and sleep
with no big op: waking from the sleep costs more than a small op does, so `time / alone
after the delay` is what the big op adds, and `small alone` (back to back) is the op's
own cost.

Each transport gives a blocking urgent op a lane of its own (DESIGN-NOTES, the urgent
lane), so that it waits neither for the thread that drives the big op nor behind the big
op's records, which a peer reads in order. Over the shared-memory rings the application's
thread posts its message into a second, small ring to the peer and reads the peer's out
of its own; over TCP it goes through a second connection to the peer, so it does not wait
behind the big op's bytes in the kernel's buffers (both ends send at once, `TCP_NODELAY`,
and a socket between two ranks of one host keeps a 256 KiB send buffer so that an op the
loop runs waits behind little); over the MPI transport the lane to a peer on the same
host is a pair of shared-memory rings of its own (transport/ring_lane.py). Where a host's
ranks outnumber its cores the MPI transport has no lanes. The thread that drives the big
op gives its core away every 100 us (transport/poller.py, `GiveWay`) and between the
slices of a lent copy: a loop busy with a big op never blocks, and the application's
thread, woken from its sleep, would otherwise wait for the scheduler's next look, up to
milliseconds. What is left is the caller's Python running two to three times slower
while the big op's copies take the two cores.

An urgent op the loop runs (an async one, or one whose lane is busy) is helped by
priorities: before each big body, and between the slices of its copy, the reader handles
the DATA records posted behind it whose op runs here at a higher priority and is small
(up to 256 KiB), reading only the records posted since its last look; a lent copy goes
in 1 MiB slices (256 KiB while an urgent op runs) and stops between two when an op was
submitted on this rank or an urgent message was handled; and between two slices the
copying thread gives up its core for a moment.

## Coordination: self-guided against negotiated

The same jobs under `TOTALREDUCE_COORDINATION=negotiated` (Horovod's model: a background
cycle every 1 ms agrees which tensors every rank has asked for, answers repeated tensors
from its response cache, and fuses small ones), with the cache (`-nocache`) or fusion
(`-nofusion`) turned off. The default, self-guided mode (`totalreduce-shm`) starts every
op the moment it is called. Run the cached, fused mode (`totalreduce-neg`) against these
columns to see what each mechanism buys.

**Many tiny tensors**: 1,000 async allreduces of one float32 each, submitted, then waited
(time per op). `{command("tiny-neg")}` (`docs/bench/tiny-neg.txt`; these are `tiny`'s backends by
default, both scheduling modes):

{table("tiny-neg")[1]}

{tiny_notes()}

**A lone blocking op**: the latency table's loop (8-byte allreduces, then barriers, back
to back) in both modes. `{command("latency-neg")}` (`docs/bench/latency-neg.txt`):

{table("latency-neg", _allreduce_barrier)[1]}

A negotiated op is agreed on before it runs: the application's thread hands the request
to the cycle thread, which allreduces the cycle's bit vector with the other ranks, runs
the op (on its own thread when it is small and alone in its cycle; DESIGN-NOTES,
negotiated coordination) and hands the result back. That is two engine ops and four
hand-offs between threads where self-guided mode runs one op on the caller's thread:
{latency_neg_notes()} A
wait on a request wakes the cycle thread, which otherwise sleeps to its tick;
without that, a blocking op would wait for the tick of the last rank to reach it, a
cycle and a half at the median.

**Skew** (as above, at 2 and 4 ranks). `{command("skew-neg")}` (`docs/bench/skew-neg.txt`):

{table("skew-neg")[1]}

{skew_neg_notes()}

**Replay** (as above, ResNet-50, 16 MB buckets). `{command("replay-neg")}`
(`docs/bench/replay-neg.txt`):

{table("replay-neg")[1]}

{replay_neg_notes()}

**When each wins**: negotiated mode for many small tensors reduced as they come (tiny
embeddings, per-parameter reductions, metrics). Self-guided mode for large gradients,
skewed ranks, and everything latency-bound. The digits example, one small bucket per
step, trains faster self-guided: each step's gradients would wait for a cycle and its
hand-offs.

## Sparse allreduce: Ok-Topk, TopkA, gTopk (totalreduce.compression)

Each algorithm against a dense allreduce of the same buffer. The gradients are either
heavy-tailed (Student-t, 2 degrees of freedom, a million float32) or captured from the
digits example's MLP (50,890 values, real minibatches per rank). Words sent are
per rank, per call, in units of k = density x n: the payload as 4-byte words, read from
the transport's counters less the 64-byte message headers; the worst rank is shown,
median over calls past the first two. Ok-Topk's bound is 6(P-1)/P: 3, 4 and 4.5 at 2, 3
and 4 ranks. TopkA's volume is 2(P-1). `oktopk` is the published, pipelined
split-and-reduce (P - 1 rotation steps in flight at once); `oktopk-1a2a` is
`OkTopk(pipeline=False)`, the same exchange in one alltoall.
`{command("sparse")}` (`docs/bench/sparse.txt`):

{table("sparse")[1]}

{sparse_notes()}

`gtopk` is the published gTopk; `gtopk-exact` (`GTopk(exact_sums=True)`) sums exactly at
the winners instead, at the cost of a second exchange. A rank of the published gTopk sends
at most one tree message and one broadcast hop of k pairs, at most 4 words per k whatever
P; rank 0 receives 2 per k in each of its ceil(log2 P) merge rounds. The same at a tenth
of the size, `{command("sparse-words")}` (`docs/bench/sparse-words.txt`; at 100,000
elements the times are mostly per-op overhead):

{table("sparse-words")[1]}

## Training with sparse gradients: accuracy against epochs and bytes (digits, 4 ranks)

The digits MLP (50,890 parameters) trained for 30 epochs at 4 ranks, per-rank batch 32,
the same seed and shards for every method: dense averaging and the three sparse
algorithms at 1% and 2% through the DistributedOptimizer, and torch's own PowerSGD DDP
hook (rank 2, vanilla allreduce for the first 10 steps, as Ok-Topk's dense warm-up) over
gloo. Learning rates are the example's: SGD 0.05 per rank with momentum 0.9 for dense and
PowerSGD, plain SGD 0.25 per rank for the sparse methods (their residuals already carry
held-back gradients forward; momentum on top made them unstable). Bytes are what a rank
sent from the first step on: the transport's own count for totalreduce; for gloo, which
keeps none, what the hook passed to `all_reduce` times 2(P-1)/P (a ring allreduce). The
target is dense's final accuracy less one point.
`{command("convergence-4")}` (`docs/bench/convergence-4.txt`):

{table("convergence-4")[1]}

![accuracy against epochs and against MB sent per rank](bench/convergence-4.png)

{convergence_notes()}

The example itself draws the same run's loss and accuracy with `--plot`:
`totalrun -np 4 python examples/train_digits.py --epochs 30 --compression oktopk --density
0.01 --plot docs/bench/digits-oktopk-1pct.png` (at 0.02, `digits-oktopk-2pct.png`; dense
without `--compression`, `digits-dense.png`).

## Recovery from a killed worker (`totalrun --max-restarts`)

A job checkpoints a state of the given size in memory, makes one more collective, and
rank 1 kills itself (SIGKILL). *restart*: from the kill to the replacement's `init()`
returning (the survivors notice, totalrun starts the new process, it imports and meets
them); *load*: its `load_checkpoint()`, the checkpoint sent from a survivor's memory;
*total*: from the kill until every rank has returned from the collective the survivors
were waiting in. Medians of 3 jobs per cell, and the worst; the target is 2 s plus the
checkpoint's size at 1 GB/s. `{command("recovery")}` (`docs/bench/recovery.txt`):

{table("recovery")[1]}

*restart* is mostly the survivors noticing the loss, totalrun starting the process
(a new Python process importing numpy and totalreduce), and the survivors dropping their
links and meeting the newcomer.

## Allreduce, averaging and the parameter server, with a straggler (digits, 3 workers)

The digits MLP trained for 10 epochs by 3 workers in three ways: gradient allreduce
(`examples/train_digits.py`), parameters averaged every H steps (`--average-period H`),
and the parameter server with 2 servers at delay bounds tau (`examples/train_digits_ps.py
--max-delay`; the servers are 2 more ranks, so 5 processes share the 2 cores). With a
straggler, the last worker sleeps in each step as long as its previous step took. Samples/s
is over the slowest worker's training time (worker 0's in the replicated row: with
`--max-restarts` the workers have no process set to agree on it; at tau = 0 they move in
step). "replicated" is tau = 0 under `--max-restarts 1`, where each server's range has a
copy on the other server and a push returns once both hold it.
Medians of 3 jobs per cell. `{command("ps")}` (`docs/bench/ps.txt`, `docs/bench/ps.png`):

{table("ps")[1]}

![throughput and accuracy per method](bench/ps.png)

{ps_notes()}

## Across hosts

Two hosts of two ranks each, simulated on this machine: each host is a network namespace
with its own hostname, and each host's link to a shared bridge is rate-limited in both
directions with `tc` (this kernel has no `netem`, so the links have no added delay). The
ranks start with srun's environment (docs/MULTIHOST.md). Same-host ranks share memory,
and the others talk over TCP across the limited links. All 4 ranks share the machine's 2
cores.

The link bound is the time for each host to send `2 (H - 1) / H` of the buffer over its
link: with 2 hosts, the whole buffer, 64 MiB at 125 MB/s = 0.537 s for 1 Gbit/s. The
flat ring sends 1.5 buffers through each host's link: two of its four neighbour pairs
straddle the hosts.

`{command("hosts-1gbit")}` (`docs/bench/hosts-1gbit.txt`):

{table("hosts-1gbit")[1]}

`{command("hosts-10gbit")}` (`docs/bench/hosts-10gbit.txt`):

{table("hosts-10gbit")[1]}

{hosts_notes()}

Training over 1 Gbit/s: the digits MLP widened to 64-2048-2048-10 (4,350,986
parameters, 17.4 MB of float32 gradients per step), batch 32 per rank, dense against
the sparse compressions at 1 %. Accuracy is on the whole test set after each epoch
(about 10 steps at 4 ranks, 21 at 2), and the time to the target is read at the end of
the first epoch that reaches it. One rank per host,
`{command("hosts-train-1")}` (`docs/bench/hosts-train-1.txt`):

{table("hosts-train-1")[1]}

Two ranks per host, `{command("hosts-train")}` (`docs/bench/hosts-train.txt`):

{table("hosts-train")[1]}

{hosts_train_notes()}

## Why the defaults are what they are

The settings in `config.py` that trade speed one way or another, and the measurements
behind each choice (2 ranks unless said; `--set NAME=VALUE` repeats any of them). Where
a paragraph names no host, its measurements come from a 2-core AMD EPYC VM, and "here"
means that VM; an Intel VM is named as such.

Why big copies go in pieces of half the L2 cache on AMD CPUs (`TOTALREDUCE_COPY_PIECE`,
memcopy.py): glibc copies a block of at least the L2 size (1 MiB here) with a vector loop
that first reads each destination line, where a smaller one goes by `rep movsb`, which
does not; into ring lines the peer has just read, in the placement where the two cores
share no cache, 1 MiB took 129 us whole and 26 us in two pieces. `python -m
totalreduce.bench collectives -n 2 --sizes 1M,4M,16M,64M --rounds 2` with `--set
COPY_PIECE=0` and without, alternated twice in that placement: allreduce 1 MB 0.073-0.085
ms against 0.171-0.172, 4 MB 0.46-0.49 against 0.67, 16 MB 2.1-2.3 against 3.0;
broadcast 4 MB 0.18-0.21 against 0.51-0.56; reducescatter 4 MB 0.19-0.20 against
0.37-0.41. In the other placement, blocks of calls each way interleaved in one job: 4 MiB
broadcasts 0.119 against 0.128 ms, allreduces 0.231 against 0.247, 1-2 MiB level.
Private copies (an allgather's own block, an input copied into a working buffer) go in
pieces from 16 MiB, where a copy into memory no cache holds ran 15-20 % faster so (2-8 MiB
ones 2-5 % slower). On other CPUs glibc uses `rep movsb` up to its much larger
non-temporal bound, and copies stay whole.

Why 2 MiB segments: one process pair alternating 1 and 2 MiB per op (so both see the same
machine state) ran 4-64 MB allreduces 5-20% faster with 2 MiB over the shared-memory rings
and over MPI, and no slower over TCP; at 4 ranks 16 and 64 MB ran 1.2-1.3x faster.  Fewer
pieces means less Python work per byte; a piece is still no bigger than one core's L2 here.

Why blocking ops of up to 2 MiB run on the caller's thread (`TOTALREDUCE_DIRECT_BYTES`,
engine/smallpath.py): `python -m totalreduce.bench collectives -n 2 --sizes 256K,1M,2M
--ops allreduce,allgather,broadcast --rounds 2` with `--set DIRECT_BYTES=65536` and then
`--set DIRECT_BYTES=2097152`: allreduce went from 0.34x to 0.36x MPI at 256 KB, from 0.41x
to 0.59x at 1 MB and from 0.43x to 0.58x at 2 MB; allgather gained 0.01-0.03x; broadcast
gained at 256 KB and 1 MB but lost at 2 MB (0.50x to 0.36x), where the general path lends
the body and the small path copies it through the ring. Allreduce decided it.

Why blocking allreduces go further on the caller's thread (DIRECT_BYTES auto: while what
one sends a peer, 2 (n - 1) / n of it, fits in the ring's two segments; 4 MiB at 2 ranks,
3 MiB at 3, 2.7 MiB at 4): an allreduce reads its peer's data once to reduce it, as
cheaply out of the ring as out of a lent copy, so lending gains it nothing and the general
path only adds hand-offs between threads. `python -m totalreduce.bench collectives -n 2
--backends totalreduce-shm,mpi --ops allreduce --sizes 1M,3M,4M,6M,16M --rounds 1`, run
alternately with the 2 MiB limit and with this one, twice each: 3 MB took 0.449/0.480 ms
and then 0.199/0.195 ms, 4 MB 0.456/0.483 and then 0.262/0.274 ms (1.54-1.60x MPI); 1, 6
and 16 MB, on the same path either way, did not move. Reducescatter, whose input is read
in place on the general path, lost on the caller's thread at 4 and 8 MB (the express lane,
through the ring) and keeps 2 MiB there; at 2 ranks a repeated one past it runs from its
Repeat up to `REPEAT_ALLREDUCE_BYTES`, lending its piece where the loop would and summing
the peer's as it lands (on an Intel VM whose rings copied slowly, 4 MB 0.58-0.64 ms
against 0.72-0.73 on the loop, 16 MB 2.36-2.60 against 2.81-2.90, 64 MB 17.8-18.0 against
18.7-19.8). Allgathers, which send one peer (n - 1) / n of their result, take the same
bound while the rings copy fast (below): at 2 ranks 3 MB took 0.217 ms against 0.322 ms
lent, 4 MB 0.327 against 0.376 ms (`--ops allgather --sizes 1M,3M,4M,6M`, old and new tree
alternated); while the rings copy slowly they keep 2 MiB, and then lend. Alltoalls, which
send each peer 1 / n of theirs, take it too while the rings copy fast: at 2 ranks 3 MB
took 0.24 ms against 0.34-0.35 ms lent (`--ops alltoall --sizes 1M,2M,3M,4M,8M`, old and
new tree alternated three times), 4 MB 0.33-0.36 ms against 0.35-0.40 ms; while the rings
copy slowly their data leaves the caller's thread from 512 KiB (below). Broadcasts take
the allreduce's bound at 2 ranks, and from 3 ranks the ring's room (a chain sends its next
peer the whole buffer; at 4 ranks on 2 cores 3 MiB broadcasts took 0.82-1.05 ms there
against 1.46-1.88 on the loop, 4 MiB ones 0.99-1.23 against 1.49-1.57, old and new tree
alternated three times in jobs of their own), and past 2 MiB go in pieces of half a
segment so that a rank copies one piece out while the one before it copies the next in (in
two whole segments the copies ran one after the other, and the caller's thread gained
nothing): with the old and the new tree alternated six times in separate jobs, 60
broadcasts each, 4 MB took 0.50-0.78 ms against 0.55-1.54 ms on the loop and 3 MB
0.39-0.49 against 0.46-1.17 (one pair of each the other way round, in the host's slow
state); at 3 ranks on 2 cores 3 MB took 1.2-2.7 against 2.0-3.9 ms, at 4 ranks 2.5 MB
2.6-3.6 against 3.8-7.3 ms. 16 MB, on the same path either way, did not move.

Why repeated 2-rank allreduces past the ring stay on the caller's thread up to 256 MiB
(`REPEAT_ALLREDUCE_BYTES`, scheduling/thresholds.py): from its second call such an
allreduce runs from its Repeat, whose sends wait for room in the ring while it reads and
sums the peer's pieces, so each piece is copied in while the peer sums the one before,
out of a cache that still holds it, with none of the loop's turns between. `python -m
totalreduce.bench collectives -n 2 --backends totalreduce-shm,mpi --ops allreduce --sizes
4M,8M,16M,32M,64M --rounds 2`, the old and the new tree alternated twice in each of the
VM's two placements: where its two cores shared a cache, 8 MB took 0.44 ms against
0.56-0.62 and 16 MB 1.10-1.13 against 1.29-1.47 (1.52-1.71x MPI against 1.36-1.44x); where
they did not, 8 MB 0.94-0.95 against 0.98-0.99 and 16 MB 2.05-2.14 against 2.43-2.64. In
jobs of their own (60 calls) where the cores shared no cache, 24 MB took 2.6-3.0 ms
against 3.3-4.2, but 28 MB 4.2-4.5 against 3.3-4.3 and 32 MB 5.1-5.6 against 4.3-4.8
(the loop lends the pieces of huge-paged buffers from 32 MiB); 64 MB was level. That was
while a Repeat lent nothing. Now it lends the pieces the loop would (by size, or while
the rings copy slowly) and sums each 512 KiB slice of a lent piece as it lands: on an
Intel VM whose rings copied slowly, with the bound at 24 MiB and at 256 MiB alternated
twice, 32 MB took 7.3-7.5 ms against 8.6-8.7, 64 MB 15.9-16.1 against 18.1-18.4 and 256
MB 67.6-69.0 against 76.9-77.1 (1.59-1.77x MPI against 1.37-1.53x). Async allreduces
wait in the loop's queue for their Repeats up to 24 MiB (`QUEUED_ALLREDUCE_BYTES`), as
measured there.

Why 2-rank allgathers and alltoalls stay on the caller's thread up to 24 MiB where their
pieces are lent (`LENT_GATHER_BYTES`, scheduling/thresholds.py): the express lane lends a
piece as the loop does, then copies the rank's own block while the peer reads, with none
of the loop's turns between the steps (100-200 us at 16 MB); from a call's second time,
its Repeat does the same without building the call's spec (engine/repeat.py). `python -m
totalreduce.bench collectives -n 2 --backends totalreduce-shm,mpi --sizes
4M,6M,8M,12M,16M,24M --ops allgather,alltoall --rounds 2`, the old tree and the new
alternated three times in jobs of their own: allgather 6 MB 0.24-0.25 ms against
0.28-0.30, 8 MB 0.32-0.36 against 0.37-0.41, 12 MB 0.59-0.65 against 0.69-0.73, 16 MB
0.98-1.05 against 1.08-1.19; alltoall 6 MB 0.32-0.34 against 0.40-0.43, 8 MB 0.53-0.57
against 0.58-0.61, 12 MB 0.90-0.99 against 0.98-1.06, 16 MB 1.31-1.38 against 1.37-1.42.
At 24 MB the lane alone was level with the loop; from a Repeat, 24 MB alltoalls took
2.10-2.20 ms against 2.30-2.37 on the loop in three alternations of four (level in the
fourth), allgathers 1.90-1.99 against 2.00-2.25 in three. At 32-64 MB the loop, which
reads a lent piece in slices, was as fast or faster. The Repeat against the lane, blocks
of ten calls interleaved in one job: 4 MB alltoalls 0.31-0.38 ms against 0.35-0.41,
allgathers 0.24-0.26 against 0.29-0.32, 16 MB 1.51-1.52 against 1.61-1.63 and 1.68-1.71
against 1.88-1.92 (the cores sharing a cache); 4 MB alltoalls 0.18-0.22 against 0.19-0.24
and 16 MB 1.32 against 1.44-1.45 where they do not.

Why gathers of 1 MiB and more lend their pieces, and reductions only from 32 MiB where
every rank has a core of its own (cross-memory attach, transport/cma.py;
`TOTALREDUCE_CMA_BYTES` auto): a lent piece is one kernel copy on the receiver's core.
For a gather's piece that is all the work, where the ring costs a memcpy on each side; a
reduction's piece is then summed in a second pass, where through the ring the sender's
core copies it in and the receiver sums it straight out of the ring. `python -m
totalreduce.bench collectives -n 2 --backends totalreduce-shm --sizes 4M,8M,16M,64M,256M
--rounds 1` with `--set CMA_BYTES=1048576` and with `--set CMA_BYTES=33554432`,
alternated twice in the host's fast state: allreduce 8 MB 1.01-1.15 against 0.82-0.87
ms, 16 MB 2.34-2.58 against 1.95-2.06, 64 and 256 MB level; reducescatter 4 MB 0.34-0.43
against 0.25-0.26, 8 MB 0.84-0.97 against 0.58-0.64, 16 MB 1.90-2.09 against 1.45-1.53;
but allgather 8 MB 0.67-0.68 against 0.84-0.97 and 16 MB 1.67-1.89 against 2.04-2.19, so
gathers keep lending. But for a piece the ring holds whole (a blocking 2-rank allgather
or alltoall of up to 4 MB): out of small pages the reader's kernel pins each one, and a
2 MiB half took it 110-235 us to read where the ring's copy in and copy out took 85-105
in all. Such a piece is lent from a Repeat only where huge pages back it and the peer's
too (each rank says so in its data, `FLAG_WOULD_LEND`: one rank lending while the other
copied was slower than both ways), where the peer lends by size alone (an async call's
side), or where the rings copy slowly (`CopyPace.beats_lending`). `--ops
allgather,alltoall --sizes 1M,3M,4M,16M --rounds 2`, this rule against lending every
such piece, alternated three times in jobs of their own, cores sharing a cache: alltoall
3 MB 0.125-0.132 ms against 0.193-0.194, allgather 3 MB 0.112-0.144 against 0.172-0.191,
4 MB 0.148-0.170 against 0.190-0.195; alltoall 4 MB 0.189-0.205 against 0.169-0.258.
Where the cores share no cache, both ways lend. At 4 ranks on 2 cores the sender's copy
takes a core a peer wanted (16 MB allreduces 8.3 ms lent, 9.2-10.2 not, `-n 4`; 8 MB
ones 4.1-4.2 lent, 4.8-5.2 not), so where ranks outnumber cores reductions lend from 8
MiB; below that the ring was as fast or faster (4 MB at 3 ranks: 1.8-3.2 ms against
2.9-4.3 lent). Ops of up to 2 MiB that run on the caller's thread (the small path) never
lend. Those measurements were of numpy's arrays, which huge pages back but for their
ends; a lent piece costs its reader a pin of each of the lender's pages, and out of
small pages (torch's CPU tensors, by default) the ring wins instead: at 2 ranks, one job
per way alternated twice, 32 MB allreduces took 6.5 ms lent against 3.7-3.9 through the
ring, 64 MB 12.1-12.5 against 7.5-7.7, 256 MB 46.5-46.9 against 30.8-32.9 (numpy's:
3.5-3.6 against 3.6-3.7, 29.4-29.7 against 30.3-30.8). So a reduction lends only out of
a buffer at least three quarters of which huge pages back, where the kernel can say
(`PAGEMAP_SCAN`, Linux 6.7; transport/pages.py), and from 8 MiB it does not lend such a
buffer while a ring copies slowly either: its big copies run at memory's speed, which
the slow-ring rule below took for slow (64 MB: 12-15 ms lent). One exception among the
gathers: a broadcast's root lends only what it copies half of itself (OpSpec.lend,
OpSpec.spread). Its core has nothing else to do. At 2 ranks, where each rank has a core,
a blocking broadcast of 1 MiB or more goes in 32 MiB pieces, each lent, and the root
copies each piece's back half into the receiver (`process_vm_writev`, at the receiver's
request) while the receiver copies the front (transport/ring_link.py): on the Intel VM,
in `bench collectives -n 2 --ops broadcast` runs alternated with the tree before it, 1
MB took 0.09-0.12 ms against 0.13-0.15 through the ring, 4 MB 0.29-0.35 against
0.51-0.54, and 16-256 MB up to a tenth less than with the front copied on a second
thread of the receiver's instead (64 MB 4.7-5.6 ms against 5.7-5.9). Elsewhere a
memcpy into the ring on the root's side plus one out on the receiver's beat one kernel
copy on the receiver's alone: at 2 ranks on the Intel host, 64 MB in 6.7-7.7 ms instead
of 10.8-11.3 (MPI: 9.1-9.5), 16 MB in 1.38-1.57 instead of 1.72. Broadcasts up to 2 MiB
go in 512 KiB pieces there, so that the receiver copies one out while the root copies
the next in (1 MiB: 164 -> 129 us, 2 MiB: 315 -> 231 us).

Why a ring whose copies run slower than the kernel's copy of a lent body lends every body
of 64 KiB or more (`TOTALREDUCE_SLOW_RING_GBPS`, transport/copy_pace.py): the writer times
its copies of 256 KiB or more into the ring; three slow in a row say slow, and any one
copy faster says fast again. On the AMD VMs these copies ran at 12-37
GB/s while the two cores shared a cache and at 2.3-6.3 GB/s while they did not; the
kernel's copy of a lent body ran at about 11 GB/s in either state, so below that the
ring's two copies cost more than the kernel's one. On another VM of the same kind the
kernel's copy ran at 4-7 GB/s while plain copies ran at 25-30 GB/s, and ring copies during
1 MiB alltoalls at 7-13 GB/s: a fixed 10 GB/s lent most of them, at 0.67-0.74 ms against
0.30-0.34 ms through the ring (alternated runs). So the bar is measured when the transport
starts (transport/cma.py `read_rate`: the best of five 512 KiB reads of the process's own
memory, about 1 ms). Copies into lines no cache holds run at
memory's speed (7-10 GB/s here) in either state, so a ring's first lap is not judged,
neither is the first lap after lending: every 0.25 s of lending the ring is tried again,
and judged from its second lap on. (Judged from their first copies, 1 MiB alltoalls lent
in the fast state and never came back: 216-233 against 123-163 us.) Blocking broadcasts
and alltoalls of 512 KiB or more then may leave the caller's thread, which cannot lend,
for the loop. On the first VM that won: `python -m totalreduce.bench collectives -n 2
--sizes 1M,2M,4M,16M`, with and without the rule, alternated, in the slow state:
broadcast 1/4/16 MB 0.31/1.72/6.87 -> 0.19/0.39/1.54 ms (MPI 0.09/0.24/1.1), alltoall 1/2
MB 0.32/0.58 -> 0.20/0.25 ms; in the fast state every cell stayed within noise. On the
second it lost: timed on both ranks, 1 MiB broadcasts took 0.57-0.68 ms lent against
0.11-0.17 ms through the ring, alltoalls 0.49-0.58 against 0.20-0.29 ms. So each way is
timed while the rings are slow, per kind of op and power-of-two size, and the faster
taken (scheduling/slow_rings.py: each tried twice first, then the slower tried again
twice in a row, the first of the two untimed, after 32 ops, and after twice as many each
time it is still 1.5x slower, up to 1024).
With every ring taken for slow (`--set SLOW_RING_GBPS=1000`, old and new tree
alternated twice), 1 MiB alltoalls went from 0.52-0.75 to 0.34-0.39 ms and 4 MiB ones from
1.9-2.4 to 1.07-1.21 ms there. A blocking broadcast too big for the caller's thread
(over 2 MiB) runs on the loop either way; there the choice, timed the same way, is whether
it lends while the rings are slow. On a third VM of the kind (its kernel copying lent
bodies at 4-7 GB/s) 4 MiB broadcasts took 1.39-1.88 ms lent against 0.83-1.31 ms through
the ring, alternated within one job, in the slow state as in the fast one; with every ring
taken for slow, 16 MiB broadcasts went from 4.6-5.2 ms (every one lent) to 2.7-2.8 ms (the
ring, lent every 16th). Allreduces of 8 MiB or more lend while the rings are slow without
being timed: 16 MiB ones took 7.2 ms lent against 9.0 through the ring there. Smaller
reductions never lend: on this VM async allreduces of 0.5-4 MB ran 1.1-1.9x faster
through the rings than lent, where the cores shared a cache and where they did not
(docs/dev/perf-log.md). Allgathers up to 2 MiB,
reducescatters and allreduces stay on the caller's thread: on the general path 1 MiB allgathers took
0.42-0.46 ms against 0.25-0.31 ms, reducescatters 0.42 against 0.19-0.25 ms. Where ranks
outnumber cores the rule is off: a copy preempted halfway looks slow whatever the caches
do, and at 4 ranks on 2 cores it made 1 MiB broadcasts, alltoalls and allreduces 1.3-3x
slower.

Why the ring holds two segments (plus 128 KiB for the small records between them): a ring's
footprint is its size, and in one process pair alternating ring policies op by op (order
rotated, 2 ranks) two segments beat the old 8 MiB ring, which restarted at offset 0 when
the reader caught up, at 1-8 MB in the host's slow state (8 MB: 0.76-0.87x MPI
against 0.58-0.66x). It also beat a plain 8 MiB ring in a moderate period (8 MB: 1.40x
against 1.30x), but not in a slow one (0.76-0.87x against 1.18-1.26x).  One record in
flight was faster still in a fast period (8 MB 1.76-1.86x against 1.61-1.63x), so no
size wins everywhere; see docs/dev/perf-log.md, "Ring footprint".

Why 16 MiB gradient buckets: with ResNet-50's gradients all ready at once (`bench replay`,
2 ranks, a quiet period of the host), the optimizer's buckets took 20.7 ms at 16 MiB, 22.6
at 8 and 23-31 at 4, against 19.6 ms for one pre-flattened buffer: smaller buckets cost
per-op overhead.  Training a 50 MB MLP (`bench train`, 3 rounds) put 4 to 25 MiB within
the run's noise of one another (2 ranks 85-94 ms per step, 4 ranks 180-205), all 1.23-1.46x
the speed of DDP over gloo.  Bigger buckets start later in backward, so overlap suffers
on deep models; 16 MiB is the smallest size that costs nothing measurable over flat.

Why init() freezes the garbage collector's view: a full collection walks every tracked
object, and after `import torch` there are enough of them that it took 150-160 ms per
collection on this host.  Training triggers one every few hundred steps on each rank, and
since every step ends in a collective, each rank's pause stalls all of them: a 20-epoch
digits run at 2 ranks lost an epoch's worth of time to two such pauses (epoch 2 ran at
3,200 samples/s against 30,000-45,000 for the others).  With the objects alive at init()
frozen, those collections took 20-50 ms.  The cost: cyclic garbage among the frozen objects
is never reclaimed (reference counting still frees everything else).

Why the reduce thread is off by default: at 2 ranks on a 2-core host, a 64 MiB float32
allreduce ran at 1.30-1.60 GB/s bus bandwidth with inline reductions and 1.02-1.13 GB/s with
1 MiB pieces handed to the reduce thread (the hand-off costs a GIL switch per piece and the
two ranks' four busy threads oversubscribe the two cores).  Hosts with spare cores may
want it on.

Why recursive halving and doubling where they are (`TOTALREDUCE_HALVING_BYTES`, 16 cores,
one rank per core): `{CMD_16_LOGSTEPS}` with `--backends totalreduce-shm,mpi --set
HALVING_BYTES=0` (off: the ring, the chain) and then `--backends totalreduce-shm --set
HALVING_BYTES=1073741824` (on: `log2 n` steps each way), medians in ms
(`docs/bench/cores16-logsteps-off.txt`, `-on.txt`). From 8 ranks the scatter-allgather
broadcast won at every size; allgather and reducescatter won from 4 to 16 MB and lost
below 1 MB and at 64 MB (where the halving reduce-scatter reduces into a copy of its input,
and the ring reads the input itself); at 4 ranks neither side won. Allreduce by the same
bound (`auto_halving_bytes` in algorithms/select.py): at 8 and 12 ranks halving ran 4 MB
2-3x faster than the ring, 16 MB at par and 64 MB 5-10% slower; at 16 ranks it was ahead
from 4 to 64 MB.

{log_steps_table()}

Why small allgathers take recursive doubling, one whole message a step
(`TOTALREDUCE_SMALL_BYTES`, from 4 ranks; 16 cores): an allgather first exchanges its
ranks' sizes, and through the ring that took `n - 1` steps. In a timestamped run of a 4 MB
allgather at 16 ranks the size exchange took 0.9-1.0 ms of the median op's 6.5 on each
rank shown, stalling wherever one rank was late (0.7-0.8 ms at 8 ranks). `python -m
totalreduce.bench collectives -n 4,8,16 --ops allgather --sizes 4K,64K,1M,4M --rounds 2
--reps-scale 0.3 --backends totalreduce-shm,mpi` before (the ring: size exchange and, up
to 1 MiB, data) and after, interleaved, medians in ms
(`docs/bench/cores16-smallgather-ring.txt`, `-doubling.txt`; a second pair of runs agreed
within 25%). 4 MB changes only in its size exchange: at 8 ranks it was ahead in both
pairs, at 16 in one (level in the other), and at 4 ranks, where its data takes the ring
either way, 3-13% behind in both.

{small_gather_table()}

## Known weak spots

{weak_spots()}
"""]
    PAGE.write_text(reflow("".join(parts)))


if __name__ == "__main__":
    main()
