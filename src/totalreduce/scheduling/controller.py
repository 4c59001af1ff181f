"""The coordination cycle of negotiated mode: a background thread that, every
``TOTALREDUCE_CYCLE_TIME_MS``, agrees with the other ranks on which tensors every rank has
asked for, then runs them, in the same order everywhere.

One cycle:

1. Take the requests submitted since the last cycle.  Each is a HIT in the response cache
   (same name, same params), INVALID (same name, other params) or a MISS.
2. Allreduce a bit vector with bitwise AND (``Min`` over bools): three status bits, stored
   inverted so that AND also answers "does any rank...?" (SHOULD_SHUT_DOWN,
   UNCACHED_IN_QUEUE, INVALID_IN_QUEUE), then one bit per cache entry this rank has ready.
   A cache bit that survives the AND is ready on every rank: no coordinator needed.
3. Only if some rank has an invalid entry: a second allreduce with bitwise OR (``Max``)
   finds them all, and every rank evicts them (the requests are negotiated afresh).
4. Only if some rank has uncached requests: they are gathered to rank 0 (an alltoall that
   sends to rank 0 only), whose coordinator (coordinator.py) answers with the responses
   whose every rank has asked; the list is broadcast, cached in order, and run.
5. Run the responses: adjacent allreduces fused (fusion.py), each op through the
   self-guided scheduler with the tensor's name, which every rank now submits alike.

So steady-state training costs one small allreduce per cycle and nothing reaches the
coordinator.

Stalls are found in two halves.  Here, a cached tensor that waits past
``stall_check_time`` is marked invalid (step 1), so that it goes to the coordinator
instead of waiting for a cache bit that some rank never sets.  There (coordinator.py,
its ``check()`` runs in step 2 on rank 0), a name that some ranks asked for and others
not gets a warning naming both, and past ``stall_shutdown_time`` an error response that
every rank waiting on it raises.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from ..config import Config
from ..engine.payload import OpFuture
from ..exceptions import MismatchError, OpTimeoutError, ShutdownError, TotalReduceError
from ..threads import start_daemon
from ..timeline import Timeline
from .coordinator import STALLED, Coordinator
from .fusion import FusionBuffers, groups
from .handle import Handle
from .joining import identity
from .ops import ReduceOp
from .requests import Request, Response, decode_requests, decode_responses, encode
from .response_cache import ResponseCache
from .selfguided import SelfGuided

logger = logging.getLogger(__name__)
_priority = operator.attrgetter("priority")

# Status bits.  The first four are set when the condition is absent, so that the AND
# answers "does any rank...?"; the last is set when it holds, so that it answers "do all?".
_SHUT_DOWN, _UNCACHED, _INVALID, _NONE_JOINED, _ALL_JOINED = range(5)
_STATUS = 5
_CONTROL = 1 << 30  # priority of the cycle's own ops: ahead of any data piece
# A response's op this small, alone in its cycle, runs on the cycle's thread (_here).
_HERE_BYTES = 64 << 10
_BITS, _INVALIDS = "\x00ctl.bits", "\x00ctl.invalid"
_JOIN_AT = "\x00ctl.joined"
_GATHER, _ANSWER = "\x00ctl.requests", "\x00ctl.responses"
# Layouts kept, and the bytes of fusion buffers the views of each may pin (a view keeps
# its buffer alive after the buffer pool lets go of it).
_LAYOUTS = 8
_VIEW_BYTES = 1 << 20


class _Layout:
    """A cycle's responses as it ran them: the requests' names, in order, and the runs it
    cut them into, each (first, end, bytes, views: see Controller._run_fused).  Kept for a
    later cycle that readies the same responses (the same list from the cache), so that a
    training step's thousands of tensors are not sorted into runs again each step."""

    __slots__ = ("responses", "names", "runs")

    def __init__(self, responses: list[Response], names: list[str],
                 runs: list[tuple[int, int, int, list[Any]]]) -> None:
        self.responses = responses
        self.names = names
        self.runs = runs


class Controller:
    def __init__(self, ops: SelfGuided, config: Config, timeline: Timeline | None) -> None:
        self._ops = ops
        self.rank, self.size = ops.rank, ops.size
        self._cycle = config.cycle_time_ms / 1000.0
        self._cache = ResponseCache(config.cache_capacity)
        # The cycle's bit vectors, allocated once: numpy lets go of the GIL to allocate
        # 1 KiB or more, and taking it back from a thread busy submitting tensors cost the
        # cycle up to a switch interval (5 ms) every time.
        self._bits = np.zeros(_STATUS + config.cache_capacity, np.bool_)
        self._cache_bits = self._bits[_STATUS:]
        self._mark = np.zeros(config.cache_capacity, np.bool_)
        self._threshold = config.fusion_threshold
        self._buffers = FusionBuffers(config.fusion_threshold)
        self._stall_check = config.stall_check_time
        self._coordinator = Coordinator(self.size, config.stall_check_time,
                                        config.stall_shutdown_time) if self.rank == 0 else None
        self._timeline = timeline
        self._queue: deque[Request] = deque()
        self._pending: dict[str, Request] = {}
        self._negotiating: set[str] = set()
        # Recent cycles' layouts, by id() of their response lists (which they keep).
        self._layouts: dict[int, _Layout] = {}
        self._stop = threading.Event()
        # The cycle thread sleeps on this till its next tick (_sleep); a thread that
        # begins to wait on a request sets _wanted and wakes it.
        self._wake = threading.Event()
        self._asleep = False
        self._wanted = False
        # Every rank evicted entries this cycle: their requests are negotiated afresh in
        # the next, which every rank then begins at once.
        self._again = False
        self._error: TotalReduceError | None = None
        # join(): this rank's pending join request, and the cycle it was made in.
        self._join: Request | None = None
        self._joined_at = -1
        self._others_joined = False  # some rank had joined at the last cycle
        self.counts = {"cycles": 0, "requests_sent": 0, "engine_ops": 0, "fused_ops": 0,
                       "tensors": 0, "cycles_repeated": 0}
        self._thread = start_daemon(self._run, "totalreduce-controller")

    # --- any thread ----------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        if self._error is not None:
            request.resolve(self._error)
            return
        # Waiting on it wakes the cycle thread (_waiting); submitting does not, so that
        # async submissions made before the wait are gathered into one cycle.
        request._waiter = self._waiting
        self._queue.append(request)
        if self._error is not None and request in self._queue:  # lost a race with the end
            request.resolve(self._error)

    def _waiting(self, request: OpFuture, timeout: float | None) -> bool:
        """Wait for ``request`` (its OpFuture waiter), waking the cycle thread if it
        sleeps: see _sleep."""
        self._wanted = True
        if self._asleep:
            self._wake.set()
        return request.wait_event(timeout)

    def stop(self, timeout: float) -> None:
        """Ask every rank to stop coordinating (at the next cycle), and wait for ours."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def stats(self) -> dict[str, int]:
        out = dict(self.counts, cache_entries=len(self._cache), cache_hits=self._cache.hits,
                   cache_misses=self._cache.misses, cache_evictions=self._cache.evictions,
                   pending=len(self._pending) + len(self._queue),
                   fusion_idle_bytes=self._buffers.idle_bytes())
        if self._coordinator is not None:
            out.update(self._coordinator.stats())
        return out

    # --- the cycle thread ----------------------------------------------------------------

    def _run(self) -> None:
        due = time.monotonic()
        while True:
            now = time.monotonic()
            again, self._again = self._again, False
            if now < due and not again:
                self._sleep(due)
                now = time.monotonic()
            # Begun before the tick, the next is a cycle from now; otherwise the ticks keep
            # their cadence.
            due = now + self._cycle if now < due else max(due + self._cycle, now)
            try:
                if self._one_cycle():
                    self._end(ShutdownError("a rank called shutdown(): no more collectives "
                                            "run in negotiated mode"))
                    return
            except TotalReduceError as exc:
                self._end(exc)
                return
            except BaseException as exc:  # a bug: fail loudly rather than hang
                logger.exception("rank %d: coordination cycle crashed", self.rank)
                self._end(TotalReduceError(f"rank {self.rank}: coordination cycle crashed: "
                                           f"{exc!r}"))
                return
            now = time.monotonic()
            if now >= due and not self._pending and not self._queue:
                # This cycle overran its period and nothing waits: the next comes a whole
                # cycle later, not at once.  A cycle that hands the application a result (a
                # barrier's, say) is often followed by a burst of submissions; one started
                # at once would find none, then wait for every rank's burst to end to agree
                # on nothing, and only the cycle after it would run them.
                due = now + self._cycle

    def _sleep(self, due: float) -> None:
        """Sleep till the tick at ``due``, unless a thread waits on a request this rank
        has not taken into a cycle yet: a blocking op would otherwise wait for the tick of
        the last rank to reach it (1.5 cycles at the median).  Async submissions made
        before that wait are taken together into the cycle it begins, so a burst is still
        gathered into one cycle."""
        self._asleep = True
        try:
            while not (self._wanted and self._queue) and not self._stop.is_set():
                left = due - time.monotonic()
                if left <= 0:
                    return
                self._wake.wait(left)
                self._wake.clear()
        finally:
            self._asleep = False

    def _end(self, error: TotalReduceError) -> None:
        self._error = error
        while self._queue:
            self._queue.popleft().resolve(error)
        for request in self._pending.values():
            request.resolve(error)
        self._pending.clear()

    def _one_cycle(self) -> bool:
        """One cycle, the steps of the module's docstring; returns whether the ranks
        agreed to stop."""
        self.counts["cycles"] += 1
        self._wanted = False  # what waiters wait on is taken now, or resolved already
        joining = self._take_requests()
        hit_bits, invalid, uncached = self._classify()
        bits = self._vote(hit_bits, invalid, bool(uncached) or joining)
        if not bits[_INVALID]:
            self._evict_invalid(invalid)
        responses = self._cache.ready(np.flatnonzero(self._cache_bits))
        self._others_joined = not bits[_NONE_JOINED]
        if not bits[_UNCACHED]:
            if joining:
                assert self._join is not None
                uncached.append(self._join)
            responses = responses + self._negotiate(uncached)  # not the cache's list
        self._run_responses(responses)
        if bits[_ALL_JOINED]:
            self._end_join()
        return not bits[_SHUT_DOWN]

    # --- step 1: this rank's requests ----------------------------------------------------

    def _take_requests(self) -> bool:
        """Move the requests submitted since the last cycle to the pending table; returns
        whether a join() came among them."""
        joining = False
        queue, pending = self._queue, self._pending
        for _ in range(len(queue)):  # a submitting thread may append meanwhile
            request = queue.popleft()
            if request.kind == "join":
                self._join, self._joined_at = request, self.counts["cycles"]
                joining = True
                continue
            name = request.name
            if name in pending:
                request.resolve(ValueError(
                    f"rank {self.rank}: a collective named '{name}' is still in "
                    "flight; names must be unique among pending collectives"))
                continue
            pending[name] = request
        return joining

    def _classify(self) -> tuple[list[int], list[int], list[Request]]:
        """The pending requests not with the coordinator already, as cache bits ready
        here, cache bits invalid here, and requests the cache does not know."""
        negotiating = self._negotiating
        candidates = [r for n, r in self._pending.items() if n not in negotiating] \
            if negotiating else self._pending.values()
        hit_bits, hits, invalid, uncached = self._cache.classify(candidates)
        # Pending requests are in submission order: the first hit is the oldest.
        if hits and (self._others_joined or self._stalled(hits[0], time.monotonic())):
            hit_bits = self._screen(hit_bits, hits, invalid, time.monotonic())
        return hit_bits, invalid, uncached

    # --- steps 2 and 3: the bit vectors ---------------------------------------------------

    def _vote(self, hit_bits: list[int], invalid: list[int], uncached: bool) -> np.ndarray:
        """The AND of every rank's status and cache bits (step 2)."""
        bits = self._bits
        bits.fill(False)
        self._cache_bits[hit_bits] = True
        news = False
        if self._coordinator is not None:
            self._coordinator.check()  # the stall inspector's turn
            news = self._coordinator.due()
        joined = self._join is not None
        if joined:
            # A joined rank stands in for every allreduce: its bits say "ready" for all.
            for bit in range(self._cache.capacity):
                response = self._cache.at(bit)
                if response is not None and response.kind == "allreduce":
                    self._cache_bits[bit] = True
        bits[_SHUT_DOWN] = not self._stop.is_set()
        bits[_UNCACHED] = not uncached and not news
        bits[_INVALID] = not invalid
        bits[_NONE_JOINED] = not joined
        bits[_ALL_JOINED] = joined
        self._control(lambda: self._ops.allreduce(bits, ReduceOp.MIN, _BITS, _CONTROL, True))
        return bits

    def _evict_invalid(self, invalid: list[int]) -> None:
        """Some rank has invalid entries: every rank evicts every rank's (step 3), and
        their requests are negotiated afresh."""
        mark = self._mark
        mark.fill(False)
        mark[invalid] = True
        self._control(lambda: self._ops.allreduce(mark, ReduceOp.MAX, _INVALIDS, _CONTROL,
                                                  True))
        for bit in np.flatnonzero(mark).tolist():
            self._cache_bits[bit] = False
            self._cache.evict(bit)
        self._again = True

    def _screen(self, hit_bits: list[int], hits: list[Request], invalid: list[int],
                now: float) -> list[int]:
        """The hits' bits without those that must go to the coordinator after all (added
        to ``invalid``): a tensor waiting past the stall check time (the coordinator can
        name who is missing), and any but an allreduce while a rank has joined (the
        coordinator refuses it)."""
        keep = []
        for bit, request in zip(hit_bits, hits, strict=True):
            if self._stalled(request, now) or \
                    (self._others_joined and request.kind != "allreduce"):
                invalid.append(bit)
            else:
                keep.append(bit)
        return keep

    def _stalled(self, request: Request, now: float) -> bool:
        return bool(self._stall_check) and now - request.t_submit > self._stall_check

    def _end_join(self) -> None:
        """Every rank has joined: each join() returns the rank that joined last (the
        latest cycle; the highest rank among those that joined in it)."""
        at = np.zeros(self.size, np.int64)
        at[self.rank] = self._joined_at
        at = self._control(lambda: self._ops.allreduce(at, ReduceOp.MAX, _JOIN_AT, _CONTROL,
                                                       True))
        last = int(np.flatnonzero(at == at.max())[-1])
        request, self._join = self._join, None
        self._others_joined = False
        self._negotiating.discard(request.name if request is not None else "")
        if self._coordinator is not None:
            self._coordinator.end_join()
        assert request is not None
        request.result = last
        request.resolve(None)

    def _control(self, start: Any) -> Any:
        """Run one of the cycle's own collectives to the end on this thread."""
        with self._ops.caller_waits():
            return start().wait()

    # --- step 4: the coordinator ----------------------------------------------------------

    def _negotiate(self, uncached: list[Request]) -> list[Response]:
        """Gather every rank's uncached requests to rank 0, whose coordinator answers with
        the responses every rank has asked for (and any stall errors); broadcast the
        answer, cache it in order and return it."""
        payload = encode([r.wire() for r in uncached])
        for request in uncached:
            self._negotiating.add(request.name)
        self.counts["requests_sent"] += len(uncached)
        splits = np.zeros(self.size, np.int64)
        splits[0] = payload.size
        got, received = self._control(lambda: self._ops.alltoall(payload, splits, _GATHER,
                                                                 _CONTROL))
        answer = np.zeros(0, np.uint8)
        if self._coordinator is not None:
            offset = 0
            for rank, n in enumerate(received.tolist()):
                self._coordinator.add(rank, decode_requests(got[offset:offset + n]))
                offset += n
            answer = encode([r.wire() for r in self._coordinator.responses()])
        length = np.array([answer.size], np.int64)
        length = self._control(lambda: self._ops.broadcast(length, 0, _ANSWER + ".len",
                                                           _CONTROL, True))
        if self.rank != 0:
            answer = np.zeros(int(length[0]), np.uint8)
        answer = self._control(lambda: self._ops.broadcast(answer, 0, _ANSWER, _CONTROL,
                                                           True))
        responses = decode_responses(answer)
        for response in responses:
            self._negotiating.discard(response.name)
            if not response.error:
                self._cache.put(response)
        return responses

    # --- step 5: running the responses --------------------------------------------------

    def _run_responses(self, responses: list[Response]) -> None:
        pending = self._pending
        tracing = self._timeline is not None and self._timeline.active
        layout = self._layouts.get(id(responses))
        if (layout is not None and layout.responses is responses and self._join is None
                and not tracing and all(map(pending.__contains__, layout.names))):
            # The cache readied what it readied in that cycle (ResponseCache.ready), and
            # each is pending here: the same runs as then.
            self.counts["cycles_repeated"] += 1
            self._run_runs(list(map(pending.pop, layout.names)), layout)
            return
        ready: list[Request] = []
        pop = pending.pop
        timeline = self._timeline
        now = time.monotonic()
        plain = self._join is None
        for response in responses:
            request = pop(response.name, None)
            if request is None:
                plain = False
                if self._join is None or response.error or response.kind != "allreduce":
                    continue  # e.g. a stall error for a tensor this rank never asked for
                request = self._stand_in(response)
            if tracing:
                assert timeline is not None
                request.t_ready = now
                timeline.span(request.name, "NEGOTIATE", request.t_submit, now)
            if response.error:
                plain = False
                request.resolve(self._error_of(response))
                continue
            ready.append(request)  # its params are the response's (checked equal)
        layout = _Layout(responses, [r.name for r in ready], [])
        start = 0
        for run, nbytes in groups(ready, self._threshold):
            layout.runs.append((start, start + len(run), nbytes, [None]))
            start += len(run)
        if plain and responses:  # every response ran as this rank's request
            layouts = self._layouts
            if len(layouts) >= _LAYOUTS:
                del layouts[next(iter(layouts))]
            layouts[id(responses)] = layout
        self._run_runs(ready, layout)

    def _run_runs(self, ready: list[Request], layout: _Layout) -> None:
        """Run ``ready`` (the cycle's requests, in response order) as ``layout`` cuts
        it."""
        runs = layout.runs
        alone = len(runs) == 1
        counts = self.counts
        counts["engine_ops"] += len(runs)
        counts["tensors"] += len(ready)
        pinned = 0  # by this layout's views
        for lo, hi, nbytes, views in runs:
            if hi - lo == 1:
                self._run_one(ready[lo], alone)
            else:
                counts["fused_ops"] += 1
                pinned += nbytes
                self._run_fused(ready[lo:hi], nbytes, alone,
                                views if pinned <= _VIEW_BYTES else None)

    def _stand_in(self, response: Response) -> Request:
        """This rank has joined: its part of a peer's allreduce is the op's identity (zeros
        for Sum and Average, so averages divide by the whole world, as in Horovod)."""
        _kind, dtype, shape, op, _root = response.params
        arr = np.full(shape, identity(ReduceOp(op), np.dtype(dtype)), np.dtype(dtype))
        return Request(response.name, response.params, arr, True, 0)

    def _error_of(self, response: Response) -> TotalReduceError:
        text = f"rank {self.rank}: {response.error}"
        if response.error.startswith(STALLED):
            return OpTimeoutError(response.name, text)
        return MismatchError(response.name, text)

    def _here(self, nbytes: int, alone: bool) -> Any:
        """How to start a response's op: small, the only one of its cycle and nothing in
        flight, on this thread to its end (the engine's small path, as the cycle's own
        ops); else on the engine, this thread going on to the next cycle.  The op is the
        same on every rank either way.  A lone 8-byte allreduce gave its handle to the
        progress thread and took the result back through a callback: 100 us to start it
        and 80 more to finish, against 50 for the whole op here."""
        if alone and nbytes <= _HERE_BYTES and self._ops.idle():
            return self._ops.caller_waits()
        return contextlib.nullcontext()

    def _run_one(self, request: Request, alone: bool) -> None:
        kind, _dtype, _shape, op, root = request.params
        ops, arr, name, prio = self._ops, request.array, request.name, request.priority
        try:
            with self._here(0 if arr is None else arr.nbytes, alone):
                if kind == "allreduce":
                    handle = ops.allreduce(arr, op, name, prio, request.inplace)
                elif kind == "broadcast":
                    handle = ops.broadcast(arr, root, name, prio, request.inplace)
                elif kind == "allgather":
                    handle = ops.allgather(arr, name, prio, request.out,
                                           request.same_shape)
                elif kind == "alltoall":
                    handle = ops.alltoall(arr, request.splits, name, prio, request.out,
                                          request.same_shape)
                elif kind == "reducescatter":
                    handle = ops.reducescatter(arr, op, name, prio)
                else:
                    handle = ops.barrier()
        except BaseException as exc:  # noqa: BLE001 - it belongs to the request's waiter
            request.resolve(exc)
            return
        label = kind.upper()
        started = time.monotonic()
        if self._timeline is not None and self._timeline.active:
            self._timeline.span(name, "QUEUE", request.t_ready, started)

        def done(h: Handle) -> None:
            if self._timeline is not None and self._timeline.active:
                self._timeline.span(name, label, started, time.monotonic())
            error = h.error()
            if error is None:
                try:
                    request.result = h.result_now()
                except Exception as exc:  # noqa: BLE001 - its caller's (a wrong out=)
                    error = exc
            request.resolve(error)

        handle.add_done_callback(done)

    def _run_fused(self, requests: list[Request], nbytes: int, alone: bool,
                   views: list[Any] | None = None) -> None:
        """One allreduce for all of ``requests`` (one dtype and op): their arrays copied
        into a fusion buffer, reduced in place, and copied back out.  The per-tensor work
        is kept to a few numpy calls: a step may fuse thousands of tiny tensors.
        ``views``: the run's slot in a layout a later cycle may repeat, holding (the fusion
        buffer, each request's piece of it) of the last time the run ran: when the buffer
        is the same again, so are the pieces (their shapes are the requests' params)."""
        arrays: list[np.ndarray] = [r.array for r in requests]  # type: ignore[misc]
        dtype = arrays[0].dtype
        t0 = time.monotonic()
        timeline = self._timeline
        if timeline is not None and timeline.active:
            for request in requests:
                timeline.span(request.name, "QUEUE", request.t_ready, t0)
        buf = self._buffers.take(dtype, nbytes // dtype.itemsize)
        base = buf.base
        last = None if views is None else views[0]  # one read: done() may replace it
        pieces = last[1] if last is not None and last[0] is base else None
        np.concatenate(arrays, axis=None, out=buf)  # axis=None: each array flattened
        t1 = time.monotonic()
        if timeline is not None and timeline.active:
            for request in requests:
                timeline.span(request.name, "MEMCPY_IN_FUSION_BUFFER", t0, t1)
        first = requests[0]
        priority = max(map(_priority, requests))
        try:
            with self._here(nbytes, alone):
                handle = self._ops.allreduce(buf, first.params[3],
                                             "\x00fused." + first.name, priority, True)
        except BaseException as exc:  # noqa: BLE001 - it belongs to the requests' waiters
            self._buffers.give(buf)
            Request.resolve_all(requests, exc)
            return

        def done(h: Handle) -> None:
            t2 = time.monotonic()
            error = h.error()
            if error is None:
                got = pieces
                if got is None:
                    got = []
                    start = 0
                    for arr in arrays:
                        end = start + arr.size
                        piece = buf[start:end]
                        got.append(piece if arr.ndim == 1 else piece.reshape(arr.shape))
                        start = end
                    if views is not None:
                        views[0] = (base, got)
                for request, arr, piece in zip(requests, arrays, got, strict=True):
                    # Assignment writes through any strides; only the shape must match.
                    # (An in-place request's result is its array from the start.)
                    if request.inplace:
                        arr[...] = piece
                    else:
                        request.result = piece.copy()
            t3 = time.monotonic()
            self._buffers.give(buf)
            if timeline is not None and timeline.active:
                for request in requests:
                    timeline.span(request.name, "ALLREDUCE", t1, t2)
                    timeline.span(request.name, "MEMCPY_OUT_FUSION_BUFFER", t2, t3)
            Request.resolve_all(requests, error)

        handle.add_done_callback(done)
