"""allgather and alltoall, for the self-guided scheduler (a mixin of SelfGuided).

Each runs as two ops, sizes first, then data, both identities taken at call time; with
``same_shape=True`` the sizes are this rank's and the data goes at once as one op.  A
repeated call takes its plan (templates.py) instead of the checks and set-up.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..engine.payload import OpFuture, OpKey, OpSpec
from ..engine.repeat import Repeat
from ..engine.schedule import Schedule
from ..interrupts import deferred as ctrl_c
from ..lru import LRU
from .call_names import UNNAMED, Ident
from .checks import (
    check_alltoall,
    check_apart,
    check_out,
    check_out_rows,
    check_rows,
    check_same_shape_splits,
)
from .handle import DoneHandle, FutureHandle, Handle
from .queued_calls import NO_CALL
from .scheduler_parts import SchedulerParts
from .templates import GatherPlan, OpTemplate, SamePlan, gather_key
from .thresholds import LENT_WHEN_SLOW
from .views import gathering_views, with_algorithm


def _bounds(counts: np.ndarray, scale: int) -> tuple[int, ...]:
    """Where each rank's block begins and ends: ``counts[i]`` rows of ``scale`` elements.
    (Through tolist(): numpy's scalars made this loop, and numpy's sum() of the counts, a
    tenth of a small gather's cost.)"""
    out = [0]
    total = 0
    for c in counts.tolist():
        total += c * scale
        out.append(total)
    return tuple(out)


def _own_in_place(send: tuple[int, ...], recv: tuple[int, ...], rank: int) -> bool:
    """Whether an alltoall's own block lies at the same place in its input and its result
    (always where every rank sends each the same): the op then copies it itself, once its
    messages are out (pairwise_alltoallv's ``own``), instead of before them."""
    return send[rank] == recv[rank] and send[rank + 1] == recv[rank + 1]


def _own_block(own: bool, flat: np.ndarray, buf: np.ndarray, lo: int, hi: int
               ) -> np.ndarray | None:
    """An allgather's input ``flat``, this rank's block ``lo:hi`` of ``buf``: the op's
    source where the op copies the block in itself (``own``: ring_allgatherv), copied
    aside where it overlaps the result, whose peers' blocks land there meanwhile; else
    copied into place now (None: no source)."""
    if own:
        return flat.copy() if np.may_share_memory(flat, buf) else flat
    buf[lo:hi] = flat
    return None


def _result_buffer(out: np.ndarray | None, rows: int, count: int, dtype: np.dtype
                   ) -> np.ndarray:
    """Where a gathering op's data phase writes: the caller's ``out`` when it has the
    result's rows (no fresh pages to fault in and zero: above glibc's mmap threshold a
    new result costs as much as the copies), else a new flat array."""
    if out is not None and out.shape[0] == rows:
        return out.reshape(-1)
    return np.empty(count, dtype)


class GatheringOps(SchedulerParts):
    """SelfGuided's allgather and alltoall; SelfGuided sets what is declared here."""

    _direct_ring: int
    _lent_gathers: int
    _gathers: LRU[tuple[Any, ...], GatherPlan]
    _same: LRU[tuple[Any, ...], SamePlan]

    def _two_phase(self, first: OpFuture, then: Callable[[], OpFuture]) -> OpFuture:
        """A future for ``then()``'s op, started once ``first`` succeeds."""
        outer = OpFuture(self._engine.wait)  # resolved by the loop: waiters drive it

        def start_second(f: OpFuture) -> None:
            if f.error() is not None:
                outer.resolve(f.error())
                return
            try:
                second = then()
            except KeyboardInterrupt as exc:
                # Ctrl-C on the application's thread, which ran this callback because
                # ``first`` was done already: the op cannot go on, and the application
                # must still see its Ctrl-C (at its next call), not an op error.
                outer.resolve(exc)
                ctrl_c.pending = True
                return
            except BaseException as exc:
                outer.resolve(exc)
                return
            second.add_done_callback(lambda s: outer.resolve(s.error()))

        first.add_done_callback(start_second)
        return outer

    def allgather_now(self, x: Any, name: str | None, priority: int,
                      out: np.ndarray | None, same_shape: bool) -> np.ndarray | None:
        """A blocking allgather like one made before, run on this thread from its
        templates' Repeats (engine/repeat.py) where it is small enough: with
        ``same_shape`` its one phase (:meth:`_same_now`), else its sizes and then its
        data (:meth:`_phases_now`).  Its result; None, with nothing done, where it is not
        one: call :meth:`allgather` and wait."""
        if priority:
            return None
        if same_shape:
            return self._same_now("allgather", x, name, out)
        return self._phases_now("allgather", x, None, name, out)

    def alltoall_now(self, x: Any, splits: Any, name: str | None, priority: int,
                     out: np.ndarray | None, same_shape: bool
                     ) -> tuple[np.ndarray, np.ndarray] | None:
        """:meth:`allgather_now` for an alltoall: its result and splits."""
        if priority:
            return None
        if same_shape:
            return None if splits is not None else self._same_now("alltoall", x, name, out)
        return self._phases_now("alltoall", x, splits, name, out)

    def _phases_now(self, kind: str, x: Any, splits: Any, name: str | None,
                    out: np.ndarray | None) -> Any:
        """An allgather or alltoall of two phases like one made before, each phase from
        its template's Repeat where it has one (the data's only up to the size the
        caller's thread runs, as :meth:`_phases` would), else as :meth:`_phases` runs it:
        its result.  None, nothing done, where its plan's sizes phase has no Repeat.  Each
        phase through the general path cost a small call about 25 us more (2 ranks: a
        small allgather took 62 us, its same-shape form, one phase from its Repeat, 16)."""
        plan = self._gather_plan(gather_key(kind, x, name, out, splits))
        if plan is None:
            return None
        rows = np.zeros(self.size, np.int64)
        sizes_repeat = self._sizes_repeat(plan, kind, name, rows)
        if sizes_repeat is None:
            return None
        arr: np.ndarray = x
        rank = self.rank
        source = plan.send_rows  # an alltoall's sizes phase sends each peer its rows
        if source is None:
            rows[rank] = arr.shape[0]
        else:
            check_apart(out, arr, kind, name)
            rows[rank] = source[rank]
        # The calls' keys only: a label is made where a message needs one.
        base = (UNNAMED if name is None else name)
        sizes_key = self._names.next_call(base + self._tag)
        data_key = self._names.next_call(base + "\x00data" + self._tag)
        ran = sizes_repeat.run(rows, sizes_key, source)
        if ran is not True or ctrl_c.pending:
            self._repeat_ended(sizes_repeat, rows, sizes_key, source, ran)
        got = self._allgather_kept(plan, arr, rows, data_key, name, out) if source is None \
            else self._alltoall_kept(plan, arr, rows, data_key, name, out)
        if got is not None:
            return got
        data_ident = Ident(data_key, name, self._label(kind, name, data_key[1]))
        if kind == "allgather":
            second, finish, state = self._allgather_data(plan, arr, rows, data_ident, 0, out)
        else:
            assert source is not None
            second, finish, state = self._alltoall_data(plan, arr, source, rows, data_ident,
                                                        0, out)
        data = second()
        slow_from = self._direct_bytes + 1 if kind == "allgather" else LENT_WHEN_SLOW
        repeat = self._gather_repeat(state["template"], data, kind, name)
        here, slow = True, None
        if repeat is not None and kind == "alltoall":
            here, slow = self._repeat_way(kind, data.work.nbytes)
        if repeat is None or not here:
            with self._caller_waits:
                return self._launch(data, finish, self._data_direct(data), slow_from).wait()
        start = time.perf_counter()
        ran = repeat.run(data.work, data.key, data.source)
        if ran is not True or ctrl_c.pending:
            self._repeat_ended(repeat, data.work, data.key, data.source, ran)
        if slow is not None:
            self._slow_rings.took(slow, False, time.perf_counter() - start)
        return finish()

    def _allgather_kept(self, plan: GatherPlan, arr: np.ndarray, rows: np.ndarray,
                        key: OpKey, name: str | None, out: np.ndarray | None
                        ) -> np.ndarray | None:
        """An allgather's data phase, its sizes phase over (``rows``), from the Repeat of
        the template kept for those rows: its result.  None, nothing done, where there is
        none (the call's data phase goes as :meth:`_allgather_data` makes it).  Without
        the spec, closures and label that path builds for a call of any kind: with them,
        the two phases of an 8-byte allgather at 2 ranks took half again as long as
        their two exchanges."""
        kept = self._kept_repeat(plan, rows)
        if kept is None:
            return None
        template, repeat, _sent, bounds, total = kept
        rank = self.rank
        buf = _result_buffer(out, total, bounds[-1], arr.dtype)
        flat = np.ascontiguousarray(arr).reshape(-1)
        source = _own_block(template.fresh, flat, buf, bounds[rank], bounds[rank + 1])
        ran = repeat.run(buf, key, source)
        if ran is not True or ctrl_c.pending:
            self._repeat_ended(repeat, buf, key, source, ran)
        check_out_rows(out, total, rank, "allgather", name)
        return buf.reshape((total, *arr.shape[1:])) if out is None else out

    def _alltoall_kept(self, plan: GatherPlan, arr: np.ndarray, rows: np.ndarray,
                       key: OpKey, name: str | None, out: np.ndarray | None
                       ) -> tuple[np.ndarray, np.ndarray] | None:
        """:meth:`_allgather_kept` for an alltoall (``rows``: the rows from each rank),
        below LENT_WHEN_SLOW (bigger ones ask the slow-ring choice, as _phases_now
        does)."""
        kept = self._kept_repeat(plan, rows)
        if kept is None:
            return None
        _template, repeat, sent, bounds, total = kept
        if bounds[-1] * arr.itemsize >= LENT_WHEN_SLOW:
            return None
        rank = self.rank
        buf = _result_buffer(out, total, bounds[-1], arr.dtype)
        flat = np.ascontiguousarray(arr).reshape(-1)
        if not _own_in_place(sent, bounds, rank):
            buf[bounds[rank]:bounds[rank + 1]] = flat[sent[rank]:sent[rank + 1]]
        ran = repeat.run(buf, key, flat)
        if ran is not True or ctrl_c.pending:
            self._repeat_ended(repeat, buf, key, flat, ran)
        check_out_rows(out, total, rank, "alltoall", name)
        return (buf.reshape((total, *arr.shape[1:])) if out is None else out, rows.copy())

    def _kept_repeat(self, plan: GatherPlan, rows: np.ndarray
                     ) -> tuple[OpTemplate, Repeat, tuple[int, ...], tuple[int, ...], int] | None:
        """The data phase's template kept in ``plan`` for the ``rows`` its sizes phase
        brought, where it has a Repeat: the template, the Repeat, the send and receive
        bounds, and the result's rows."""
        counts = tuple(rows.tolist())
        with self._lock:
            kept = plan.data(counts)
        if kept is None:
            return None
        template, sent, bounds = kept
        repeat = template.repeat
        if repeat is None:
            return None
        return template, repeat, sent, bounds, sum(counts)

    def _sizes_repeat(self, plan: GatherPlan, kind: str, name: str | None,
                      rows: np.ndarray) -> Repeat | None:
        """The Repeat of ``plan``'s sizes phase, made at its first ask (``rows``: a
        buffer of the phase's shape)."""
        template = plan.sizes
        if not template.repeat_tried:
            template.repeat_tried = True
            spec = template.spec(NO_CALL, "", rows, 0, self._members, plan.send_rows)
            template.repeat = self._engine.repeat(
                spec, functools.partial(self._label, kind, name))
        return template.repeat

    def _gather_repeat(self, template: OpTemplate, spec: OpSpec, kind: str,
                       name: str | None) -> Repeat | None:
        """The Repeat of a gathering op's data ``template`` (``spec``: a call of it), made
        at its first ask, where its calls are ones the caller's thread runs: an
        allgather's whatever the rings' pace, an alltoall's while they copy fast (the
        callers ask _repeat_way); at 2 ranks, one as big as the caller's thread runs
        whose bodies are lent (_data_direct), which its Repeat lends too."""
        if not template.repeat_tried:
            template.repeat_tried = True
            limit = min(self._direct_ring, self._direct_bytes)
            nbytes = spec.work.nbytes
            lends = (nbytes > limit and bool(self._lent_gathers)
                     and self._engine.lends_first(spec))
            if lends:
                limit = self._data_direct(spec)
            if 0 < nbytes <= limit:
                template.repeat = self._engine.repeat(
                    spec, functools.partial(self._label, kind, name), lends)
        return template.repeat

    def _same_now(self, kind: str, x: Any, name: str | None, out: np.ndarray | None
                  ) -> Any:
        """:meth:`_gather_same`'s call from its plan's Repeat, if it has one (else None,
        nothing done)."""
        key = gather_key(kind + "\x00same", x, name, out, None)  # splits: none given
        if key is None:
            return None
        with self._lock:
            plan = self._same.get(key)
        if plan is None or plan.template.repeat is None:
            return None
        arr: np.ndarray = x
        slow = None
        if kind == "alltoall":  # an allgather's Repeat runs whatever the rings' pace
            here, slow = self._repeat_way(kind, arr.nbytes)
            if not here:
                return None
        start = time.perf_counter()
        check_apart(out, arr, kind, name)
        rank, bounds = self.rank, plan.recv
        rows = self.size * int(plan.recv_rows[0])
        buf = _result_buffer(out, rows, bounds[-1], arr.dtype)
        flat = arr.reshape(-1)
        if kind == "allgather":
            self._repeat(plan.template.repeat, buf, name,
                         _own_block(plan.template.fresh, flat, buf, bounds[rank],
                                    bounds[rank + 1]))
        else:
            flat = np.ascontiguousarray(flat)  # its sends read it (the op's source)
            if not plan.template.fresh:
                buf[bounds[rank]:bounds[rank + 1]] = \
                    flat[plan.send[rank]:plan.send[rank + 1]]
            self._repeat(plan.template.repeat, buf, name, flat)
            if slow is not None:
                self._slow_rings.took(slow, False, time.perf_counter() - start)
        check_out_rows(out, rows, rank, kind, name)
        got = buf.reshape((rows, *arr.shape[1:])) if out is None else out
        return got if kind == "allgather" else (got, plan.recv_rows.copy())

    def _gather_plan(self, key: tuple[Any, ...] | None) -> GatherPlan | None:
        if key is None:
            return None
        with self._lock:
            return self._gathers.get(key)

    def _keep_gather_plan(self, key: tuple[Any, ...] | None, plan: GatherPlan) -> None:
        if key is not None:
            with self._lock:
                self._gathers.put(key, plan)

    def allgather(self, x: Any, name: str | None, priority: int,
                  out: np.ndarray | None = None, same_shape: bool = False) -> Handle:
        if same_shape:
            return self._gather_same("allgather", x, None, name, priority, out)
        key = gather_key("allgather", x, name, out)
        plan = self._gather_plan(key)
        arr: np.ndarray = x
        if plan is None:  # the checks: a plan's key stands for them
            arr = check_rows(x, "allgather", name)
            check_out(out, arr, "allgather", name)
        n, rank = self.size, self.rank
        sizes_key, label = self._call("allgather", name)
        data_ident = self._ident("allgather", name, "\x00data")
        sizes = np.zeros(n, np.int64)
        sizes[rank] = arr.shape[0]
        if plan is not None:
            first = plan.sizes.spec(sizes_key, label, sizes, priority, self._members)
        else:
            view, shown = gathering_views("allgather", arr)
            sched, sizes_algorithm, _own = self._algorithms.allgather(tuple(range(n + 1)))
            first = self._spec(
                Ident(sizes_key, name, label),
                with_algorithm(lambda: dict(view(), phase="sizes"), sizes_algorithm),
                sizes.dtype, n, sched, sizes, priority, ("allgather", arr.dtype, arr.shape, 0),
                with_algorithm(shown, sizes_algorithm))
            plan = GatherPlan(OpTemplate(first))
            self._keep_gather_plan(key, plan)
        second, finish, _state = self._allgather_data(plan, arr, sizes, data_ident, priority,
                                                      out)
        # Past DIRECT_BYTES (and up to the ring's bound) only while the rings copy fast.
        return self._phases(first, second, finish, label, self._direct_bytes + 1)

    def _allgather_data(self, plan: GatherPlan, arr: np.ndarray, sizes: np.ndarray,
                        ident: Ident, priority: int, out: np.ndarray | None
                        ) -> tuple[Callable[[], OpSpec], Callable[[], Any], dict[str, Any]]:
        """An allgather's data phase, once its sizes phase has filled ``sizes``: a
        function making its spec (and keeping its template in ``plan``), one making the
        call's result once it is done, and where the first leaves the phase's buffer
        ("out") and template ("template")."""
        rank = self.rank
        row = math.prod(arr.shape[1:])
        state: dict[str, Any] = {}
        name = ident.name

        def second() -> OpSpec:
            rows = tuple(sizes.tolist())
            with self._lock:
                kept = plan.data(rows)
            bounds = _bounds(sizes, row) if kept is None else kept[1]
            buf = _result_buffer(out, sum(rows), bounds[-1], arr.dtype)
            flat = np.ascontiguousarray(arr).reshape(-1)
            if kept is None:
                schedule, algorithm, own = self._algorithms.allgather(bounds, arr.dtype, True)
            else:
                own = kept[0].fresh
            source = _own_block(own, flat, buf, bounds[rank], bounds[rank + 1])
            state["out"] = buf
            if kept is not None:
                state["template"] = kept[0]
                return kept[0].spec(ident.key, ident.label, buf, priority, self._members,
                                    source)
            view, shown = gathering_views("allgather", arr)
            spec = self._spec(ident, with_algorithm(view, algorithm), arr.dtype, bounds[-1],
                              schedule, buf, priority,
                              ("allgather", arr.dtype, arr.shape, 1, algorithm),
                              with_algorithm(shown, algorithm), source=source, fresh=own,
                              source_at=bounds[rank] if own else 0)
            template = state["template"] = OpTemplate(spec)
            with self._lock:
                plan.keep(rows, template, bounds, bounds)
            return spec

        def finish() -> np.ndarray:
            rows = sum(sizes.tolist())
            check_out_rows(out, rows, rank, "allgather", name)
            got: np.ndarray = state["out"]
            return got.reshape((rows, *arr.shape[1:])) if out is None else out

        return second, finish, state

    def _phases(self, first: OpSpec, second: Callable[[], OpSpec],
                finish: Callable[[], Any], label: str, slow_from: int) -> Handle:
        """An op whose second part is built from its first's result (sizes, then data).
        A thread that blocks on it runs the two one after the other (each may take the
        small path, the data up to :meth:`_data_direct`; see _launch for ``slow_from``);
        otherwise the second starts when the first ends."""
        if self._engine.waits_here():
            try:
                self._launch(first, lambda: None).wait()
            except Exception as exc:  # the op's failure: the handle's wait() raises it
                return DoneHandle(None, label, exc)
            data = second()
            return self._launch(data, finish, self._data_direct(data), slow_from)
        future = self._two_phase(self._engine.submit(first),
                                 lambda: self._engine.submit(second()))
        return FutureHandle([future], finish, label)

    def alltoall(self, x: Any, splits: Any, name: str | None, priority: int,
                 out: np.ndarray | None = None, same_shape: bool = False) -> Handle:
        if same_shape:
            return self._gather_same("alltoall", x, splits, name, priority, out)
        key = gather_key("alltoall", x, name, out, splits)
        plan = self._gather_plan(key)
        n, rank = self.size, self.rank
        arr: np.ndarray = x
        if plan is None:
            arr, send_rows = check_alltoall(x, splits, name, n)
            check_out(out, arr, "alltoall", name)
        else:
            assert plan.send_rows is not None  # an alltoall's plan keeps them
            send_rows = plan.send_rows
            check_apart(out, arr, "alltoall", name)
        splits_key, label = self._call("alltoall", name)
        data_ident = self._ident("alltoall", name, "\x00data")
        recv_rows = np.zeros(n, np.int64)
        recv_rows[rank] = send_rows[rank]
        if plan is not None:
            first = plan.sizes.spec(splits_key, label, recv_rows, priority, self._members,
                                    send_rows)
        else:
            view, shown = gathering_views("alltoall", arr)
            unit = tuple(range(n + 1))
            first = self._spec(Ident(splits_key, name, label),
                               lambda: dict(view(), phase="splits"), recv_rows.dtype, 0,
                               self._algorithms.alltoall(unit, unit)[0], recv_rows, priority,
                               ("alltoall", arr.dtype, arr.shape, 0), shown,
                               source=send_rows)
            plan = GatherPlan(OpTemplate(first), send_rows)
            self._keep_gather_plan(key, plan)
        second, finish, _state = self._alltoall_data(plan, arr, send_rows, recv_rows,
                                                     data_ident, priority, out)
        return self._phases(first, second, finish, label, LENT_WHEN_SLOW)

    def _alltoall_data(self, plan: GatherPlan, arr: np.ndarray, send_rows: np.ndarray,
                       recv_rows: np.ndarray, ident: Ident, priority: int,
                       out: np.ndarray | None
                       ) -> tuple[Callable[[], OpSpec], Callable[[], Any], dict[str, Any]]:
        """:meth:`_allgather_data` for an alltoall, whose sizes phase fills
        ``recv_rows``."""
        rank = self.rank
        row = math.prod(arr.shape[1:])
        flat = np.ascontiguousarray(arr).reshape(-1)
        state: dict[str, Any] = {}
        name = ident.name

        def second() -> OpSpec:
            rows = tuple(recv_rows.tolist())
            with self._lock:
                kept = plan.data(rows)
            if kept is None:
                sb, rb = _bounds(send_rows, row), _bounds(recv_rows, row)
            else:
                sb, rb = kept[1], kept[2]
            buf = _result_buffer(out, sum(rows), rb[-1], arr.dtype)
            own = _own_in_place(sb, rb, rank)
            if not own:
                buf[rb[rank]:rb[rank + 1]] = flat[sb[rank]:sb[rank + 1]]
            state["out"] = buf
            if kept is not None:
                state["template"] = kept[0]
                return kept[0].spec(ident.key, ident.label, buf, priority, self._members,
                                    flat)
            view, shown = gathering_views("alltoall", arr)
            schedule, algorithm = self._algorithms.alltoall(sb, rb, arr.dtype, own)
            spec = self._spec(ident, with_algorithm(view, algorithm), arr.dtype, 0, schedule,
                              buf, priority, ("alltoall", arr.dtype, arr.shape, 1, algorithm),
                              with_algorithm(shown, algorithm), source=flat, fresh=own)
            template = state["template"] = OpTemplate(spec)
            with self._lock:
                plan.keep(rows, template, sb, rb)
            return spec

        def finish() -> tuple[np.ndarray, np.ndarray]:
            rows = sum(recv_rows.tolist())
            check_out_rows(out, rows, rank, "alltoall", name)
            got: np.ndarray = state["out"]
            return (got.reshape((rows, *arr.shape[1:])) if out is None else out,
                    recv_rows.copy())

        return second, finish, state

    def _gather_same(self, kind: str, x: Any, splits: Any, name: str | None, priority: int,
                     out: np.ndarray | None) -> Handle:
        """An allgather or alltoall whose ranks all pass the same shape: every rank's
        block has this rank's rows, so the data goes at once, without the sizes phase
        (as MPI_Allgather and MPI_Alltoall, whose counts are the caller's).  It keeps the
        call's first identity and a view of its own, so a rank that runs the two phases
        meanwhile, or passes another shape, fails the op on every rank as a mismatch."""
        key = gather_key(kind + "\x00same", x, name, out, splits)
        plan = None
        if key is not None:
            with self._lock:
                plan = self._same.get(key)
        n, rank = self.size, self.rank
        arr: np.ndarray = x
        if plan is None:
            if kind == "alltoall":
                check_same_shape_splits(splits, name)
                arr, send_rows = check_alltoall(x, None, name, n)
                recv_rows = np.full(n, send_rows[rank], np.int64)
            else:
                arr = check_rows(x, kind, name)
                send_rows = recv_rows = np.full(n, arr.shape[0], np.int64)
            check_out(out, arr, kind, name)
        else:
            check_apart(out, arr, kind, name)
            recv_rows = plan.recv_rows
        ident = self._ident(kind, name)
        flat = np.ascontiguousarray(arr).reshape(-1)
        if plan is None:
            row = math.prod(arr.shape[1:])
            sb, rb = _bounds(send_rows, row), _bounds(recv_rows, row)
        else:
            sb, rb = plan.send, plan.recv
        rows = n * int(recv_rows[0])
        buf = _result_buffer(out, rows, rb[-1], arr.dtype)
        own = False
        schedule: Schedule | None = None
        if kind == "allgather":  # the whole input is this rank's block
            if plan is None:
                schedule, algorithm, own = self._algorithms.allgather(rb, arr.dtype, True)
            else:
                own = plan.template.fresh
            source = _own_block(own, flat, buf, rb[rank], rb[rank + 1])
        else:
            source = flat
            own = _own_in_place(sb, rb, rank)
            if not own:
                buf[rb[rank]:rb[rank + 1]] = flat[sb[rank]:sb[rank + 1]]
        if plan is not None:
            template = plan.template
            spec = template.spec(ident.key, ident.label, buf, priority, self._members,
                                 source)
            if not priority:  # for _same_now's calls
                self._gather_repeat(template, spec, kind, name)
        else:
            def view() -> dict[str, Any]:
                return {"kind": kind, "dtype": str(arr.dtype), "shape": list(arr.shape),
                        "same_shape": True}

            if kind == "allgather":
                assert schedule is not None
                spec = self._spec(ident, with_algorithm(view, algorithm), arr.dtype, rb[-1],
                                  schedule, buf, priority,
                                  (kind, arr.dtype, arr.shape, "same", algorithm),
                                  source=source, fresh=own,
                                  source_at=rb[rank] if own else 0)
            else:
                schedule, algorithm = self._algorithms.alltoall(sb, rb, arr.dtype, own)
                spec = self._spec(ident, with_algorithm(view, algorithm), arr.dtype, 0,
                                  schedule, buf, priority,
                                  (kind, arr.dtype, arr.shape, "same", algorithm),
                                  source=source, fresh=own)
            if key is not None:
                with self._lock:
                    self._same.put(key, SamePlan(OpTemplate(spec), sb, rb, recv_rows))

        def finish() -> Any:
            check_out_rows(out, rows, rank, kind, name)
            got = buf.reshape((rows, *arr.shape[1:])) if out is None else out
            return got if kind == "allgather" else (got, recv_rows.copy())

        direct = self._data_direct(spec)
        if kind == "allgather":  # as the two phases' data (allgather, alltoall)
            return self._launch(spec, finish, direct, self._direct_bytes + 1)
        return self._launch(spec, finish, direct, LENT_WHEN_SLOW)

    def _data_direct(self, spec: OpSpec) -> int:
        """The largest gathering op (``spec``, its data) the caller's thread runs: the
        ring's bound (thresholds.direct_ring_bytes), or where DIRECT_BYTES is auto, at 2
        ranks, up to LENT_GATHER_BYTES where what it sends its peer would be lent."""
        nbytes = spec.work.nbytes
        if (self._direct_ring < nbytes <= self._lent_gathers
                and self._engine.lends_first(spec)):
            return nbytes
        return self._direct_ring
