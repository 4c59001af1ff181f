"""Self-guided scheduling (Total Reduce): every rank names its ops alone and starts them
the moment they are submitted.

Op identity: ``(hash(name), n)`` where ``n`` counts this rank's earlier submissions of that
name.  Unnamed ops all share one name and one counter, so they match when every rank makes
the same calls in the same order — and a rank that skips or swaps a call is caught as a
mismatch instead of hanging.  Collectives whose sizes are not known everywhere
(allgather, alltoall) run as two ops, sizes first; both identities are taken at call time
so later calls cannot overtake them.  A caller that says every rank passes the same shape
(``same_shape=True``) makes them one op.
"""

from __future__ import annotations

import functools
import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..config import Config
from ..engine.algorithms import Algorithms
from ..engine.engine import Engine
from ..engine.payload import OpFuture, OpKey, OpSpec
from ..engine.repeat import Repeat
from ..engine.schedule import Schedule, even_bounds
from ..interrupts import deferred as ctrl_c
from ..lru import LRU
from ..memcopy import copy_array
from ..transport.wire import (
    Header,
    dtype_code,
)
from .broadcasting import BroadcastOps
from .call_names import UNNAMED, CallNames, Ident, hash64
from .checks import (
    check_allreduce,
    check_grouped,
    check_reducescatter,
)
from .gathering import GatheringOps
from .handle import DoneHandle, FutureHandle, Handle
from .joining import served_spec
from .ops import UFUNCS, ReduceOp, averager
from .queued_calls import QueuedCalls, nothing
from .slow_rings import SlowRingChoice
from .templates import (
    GATHER_PLANS,
    GatherPlan,
    OpTemplate,
    SamePlan,
    ScatterPlan,
    scatter_key,
)
from .thresholds import (
    CROWDED_REDUCE_LEND_BYTES,
    HUGE_LEND_SHARE,
    LENT_GATHER_BYTES,
    QUEUED_ALLREDUCE_BYTES,
    REDUCE_LEND_BYTES,
    REPEAT_ALLREDUCE_BYTES,
    direct_broadcast_bytes,
    direct_ring_bytes,
)
from .views import with_algorithm

_JOIN = "\x00join"


# Entries of each spec cache: a training loop repeats a few hundred (name, shape) pairs;
# shapes that change every step cost a rebuild (~15 us), never memory.
_SPEC_CACHE = 1024
# grouped_allreduce fuses arrays smaller than this (copying them in and out) and sends
# bigger ones as ops of their own: at ~5 GB/s a copy in and out of 128 KiB costs about
# what one more op costs in Python (~50 us).
_FUSE_BELOW = 128 << 10


def _freeze(obj: Any) -> Any:
    if isinstance(obj, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in obj.items()))
    if isinstance(obj, list | tuple):
        return tuple(_freeze(v) for v in obj)
    return obj


class SelfGuided(GatheringOps, BroadcastOps, QueuedCalls):
    """Builds op specs from numpy arrays and submits them to the engine."""

    def __init__(self, engine: Engine, config: Config,
                 members: tuple[int, ...] | None = None, set_id: int = 0) -> None:
        """``members``: the job's ranks of process set ``set_id`` (process_sets.py), whose
        ops this instance runs, counting ranks within the set; None: the whole job."""
        self._engine = engine
        self._config = config
        self._members = members
        self._set_id = set_id
        self.rank = engine.rank if members is None else members.index(engine.rank)
        self.size = engine.size if members is None else len(members)
        # Op names of a set carry its id: its calls never match another set's.
        self._tag = f"\x00set{set_id}" if set_id else ""
        self._caller_waits = engine.caller_waits()
        self._direct_bytes = config.direct_limit
        self._direct_ring = self._direct_bytes
        self._peers = [r for r in (range(engine.size) if members is None else members)
                       if r != engine.rank]
        # At 2 ranks, gathers up to this whose pieces are lent stay here (_data_direct).
        self._lent_gathers = 0
        self._direct_broadcast = self._direct_bytes
        room = 0
        if config.direct_bytes < 0:  # auto
            room = engine.ring_room(self._peers)
            self._direct_ring = direct_ring_bytes(self._direct_bytes, room, self.size)
            self._direct_broadcast = direct_broadcast_bytes(self._direct_ring, room,
                                                            self.size)
            if self.size == 2:
                self._lent_gathers = LENT_GATHER_BYTES
        # Blocking allreduces up to this run from their Repeat on this thread from their
        # second call, past the ring too (_big_allreduce); async ones up to _queued_big
        # wait in the loop's queue to run from theirs (_queued).
        self._direct_big = self._queued_big = self._direct_ring
        # Async allreduces like ones made before wait in the loop's queue, to run from
        # their Repeats (_queued), where that has been measured faster: at 2 ranks on the
        # rings.  At 3 and 4 ranks most of their Repeats handed over (each after a spin)
        # and times moved both ways within the noise; over sockets they did not move.
        self._queues = False
        if self.size == 2 and room > 0 and not engine.crowded():
            self._direct_big = max(self._direct_ring, REPEAT_ALLREDUCE_BYTES)
            self._queued_big = max(self._direct_ring, QUEUED_ALLREDUCE_BYTES)
            self._queues = True
        hosts = engine.hosts
        if members is not None and hosts is not None:
            hosts = tuple(hosts[m] for m in members)
        # Whether the ranks lend each other big bodies, from what every rank knows alike
        # (its schedules depend on it): one host, shared-memory rings, lending allowed.
        lent = (config.transport in ("auto", "shm") and config.ring_bytes > 0
                and config.lend_bytes > 0 and hosts is not None and len(set(hosts)) == 1)
        self._algorithms = Algorithms(self.rank, self.size, config.segment_bytes,
                                      config.small_bytes, hosts, config.hierarchical, members,
                                      config.halving_bytes, lent)
        self._lock = threading.Lock()
        self._names = CallNames(config.name_capacity, engine.forget_name)
        self._join_rounds = 0
        self._sigs: LRU[Any, int] = LRU(_SPEC_CACHE)
        # (kind, dtype, shape, op, ..., name) -> (view, sig): a training loop's allreduces
        # repeat, and building and freezing the view dict cost ~15 us of a 1 MB op's ~200.
        self._known: LRU[tuple[Any, ...], tuple[dict[str, Any], int]] = LRU(_SPEC_CACHE)
        # (dtype, shape, op, name) -> what its small blocking allreduces share.
        self._small: LRU[tuple[Any, ...], OpTemplate] = LRU(_SPEC_CACHE)
        # (name, dtype, shapes, op) -> a grouped allreduce's part, for its async calls.
        self._grouped: LRU[tuple[Any, ...], OpTemplate] = LRU(_SPEC_CACHE)
        self._barrier: OpTemplate | None = None
        # What every repeated barrier reduces: its result is never read, so calls (even
        # at once, on several threads) may share it, and a call allocates nothing.
        self._barrier_byte = np.zeros(1, np.uint8)
        # Broadcasts' templates (with the root's index in the set), by broadcast_key;
        # allgathers' and alltoalls' plans, by gather_key.
        self._broadcasts: LRU[tuple[Any, ...], tuple[OpTemplate, int]] = LRU(_SPEC_CACHE)
        self._gathers: LRU[tuple[Any, ...], GatherPlan] = LRU(GATHER_PLANS)
        self._same: LRU[tuple[Any, ...], SamePlan] = LRU(GATHER_PLANS)
        # Reducescatters' plans, by scatter_key and whether the call reads its input.
        self._scatters: LRU[tuple[Any, ...], ScatterPlan] = LRU(_SPEC_CACHE)
        self._slow_rings = SlowRingChoice()

    def close(self) -> None:
        """Nothing to stop: every op is the engine's."""

    def idle(self) -> bool:
        """Whether the engine has nothing in flight (a hint: see Engine.idle)."""
        return self._engine.idle()

    def caller_waits(self) -> Any:
        """``with ops.caller_waits():`` this thread waits for what it submits inside, and
        drives the engine's loop itself meanwhile, so the progress thread is not woken."""
        return self._caller_waits

    @property
    def slow_rings(self) -> SlowRingChoice:
        """The ways blocking ops took while the rings copied slowly (tests read them)."""
        return self._slow_rings

    def stats(self) -> dict[str, int]:
        """Sizes of the bounded tables (tests and memory checks read them)."""
        with self._lock:
            return {"names": len(self._names), "name_evictions": self._names.evictions,
                    "specs": len(self._known), "sigs": len(self._sigs),
                    "small_plans": len(self._small), "gather_plans": len(self._gathers),
                    "same_shape_plans": len(self._same),
                    "broadcast_plans": len(self._broadcasts),
                    "scatter_plans": len(self._scatters)}

    # --- identity ---------------------------------------------------------------------

    def count_served(self, name_key: int, seq: int) -> None:
        """A peer's call ``seq`` of name ``name_key`` ran here without a submit (join):
        this rank's next call of that name is ``seq + 1`` at least (any thread)."""
        self._names.count_served(name_key, seq)

    def _ident(self, kind: str, name: str | None, phase: str = "") -> Ident:
        key, label = self._call(kind, name, phase)
        return Ident(key, name, label)

    def _call(self, kind: str, name: str | None, phase: str = "") -> tuple[OpKey, str]:
        """This rank's next call of ``name`` (``phase``: a part of an op with an identity
        of its own): its key, (name hash, call count), and its label for messages."""
        h, seq = self._names.next_call((UNNAMED if name is None else name) + phase
                                       + self._tag)
        return (h, seq), self._label(kind, name, seq)

    def _label(self, kind: str, name: str | None, seq: int) -> str:
        """The label of call ``seq`` of ``name``, for messages."""
        if name is None:
            label = f"{kind} (unnamed) (call #{seq})"
        elif seq:
            label = f"{kind} '{name}' (call #{seq})"
        else:
            label = f"{kind} '{name}'"
        if self._set_id:
            label += f" in process set {self._set_id} (ranks {list(self._members or ())})"
        return label

    def _spec(self, ident: Ident, view: dict[str, Any] | Callable[[], dict[str, Any]],
              dtype: np.dtype, count: int, schedule: Schedule, work: np.ndarray,
              priority: int, known: tuple[Any, ...] | None = None,
              shown: dict[str, Any] | Callable[[], dict[str, Any]] | None = None,
              **kw: Any) -> OpSpec:
        """``view`` (or a function making it) is what ranks must agree on; ``known``, a
        hashable key that determines it (and ``shown``), lets a repeated op skip building
        them.  ``shown``, if given, is what a mismatch message shows of this rank's call
        instead of ``view`` (an allgather's whole shape, though ranks agree only on its
        rows)."""
        key = None if known is None else (*known, ident.name)
        if key is not None:
            with self._lock:
                hit = self._known.get(key)
        else:
            hit = None
        if hit is not None:
            describe, sig = hit
        else:
            view = dict(view() if callable(view) else view, name=ident.name)
            # A training loop repeats the same few views: hashing their JSON each call was
            # a measurable share of a small op's cost.
            frozen = _freeze(view)
            with self._lock:
                cached = self._sigs.get(frozen)
            sig = hash64(json.dumps(view, sort_keys=True)) if cached is None else cached
            describe = view if shown is None else \
                dict(shown() if callable(shown) else shown, name=ident.name)
            with self._lock:
                self._sigs.put(frozen, sig)
                if key is not None:
                    self._known.put(key, (describe, sig))
        return OpSpec(ident.key, ident.label, sig, dtype_code(dtype), count, describe,
                      schedule, work, priority=priority, ranks=self._members, **kw)

    # --- allreduce ------------------------------------------------------------------

    def allreduce(self, x: Any, op: Any, name: str | None, priority: int,
                  inplace: bool) -> Handle:
        small = self._small_key(x, op, name, inplace)
        if small is not None:
            with self._lock:
                plan = self._small.get(small)
            if plan is not None and not priority and not self._engine.waits_here():
                queued = self._queue_repeat(plan, x, name, inplace)
                if queued is not None:
                    return queued
            # A bigger op's template serves its Repeat alone (_big_allreduce): every
            # other call of it builds its spec, whose lending depends on the call.
            if plan is not None and x.nbytes <= self._direct_ring:
                if self._engine.waits_here():
                    return self._small_allreduce(plan, x, name, priority, inplace)
                # Async: the plan spares the checks and the spec's making all the same;
                # the loop runs it.
                spec, result = self._small_spec(plan, x, name, priority, inplace)
                return FutureHandle([self._engine.submit(spec)], lambda: result, spec.label)
        rop, arr = check_allreduce(x, op, name, inplace)
        ident = self._ident("allreduce", name)
        source = self._fresh_source(arr, inplace, self._direct_ring)
        if source is not None:
            work, writeback = np.empty(arr.size, arr.dtype), False
        else:
            work, writeback = self._working_copy(arr, inplace)

        def view() -> dict[str, Any]:
            return {"kind": "allreduce", "dtype": str(arr.dtype), "shape": list(arr.shape),
                    "op": rop.label}

        spec = self._reduce_spec(ident, view, arr.dtype, work, rop, priority,
                                 ("allreduce", arr.dtype, arr.shape, rop), source)

        def finish() -> np.ndarray:
            if writeback:
                arr[...] = work.reshape(arr.shape)
            return arr if inplace else work.reshape(arr.shape)

        if small is not None:
            with self._lock:
                # Its calls lend as this first one chose, the loop's async ones too: with
                # every piece of a 1-2 MiB template lent by size, and any while a ring
                # copied slowly, async allreduces submitted at once took 1 MB ones 16.5 ms
                # for 48 of them against 7.9 through the ring, 2 MB 21.2 against 7.2
                # (2 ranks, cores sharing a cache), and a ResNet-50 gradient set 26.6-27.1
                # ms tensor by tensor against 18.2-18.4, and 21.2-26.6 grouped in 25 MB
                # buckets against 16.8-17.6 (thresholds.CROWDED_REDUCE_LEND_BYTES).  A
                # bigger one's template is replaced by one that reads no source, which
                # serves in-place calls too.
                if (arr.nbytes <= self._direct_ring or plan is None
                        or (plan.fresh and not spec.fresh)):
                    self._small.put(small, OpTemplate(spec))
        return self._launch(spec, finish, self._direct_ring)

    def _small_key(self, x: Any, op: Any, name: Any, inplace: bool
                   ) -> tuple[Any, ...] | None:
        """The key of the :class:`OpTemplate` a call may reuse (the one a
        call like it left), if the call is small enough for the small path and, in place,
        contiguous and writable; None otherwise."""
        if (type(x) is not np.ndarray or type(op) is not ReduceOp
                or (name is not None and type(name) is not str) or self._direct_bytes <= 0
                or x.nbytes > self._direct_big
                or (inplace and not (x.flags.c_contiguous and x.flags.writeable))):
            return None
        return (x.dtype, x.shape, op, name)

    def _small_spec(self, plan: OpTemplate, x: np.ndarray, name: str | None,
                    priority: int, inplace: bool) -> tuple[OpSpec, np.ndarray]:
        """A repeated small allreduce's spec and the array its result will be in."""
        key, label = self._call("allreduce", name)
        # In place, x is contiguous (_small_key), so ravel() is a view; not in place, the
        # result is an array of its own, never x.
        work = x.ravel() if inplace else x.flatten()
        result = x if inplace else work.reshape(x.shape)
        return plan.spec(key, label, work, priority, self._members), result

    def _small_allreduce(self, plan: OpTemplate, x: np.ndarray, name: str | None,
                         priority: int, inplace: bool) -> Handle:
        """A repeated small blocking allreduce (see :class:`OpTemplate`)."""
        spec, result = self._small_spec(plan, x, name, priority, inplace)
        ran = self._engine.run_now(spec)
        if ran is True:
            return DoneHandle(result, spec.label)
        future = self._engine.submit(spec) if ran is False else ran
        return FutureHandle([future], lambda: result, spec.label)

    def allreduce_now(self, x: Any, op: Any, name: str | None, priority: int,
                      inplace: bool) -> np.ndarray | None:
        """A blocking allreduce like one made before, small enough for the engine to run to
        its end on this thread: its result.  None, with nothing done, where it is not one:
        call :meth:`allreduce` and wait.  Skips the handle and the hand-off through
        :meth:`caller_waits`, each a share of a small op's cost."""
        # The template first, then the array's layout: a template is kept only for calls
        # that passed _small_key's tests, and a call of the same dtype, shape, op and
        # name passes its size tests too, whose bounds are fixed at set-up (_small_key's
        # work without its call).
        if (type(x) is not np.ndarray or type(op) is not ReduceOp
                or (name is not None and type(name) is not str)):
            return None
        key = (x.dtype, x.shape, op, name)
        entries = self._small.entries
        with self._lock:
            plan = entries.get(key)  # LRU.get, inline
            if plan is None:
                return None
            entries.move_to_end(key)
        if inplace:
            flags = x.flags
            if not (flags.c_contiguous and flags.writeable):
                return None
        if x.nbytes > self._direct_ring:
            return self._big_allreduce(plan, x, name, priority, inplace)
        repeat = plan.repeat
        if repeat is None or priority:
            spec, result = self._small_spec(plan, x, name, priority, inplace)
            if not plan.repeat_tried and not priority:
                plan.repeat_tried = True
                plan.repeat = self._engine.repeat(
                    spec, functools.partial(self._label, "allreduce", name))
            self._run_blocking(spec)
            return result
        # A flat x is its own working buffer: ravel() would make a view of it each call.
        work = (x if x.ndim == 1 else x.ravel()) if inplace else x.flatten()
        # The start of _repeat, inline (kept in step with it): a frame fewer on every
        # repeated blocking allreduce.
        ident = self._names.next_call((UNNAMED if name is None else name) + self._tag)
        ran = repeat.run(work, ident)
        if ran is not True or ctrl_c.pending:
            self._repeat_ended(repeat, work, ident, None, ran)
        return x if inplace else work.reshape(x.shape)

    def _big_allreduce(self, plan: OpTemplate, x: np.ndarray, name: str | None,
                       priority: int, inplace: bool) -> np.ndarray | None:
        """A blocking allreduce past the ring (up to _direct_big) from its template's
        Repeat, whose sends wait while the ring is full (repeat.py): its result; None,
        nothing done, where it does not run that way (call :meth:`allreduce`).

        At 2 ranks on the shared-memory rings each piece is then copied into the ring
        while the peer sums the one before, out of a cache that still holds it, with no
        turn of the loop between (bench collectives, one job each way, alternated
        twice): where the VM's two cores shared a cache, 8 MB allreduces took 0.44 ms
        this way against 0.56-0.62 on the loop, 16 MB 1.10-1.13 against 1.29-1.47;
        where they did not, 8 MB 0.94-0.95 against 0.98-0.99, 16 MB 2.05-2.14 against
        2.43-2.64, and 24 MB 2.6-3.0 against 3.3-4.2 (three alternations).  While the
        rings copy slowly (copy_pace.py) the Repeat lends the pieces the loop would, where
        the peer's would too (OpSpec.agree_slow).  Not for an urgent call."""
        if priority:
            return None
        source = None
        if plan.fresh:  # its Repeat reads the call's input: not one in place
            if inplace:
                return None
            work = np.empty(x.size, x.dtype)
            source = x.reshape(-1)
        else:
            work = x.reshape(-1) if inplace else x.flatten()
        repeat = self._plan_repeat(plan, work, "allreduce", name, source)
        if repeat is None:
            return None
        self._repeat(repeat, work, name, source)
        return x if inplace else work.reshape(x.shape)

    def _repeat(self, repeat: Repeat, work: np.ndarray, name: str | None,
                source: np.ndarray | None = None) -> None:
        """Run the next call of ``name`` on ``work`` (and ``source``, where its op reads
        one) from ``repeat`` (engine/repeat.py: the buffers and the identity are all the
        call's own), or the usual way where the engine is not idle; raises its error."""
        ident = self._names.next_call((UNNAMED if name is None else name) + self._tag)
        ran = repeat.run(work, ident, source)
        if ran is not True or ctrl_c.pending:
            self._repeat_ended(repeat, work, ident, source, ran)

    def _repeat_ended(self, repeat: Repeat, work: np.ndarray, ident: OpKey,
                      source: np.ndarray | None, ran: OpFuture | bool) -> None:
        """After ``repeat.run`` (``ran``) of the call ``ident``: a Ctrl-C that came
        meanwhile, or the call the usual way (False: it did not begin), or the wait for
        the op it became on the general path; raises its error."""
        if ran is True:
            ctrl_c.raise_if_pending()
        elif ran is False:
            self._run_blocking(repeat.spec(work, ident, source))
        else:
            with self._caller_waits:
                FutureHandle([ran], nothing, repeat.label(ident[1])).wait()

    def barrier_now(self) -> bool:
        """A barrier run to its end on this thread, as :meth:`allreduce_now`: False, with
        nothing done, where it cannot be (the first one): call :meth:`barrier`."""
        plan = self._barrier
        if plan is None or self._direct_bytes <= 0:
            return False
        if plan.repeat is not None:
            # While the engine is idle; else (Repeat.run refuses) on the urgent lane, past
            # whatever is in flight, as every barrier ran before.
            self._repeat(plan.repeat, self._barrier_byte, None)
            return True
        spec = self._barrier_spec()
        if not plan.repeat_tried:
            plan.repeat_tried = True
            plan.repeat = self._engine.repeat(
                spec, functools.partial(self._label, "barrier", None))
        self._run_blocking(spec)
        return True

    def _run_blocking(self, spec: OpSpec) -> None:
        """Run ``spec`` to its end, on this thread from its first message if the engine
        can (engine/express.py) and it fits the ring, else on the loop; raises its
        error."""
        ran = self._engine.run_now(spec) if spec.work.nbytes <= self._direct_ring else False
        if ran is not True:
            with self._caller_waits:
                future = self._engine.submit(spec) if ran is False else ran
                FutureHandle([future], nothing, spec.label).wait()
        elif ctrl_c.pending:
            ctrl_c.raise_if_pending()

    def _launch(self, spec: OpSpec, finish: Callable[[], Any],
                direct: int | None = None, slow_from: int | None = None) -> Handle:
        """Start ``spec``: on this thread to its end when it is small (``direct`` bytes at
        most; DIRECT_BYTES by default), this thread blocks on it and nothing else is in
        flight (engine/smallpath.py), else on the engine; so too one of ``slow_from``
        bytes or more while the rings copy slowly (its bodies are then lent) where that
        has been faster, and a bigger one then lends its bodies only where that has."""
        direct = self._direct_bytes if direct is None else direct
        nbytes = spec.work.nbytes
        if direct and nbytes <= direct and self._engine.waits_here():
            slow = None
            if (slow_from is not None and nbytes >= slow_from
                    and self._engine.lends(self._peers)):
                # Which way is faster while the rings are slow depends on the host: timed.
                slow = SlowRingChoice.key(spec.label.partition(" ")[0], nbytes)
                if self._slow_rings.leave(slow):
                    # Timed from here: submit() may drive the op a while itself.
                    timed = self._slow_rings.timed(finish, slow)
                    return FutureHandle([self._engine.submit(spec)], timed, spec.label)
            start = 0.0 if slow is None else time.perf_counter()
            ran = self._engine.run_now(spec)
            if ran is True:
                if slow is not None:
                    self._slow_rings.took(slow, False, time.perf_counter() - start)
                return DoneHandle(finish(), spec.label)
            if ran is not False:
                return FutureHandle([ran], finish, spec.label)
        elif (slow_from is not None and nbytes >= slow_from and self._engine.waits_here()
              and self._engine.lends(self._peers)):
            # On the loop, whether lending beats the ring's copies while the rings are
            # slow depends on the host as well: timed.
            slow = SlowRingChoice.key(spec.label.partition(" ")[0], nbytes, lending=True)
            spec.lend_slow = self._slow_rings.leave(slow)
            timed = self._slow_rings.timed(finish, slow, spec.lend_slow)
            return FutureHandle([self._engine.submit(spec)], timed, spec.label)
        return FutureHandle([self._engine.submit(spec)], finish, spec.label)

    def _fresh_source(self, arr: np.ndarray, inplace: bool, direct: int
                      ) -> np.ndarray | None:
        """The input itself, where an op may read it instead of a copy of it: more than
        ``direct`` bytes, not in place, contiguous, whose caller waits for it (so it cannot
        change the input meanwhile, as an async caller could)."""
        if (inplace or arr.nbytes <= direct or not arr.flags.c_contiguous
                or not self._engine.waits_here()):
            return None
        return arr.reshape(-1)

    def _working_copy(self, arr: np.ndarray, inplace: bool) -> tuple[np.ndarray, bool]:
        """A flat contiguous buffer; in place when the array allows it."""
        if inplace and arr.flags.c_contiguous and arr.flags.writeable:
            return arr.reshape(-1), False
        if inplace and not arr.flags.writeable:
            raise ValueError("in-place collective on a read-only array")
        return np.array(arr, copy=True, order="C").reshape(-1), inplace

    def _reduction_lends(self, work: np.ndarray, source: np.ndarray | None = None
                         ) -> tuple[bool, bool, bool]:
        """Whether a reduction into ``work`` (from ``source``, where it reads one: OpSpec.
        fresh) may lend its pieces (OpSpec.lend), and may while a ring copies slowly
        (OpSpec.lend_slow).  The first: as any op where CMA_BYTES is set, else from
        REDUCE_LEND_BYTES, or CROWDED_REDUCE_LEND_BYTES where the host is crowded.  Below
        CROWDED_REDUCE_LEND_BYTES neither (thresholds.py has why).  From there on, neither
        but out of a buffer that huge pages back
        (HUGE_LEND_SHARE), as far as the kernel can say: through the ring small pages
        cost nothing more, and at 2 ranks the slow-ring rule lent 64 MB allreduces of
        them (their big copies run at memory's speed), which then took 12-15 ms against
        7.5-7.7 copied.  The buffer asked about is the caller's: a fresh ``work`` is ours,
        untouched yet, and numpy asks huge pages for it.

        The kernel is asked only where its answer turns a choice now: for an op that the
        size would lend, or while most rings copy slowly (Engine.lends).  Asking costs
        10-60 us at 16-64 MiB once the op's copies have flushed the caches (a 16 MB
        allreduce spent 50 us of its 140 before its first copy on it); an op that starts
        while the rings copy fast and sees one turn slow may lend small-paged pieces.

        The third (OpSpec.agree_slow): at 2 ranks, whether the second may differ from the
        peer's, which its own pages and its rings' pace at this call decided.  A 9 MiB
        numpy array is 0.67 or 0.89 huge-paged by where malloc put it, which differs from
        process to process; a Repeat's calls then lend while slow only where both ranks
        would."""
        if self._config.cma_bytes >= 0:
            return True, True, False
        nbytes = work.nbytes
        if nbytes < CROWDED_REDUCE_LEND_BYTES:
            return False, False, False
        big = nbytes >= REDUCE_LEND_BYTES or self._engine.crowded()
        agree = not big and self.size == 2
        if not big and not self._engine.lends(self._peers):
            return False, True, agree
        share = self._engine.huge_share(work if source is None else source)
        pages = share is None or share >= HUGE_LEND_SHARE
        return big and pages, pages, agree

    def _reduce_spec(self, ident: Ident,
                     view: dict[str, Any] | Callable[[], dict[str, Any]], dtype: np.dtype,
                     work: np.ndarray, rop: ReduceOp, priority: int,
                     known: tuple[Any, ...] | None = None,
                     source: np.ndarray | None = None) -> OpSpec:
        """``source``: the input, where ``work`` is left undefined for the algorithm to
        fill from it (OpSpec.fresh); copied into ``work`` if the algorithm cannot."""
        plan = self._algorithms.allreduce(work.size, dtype, source is not None)
        if source is not None and not plan.fresh:
            copy_array(work, source)
            source = None
        view = with_algorithm(view, plan.algorithm)
        known = None if known is None else (*known, plan.algorithm)
        schedule, recipe = plan.schedule, plan.recipe | int(rop) << 4
        finalize = averager(dtype, self.size) if rop == ReduceOp.AVERAGE else None
        lend, lend_slow, agree = self._reduction_lends(work, source)
        return self._spec(ident, view, dtype, work.size, schedule, work, priority, known,
                          ufunc=UFUNCS[rop], finalize=finalize, recipe=recipe,
                          source=source, fresh=source is not None, lend=lend,
                          lend_slow=lend_slow, agree_slow=agree)

    def grouped_allreduce(self, xs: Sequence[Any], op: Any, name: str | None,
                          priority: int, inplace: bool) -> Handle:
        """Arrays of at least ``_FUSE_BELOW`` bytes go as ops of their own (in place when
        they can: no copy at all); the smaller ones of each dtype are fused into one op.

        Fusing everything cost a copy in and a copy out of every byte, which made a
        ResNet-50 gradient set slower grouped (78 ms at 2 ranks) than reduced tensor by
        tensor (41 ms); the copies pay only where they save per-op overhead.

        A blocking call (its thread waits for it: :meth:`caller_waits`) runs its parts one
        after another as blocking allreduces do, each small one to its end on this thread:
        ResNet-50's gradients in 16 MB buckets at 2 ranks took 44-46 ms that way against
        58-59 ms submitted all at once to the loop (three alternated runs).  A part that
        meets a mismatch there goes on on the loop and fails at ``wait()``, and the parts
        after it still go, as in the async form, so every part's calls line up rank by
        rank."""
        rop, arrs = check_grouped(xs, op, name, inplace)
        parts: list[list[int]] = []
        fused: dict[np.dtype, list[int]] = {}
        # Fused even where each part runs from its Repeat (queued, or blocking: _part_now):
        # at 2 ranks 1,000 tiny arrays took 1.06 ms blocking fused against 10.1 unfused,
        # though ResNet-50's gradients in 25 MB async groups took 15.3 ms fused against
        # 12.3 (blocking: 11.3 against 12.3).  Every rank's parts must be alike, so the
        # rule cannot depend on whether this caller waits.
        for i, a in enumerate(arrs):
            if a.nbytes >= _FUSE_BELOW:
                parts.append([i])
            else:
                if a.dtype not in fused:
                    fused[a.dtype] = []
                    parts.append(fused[a.dtype])
                fused[a.dtype].append(i)
        with self._engine.queuing_calls():
            futures, outputs = self._grouped_parts(arrs, parts, name, rop, priority, inplace)

        def finish() -> list[np.ndarray]:
            result: list[np.ndarray] = [np.empty(0)] * len(arrs)
            for idx, work, writeback in outputs:
                offset = 0
                for i in idx:
                    a = arrs[i]
                    part = work[offset:offset + a.size].reshape(a.shape)
                    offset += a.size
                    if writeback:
                        a[...] = part
                    result[i] = a if inplace else part
            return result

        return FutureHandle(futures, finish, f"grouped_allreduce of {len(arrs)} arrays")

    def _grouped_parts(self, arrs: list[np.ndarray], parts: list[list[int]],
                       name: str | None, rop: Any, priority: int, inplace: bool
                       ) -> tuple[list[OpFuture], list[tuple[list[int], np.ndarray, bool]]]:
        """Run, queue or submit each part of a grouped allreduce (see grouped_allreduce):
        the parts' futures, and each part's arrays, buffer and whether it is copied back."""
        futures: list[OpFuture] = []
        outputs: list[tuple[list[int], np.ndarray, bool]] = []
        waits = self._engine.waits_here()
        for k, idx in enumerate(parts):
            gname = None if name is None else (name if len(parts) == 1 else f"{name}.{k}")
            dtype = arrs[idx[0]].dtype
            if len(idx) == 1:
                work, writeback = self._working_copy(arrs[idx[0]], inplace)
            else:
                work = np.concatenate([arrs[i].reshape(-1) for i in idx])
                writeback = inplace
            outputs.append((idx, work, writeback))
            key = (gname, dtype, tuple(arrs[i].shape for i in idx), rop)
            with self._lock:
                plan = self._grouped.get(key)
            if plan is not None and not priority:
                if waits:
                    ran = self._part_now(plan, work, gname)
                    if ran is not None:
                        futures.extend(ran)
                        continue
                else:
                    queued = self._queued(plan, work, "grouped_allreduce", gname)
                    if queued is not None:
                        futures.append(queued[0])
                        continue
            ident = self._ident("grouped_allreduce", gname)
            view = {"kind": "grouped_allreduce", "dtype": str(dtype),
                    "shape": [list(arrs[i].shape) for i in idx], "op": rop.label}
            spec = self._reduce_spec(ident, view, dtype, work, rop, priority)
            if plan is None:
                with self._lock:
                    self._grouped.put(key, OpTemplate(spec))
            # _launch runs it here when this thread waits for it, else submits it.
            futures.extend(self._launch(spec, nothing, self._direct_ring).futures)
        return futures, outputs

    # --- reducescatter --------------------------------------------------------------

    def reducescatter(self, x: Any, op: Any, name: str | None, priority: int) -> Handle:
        key = scatter_key(x, op, name)
        if key is not None:
            # Read in place (below) or not: the algorithm may differ.
            key = (*key, self._fresh_source(x, False, 0) is not None)
            with self._lock:
                plan = self._scatters.get(key)
            if plan is not None:
                return self._scatter_again(plan, x, name, priority)
        rop, arr = check_reducescatter(x, op, name)
        ident = self._ident("reducescatter", name)
        row = math.prod(arr.shape[1:])
        rows = even_bounds(arr.shape[0], self.size)
        bounds = tuple(b * row for b in rows)
        # Read in place at every size (the small path reads a source too): a copy of the
        # whole input cost a 1 MB reduce-scatter a quarter of its time.
        source = self._fresh_source(arr, False, 0)
        work = np.array(arr, copy=True, order="C").reshape(-1) if source is None \
            else np.empty(arr.size, arr.dtype)
        def view() -> dict[str, Any]:
            return {"kind": "reducescatter", "dtype": str(arr.dtype),
                    "shape": list(arr.shape), "op": rop.label}

        schedule, algorithm, fresh = self._algorithms.reducescatter(bounds, arr.dtype,
                                                                   source is not None)
        if source is not None and not fresh:
            copy_array(work, source)
            source = None
        finalize = averager(arr.dtype, self.size) if rop == ReduceOp.AVERAGE else None
        lend, lend_slow, agree = self._reduction_lends(work, source)
        spec = self._spec(ident, with_algorithm(view, algorithm), arr.dtype, work.size,
                          schedule, work, priority,
                          ("reducescatter", arr.dtype, arr.shape, rop, algorithm),
                          ufunc=UFUNCS[rop], finalize=finalize, source=source,
                          fresh=source is not None, lend=lend, lend_slow=lend_slow,
                          agree_slow=agree)
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        shape = (rows[self.rank + 1] - rows[self.rank], *arr.shape[1:])
        if key is not None:
            with self._lock:
                self._scatters.put(key, ScatterPlan(OpTemplate(spec), lo, hi, shape))
        return self._launch(spec, lambda: work[lo:hi].reshape(shape))

    def _scatter_again(self, plan: ScatterPlan, x: np.ndarray, name: str | None,
                       priority: int) -> Handle:
        """A reducescatter like one made before (scatter_key): its checks, bounds,
        algorithm and signature are the plan's."""
        key, label = self._call("reducescatter", name)
        source = self._fresh_source(x, False, 0)
        template = plan.template
        if source is not None and template.fresh:
            work = np.empty(x.size, x.dtype)
        else:
            work, source = np.array(x, copy=True, order="C").reshape(-1), None
        spec = template.spec(key, label, work, priority, self._members, source)
        spec.lend, spec.lend_slow, spec.agree_slow = self._reduction_lends(
            work, spec.source)  # its own
        if not template.repeat_tried and not priority:
            template.repeat_tried = True
            if 0 < work.nbytes <= self._direct_bytes:  # _launch's direct bound
                template.repeat = self._engine.repeat(
                    spec, functools.partial(self._label, "reducescatter", name))
            elif self._queues and work.nbytes <= self._direct_big:
                # At 2 ranks past it too, lending its piece where the loop would (as
                # _big_allreduce's): on an Intel VM whose rings copied slowly, 4 MB
                # reducescatters took 0.58-0.64 ms so against 0.72-0.73 on the loop, 8 MB
                # 1.24-1.30 against 1.43-1.57, 16 MB 2.36-2.60 against 2.81-2.90 (old and
                # new tree alternated twice).
                template.repeat = self._engine.repeat(
                    spec, functools.partial(self._label, "reducescatter", name),
                    lends=True)
        lo, hi, shape = plan.lo, plan.hi, plan.shape
        return self._launch(spec, lambda: work[lo:hi].reshape(shape))

    def reducescatter_now(self, x: Any, op: Any, name: str | None, priority: int
                          ) -> np.ndarray | None:
        """A blocking reducescatter like one made before, small enough to run on this
        thread from its template's Repeat: its result, as :meth:`allreduce_now`.  None,
        with nothing done, where it is not one: call :meth:`reducescatter` and wait."""
        key = scatter_key(x, op, name)
        if key is None or priority:
            return None
        # As reducescatter's key for a caller that waits: it reads a contiguous input.
        contiguous = key[-1]
        with self._lock:
            plan = self._scatters.get((*key, contiguous))
        if plan is None or plan.template.repeat is None:
            return None
        arr: np.ndarray = x
        if contiguous and plan.template.fresh:  # as _scatter_again
            work, source = np.empty(arr.size, arr.dtype), arr.reshape(-1)
        else:
            work, source = np.array(arr, copy=True, order="C").reshape(-1), None
        self._repeat(plan.template.repeat, work, name, source)
        return work[plan.lo:plan.hi].reshape(plan.shape)

    # --- join -----------------------------------------------------------------------

    def join(self) -> int:
        """Serve the peers' allreduces (joining.py) until every rank has joined; return
        the rank that joined last (by the wall clock of its join() call)."""
        if self._members is not None:
            raise NotImplementedError("join() runs over the whole job, not a process set")
        ident = self._ident("join", _JOIN)
        n, rank = self.size, self.rank
        now = time.time_ns()
        times = np.full(n, now, np.int64)  # what each peer gets from us
        got = np.zeros(n, np.int64)
        got[rank] = now

        def serve(header: Header) -> OpSpec | None:
            spec = served_spec(header, self._algorithms)
            if spec is not None:
                self.count_served(header.name_key, header.seq)
            return spec

        # The join op is stamped with the next round, so that no rank, joined or not,
        # ever serves it in place of its own join() call.
        unit = tuple(range(n + 1))
        spec = self._spec(ident, {"kind": "join"}, got.dtype, 0,
                          self._algorithms.alltoall(unit, unit)[0], got, -(1 << 30),
                          source=times, epoch=self._join_rounds + 1)
        self._engine.begin_join(serve)
        try:
            with self._engine.caller_waits():
                FutureHandle([self._engine.submit(spec)], lambda: None, ident.label).wait()
        finally:
            self._join_rounds += 1
            self._engine.end_join()
        return int(np.argmax(got))

    # --- barrier --------------------------------------------------------------------

    def barrier(self) -> Handle:
        return self._launch(self._barrier_spec(), nothing)

    def _barrier_spec(self) -> OpSpec:
        ident = self._ident("barrier", None)
        work = np.zeros(1, np.uint8)
        plan = self._barrier
        if plan is not None:  # every barrier is the same op but for its identity
            return plan.spec(ident.key, ident.label, work, 1 << 30, self._members)
        view = {"kind": "barrier", "dtype": "uint8", "shape": [1], "op": "Sum"}
        spec = self._reduce_spec(ident, view, work.dtype, work, ReduceOp.SUM, 1 << 30)
        self._barrier = OpTemplate(spec)
        return spec
