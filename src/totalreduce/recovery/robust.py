"""Collectives that survive a killed worker, as Rabit's do: only the dead rank restarts,
and it catches up from its peers' memory.

With ``totalrun --max-restarts K`` every collective of the numpy API goes through
:class:`Robust`.  The model is Rabit's:

* The application checkpoints its state with :func:`totalreduce.checkpoint` (a
  collective; every rank keeps its copy in memory, and the checkpoint's *version* counts
  them) and starts with ``version, state = totalreduce.load_checkpoint()``, looping from
  ``version``.  Every rank makes the same collectives between two checkpoints (named ones
  match by name and call count, unnamed ones by order, as always).
* Each rank keeps the result of every collective since its last checkpoint (the log,
  log.py), and in flight the input of each, so it can run it again.
* When a rank dies, every survivor's collectives fail with a non-orderly
  :class:`PeerFailureError`.  Instead of raising it, each survivor drops its links, waits
  for the launcher to start the replacement, and meets it (``rebuild``: the runtime's new
  links, engine and scheduler, under the launcher's next restart generation).
* Then every rank takes part in recovery *rounds* (plan.py) until all are back in step:
  the replacement's ``load_checkpoint()`` gets the newest checkpoint from a survivor; each
  collective it makes again is answered from a survivor's log, not recomputed; the
  collectives the survivors were waiting in are answered from a rank that finished them,
  or run anew once the replacement reaches them.  The survivors keep their processes,
  memory and place in the program: they just return late from the collective they were
  in.

A rank lost while rounds run (or a replacement dying in its own recovery) starts the
same again under the next generation: every step is idempotent (a result, once there,
stays; a checkpoint is committed once per version).  What cannot be recovered raises on
every rank: no replacement within ``TOTALREDUCE_RECOVERY_TIMEOUT``, a log that outgrew
``TOTALREDUCE_RECOVERY_LOG_BYTES``, or ranks whose calls disagree.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..exceptions import PeerFailureError, TotalReduceError
from ..lru import LRU
from ..scheduling.handle import Handle
from ..scheduling.ops import ReduceOp
from ..scheduling.protocol import NothingAtOnce, Scheduler
from .codec import blanks, copy_state, decode, encode, join, split
from .log import PRELUDE, ResultLog
from .plan import OpId, Plan, Statement, decide, wanted

logger = logging.getLogger(__name__)

_INTERNAL = "__recovery"
_NAMES = 1 << 16  # distinct collective names remembered between two checkpoints


def parse_deaths(spec: str) -> set[tuple[int, int, int, int]]:
    """``TOTALREDUCE_MOCK_DEATH``: ``rank,version,op,attempt`` entries, ';' between."""
    deaths = set()
    for part in spec.replace(" ", "").split(";"):
        if not part:
            continue
        try:
            rank, version, op, attempt = (int(v) for v in part.split(","))
        except ValueError:
            raise ValueError(f"TOTALREDUCE_MOCK_DEATH={spec!r}: each entry is "
                             "rank,version,op,attempt (integers)") from None
        deaths.add((rank, version, op, attempt))
    return deaths


class RobustHandle(Handle):
    """A collective that recovery may answer from another rank's log or run again."""

    __slots__ = ("_robust", "op", "kind", "_submit", "_to_arrays", "_from_arrays",
                 "_restore", "_after", "inner", "_value", "_error", "_resolved", "_label",
                 "_on_done")

    def __init__(self, robust: Robust, op: OpId, kind: str, submit: Callable[[Any], Handle],
                 to_arrays: Callable[[Any], list[np.ndarray]],
                 from_arrays: Callable[[list[np.ndarray]], Any],
                 restore: Callable[[], None] | None,
                 after: Callable[[], None] | None = None) -> None:
        self._robust = robust
        self.op = op
        self.kind = kind
        self._submit = submit            # runs it on a scheduler
        self._to_arrays = to_arrays      # its result as arrays (for the log and the wire)
        self._from_arrays = from_arrays  # the result from arrays (in place, where asked)
        self._restore = restore          # an in-place op's input back before a new run
        self._after = after              # what succeeding means besides the value
        self.inner: Handle | None = None
        self._value: Any = None
        self._error: BaseException | None = None
        self._resolved = False
        self._label = f"{kind} {op[1]!r} (call #{op[2]} since checkpoint {op[0]})"
        self._on_done: list[Callable[[Any], None]] = []

    @property
    def label(self) -> str:
        return self._label

    @property
    def futures(self) -> list[Any]:
        return self.inner.futures if self.inner is not None else []

    def start(self, scheduler: Scheduler) -> None:
        if self._restore is not None and self.inner is not None:
            self._restore()
        self.inner = self._submit(scheduler)

    def done(self) -> bool:
        return self._resolved or (self.inner is not None and self.inner.done()
                                  and self.inner.error() is None)

    def error(self) -> BaseException | None:
        return self._error

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        if self._resolved:
            fn(self)
        else:
            self._on_done.append(fn)

    def wait(self, timeout: float | None = None) -> Any:
        self._robust.settle(self, timeout)
        if self._error is not None:
            raise self._error
        return self._value

    def result_now(self) -> Any:
        return self.wait()

    def resolve(self, arrays: list[np.ndarray] | None, value: Any = None,
                error: BaseException | None = None) -> None:
        """The op's outcome: from its own run (``value``), from another rank's log
        (``arrays``), or an error."""
        if self._resolved:
            return
        if error is None:
            self._value = self._from_arrays(arrays) if arrays is not None else value
            if self._after is not None:
                self._after()
        self._error = error
        self._resolved = True
        for fn in self._on_done:
            fn(self)

    @property
    def resolved(self) -> bool:
        return self._resolved

    def arrays(self) -> list[np.ndarray]:
        return self._to_arrays(self._value)


class Robust(NothingAtOnce):
    """The numpy API's collectives, with recovery (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, rank: int, size: int, attempt: int,
                 log_bytes: int, timeout: float, mock_death: str,
                 rebuild: Callable[[float], Scheduler]) -> None:
        """``rebuild(deadline)``: drop this world, meet the replacement under the next
        generation (before ``deadline``, monotonic time) and return the new scheduler."""
        self._ops = scheduler
        self.rank = rank
        self.size = size
        self._attempt = attempt
        self._timeout = timeout
        self._rebuild = rebuild
        self._deaths = parse_deaths(mock_death)
        self._log = ResultLog(log_bytes)
        self._lock = threading.RLock()
        # Calls of each name since the checkpoint.  Bounded: a name forgotten here would
        # count from 0 again and could be answered with an older call's result, so
        # forgetting one makes this span of the log unusable (as an overflow does).
        self._counts: LRU[str, int] = LRU(_NAMES, lambda _k, _v: self._log.lose())
        self._seq = 0  # collectives since the checkpoint (for fault injection)
        self._pending: dict[OpId, RobustHandle] = {}
        # A replacement starts in recovery: it must catch up before it runs anything.
        self.recovering = attempt > 0
        self._wants_checkpoint = False
        self._prelude = True  # until the program loads its checkpoint
        self._rounds = 0
        self.recoveries = 0  # failures survived by this rank

    # --- scheduler protocol: what the public API calls ----------------------------------

    def caller_waits(self) -> Any:
        return self._ops.caller_waits()

    def stats(self) -> dict[str, int]:
        return dict(self._ops.stats(), recovery_log_bytes=self._log.bytes,
                    recovery_log_entries=len(self._log), recoveries=self.recoveries,
                    checkpoint_version=self._log.version)

    def close(self) -> None:
        self._ops.close()

    def join(self) -> int:
        raise ValueError("join() is not supported with --max-restarts: recovery needs "
                         "every rank to make the same collectives")

    def allreduce(self, x: Any, op: Any, name: str | None, priority: int,
                  inplace: bool) -> Handle:
        return self._call("allreduce", name, lambda s: s.allreduce(
            x, op, name, priority, inplace), x if inplace else None)

    def grouped_allreduce(self, xs: Sequence[Any], op: Any, name: str | None,
                          priority: int, inplace: bool) -> Handle:
        xs = list(xs)
        return self._call("grouped_allreduce", name, lambda s: s.grouped_allreduce(
            xs, op, name, priority, inplace), xs if inplace else None, many=True)

    def broadcast(self, x: Any, root_rank: int, name: str | None, priority: int,
                  inplace: bool) -> Handle:
        return self._call("broadcast", name, lambda s: s.broadcast(
            x, root_rank, name, priority, inplace), x if inplace else None)

    def allgather(self, x: Any, name: str | None, priority: int,
                  out: Any = None, same_shape: bool = False) -> Handle:
        return self._call("allgather", name,
                          lambda s: s.allgather(x, name, priority, out, same_shape), into=out)

    def reducescatter(self, x: Any, op: Any, name: str | None, priority: int) -> Handle:
        return self._call("reducescatter", name,
                          lambda s: s.reducescatter(x, op, name, priority))

    def alltoall(self, x: Any, splits: Any, name: str | None, priority: int,
                 out: Any = None, same_shape: bool = False) -> Handle:
        return self._call("alltoall", name,
                          lambda s: s.alltoall(x, splits, name, priority, out, same_shape),
                          pair=True, into=out)

    def barrier(self) -> Handle:
        return self._call("barrier", None, lambda s: s.barrier(), nothing=True)

    # --- checkpoints --------------------------------------------------------------------

    def version_number(self) -> int:
        return self._log.version

    def checkpoint(self, state: Any) -> None:
        """Every rank keeps a copy of ``state`` as checkpoint ``version + 1``, once every
        rank has got here (a collective)."""
        kept = copy_state(state)
        with self._lock:
            self._prelude = False  # a program that checkpoints has begun its loop
            # Results of earlier collectives must be in the log before it is cleared.
            for handle in list(self._pending.values()):
                self.settle(handle, None)
            handle = self._call("checkpoint", "~checkpoint", lambda s: s.barrier(),
                                nothing=True, state=kept)
        handle.wait()

    def load_checkpoint(self) -> tuple[int, dict[str, Any] | None]:
        """``(version, state)`` of the newest checkpoint: ``(0, None)`` on a fresh start;
        in a restarted worker, what the survivors kept."""
        with self._lock:
            if self._prelude:
                self._prelude = False
                self._counts.clear()
                self._seq = 0
            if self.recovering:
                self._wants_checkpoint = True
                while self._wants_checkpoint:
                    self._recover_step()
            state = self._log.state
            return self._log.version, (None if state is None else copy_state(state))

    # --- submitting and waiting -------------------------------------------------------

    def _call(self, kind: str, name: str | None, submit: Callable[[Any], Handle],
              inplace: Any = None, *, many: bool = False, pair: bool = False,
              nothing: bool = False, state: dict[str, Any] | None = None,
              into: np.ndarray | None = None) -> RobustHandle:
        with self._lock:
            key = name if name is not None else f"~{kind}"
            count = self._counts.get(key) or 0
            self._counts.put(key, count + 1)
            op = (PRELUDE if self._prelude else self._log.version, key, count)
            if (self.rank, op[0], self._seq, self._attempt) in self._deaths:
                logger.warning("rank %d: TOTALREDUCE_MOCK_DEATH: dying before %s",
                               self.rank, op)
                os.kill(os.getpid(), signal.SIGKILL)
            self._seq += 1
            to_arrays, from_arrays, restore = _shapes(inplace, many, pair, nothing, into)
            after = self._committer(op, state) if state is not None else None
            handle = RobustHandle(self, op, kind, submit, to_arrays, from_arrays, restore,
                                  after)
            self._pending[op] = handle
            if not self.recovering:
                handle.start(self._ops)
            return handle

    def _committer(self, op: OpId, state: dict[str, Any]) -> Callable[[], None]:
        def commit() -> None:
            if self._log.last_checkpoint != op:
                self._log.commit(op, state)
                self._counts.clear()
                self._seq = 0
        return commit

    def settle(self, handle: RobustHandle, timeout: float | None) -> None:
        """Resolve ``handle``: by its own run, or through recovery.  The wait for its own
        run holds no lock, so another thread may submit meanwhile (the op may need it)."""
        while True:
            with self._lock:
                if handle.resolved:
                    return
                if self.recovering:
                    self._recover_step()
                    continue
                inner = handle.inner
                assert inner is not None
            try:
                value = inner.wait(timeout)
            except PeerFailureError as exc:
                with self._lock:
                    # Another thread's wait may have met this failure first: recovery
                    # then answered this handle too.
                    if not handle.resolved and handle.inner is inner:
                        if exc.orderly:
                            self._fail(handle, exc)
                        else:
                            self._begin_recovery(exc)
                continue
            except TotalReduceError as exc:
                with self._lock:
                    if not handle.resolved and handle.inner is inner:
                        self._fail(handle, exc)
                continue
            with self._lock:
                if not handle.resolved:
                    self._done(handle, None, value)

    def _done(self, handle: RobustHandle, arrays: list[np.ndarray] | None,
              value: Any = None) -> None:
        handle.resolve(arrays, value)
        self._pending.pop(handle.op, None)
        if handle.kind != "checkpoint":
            self._log.add(handle.op, handle.kind, arrays if arrays is not None
                          else handle.arrays())

    def _fail(self, handle: RobustHandle, error: BaseException) -> None:
        handle.resolve(None, error=error)
        self._pending.pop(handle.op, None)

    # --- recovery -------------------------------------------------------------------------

    def rewire(self, scheduler: Scheduler) -> None:
        """The world was rebuilt by a caller of point-to-point messages (the parameter
        server, which makes no collectives): go on on its new scheduler."""
        with self._lock:
            self._ops = scheduler

    def _begin_recovery(self, cause: PeerFailureError) -> None:
        """A rank was lost: keep what finished, meet the replacement, then go round."""
        for handle in list(self._pending.values()):
            inner = handle.inner
            if inner is not None and inner.done() and inner.error() is None:
                self._done(handle, None, inner.wait())
        self.recovering = True
        self.recoveries += 1
        logger.warning("rank %d: waiting for rank %d's replacement (recovery)", self.rank,
                       cause.rank)
        deadline = time.monotonic() + self._timeout
        try:
            self._ops = self._rebuild(deadline)
        except (OSError, TimeoutError) as exc:
            error = PeerFailureError(cause.rank, f"rank {self.rank}: lost rank {cause.rank} "
                                     f"and no replacement joined within "
                                     f"TOTALREDUCE_RECOVERY_TIMEOUT={self._timeout:g} s "
                                     f"({exc}); {cause}")
            error.recoverable = False
            self._give_up(error)

    def _give_up(self, error: BaseException) -> None:
        for handle in list(self._pending.values()):
            self._fail(handle, error)
        self.recovering = False
        self._wants_checkpoint = False
        raise error

    def _recover_step(self) -> None:
        """One round, or a new world if a rank is lost during it."""
        try:
            self._round()
        except PeerFailureError as exc:
            if exc.orderly or not getattr(exc, "recoverable", True):
                self._give_up(exc)
            self._begin_recovery(exc)

    def _round(self) -> None:
        self._rounds += 1
        log = self._log
        mine = Statement(log.version, self._wants_checkpoint, tuple(sorted(self._pending)))
        with self._ops.caller_waits():
            said = [_read_statement(b) for b in self._gather(_write_statement(mine), "said")]
            ops = wanted(said)
            held = self._gather(bytes(op in log for op in ops), "held")
            plan = decide(said, [{op for op, h in zip(ops, row, strict=True) if h}
                                 for row in held])
            self._carry_out(plan)
        if plan.final:
            self.recovering = False
            logger.warning("rank %d: recovered (checkpoint %d; %d rounds)", self.rank,
                           log.version, self._rounds)
            self._rounds = 0
        elif not plan.progress():
            self._give_up(TotalReduceError(_stuck(self.rank, said, log.overflowed)))

    def _carry_out(self, plan: Plan) -> None:
        log = self._log
        if self._wants_checkpoint and plan.checkpoint_from is None:
            self._wants_checkpoint = False  # nobody has one: a fresh start
        if plan.checkpoint_from is not None:
            mine = {"version": log.version, "state": np.frombuffer(b"", np.uint8)}
            if self.rank == plan.checkpoint_from:
                head, arrays = split(log.state)
                mine["state"] = np.frombuffer(head, np.uint8)
                got = self._send_state(mine, arrays, plan.checkpoint_from, "checkpoint")
            else:
                got = self._send_state(mine, None, plan.checkpoint_from, "checkpoint")
            if self._wants_checkpoint:
                sent, arrays = got
                log.version = int(sent["version"])
                log.state = join(sent["state"].tobytes(), arrays)
                log.last_checkpoint = (log.version - 1, "~checkpoint", 0) \
                    if log.version else None
                self._counts.clear()
                self._seq = 0
                self._wants_checkpoint = False
        for op, src in plan.serve:
            kind, results = "", None
            if self.rank == src:
                kind, results = ("checkpoint", []) if op == log.last_checkpoint \
                    else log.get(op)
            sent, arrays = self._send_state({"kind": kind}, results, src, "result")
            handle = self._pending.get(op)
            if handle is not None:
                self._done(handle, arrays)
        runs = [self._pending[op] for op in plan.run]
        for handle in runs:
            handle.start(self._ops)
        for handle in runs:
            assert handle.inner is not None
            self._done(handle, None, handle.inner.wait())

    # --- the rounds' own messages -------------------------------------------------------

    def _gather(self, payload: bytes, tag: str) -> list[bytes]:
        ops = self._ops
        sizes = ops.allgather(np.array([len(payload)], np.int64), f"{_INTERNAL}.{tag}.n",
                              0).wait()
        data = ops.allgather(np.frombuffer(payload, np.uint8), f"{_INTERNAL}.{tag}", 0).wait()
        out, at = [], 0
        for n in sizes.tolist():
            out.append(data[at:at + n].tobytes())
            at += n
        return out

    def _broadcast(self, payload: bytes, root: int, tag: str) -> bytes:
        ops = self._ops
        n = ops.broadcast(np.array([len(payload)], np.int64), root, f"{_INTERNAL}.{tag}.n",
                          0, False).wait()
        buf = np.frombuffer(payload, np.uint8) if self.rank == root \
            else np.zeros(int(n[0]), np.uint8)
        return bytes(ops.broadcast(buf, root, f"{_INTERNAL}.{tag}", 0, False).wait())

    def _send_state(self, head: dict[str, Any], arrays: list[np.ndarray] | None, root: int,
                    tag: str) -> tuple[dict[str, Any], list[np.ndarray]]:
        """``root``'s ``head`` (scalars and small arrays) and ``arrays`` to every rank:
        the head as one message, then each array as itself, received in place (a big
        checkpoint is never copied into one buffer)."""
        mine = b""
        if self.rank == root:
            assert arrays is not None
            manifest, _ = split({str(i): a for i, a in enumerate(arrays)})
            mine = encode(dict(head, manifest=np.frombuffer(manifest, np.uint8)))
        got = decode(self._broadcast(mine, root, tag))
        assert got is not None
        manifest = got.pop("manifest").tobytes()
        out = arrays if self.rank == root else blanks(manifest)
        assert out is not None
        for i, arr in enumerate(out):
            self._ops.broadcast(arr.reshape(-1), root, f"{_INTERNAL}.{tag}.{i}", 0,
                                True).wait()
        return got, out


def _shapes(inplace: Any, many: bool, pair: bool, nothing: bool,
            into: np.ndarray | None = None
            ) -> tuple[Callable[[Any], list[np.ndarray]],
                       Callable[[list[np.ndarray]], Any], Callable[[], None] | None]:
    """How a kind of result becomes arrays and back, and how an in-place op's input is put
    back before it runs again.  ``into``: the caller's ``out=``, which a result taken from
    the log (not run again) is written to as well."""
    if nothing:
        return (lambda _v: []), (lambda _a: None), None
    if into is not None:
        def into_back(arrays: list[np.ndarray]) -> Any:
            into[...] = arrays[0].reshape(into.shape)
            return (into, arrays[1]) if pair else into

        return (lambda v: [v[0], v[1]] if pair else [v]), into_back, None
    if pair:
        return (lambda v: [v[0], v[1]]), (lambda a: (a[0], a[1])), None
    if many:
        targets = inplace
        backup = [np.array(t, copy=True) for t in targets] if targets is not None else None

        def many_back(arrays: list[np.ndarray]) -> Any:
            if targets is None:
                return arrays
            for t, a in zip(targets, arrays, strict=True):
                t[...] = a.reshape(t.shape)
            return targets

        def many_restore() -> None:
            assert targets is not None and backup is not None
            for t, b in zip(targets, backup, strict=True):
                t[...] = b

        return (lambda v: list(v)), many_back, (many_restore if targets is not None else None)
    if inplace is None:
        return (lambda v: [v]), (lambda a: a[0]), None
    target = inplace
    saved = np.array(target, copy=True)

    def one_back(arrays: list[np.ndarray]) -> Any:
        target[...] = arrays[0].reshape(target.shape)
        return target

    def one_restore() -> None:
        target[...] = saved

    return (lambda v: [v]), one_back, one_restore


def _write_statement(s: Statement) -> bytes:
    return json.dumps({"v": s.version, "c": s.wants_checkpoint,
                       "p": [list(op) for op in s.pending]}).encode()


def _read_statement(raw: bytes) -> Statement:
    obj = json.loads(raw)
    return Statement(int(obj["v"]), bool(obj["c"]),
                     tuple((int(v), str(n), int(k)) for v, n, k in obj["p"]))


def _stuck(rank: int, said: list[Statement], overflowed: bool) -> str:
    lines = [f"rank {rank}: recovery cannot go on: no rank holds a result that another "
             "waits for, and no collective is waited for by every rank"]
    for r, s in enumerate(said):
        what = "the checkpoint" if s.wants_checkpoint else \
            ", ".join(f"{n!r} #{k} since checkpoint {v}" for v, n, k in s.pending) or "nothing"
        lines.append(f"  rank {r} (checkpoint {s.version}) waits for {what}")
    if overflowed:
        lines.append("This rank could not keep every result since the checkpoint (they "
                     "outgrew TOTALREDUCE_RECOVERY_LOG_BYTES, or more than 65536 names "
                     "were used): checkpoint more often, or raise it.")
    else:
        lines.append("Every rank must make the same collectives between checkpoints, and a "
                     "restarted rank must call totalreduce.load_checkpoint() first.")
    return "\n".join(lines)


__all__ = ["ReduceOp", "Robust", "RobustHandle", "parse_deaths"]
