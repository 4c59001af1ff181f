"""Every knob in one place: a frozen dataclass read from ``TOTALREDUCE_*`` env vars.

Precedence: keyword argument to ``init()`` > environment variable > default.  Unknown keyword
arguments are a ``TypeError`` (a typo must not silently fall back to a default), and odd
boolean spellings are rejected rather than guessed.  Values that do not parse or are out
of range raise one :class:`ConfigError` naming every one of them, each as
``VARIABLE=value: why`` (the variable it was read from, Horovod's included, or the
``init()`` keyword); totalrun checks the environment this way before it starts a job.

=================================  ==============================================  =========
env var                            meaning                                         default
=================================  ==============================================  =========
TOTALREDUCE_SEGMENT_BYTES          pipelining unit of large ops (bytes)            2 MiB
TOTALREDUCE_FLOATING_CAP           bytes this rank accepts for ops it has not      64 MiB
                                   submitted yet (split evenly between senders)
TOTALREDUCE_REDUCE_THREAD_BYTES    pieces at least this big are reduced on the     -1
                                   reduce thread, smaller ones inline (0 = always
                                   thread, -1 = never: no reduce thread at all)
TOTALREDUCE_STALL_CHECK_TIME       seconds before a waiting op is reported, with   60
                                   the ranks that submitted it and those that did
                                   not (0 = never)
TOTALREDUCE_STALL_SHUTDOWN_TIME    seconds before a stalled op fails on every      0
                                   rank instead of waiting on (0 = never)
TOTALREDUCE_OP_TIMEOUT             seconds before a waiting op fails here, however 1800
                                   it stalled (self-guided mode; 0 = never)
TOTALREDUCE_CONNECT_TIMEOUT        seconds to rendezvous and connect all peers     60
                                   (0 = no limit)
TOTALREDUCE_SHUTDOWN_TIMEOUT       longest shutdown() waits for its last messages  10
                                   to leave and the peers' links to close (it
                                   never waits for the peers' own shutdown())
TOTALREDUCE_MISMATCH_GRACE         seconds a rank waits to collect every rank's    1.0
                                   view of a mismatched op before raising
TOTALREDUCE_SMALL_BYTES            allreduces up to this size use recursive        -1
                                   doubling (fewer hops), bigger ones recursive
                                   halving (below) or the ring; so do allgathers
                                   (and their size exchange) from 4 ranks, one
                                   message a step; -1 = auto (2 MiB at 2 ranks,
                                   else 1 MiB)
TOTALREDUCE_HALVING_BYTES          allreduces above SMALL_BYTES and up to this     -1
                                   size use recursive halving then doubling
                                   (2 log2 n hops, the ring's bytes), bigger ones
                                   the ring; so do reducescatters, allgathers
                                   (recursive doubling) and broadcasts (scatter
                                   then allgather) up to it, where the ranks are a
                                   power of two >= 4; -1 = auto: from 8 ranks on
                                   one host, allreduce up to n MiB (no limit from
                                   16), reducescatter and allgather above
                                   SMALL_BYTES up to n MiB, broadcast at every size
TOTALREDUCE_DIRECT_BYTES           blocking ops up to this size run on the         -1
                                   caller's thread when nothing else is in flight
                                   (engine/smallpath.py; 0 = never); -1 = auto:
                                   2 MiB, and allreduces, allgathers, alltoalls
                                   and broadcasts while what they send one peer
                                   fits in its shared-memory ring (gathers only
                                   while the ring copies fast), and at 2 ranks
                                   allgathers and alltoalls up to 24 MiB whose
                                   pieces are lent (CMA_BYTES), and repeated
                                   allreduces up to 24 MiB while the rings copy
                                   fast (their sends wait for room)
TOTALREDUCE_TRANSPORT              shm, tcp, mpi, inproc or auto (mpi when         auto
                                   started by an MPI launcher and mpi4py imports,
                                   else shm); see transport/registry.py
TOTALREDUCE_HOST_ID                what ranks compare to learn who shares their    (none)
                                   host (and so shared memory and the first stage
                                   of a hierarchical allreduce); default: the
                                   hostname and the kernel's boot id
TOTALREDUCE_HIERARCHICAL           allreduce across hosts: on (1) reduce within    auto
                                   each host, then across hosts, then share within
                                   it; off (0) one flat ring or doubling over all
                                   ranks; auto: on where the job spans hosts with
                                   the same number of ranks on each (>= 2) and
                                   the op would take the ring
TOTALREDUCE_SHM_BYTES              shared-memory ring per direction between two    -1
                                   ranks on one host (shm transport; 0 = off,
                                   -1 = auto: two segments plus 128 KiB); under
                                   the mpi transport 0 also keeps urgent ops'
                                   lanes to such ranks in MPI (a tag of their own)
TOTALREDUCE_CMA_BYTES              ops at least this big lend their pieces to      -1
                                   ring peers: the receiver's kernel copies them
                                   out of the sender's memory (0 = never); -1 =
                                   auto: 1 MiB, reductions 32 MiB where every
                                   rank of the host has a core of its own, else
                                   8 MiB (a lent piece costs its receiver a copy
                                   and then a sum), and only out of buffers that
                                   huge pages back where the kernel can say (a
                                   blocking gather's piece that the ring holds
                                   whole, also while the ring copies slowly)
TOTALREDUCE_SLOW_RING_GBPS         a shared-memory ring whose big copies ran       -1
                                   slower than this lately (GB/s) lends every
                                   body of 64 KiB or more instead, and blocking
                                   broadcasts and alltoalls of 512 KiB or more
                                   (allgathers past 2 MiB) leave the caller's
                                   thread to have theirs lent where most of their
                                   peers' rings are so and that has been the
                                   faster way, timed (not a 2-rank broadcast
                                   whose root copies half of what it lends:
                                   that one always lends; copy_pace.py;
                                   0 = never; -1 = auto: as fast as the kernel
                                   copies a lent body here, measured at start)
TOTALREDUCE_COPY_PIECE             copies of bodies of at least twice this size,  -1
                                   and of arrays from 16 MiB, go in pieces of
                                   this many bytes (0 = whole); -1 = auto: half
                                   the L2 cache on AMD CPUs, whose glibc copies
                                   blocks that big a slower way (memcopy.py),
                                   else 0
TOTALREDUCE_SCRATCH_BYTES          receive buffers kept idle for reuse; past it    32 MiB
                                   the least recently used sizes are freed
TOTALREDUCE_NAME_CAPACITY          op names whose call counts a rank remembers     65536
                                   (see below)
TOTALREDUCE_BUCKET_BYTES           gradient bucket size of the torch               16 MiB
                                   DistributedOptimizer: small gradients travel
                                   together up to this many bytes
TOTALREDUCE_AUTOTUNE               1: each DistributedOptimizer tries bucket       0
                                   sizes and overlap on and off for its first
                                   steps, then keeps the fastest (torch/autotune.py)
TOTALREDUCE_AUTOTUNE_LOG           a CSV file for the trials and the choice        (none)
                                   (rank 0 writes it)
TOTALREDUCE_GC_FREEZE              1: init() moves every object alive then out of  1
                                   the garbage collector's full walks
                                   (gc.freeze()); 0: leave the collector alone
TOTALREDUCE_COORDINATION           selfguided: ops start at once and find each     selfguided
                                   other by name; negotiated: a coordinator
                                   (rank 0) says when every rank has asked for a
                                   tensor, as Horovod does (scheduling/)
TOTALREDUCE_CYCLE_TIME_MS          negotiated: milliseconds between coordination   1
                                   cycles (a wait on a request not yet in one
                                   begins one at once)
TOTALREDUCE_CACHE_CAPACITY         negotiated: responses remembered, so repeated   1024
                                   tensors skip the coordinator (0 = off)
TOTALREDUCE_FUSION_THRESHOLD       negotiated: allreduces ready in one cycle are   128 MiB
                                   fused into ops of up to this many bytes
                                   (0 = off)
TOTALREDUCE_TIMELINE               a file to write a Chrome trace of every op to   (none)
                                   (rank 0's; other ranks write PATH.RANK); its
                                   folder is created if missing
TOTALREDUCE_MAX_RESTARTS           set by ``totalrun --max-restarts``: > 0 turns   0
                                   on recovery (recovery/robust.py)
TOTALREDUCE_ATTEMPT                set by totalrun: how many times this rank was   0
                                   restarted before this life
TOTALREDUCE_RECOVERY_TIMEOUT       seconds the survivors of a failure wait for     120
                                   its replacement to join before every rank
                                   raises PeerFailureError
TOTALREDUCE_RECOVERY_LOG_BYTES     results kept since the last checkpoint, for a   1 GiB
                                   replacement to catch up from; a failure past
                                   it cannot be recovered (checkpoint more often)
TOTALREDUCE_SERVERS                set by ``totalrun --servers S``: the last S     0
                                   ranks are parameter servers (totalreduce.ps),
                                   the others its workers
TOTALREDUCE_MOCK_DEATH             fault injection for tests: ``rank,version,      (none)
                                   op,attempt`` (';' between several): that rank
                                   kills itself (SIGKILL) before its op-th
                                   collective of that checkpoint version, in that
                                   life
=================================  ==============================================  =========

A Horovod job's settings carry over: where a ``TOTALREDUCE_*`` variable above is unset, its
Horovod counterpart is read (``HOROVOD_FUSION_THRESHOLD``, ``HOROVOD_CYCLE_TIME``,
``HOROVOD_CACHE_CAPACITY``, ``HOROVOD_TIMELINE``, ``HOROVOD_STALL_CHECK_TIME_SECONDS``,
``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``, ``HOROVOD_HIERARCHICAL_ALLREDUCE``), and rank 0
prints a one-line notice for each.
It also prints one for each ``TOTALREDUCE_*`` variable that names no setting (a typo is
otherwise silently ignored).

Why names are forgotten: ops match across ranks by (name, call count), so every rank keeps
a count per name.  A job that names ops afresh every step (``f"grad.{step}"``) would grow
that table forever, so only the ``TOTALREDUCE_NAME_CAPACITY`` names used most recently are
remembered; a forgotten name starts again at call 0, under another identity (a count of
its forgettings, kept for as many names), so that a rank which has not forgotten it yet
does not take a faster peer's new call 0 for its finished old one.  That is safe when
every rank forgets it too, which holds when ranks submit the same names (in any order
nearby): a name is forgotten only after that many other names were used since its last
call.  A job that reuses a name after more distinct names than that, with ranks far apart
in their sequences, should raise the capacity.

Why the other defaults are what they are (segment and ring sizes, lending, buckets, the
garbage collector, the reduce thread): the measurements are in docs/BENCHMARKS.md, "Why
the defaults are what they are".
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from .memcopy import MIN_PIECE

_PREFIX = "TOTALREDUCE_"
# Horovod's names for our settings (read when ours is unset), and the factor from its unit.
_HOROVOD = {
    "fusion_threshold": ("HOROVOD_FUSION_THRESHOLD", 1),
    "cycle_time_ms": ("HOROVOD_CYCLE_TIME", 1),
    "cache_capacity": ("HOROVOD_CACHE_CAPACITY", 1),
    "timeline": ("HOROVOD_TIMELINE", 1),
    "stall_check_time": ("HOROVOD_STALL_CHECK_TIME_SECONDS", 1),
    "stall_shutdown_time": ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 1),
    "autotune": ("HOROVOD_AUTOTUNE", 1),
    "autotune_log": ("HOROVOD_AUTOTUNE_LOG", 1),
    "hierarchical": ("HOROVOD_HIERARCHICAL_ALLREDUCE", 1),
}


# TOTALREDUCE_* variables that are not settings: what the launchers give each worker.
_LAUNCH_VARIABLES = frozenset({
    "TOTALREDUCE_RANK", "TOTALREDUCE_SIZE", "TOTALREDUCE_LOCAL_RANK",
    "TOTALREDUCE_LOCAL_SIZE", "TOTALREDUCE_RENDEZVOUS", "TOTALREDUCE_SECRET",
    "TOTALREDUCE_JOB_ID", "TOTALREDUCE_FAILURE_DIR", "TOTALREDUCE_RAY_RANK",
    "TOTALREDUCE_RAY_SIZE", "TOTALREDUCE_RAY_LOCAL_RANK", "TOTALREDUCE_RAY_LOCAL_SIZE",
})

# What each setting accepts, and what the error says when a value is outside it.
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "segment_bytes": (lambda v: v >= 64, "must be at least 64 (bytes per piece)"),
    "floating_cap": (lambda v: v >= 0, "must be >= 0 (bytes)"),
    "reduce_thread_bytes": (lambda v: v >= -1,
                            "must be >= 0 (bytes), or -1 for no reduce thread"),
    "stall_check_time": (lambda v: v >= 0, "must be >= 0 (seconds; 0 = never)"),
    "stall_shutdown_time": (lambda v: v >= 0, "must be >= 0 (seconds; 0 = never)"),
    "op_timeout": (lambda v: v >= 0, "must be >= 0 (seconds; 0 = never)"),
    "connect_timeout": (lambda v: v >= 0, "must be >= 0 (seconds; 0 = no limit)"),
    "shutdown_timeout": (lambda v: v >= 0, "must be >= 0 (seconds)"),
    "mismatch_grace": (lambda v: v >= 0, "must be >= 0 (seconds)"),
    "small_bytes": (lambda v: v >= -1, "must be >= 0 (bytes), or -1 for auto"),
    "halving_bytes": (lambda v: v >= -1, "must be >= 0 (bytes), or -1 for auto"),
    "direct_bytes": (lambda v: v >= -1, "must be >= 0 (bytes; 0 = never), or -1 for auto"),
    "transport": (lambda v: v in ("auto", "shm", "tcp", "mpi", "inproc"),
                  "must be one of auto, shm, tcp, mpi, inproc"),
    "hierarchical": (lambda v: v in ("auto", "on", "off", "1", "0"),
                     "must be auto, on (or 1) or off (or 0)"),
    "shm_bytes": (lambda v: v >= -1,
                  "must be >= 0 (bytes; 0 = no shared memory), or -1 for auto"),
    "cma_bytes": (lambda v: v >= -1,
                  "must be >= 0 (bytes; 0 = never lend), or -1 for auto"),
    "slow_ring_gbps": (lambda v: v >= 0 or v == -1,
                       "must be >= 0 (GB/s; 0 = never lend for it), or -1 for auto"),
    "copy_piece": (lambda v: v == -1 or v == 0 or v >= MIN_PIECE,
                   "must be >= 4096 (bytes), 0 for whole copies, or -1 for auto"),
    "scratch_bytes": (lambda v: v >= 0, "must be >= 0 (bytes)"),
    "name_capacity": (lambda v: v >= 1, "must be >= 1 (names)"),
    "bucket_bytes": (lambda v: v >= 1, "must be >= 1 (bytes)"),
    "gc_freeze": (lambda v: v in (0, 1), "must be 0 or 1"),
    "autotune": (lambda v: v in (0, 1), "must be 0 or 1"),
    "coordination": (lambda v: v in ("selfguided", "negotiated"),
                     "must be selfguided or negotiated"),
    "cycle_time_ms": (lambda v: v >= 0, "must be >= 0 (milliseconds)"),
    "cache_capacity": (lambda v: v >= 0, "must be >= 0 (responses; 0 = no cache)"),
    "fusion_threshold": (lambda v: v >= 0, "must be >= 0 (bytes; 0 = no fusion)"),
    "max_restarts": (lambda v: v >= 0, "must be >= 0 (restarts per rank; 0 = none)"),
    "attempt": (lambda v: v >= 0, "must be >= 0 (set by totalrun)"),
    "recovery_timeout": (lambda v: v > 0, "must be > 0 (seconds)"),
    "recovery_log_bytes": (lambda v: v >= 0, "must be >= 0 (bytes)"),
    "servers": (lambda v: v >= 0, "must be >= 0 (parameter servers; 0 = none)"),
    "mock_death": (lambda v: re.fullmatch(r"(\s*-?\d+(,-?\d+){3}\s*(;|$))*", v) is not None,
                   "must be rank,version,op,attempt entries of integers, ';' between"),
}


class ConfigError(ValueError):
    """Settings that do not parse or are out of range.  ``problems`` holds one line per
    setting, ``NAME=value: why``, NAME being the environment variable the value came from
    or the ``init()`` keyword; the message is those lines."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def _show(raw: object) -> str:
    text = str(raw)
    return text if text and not any(c.isspace() for c in text) else repr(text)


def _why(name: str, value: Any) -> str | None:
    accepts, why = _RULES.get(name, (None, ""))
    try:
        return None if accepts is None or accepts(value) else why
    except TypeError:
        return why


def horovod_notices(environ: Mapping[str, str] | None = None) -> list[str]:
    """One line per Horovod variable read in place of an unset ``TOTALREDUCE_*`` one, and
    per ``TOTALREDUCE_*`` variable that names no setting."""
    env = os.environ if environ is None else environ
    out = []
    for name, (hvd, _unit) in _HOROVOD.items():
        ours = _PREFIX + name.upper()
        if not env.get(ours) and env.get(hvd):
            out.append(f"totalreduce: {ours} is unset; using {hvd}={env[hvd]}")
    known = [_PREFIX + f.name.upper() for f in dataclasses.fields(Config)]
    for var in sorted(env):
        if var.startswith(_PREFIX) and var not in known and var not in _LAUNCH_VARIABLES:
            near = difflib.get_close_matches(var, known, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            out.append(f"totalreduce: {var}={_show(env[var])}: not a totalreduce setting, "
                       f"ignored{hint}")
    return out


# What an auto-sized shared-memory ring holds besides its two segments: room for the
# small records (READYs, small ops) that travel between them.
RING_SMALL_ROOM = 128 << 10


@dataclasses.dataclass(frozen=True)
class Config:
    segment_bytes: int = 2 << 20
    floating_cap: int = 64 << 20
    reduce_thread_bytes: int = -1
    stall_check_time: float = 60.0
    stall_shutdown_time: float = 0.0
    op_timeout: float = 1800.0
    connect_timeout: float = 60.0
    shutdown_timeout: float = 10.0
    mismatch_grace: float = 1.0
    small_bytes: int = -1
    halving_bytes: int = -1
    direct_bytes: int = -1
    transport: str = "auto"
    host_id: str = ""
    hierarchical: str = "auto"
    shm_bytes: int = -1
    cma_bytes: int = -1
    slow_ring_gbps: float = -1.0
    copy_piece: int = -1
    scratch_bytes: int = 32 << 20
    name_capacity: int = 1 << 16
    bucket_bytes: int = 16 << 20
    autotune: int = 0
    autotune_log: str = ""
    gc_freeze: int = 1
    coordination: str = "selfguided"
    cycle_time_ms: float = 1.0
    cache_capacity: int = 1024
    fusion_threshold: int = 128 << 20
    timeline: str = ""
    max_restarts: int = 0
    attempt: int = 0
    recovery_timeout: float = 120.0
    recovery_log_bytes: int = 1 << 30
    servers: int = 0
    mock_death: str = ""

    def __post_init__(self) -> None:
        problems = [f"{f.name}={_show(getattr(self, f.name))}: {why}"
                    for f in dataclasses.fields(self)
                    if (why := _why(f.name, getattr(self, f.name))) is not None]
        if problems:
            raise ConfigError(problems)

    @property
    def direct_limit(self) -> int:
        """Bytes up to which a blocking op may run on the caller's thread (0: never);
        allreduces, allgathers, alltoalls and broadcasts may go further where
        DIRECT_BYTES is auto (scheduling/selfguided.py)."""
        return 2 << 20 if self.direct_bytes < 0 else self.direct_bytes

    @property
    def lend_bytes(self) -> int:
        """Ops at least this big lend their pieces to ring peers (0: never); where
        CMA_BYTES is auto, reductions only from a bigger size (scheduling/selfguided.py)."""
        return 1 << 20 if self.cma_bytes < 0 else self.cma_bytes

    @property
    def ring_bytes(self) -> int:
        """The shared-memory ring size per direction (0: no rings)."""
        if self.shm_bytes >= 0:
            return self.shm_bytes
        # Two segment records and room for the small ones between them: the writer can run
        # one piece ahead, and the ring's footprint (its capacity) stays in cache.
        return 2 * self.segment_bytes + RING_SMALL_ROOM

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Config:
        """Build a config: ``overrides`` beat ``TOTALREDUCE_*`` variables beat defaults.

        Raises:
            TypeError: an override names no known setting.
            ConfigError: (a ValueError) values that cannot be parsed or are out of range,
                every one of them, each named by the variable (or keyword) it came from.
        """
        values, sources, problems = _read(cls, environ, overrides)
        for name, value in values.items():
            why = _why(name, value)
            if why is not None:
                problems.append(f"{sources[name]}: {why}")
        if values.get("timeline"):
            why = make_timeline_folder(str(values["timeline"]))
            if why is not None:
                problems.append(f"{sources['timeline']}: {why}")
        if problems:
            raise ConfigError(problems)
        return cls(**values)


def _read(cls: type[Config], environ: Mapping[str, str] | None, overrides: dict[str, Any]
          ) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """The values set by ``overrides`` and the environment, where each came from (as
    ``NAME=value``), and a line for each that does not parse."""
    env = os.environ if environ is None else environ
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise TypeError(f"unknown totalreduce setting(s): {', '.join(unknown)}; "
                        f"known: {', '.join(sorted(fields))}")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    problems: list[str] = []
    for name, field in fields.items():
        if name in overrides:
            values[name] = overrides[name]
            sources[name] = f"{name}={_show(overrides[name])}"
            continue
        var = _PREFIX + name.upper()
        raw = env.get(var)
        if (raw is None or raw == "") and name in _HOROVOD:
            var = _HOROVOD[name][0]
            raw = env.get(var)
        if raw is None or raw == "":
            continue
        kind = {"int": int, "str": str}.get(str(field.type), float)
        sources[name] = f"{var}={_show(raw)}"
        try:
            values[name] = kind(raw)
        except ValueError:
            what = {int: "an integer", float: "a number"}.get(kind, "valid")
            rule = _RULES.get(name)
            problems.append(f"{var}={_show(raw)}: not {what}"
                            + (f"; {rule[1]}" if rule else ""))
    return values, sources, problems


def check_environment(environ: Mapping[str, str]) -> list[str]:
    """What a job started with ``environ`` would refuse, a ``NAME=value: why`` line per
    setting (totalrun calls this before it starts any worker)."""
    try:
        Config.from_env(environ)
    except ConfigError as exc:
        return exc.problems
    return []


def make_timeline_folder(path: str) -> str | None:
    """Create the folder a timeline file goes in, if missing (from_env does, so that a
    path in a new folder works, and one that cannot work is refused before anything
    starts); why it cannot be, or None."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.exists(folder) and not os.path.isdir(folder):
        return f"{folder} is not a folder"
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        return f"cannot create its folder {folder}: {exc.strerror or exc}"
    if not os.access(folder, os.W_OK):
        return f"cannot write to its folder {folder}"
    return None
