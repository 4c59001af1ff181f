"""Build docs/BENCHMARKS.md from the tables ``python -m totalreduce.bench`` printed.

    python docs/bench/make_page.py

Each section names the command whose output it shows (the file in docs/bench/), so a
reader can rerun it; the environment line comes from the bench's own output.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

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


def _measured(env: str) -> str:
    """Where a table was measured, from its environment line: the tables come from runs
    at different commits, and on two kinds of host."""
    fields = dict(part.strip().split(" ", 1) for part in
                  env.removeprefix("environment: ").split(",") if " " in part.strip())
    if "cpu" not in fields:
        return ""
    return f"\n\n<sub>{fields['cpu']}, commit {fields.get('commit', '?')}</sub>"


def main() -> None:
    env, coll2 = table("collectives-2")
    _, small2 = table("collectives-2", lambda c: c[0] == "allreduce" and c[2] in
                      ("4", "64", "1K", "16K"))
    parts = [f"""# Benchmarks

Every number on this page comes from `python -m totalreduce.bench` (install:
`pip install torch==2.13.0 && pip install -e ".[dev,mpi,torch]"`). Each section shows the
command and the file in `docs/bench/` holding its full output. `python
docs/bench/regenerate.py` reruns every command and rebuilds the page from those files
(`--list` shows them; `--cores16` runs the 16-core ones). How the numbers got here, and
the experiments behind the defaults, are in `docs/dev/perf-log.md`.

## Environment

A virtual machine with 2 AMD EPYC cores and no GPU; every rank on the same host, so
same-host transports (shared-memory rings, MPICH's shared memory) carry all traffic.
Every table but the 16-core ones comes from one run of `regenerate.py` on this machine,
at the commit named under each table; the 16-core tables come from machines with 16
Intel Xeon cores, at the commits named under them. The bench printed:

    {env.removeprefix("environment: ")}

Here a plain copy of 16 MiB between two warm buffers runs at about 33 GB/s (1 MiB at 55
GB/s), the kernel's copy of a lent body (`process_vm_readv`) at 10-13.6 GB/s, and a `for`
loop's iteration takes 17-19 ns. The host is shared and noisy: medians move by 10-50 %
from one run to the next, MPI's too, so compare ratios within a table, not absolute
times across tables. It also moves the VM, for minutes at a time, between two placements
of its two virtual cores: one where they share a cache and one where they do not. In the
second, glibc's `memcpy` of 1 MiB or more into memory the other core has just read ran
five to six times slower (129 us for 1 MiB, against 20 us in the first): MPI's copies
slow down there, and totalreduce copies such blocks in 512 KiB pieces, which took 26 us
(`memcopy.py`, `TOTALREDUCE_COPY_PIECE`). A run, and a table, may cross both
placements. totalreduce's rings also time their copies and lend what they would copy
while the copies run slower than the kernel's copy measured at start
(`TOTALREDUCE_SLOW_RING_GBPS`, see "Why the defaults are what they are").

Some of the measurements behind the defaults come from other 2-core VMs: one with Intel
Xeon cores (a plain copy of 16 MiB at 10.6 GB/s, the kernel's copy at 9-11 GB/s, a `for`
loop's iteration in 30-45 ns), where the tables were regenerated before, and earlier ones
with AMD EPYC cores, which switched, for seconds to minutes at a time, between two states
that looked
like two placements of their two virtual cores: one where they shared a cache and one
where they did not. There, two processes passing 512 KiB through a shared-memory buffer
(no totalreduce code) took 14 us to copy it in and 15 us to copy it out in the first
state, 100-210 us and 50-55 us in the second; the kernel's copy of the same bytes from one
process to the other took 48 us in both. One such VM ran Python 2.5-3x slower than
another (a `for` loop's iteration in 95-170 ns) and copied lent bodies at 4-7 GB/s while
its plain copies ran at 25-30 GB/s.

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

{coll2}

### The same with huge-page arrays

`{command("collectives-2-huge")}` (`docs/bench/collectives-2-huge.txt`). The table above
hands every library arrays made by `np.ones` and `np.empty`, as a user makes them, and
what backs their pages differs: numpy asks for huge pages only from 4 MiB, and even then
only the 2 MiB-aligned middle of an array gets them, where malloc put it (in one sitting
a 16 MB array's halves were 1.0/1.0 huge-paged in MPI's job, 0.94/0.81 in ours). Here
every backend gets arrays that start on a 2 MiB boundary, advised for huge pages. MPICH's
1 MB broadcasts and alltoalls then take 0.027-0.028 ms (0.056-0.075 out of numpy's
arrays in the table above) and its 4 MB broadcasts 0.100 (0.191), while ours barely move,
so broadcasts and alltoalls fall to 0.44-0.73x at 1-16 MB; the reductions still lead
(allreduce 1.85-3.63x, reducescatter 1.28-3.32x from 1 MB), and from 64 MB every op but
the allgather (0.77-0.82x here) is at or near par. The two tables ran in different states
of the VM (this one with its cores sharing no cache), which moves MPI's cells too: its 4
MB alltoall took 0.258 ms here. Torch's CPU tensors get small pages, as numpy's arrays
under 4 MiB do; on a host whose `transparent_hugepage` setting is `always`, big arrays
get huge pages without asking.

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

The bare exchanges are what copying through memory allows here: at 4 and 16 MB the
faster of the two runs 1.50x and 1.28x as fast as MPI, at 1 MB, where a piece stays in a
core's cache, 2.5x (1.15-1.35x at 1-16 MB on the Intel VM), so no engine on these copies
gets much further. The gap between them and totalreduce is the engine's own cost: its
headers, credit, handlers and turns of the loop, about 0.03 ms a call at 1 MB here
(0.1 ms on the Intel VM). When 16 MB allreduces still lent their 2 MiB pieces (2-rank
reductions now lend from 32 MiB), timestamps in one process pair put 70-130 us of
handling between one piece's copy and the next's (the next record waits for a turn of
the loop, which first posts the reduced piece), eight times a call. Here, where each op
follows the others, the engine's 16 MB allreduce took 0.14 ms more than the bare ring's
(a repeated one runs from its Repeat, "Why the defaults" below); in its own job (the
collectives table) it takes 1.17 ms against MPI's 2.00.

## Allreduce, 4 ranks (4 processes on 2 cores)

`{command("collectives-4")}`
(`docs/bench/collectives-4.txt`). Four ranks share two cores, so every library is
oversubscribed; spinning waiters cost the peers' CPU time.

![allreduce bus bandwidth, 4 ranks](bench/collectives-4.png)

{table("collectives-4")[1]}

## 16 cores: 4 to 16 ranks

A virtual machine with 16 Intel Xeon cores and one rank per core; MPI is Open MPI 4.1.6
(its `mpiexec`, mpi4py 4.1.2), gloo is torch 2.11's. The three tables below come from one
run of `regenerate.py --cores16` at one commit (under each table). Such machines differ
from one to the next and from one sitting to the next: at an earlier commit two of them
gave 92 and 141 us for the 16-rank 8-byte allreduce (this table's gave 82, two sittings
of its machine at the commit before 80 and 82), and in those two sittings 64 MB cells ran
10-25% faster than in this table, MPI's and gloo's too (gloo's 8-rank allreduce 58-59
ms against 70), so again compare within a table. Shared-memory rings carry all of
totalreduce's traffic.

Allreduce:

`{command("cores16-allreduce")}`
(`docs/bench/cores16-allreduce.txt`). Up to 1 MiB it is recursive doubling; above, from
8 ranks, recursive halving then doubling (up to 8 MiB at 8 ranks, every size at 16),
else the ring. Blocking calls whose sends to a peer fit its ring run on the caller's
thread (the express lane), recursive halving included: in the sitting before this table,
alternated twice with the commit before (which ran halving on the loop), 2 MB at 8 ranks
took 1.54 and 2.28 ms against 2.54 and 2.67, and at 16 ranks 4.12 and 3.57 against 4.30
and 3.78. At 16 ranks 1 MB by halving (`--set SMALL_BYTES=262144`) was no faster than by
doubling (2.24 and 2.20 ms against 2.24 and 2.18), nor was halving at 4 ranks for 1-4 MB
(`--set HALVING_BYTES=16777216`) in both of two runs. Nor was the ring from 512 KiB
(`--set SMALL_BYTES=262144 --set HALVING_BYTES=262144`, four runs alternated with the
default): 1 MB at 4 ranks took 0.47-0.62 ms against 0.49-0.71, 4 MB at 8 ranks 6.3-11.6
against 4.0-4.8, and at 16 ranks 1 MB 2.3-3.8 against 1.7-2.7 and 4 MB 29-37 against
5.3-6.3.

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

The 16-rank 1 MB allgather's median fell in a slow stretch (p10 0.54 ms): in two
sittings at the commit before it took 0.48 and 0.50 ms (0.66-0.72x MPI).

Blocking 8-byte allreduce and barrier:

`{command("cores16-latency")}`
(`docs/bench/cores16-latency.txt`, timed as in the latency section below). Recursive
doubling takes `log2 n` steps. Timestamps in the express lane (2,000 calls back to back,
medians, on a machine of this kind that gave 26 us at 2 ranks) put 7.4 us between the
call and the lane, 6.1 us in posting the first message, and per step 2-3 us waiting for
the partner's message and 6.9-9.5 us reducing it, freeing its slot and posting the next:
39 us at 4 ranks. From 8 ranks the waits grow instead: one rank ran every part 40% slower
than the others (13 against 9 us before the lane), and its partners waited 19-26 us for it
in each step it took part in (74 us in all). Pinning each rank to a core of its own helped
little or not at all (103-110 us against 89-95 at 8 ranks, 125-133 against 130-135 at 16).

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
engine's and the API's bookkeeping (docs/dev/perf-log.md, small messages). The host
moves our medians by up to 1.5x from run to run and MPI's much less: at 2 ranks the
8-byte allreduce took 3.4x MPI's time here (5.7x on the Intel VM), the barrier 2.9x
(4.8x). The MPI transport took 4.0x and 3.3x; sockets 6.4x and 5.5x, where through the
loop, before they could show messages in place, they took 26x and 6-8x on this VM.
At 4 ranks on 2 cores every hop waits for a peer to get a core.

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

MPI's `per-tensor` runs in one of two modes from iteration to iteration on this host:
34-37 ms, as here, or 12-13 ms. In three runs of its own
(`--backends mpi --rounds 1 --reps 15`) its median was 16.8-17.5 ms, p10-p90
12.3-38.9 (12.2-12.6 in three other runs, the host in another state): against that mode
the optimizer's buckets (9.9-10.4 ms here) run at 0.56-0.85x its time, `flat` (12.1) and
`per-tensor` (12.4) at 0.69-1.02x, and the grouped modes (11.8-16.1) at 0.67-1.32x. At 2
ranks, async allreduces like ones made before that are submitted together wait for the
first `wait()`, which runs them one after another, each as a blocking call would run
(DESIGN-NOTES, queued async calls); so do a grouped call's parts, whose arrays under 128
KiB are fused, and whose parts come out of step across ranks more often (a part whose
peer is late sends the rest to the general path). Started on the general path all at
once instead, `per-tensor` took 15.7-20.7 ms here, and the grouped modes 14.0-20.2.

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

Whole training runs: `examples/torch_synthetic_benchmark.py` (a ResNet-18-shaped network,
batch 16 of 64x64 images per worker, one thread each; `totalrun -np N python
examples/torch_synthetic_benchmark.py`) gave 59.4 img/s at 1 worker, 86.2 in total at 2
and 83.7 at 4 on the Intel VM (81.5, 132.8 and 126.6 on an AMD VM), bound by the 2 cores;
`examples/train_digits.py` reaches
97-98% test accuracy in 20 epochs at 1, 2 and 4 ranks.

## Skew: ranks ready at random times, each in its own order (ResNet-50, 2 ranks)

Each rank draws a ready time in [0, 50 ms) for every tensor and submits each as soon as
it is ready, in its own order (totalreduce); MPI and gloo need one common order, so they
take the tensors in backward order, each once ready. Ideal = the last ready time (max over
ranks) + MPI's flat allreduce time in the same run.

`{command("skew-2")}` (`docs/bench/skew-2.txt`):

{table("skew-2")[1]}

## Preemption: a 1 KB allreduce issued 2 ms into a 64 MB one (2 ranks)

`{command("preempt-2")}` (`docs/bench/preempt-2.txt`):

{table("preempt-2")[1]}

The urgent op here is blocking, issued after a barrier, the big op's start and a 2 ms
sleep. `small alone after the delay` is the same call after the same barrier and sleep
with no big op: waking from the sleep costs more than a small op does (MPI's: 5 us back
to back, 17 us after the sleep; ours: 26 and 145 us, in a run of their own), so
`time / alone after the delay` is what the big op adds, and `small alone` (back to back)
is the op's own cost. Over the
shared-memory rings the urgent op runs on its own lane (DESIGN-NOTES, the urgent lane):
the application's thread posts its message into a second, small ring to the peer and
reads the peer's out of its own, without waiting for the thread that drives the big op
and without the big op's records ahead of it in the ring, which is read in order: 0.220
ms here against 0.095 ms alone after the delay (2.32x; 1.7-7.7x in other runs here, where
the time alone after the delay moved between 0.02 and 0.11 ms while the time during the
big op stayed at 0.09-0.24; on the Intel VM, at an earlier commit, 0.229 against 0.180
ms, 1.27x). The thread that drives the big op gives its core away every 100 us
(transport/poller.py, `GiveWay`), as well as between the slices of a lent copy: a loop
busy with a big op never blocks, and the application's thread, woken from its sleep,
otherwise waited for the scheduler's next look before it ran, up to a millisecond (p90
0.46-0.96 ms before, 0.16-0.44 with it). What is left is the caller's Python running two
to three times slower while the big op's copies take the two cores: with timestamps on
both ranks, at the median, about 50 us from the call to the op's start (20-25 us after
the same sleep with no big op), 12-15 us to post its message (9-10) and 15-20 us to find
and apply the peer's. Neither a nap of the loop's thread while an urgent op runs (at a
turn's end or between looks at MPI), nor yielding the core between looks at the lane (5x
slower), nor busy-polling the whole 2 ms before a nap (no change), did better.

Big ops' pieces are lent (the receiver copies each 2 MiB piece out of the sender's memory
and reduces it), and the reader takes ring records in order, so a message posted behind a
dozen of them waits for all ("priority off"). An urgent op the loop runs (an async one,
or over TCP or MPI) is helped by priorities as follows:

- Before each big body, and between the slices of its copy, the reader handles the DATA
  records posted behind it whose op runs here at a higher priority and is small (up to
  256 KiB: a bucket passing a bucket gains little and the looking costs). A look reads
  only the records posted since the last one: reading the 25-30 waiting records whole on
  every slice cost 45-75 us a look and made a 2 MiB copy take 0.6-0.8 ms.
- A lent copy goes in 1 MiB slices (256 KiB while an urgent op runs) and stops between
  two when an op was submitted on this rank, so that op starts at once, or when an urgent
  message was handled, so its waiting caller returns; it goes on at the next turn.
- Between two slices the copying thread gives up its core for a moment: two ranks of two
  threads each share the two cores, and the application thread woken to submit the
  urgent op otherwise waited for the scheduler, 4 ms in one try of ten.

That way an urgent op takes 0.3-0.5 ms against 0.02 ms alone: about 80 us from the call
to the wait, 50-130 us for the progress thread to finish the copy or reduction in hand
and hand over the loop, 20 us to start the op, 40 us to post its message and poll, 30-60
us to find the peer's message behind the big op's 30 lent records, and 40-50 us to apply
it and return. Neither reducing each slice as it landed nor smaller slices (256 or 512
KiB) made it faster: the first delayed each piece's acknowledgement until the slice
before the last was reduced (16 MB allreduces ran 5-8 % slower), the second cost 16 MB
allreduces 10-30 %.

Over TCP a blocking urgent op goes through a second connection to the peer, its lane, so
it does not wait behind the big op's bytes in the kernel's buffers: 0.148 ms against
0.066 ms alone after the delay here (2.22x; 1.0-3.8x in other runs here, 3.87x on the
Intel VM at an earlier commit). Both ends of every connection and lane send at once
(`TCP_NODELAY`): a lane's accepting end once lacked it, and a lone urgent message then
waited for the peer's delayed ACK, up to 40 ms. Its slow tail was the two ranks' calls
starting up to 1-5 ms apart after the same 2 ms sleep (timestamps on both ranks): each
rank's thread waited that long for a core, which the progress thread's socket reads kept
busy; since that thread gives its core away every 100 us the calls start at most 0.16 ms
apart (p90 0.28-0.73 ms, against 0.38-3.1 before), where a shorter interpreter switch
interval (0.5 ms) had not helped. An
urgent op the loop runs waits behind those bytes, which is why a socket between two ranks
of one host keeps a 256 KiB send buffer (with the kernel's own sizing, up to 4 MiB here,
the urgent op took 12.6 ms, and 16-64 MB ops were slower too); a socket to another host
keeps the kernel's sizing, which a real link needs (at 256 KiB a 64 MB allreduce between
two simulated hosts behind a 10 Gbit/s link ran 3x slower). Over the MPI transport the
lane to a peer on the same host is a pair of shared-memory rings of its own
(transport/ring_lane.py): 0.165 ms against 0.099 ms alone after the delay (1.67x; p90
0.26 ms; 3.0-4.0x in other runs here). Its tail was a peer's thread woken from the sleep
late, waiting for a core which the progress thread's calls into MPI kept busy: 0.3-1 ms
late in one call of three or four, and the median moved between 0.1 and 2 ms from run to run
(4.1-22x; on the Intel VM, stamped in C as `clock_nanosleep` returns, 3.5-4.3 ms late at
the median under this transport against 0.5 ms over the rings). Neither a shorter
switch interval, nor the progress thread at nice 10, nor a longer wait in the lane
before the loop takes over settled it (docs/dev/perf-log.md); the thread that polls MPI
giving its core away every 100 us (`GiveWay`) did: 0.091-0.095 ms in three alternated
runs against 0.14-0.52 without, with no change to 16-64 MB ops over this transport. What
is left is the caller's Python, two to three times slower while the big op's transfers
take the cores, as over the rings. As an MPI tag
of its own, which a peer on another host still gets, it went through MPICH, which lets
one thread into the library at a time and moves the big op's bytes inside the calls the
urgent op makes: 0.3-2.9 ms at the median in alternated runs, against 0.5-0.7 with the
rings. Where a host's ranks outnumber its cores the MPI transport has no lanes (a 4-rank
barrier on 2 cores took 0.97 ms with them, 0.67 without). An urgent op the loop runs
waits behind what MPI has queued to that peer, which is kept to 8 MiB of bodies for that
reason (sixteen 2 MiB pieces took it 3.9-5.3 ms).

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

Fusion is what wins here: 1,000 ops become a few. Without fusion, negotiated mode costs
more per tensor than self-guided mode (`-nofusion` against `totalreduce-shm`: 37.5
against 11.7 µs at 2 ranks). The cache cuts the cost another 9x: without it, every
tensor's request goes to rank 0 and back each time (`-nocache`). Self-guided mode pays an
op per tensor: at 2 ranks its calls wait for the first `wait()`, which runs them one
after another each as a blocking call (11.7 µs; 20-24 µs each on the loop all at once),
and at 4 ranks each is a whole engine op on the loop (100.5 µs). The faster mode,
negotiated with cache and fusion, takes 1.4 µs per op at 2 ranks, 4.7x faster than 1,000
of MPI's `Iallreduce` (6.5 µs each), and 4.1 µs at 4 ranks (four processes on two
cores), 9.5x faster than MPI's 38.9. On the Intel VM it took 4.7 and 12.5 µs, and on a slower AMD VM
(see Environment), before the cycle reused a repeated step's fusion runs, 7.9 and 22.2
µs. It varies with the host (1.3 to 1.5 µs between the 10th and 90th percentiles at 2
ranks here): the whole cost is Python on the submitting thread and the cycle thread.
Per tensor, the submission takes 1.5-2.5 µs (a tensor whose dtype, op and shape were
seen before skips the argument checks and makes one new object); the cycle's taking,
classifying, fusion copies and completion about 1 µs, since a cycle that readies the same
cached tensors as a recent one reuses that cycle's fusion runs and the views of its
buffer (DESIGN-NOTES, negotiated coordination); the rest is the two small allreduces of
the cycle, most of it waiting for the other rank.

**A lone blocking op**: the latency table's loop (8-byte allreduces, then barriers, back
to back) in both modes. `{command("latency-neg")}` (`docs/bench/latency-neg.txt`):

{table("latency-neg", _allreduce_barrier)[1]}

A negotiated op is agreed on before it runs: the application's thread hands the request
to the cycle thread, which allreduces the cycle's bit vector with the other ranks, runs
the op (on its own thread when it is small and alone in its cycle; DESIGN-NOTES,
negotiated coordination) and hands the result back. That is two engine ops and four
hand-offs between threads where self-guided mode runs one op on the caller's thread:
94 and 130 µs for the allreduce and the barrier at 2 ranks, 14-20x self-guided mode's
time. At 4 ranks on 2 cores each hand-off also waits for a core (0.44 and 0.53 ms). A
wait on a request wakes the cycle thread, which otherwise sleeps to its tick;
without that, a blocking op would wait for the tick of the last rank to reach it, a
cycle and a half at the median.

**Skew** (as above, at 2 and 4 ranks). `{command("skew-neg")}` (`docs/bench/skew-neg.txt`):

{table("skew-neg")[1]}

Self-guided mode starts each gradient's reduction the moment every rank has submitted it,
so it finishes within 0.62x (2 ranks) and 0.74x (4 ranks) of the ideal. Negotiated mode
first waits for a cycle to notice (0.90x and 1.03x). Without fusion, each of the 161
tensors then runs as an engine op of its own behind that wait, which in this run beat
fusing the few that a cycle finds together at 2 ranks (0.65x) and tied it at 4 (1.01x),
where the ops compete for two cores (on the Intel VM 0.99x and 1.29x).

**Replay** (as above, ResNet-50, 16 MB buckets). `{command("replay-neg")}`
(`docs/bench/replay-neg.txt`):

{table("replay-neg")[1]}

With all 102 MB ready at once, self-guided mode is faster in every mode: at 2 ranks its
grouped mode took 16.3 ms against negotiated's 34.3, its per-tensor mode 13.6 against
35.1 and its optimizer mode 11.3 against 19.1 (flat: 11.6 against 13.4). Turning
negotiated mode's fusion off left its per-tensor mode at 35.1 ms here (31.9 against 36.8
in another run: fusing big tensors adds a copy in and a copy out of every byte). At 4
ranks negotiated per-tensor takes 96.3 ms, self-guided grouped 80.3.

**When each wins**: negotiated mode for many small tensors reduced as they come (tiny
embeddings, per-parameter reductions, metrics). Self-guided mode for large gradients,
skewed ranks, and everything latency-bound. The digits example, one small bucket per
step, trains about 1.5 times as fast self-guided as negotiated (2 ranks, the third of 3
epochs, three interleaved runs of each: 24,300-36,300 samples/s against 16,300-24,500 on
this noisy host): each step's gradients wait for a cycle and its hand-offs.

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

On one host, where a dense allreduce moves memory at memory speed, the sparse algorithms
are mostly slower than dense: selection costs more than the bytes it saves (Ok-Topk on
the heavy-tailed values is the exception: in one alltoall it beats dense at every rank
count at 1 %, 0.68-0.95x, and at 4 ranks at 2 %, 0.89x; pipelined, at 4 ranks, 0.95x and
1.13x). The point
is the volume, which is what a network between hosts pays for. Ok-Topk sends 2.2-4.0
words per k, under its bound at every size, while TopkA's grows with the ranks. On the
million heavy-tailed values Ok-Topk is also the fastest of the three, because its reused
thresholds avoid a top-k sort. Its pipelined exchange has nothing to overlap with on 2
cores, so one alltoall is faster here (1.3-1.4x at 4 ranks on the million values, up to
2.7x on the smaller vectors); with a core per rank and a
real network between them, summing one step while the next travels is what the pipeline
is for.

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

Every sparse method reaches the target within 1.5x dense's epochs except gTopk at 1%
(18 against 9). Ok-Topk at 1% sends 0.076 MB per rank per epoch once
its warm-up is over, against 0.071 for gTopk and 0.125 for TopkA at the same density,
0.125 for PowerSGD and 4.07 for dense: 54x less than dense. Its first epoch is the dense
warm-up (10 steps, about 4 MB), which is most of its bytes to target; PowerSGD's vanilla
start costs the same. On this small model PowerSGD at rank 2 trains as well as dense in
fewer bytes than Ok-Topk's warm-up plus sparse epochs; the sparse methods' volume
advantage grows with the model, which the words-per-k table above measures.

The example itself draws the same run's loss and accuracy with `--plot`:
`totalrun -np 4 python examples/train_digits.py --epochs 30 --compression oktopk --density
0.01 --plot docs/bench/digits-oktopk-1pct.png` (final 97.56%; at 0.02, `digits-oktopk-2pct.png`,
97.78%; dense without `--compression`, `digits-dense.png`, 98.00%).

## Recovery from a killed worker (`totalrun --max-restarts`)

A job checkpoints a state of the given size in memory, makes one more collective, and
rank 1 kills itself (SIGKILL). *restart*: from the kill to the replacement's `init()`
returning (the survivors notice, totalrun starts the new process, it imports and meets
them); *load*: its `load_checkpoint()`, the checkpoint sent from a survivor's memory;
*total*: from the kill until every rank has returned from the collective the survivors
were waiting in. Medians of 3 jobs per cell, and the worst; the target is 2 s plus the
checkpoint's size at 1 GB/s. `{command("recovery")}` (`docs/bench/recovery.txt`):

{table("recovery")[1]}

A new Python process importing numpy and totalreduce is 0.11-0.13 s of *restart* here
(0.4 s on the Intel VM); the rest is the survivors noticing the loss, totalrun starting
the process, and the survivors dropping their links and meeting the newcomer.

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

On one host the server pays for its extra processes and for a round trip per push and per
pull (a round trip costs tens to a hundred µs here, against a few for MPI), so it
trains at 0.22-0.25x allreduce's rate (0.28-0.40x on the Intel VM). With the straggler,
removing the bound bought 1.87x tau = 0's throughput in this run (0.90x to 1.92x in
others: the straggler's own steps bound the time either way) and cost 2.9 points of
accuracy (0.7 to 8.0 in those others); bounds of 1 and 4 keep tau = 0's accuracy within
0.5 points. Averaging every 4 or 16 steps is the fastest, and every 16 loses 2 points.
Surviving a server's loss costs 0.58x of tau = 0's throughput without a straggler (a push
waits for a second server's round trip) and 0.97x with one, whose own steps set the pace
(0.52-0.73x and 0.64-1.03x in other runs).

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

At 10 Gbit/s the 2 cores, not the link, set the time. With 100 Gbit/s links the same
jobs take as long (`docs/bench/hosts-100gbit.txt`: 0.092 s hierarchical at 64 MiB,
against 0.098 s at 10 Gbit/s). One rank per host has no local stages and a core to
itself; it comes within 1.08x of the 10 Gbit/s bound (`--per-host 1 --modes flat`,
`docs/bench/hosts-10gbit-1.txt`).

Training over 1 Gbit/s: the digits MLP widened to 64-2048-2048-10 (4,350,986
parameters, 17.4 MB of float32 gradients per step), batch 32 per rank, dense against
the sparse compressions at 1 %. Accuracy is on the whole test set after each epoch
(about 10 steps at 4 ranks, 21 at 2), and the time to the target is read at the end of
the first epoch that reaches it. One rank per host,
`{command("hosts-train-1")}` (`docs/bench/hosts-train-1.txt`):

{table("hosts-train-1")[1]}

Two ranks per host, `{command("hosts-train")}` (`docs/bench/hosts-train.txt`):

{table("hosts-train")[1]}

With two ranks per host, four ranks share the 2 cores. The forward and backward passes
and the sparse selection then take most of a step, and the sparse methods' lead in
samples/s (1.9-2.7x) turns into 0.86-1.39x dense's speed to 95 %: they need one to three
epochs more than dense.

## Why the defaults are what they are

The settings in `config.py` that trade speed one way or another, and the measurements
behind each choice (2 ranks unless said; `--set NAME=VALUE` repeats any of them).

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
copy faster says fast again. On the AMD VMs (see Environment) these copies ran at 12-37
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
twice in a row, the first of the two untimed, every 32nd op).
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

- Small messages: a blocking allreduce of a few bytes costs 6.8 us at 2 ranks in the
  latency table (MPI: 2.0 us, 3.4x; 5.7x on the Intel VM), nearly all of it Python per
  op, even from a Repeat; 8.1 us over the MPI transport, 12.8 us over sockets. A barrier
  takes 6.5 us (2.9x). Async small allreduces, which the loop runs, cost about 30 us each
  self-guided (the `tiny` table).
  An allgather or alltoall whose ranks' rows may differ is two such exchanges, sizes then
  data; `same_shape=True` makes it one (0.011 ms at 4 bytes in the 2-rank table, a
  broadcast 0.012 ms, against MPI's 0.001-0.003). A repeated one skips its
  checks and set-up (scheduling/templates.py); a repeated blocking broadcast,
  reducescatter, allgather or alltoall runs from a Repeat as an allreduce does, each
  phase of a two-phase one from its own (back to back at 2 ranks, 4 to 8 bytes: 25-60
  us against 40-85 without; the small-allgather table above). Batch
  small tensors (`grouped_allreduce`, the optimizer's buckets), or run many of them
  negotiated (fused: see above).
- The 2-rank collectives table: allreduce 2.07x MPI at 1 MB, 1.86x at 4 MB and 1.70x at
  16 MB, 3.04-3.13x from 64 MB; reducescatter 1.74-2.01x at 1-16 MB, 3.33-3.59x from
  64 MB (on the Intel VM allreduce ran 1.15x, 0.93x and 0.96x, reducescatter
  0.86-0.88x). MPICH's shared memory moves 16 MB at 8.4-9.2 GB/s of algorithm bandwidth
  for the reductions here (1-4 MB at 8.2-11.7 GB/s), which leaves a reduction little room
  at 16 MB: a 16 MB allreduce takes us 1.17 ms against MPI's 2.00 in this run (1.10-1.13
  against 1.72-1.89, 1.52-1.71x, in jobs of their own), and the floor table's bare
  exchanges, with no engine, reach 1.11-1.50x MPI at 4-16 MB.
- On a 2-vCPU Intel VM whose rings copied slowly (no model named; `bench collectives -n
  2 --backends mpi,totalreduce-shm --sizes 1M,4M,16M,64M,256M --rounds 2 --reps-scale
  0.5`, one run), allreduce and reducescatter led MPI from 64 MB (1.47-1.74x) and
  reducescatter from 4 MB (1.25-1.29x at 4-16 MB), allreduce ran 1.01x at 1 MB, 0.88x at
  4 MB and 0.98x at 16 MB; the gathers trailed it at every size (allgather 0.62-0.96x,
  alltoall 0.42-0.95x) and broadcast below 256 MB (0.45-0.94x, 1.65x at 256 MB; its 64
  MB cell took 6.4 ms in one run and 10.7 in another). The bare exchanges of the
  floor table reached 0.85-0.89x MPI at 4 MB and 1.09-1.12x at 16 MB through a ring,
  1.08-1.17x and 1.52-1.59x reading the peer's memory (`bench floor`, four runs), as
  MPICH does there (`process_vm_readv`): on such a host the ring's two copies cost more
  than the kernel's one. A 2-rank allreduce from 8 MB, or reducescatter past DIRECT_BYTES,
  lends its pieces from its Repeat there and sums each 512 KiB slice of the peer's as it
  lands. At 4 ranks on its 2 vCPUs allreduce ran 0.52x at 1 MB, 0.56x at 4 MB, 0.93x at
  16 MB and 1.40x at 64 MB; a blocking 8-byte allreduce 11.5 us against MPI's 1.5
  (7.8x), a barrier 10.0 against 1.8 (5.7x). docs/dev/perf-log.md has where the time
  went.
- Calls back to back flatter both libraries, ours more: with a pause before each call
  (as between a training step's reductions), 16 MB allreduces at 2 ranks took 1.13-1.26
  ms back to back, 1.38-1.59 after 1 ms and 1.88-2.08 after 10 ms; MPI's 2.04-2.05,
  2.03-2.10 and 2.36-2.54 (one job per library, each pause in turn, three runs, the VM's
  cores sharing a cache). Where they shared none: ours 1.87-1.96, 1.78-1.97 and 2.15-2.22
  ms, MPI's 1.72-2.15, 1.91-2.17 and 1.85-2.08 (two runs), level.
- The other collectives at 2 ranks, from 1 MB (medians): allgather 1.10x at 1 MB, 0.99x
  at 4 MB, 0.84x at 16 MB and 1.04-1.07x at 64 and 256 MB; alltoall 1.01x at 1 MB, 0.82x
  at 4 MB, 0.92x at 16 MB, 0.97-1.02x from 64 MB; broadcast 1.73x at 1 MB, 1.30x at 4 MB,
  1.00x at 16 MB, 0.94x at 64 MB and 1.06x at 256 MB, the receiver copying the root's
  lent 32 MiB pieces with two threads of its own in this run. MPI moves these at
  10-22 GB/s of algorithm bandwidth (its 16 MB broadcast takes 0.79 ms in this run). Run
  after run in one placement the gathers' 4-16 MB cells stay below par (eight runs back
  to back at 1-16 MB, the VM's cores sharing a cache: allgather 0.88-1.08x at 4 MB and
  0.72-0.87x at 16 MB, alltoall 0.69-0.90x and 0.81-0.96x), while across placements one
  cell has spanned 0.45-1.96x. An
  alltoall moves what MPI's does the way MPI's does (one `process_vm_readv` of the peer's
  block, a copy of our own): a bare exchange in Python doing just that, in one job with
  MPI's and ours on the same arrays, took 0.18 ms at 4 MB (MPI 0.18, ours 0.24) and
  1.20-1.23 ms at 16 MB (MPI 1.17-1.21, ours 1.39-1.44), its reads as long as ours within
  5 %. The rest is ours: about 30 us of Python before the read on the express lane (the
  call's checks, its spec, the lane; 15 us from a Repeat) and the wait for the peer's
  acknowledgement after it, and at 16 MB the same Python run two to three times slower
  out of caches the copies have just flushed; and which half of a 4 MB array the kernel
  backed with a huge page (a malloc'd 4 MB array holds one), since a lent half of small
  pages takes its reader about twice as long (130 against 70 us at 2 MiB). Repeated
  same-shape gathers up to 2 MiB (and at 2 ranks up to 24 MiB where their pieces are
  lent) and broadcasts up to the ring's bound run from a Repeat, and
  an allgather or alltoall sends its own block from its input and copies it
  into place itself (after its receives, up to 4 MiB); what is left at 1 MB is Python per op
  (about 0.1 ms, a third to a half of the call) and per piece. From run to run on this
  host the 64-256 MB cells move by 10-15%. Without `out=` allgather and alltoall run at
  about 0.5x from 64 MB: above glibc's mmap threshold (32 MB) every call's new result is
  fresh memory, and the kernel faulting and zeroing it costs about as much as the copies
  (32 MB into fresh pages: 8 ms; into reused ones: 4.6 ms, on an AMD VM).
- Huge pages: out of arrays that huge pages back (`--arrays huge`, the section after the
  2-rank table), MPICH's 1 MB broadcasts and alltoalls run twice as fast or more as out of
  numpy's own, and its 4 MB broadcasts nearly so; ours barely move (a 2-rank broadcast's
  root lends its huge-paged pieces from 640 KiB, which took 4 MB ones 10-15% faster), so
  there we trail it at 0.44-0.73x for broadcasts and alltoalls at 1-16 MB.
- `totalreduce-tcp` (sockets only, e.g. across hosts) trails MPI's shared memory from
  1 MB up on this host (0.27-0.74x) but for allreduce and reducescatter from 64 MB
  (1.23-1.77x); its small ops run on the caller's thread as the rings' do (4 bytes:
  0.015-0.021 ms). `totalreduce-mpi` (our engine over MPI point-to-point) leads MPI's own
  allreduce and reducescatter from 64 MB (2.87-3.49x), reducescatter at 4-16 MB
  (1.31-1.56x) and allreduce at 16 MB (1.03x), and trails it elsewhere from 1 MB
  (0.41-0.98x); its ops with bodies up to 256 KiB run on the caller's thread (4 bytes:
  0.009-0.014 ms).
- 8 to 16 ranks (16 cores): from 16 MB every cell leads MPI (1.03-4.72x) and every
  allreduce cell leads gloo, but at 1-4 MB most trail MPI: allreduce 0.36-0.69x at 4-16
  ranks, allgather 0.58-0.84x, alltoall 0.47-0.65x, broadcast at 16 ranks 0.37-0.58x,
  reducescatter 0.64-0.77x; broadcast at 8 ranks (0.93x, 1.09x) and reducescatter at 8
  ranks and 4 MB (1.18x) are at or above par. A 1 MB allreduce at 16 ranks by recursive
  doubling sends and reduces the whole buffer in each of four steps (2.2 ms against MPI's
  0.61); recursive halving, half the bytes in twice the steps, was no faster. A blocking
  8-byte allreduce takes 4.3x its 2-rank time at 16 ranks and 13x MPI's (82 us against
  19 and 6.2); timed on every rank (1,500 calls after a barrier each), all 16 had the
  same median within 1 us (77-78): every step waits for its partner's previous one (see
  the latency table's notes). The
  ring at 16 ranks runs 4 MB several times slower than its bytes call for (allgather 9.0 ms
  against 3.3 with recursive doubling). Timestamps show each lent 256 KiB piece taking about
  50 us to copy out of its sender (5 GB/s), one step after another, and the size exchange
  taking 0.9-1.0 ms (now one message a step); 4 MB ring allgathers took 6.5 ms lent and 2.8
  ms with `TOTALREDUCE_CMA_BYTES=0 TOTALREDUCE_SLOW_RING_GBPS=0` in one run. Lending stays
  on: in another sitting, without it, five of six 16-64 MB cells of allreduce, allgather and
  reducescatter at 16 ranks ran 16-49% slower (64 MB allreduce 76 against 58 ms); at 8 ranks
  allreduces of 4-64 MB ran 17-22% faster without it and allgathers of 16-64 MB 10-38%
  slower; a run of 1 and 16 MB allreduces at 4-16 ranks lending from 1 MiB (`--set
  CMA_BYTES=1048576`, alternated with the default) was no faster. The log-step algorithms
  avoid the ring where they are chosen.
- Oversubscribed ranks (4 on 2 cores): small ops take about 0.1 ms (5.3x and 3.6x
  MPI's 8-byte allreduce and barrier in the latency table, 5.4x and 3.9x over the MPI
  transport, 6.8x and 5.1x over sockets; 0.18-0.37x in the 4-rank table, where every call
  follows a barrier), and allreduces run at 1.58x MPI at 1 MB, 1.22x at 4 MB, 0.91x at
  16 MB and 2.68x at 64 MB (0.91x, 0.64x, 1.07x and 2.23x in an earlier run here; on the
  Intel VM 0.66x, 0.63x, 0.92x and 1.69x). Every hop waits for a peer to get a core;
  neither the small path's threshold, nor doubling up to 4 or 16 MB, nor the ring from
  256 KiB, nor recursive halving from 1 MB (or up to 16 MB), nor longer or shorter spins
  before a hand-over (0, 0.2 or 5 ms with the cores crowded) did better. Reductions
  there lend their pieces only from 8 MiB (4 MB at 3 ranks: 1.8-3.2 ms through the ring
  against 2.9-4.3 lent). Every call in these tables starts as its rank leaves a barrier,
  and ours lets its four ranks go over 66-116 us (MPI's over 21 us; rank 0 taking the
  last rank's exit time less the first's, 300 barriers with 1 MB of numpy work between
  them), which a call waiting for its slowest rank pays on top of its own time. Four
  processes spinning on a shared array, yielding between looks, part within 16-49 us; a
  barrier of direct messages to every peer (one hop where recursive doubling takes two)
  let them go over 116-123 us.
- Preemption: a blocking urgent op during a 64 MB allreduce takes 2.3x its time alone
  after the same sleep over shared memory (1.7-7.7x in other runs, where the time alone
  moved more than the time during the big op), 2.2x over TCP (1.0-3.8x) and 1.7x over
  the MPI transport (3.0-4.0x in other runs), each on its own lane (the preemption
  section). What is
  left is the caller's Python running two to three times slower while the big op's
  copies take the cores; an urgent op the loop runs (an async one) waits much longer.
"""]
    PAGE.write_text("".join(parts))


if __name__ == "__main__":
    main()
