"""A server: holds its share of every key, applies pushes in arrival order, answers
pulls, and holds back each worker's clock until the delay bound allows it to go on.

With recovery on (``--max-restarts``) and two servers or more, each server's share is
replicated on the next server (by index, wrapping round): the primary forwards every
init and push it takes, in the order it takes them, and its replica runs them through
the same code on a store of its own, so both hold the same weights and updater state.
A worker's request is answered only once the replica has acknowledged it, so no
acknowledged push lives on one server alone.  A server that dies is restarted by the
launcher; its replacement takes its share from its successor's copy and the copy it
keeps from its predecessor's share, while every survivor meets the replacement and
sends again what the lost world did not deliver (forwards not acknowledged; the
workers, their requests).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import numpy as np

import totalreduce as tr

from .. import runtime as _runtime
from ..exceptions import PeerFailureError, TotalReduceError
from .keys import Roles
from .messages import (
    ERROR,
    OK,
    PRIMARY,
    REPLICA,
    Codec,
    Op,
    Reply,
    Request,
    as_bytes,
    decode_dtype,
    next_request,
    post_reply,
    post_request,
)
from .store import Held, Share, Store
from .updaters import Updater

log = logging.getLogger(__name__)
_SENDS_AHEAD = 64  # replies in flight before the server waits for the oldest


class RequestError(Exception):
    """A request the server refuses, with nothing changed; the worker raises it."""


Outgoing = tuple[int, Reply, np.ndarray | None]  # (worker, reply, payload)


@dataclass
class Forward:
    """A request forwarded to the replica, and the replies it holds back until the
    replica acknowledges it."""
    request: Request
    payload: np.ndarray | None
    replies: list[Outgoing] = field(default_factory=list)


class Server:
    def __init__(self, roles: Roles, rank: int, updater: Updater,
                 replicated: bool = False) -> None:
        self.roles, self.rank, self.updater = roles, rank, updater
        index = rank - roles.workers
        self.successor = roles.server_rank((index + 1) % roles.servers)
        self.predecessor = roles.server_rank((index - 1) % roles.servers)
        self.replicated = replicated and roles.servers > 1
        self.primary = Store()
        self.replica = Store()  # the predecessor's share, when replicated
        self.done = [0] * roles.workers      # iterations each worker has finished
        self.finished: set[int] = set()
        self.waiters: list[tuple[int, int]] = []  # (worker, iterations it waits for)
        self.finishing: list[int] = []  # workers whose finish waits for the others'
        self.lead = 0  # the most iterations a worker was seen ahead of the slowest
        self.recoveries = 0  # worlds this server rebuilt after losing a rank
        self._sends: deque[tr.Handle] = deque()
        self._forwards: deque[Forward] = deque()  # not yet acknowledged by the replica
        self._gate: list[Outgoing] | None = None  # replies of the request being forwarded
        # A replacement's stores still to come from its peers, and what waits for them.
        self._missing: set[int] = set()
        self._deferred: list[tuple[Request, np.ndarray | None, int]] = []

    # --- the loop ----------------------------------------------------------------------

    def serve(self, replacement: bool = False) -> None:
        """Answer requests until every worker has finished.  A ``replacement`` first
        asks its peers for the stores its predecessor held."""
        if replacement and self.replicated:
            self._ask_for_stores()
        while len(self.finished) < self.roles.workers:
            try:
                request, payload, source = next_request()
                self._take(request, payload, source)
            except PeerFailureError as exc:
                _runtime.current().meet_replacement(exc)
                self._rebuilt()
        while self._sends:
            self._sends.popleft().wait()

    def _take(self, request: Request, payload: np.ndarray | None, source: int) -> None:
        if self.roles.is_server(source):
            self._from_server(request, payload, source)
        elif self._missing:
            self._deferred.append((request, payload, source))
        else:
            self._from_worker(request, payload, source)

    def _rebuilt(self) -> None:
        """The world was rebuilt: whatever was in flight is gone.  Workers send their
        requests again, so no reply is owed any more; the replica gets every forward it
        has not acknowledged again (it skips pushes it holds already)."""
        self.recoveries += 1
        self.waiters.clear()
        self.finishing.clear()
        self._sends.clear()
        for store in (self.primary, self.replica):
            for share in store.keys.values():
                share.waiting.clear()
        for forward in self._forwards:
            forward.replies.clear()
            self._send_forward(forward)
        for which in self._missing:  # a replacement still waiting: ask the new world
            self._ask_for(which)
        log.warning("server rank %d: serving again after a rebuild (%d forwards sent "
                    "again)", self.rank, len(self._forwards))

    def _send(self, handles: list[tr.Handle]) -> None:
        self._sends.extend(handles)
        while self._sends and (len(self._sends) > _SENDS_AHEAD or self._sends[0].done()):
            self._sends.popleft().wait()

    def _reply(self, worker: int, reply: Reply, payload: np.ndarray | None = None) -> None:
        if self._gate is not None:
            self._gate.append((worker, reply, payload))
        else:
            self._send(post_reply(reply, payload, worker))

    def _refuse(self, worker: int, why: str) -> None:
        text = np.frombuffer(f"server rank {self.rank}: {why}".encode(), np.uint8)
        self._reply(worker, Reply(ERROR, 0, text.size), text)

    # --- workers' requests ---------------------------------------------------------------

    def _from_worker(self, request: Request, payload: np.ndarray | None, worker: int
                     ) -> None:
        op = request.op
        if op in (Op.INIT, Op.PUSH, Op.RESUME) and self.replicated:
            # Answered once the replica holds it too.
            forward = Forward(request._replace(origin=worker), payload)
            self._gate = forward.replies
            try:
                self._change(self.primary, request, payload, worker)
            finally:
                self._gate = None
            self._forwards.append(forward)
            self._send_forward(forward)
            return
        try:
            if op in (Op.INIT, Op.PUSH, Op.RESUME):
                self._change(self.primary, request, payload, worker)
            elif op == Op.PULL:
                share = self._share(self.primary, request, "pull")
                a, b = request.lo - share.lo, request.hi - share.lo
                assert share.weights is not None
                data = as_bytes(share.weights[a:b])
                self._reply(worker, Reply(OK, 0, data.size), data)
            elif op == Op.CLOCK:
                self._clock(request, worker)
            elif op == Op.FINISH:
                self.finished.add(worker)
                self.finishing.append(worker)
                self._release()
            else:
                raise RequestError(f"unknown request {op} from rank {worker}")
        except RequestError as exc:
            self._refuse(worker, str(exc))

    def _change(self, store: Store, request: Request, payload: np.ndarray | None,
                worker: int) -> None:
        """An init, a push or a resume, on the primary store or (forwarded) the
        replica's."""
        try:
            if request.op == Op.INIT:
                self._init(store, request, payload, worker)
            elif request.op == Op.RESUME:
                self._resume(store, worker)
            else:
                self._push(store, request, payload, worker)
        except RequestError as exc:
            if store is self.primary:  # the replica refuses the same, silently
                self._refuse(worker, str(exc))

    def _resume(self, store: Store, worker: int) -> None:
        """A worker's replacement asks where it stopped: the iterations it had finished
        and its last push's number, so that its next push is not taken for a repeat.
        (Forwarded like a push, so the replica forgets the same held pushes.)"""
        last = store.forget_unfinished(worker, self.done[worker])
        self._reply(worker, Reply(OK, self.done[worker], 0, last))

    # --- the other servers ---------------------------------------------------------------

    def _send_forward(self, forward: Forward) -> None:
        self._send(post_request(forward.request, forward.payload, self.successor))

    def _from_server(self, request: Request, payload: np.ndarray | None, server: int
                     ) -> None:
        op = request.op
        if op == Op.RECOVER:
            self._send_store(request.amount, server)
        elif op == Op.SNAPSHOT:
            self._install(request, payload, server)
        elif self._missing:
            self._deferred.append((request, payload, server))
        elif op == Op.ACKED:
            forward = self._forwards.popleft()
            for worker, reply, data in forward.replies:
                self._send(post_reply(reply, data, worker))
        elif op in (Op.INIT, Op.PUSH, Op.RESUME) and request.origin >= 0:
            # A forward of the predecessor's: the same change on our copy, replies
            # dropped (the primary answers), then the acknowledgement.
            self._gate = []
            try:
                self._change(self.replica, request, payload, request.origin)
            finally:
                self._gate = None
            self._send(post_request(Request(Op.ACKED, 0, seq=request.seq), None, server))
        else:
            raise TotalReduceError(f"server rank {self.rank}: unexpected request {request} "
                                   f"from server rank {server}")

    def _ask_for_stores(self) -> None:
        """A replacement's first act: its share is its successor's copy, its copy is its
        predecessor's share.  Workers' requests wait until both are here."""
        self._missing = {PRIMARY, REPLICA}
        self.recoveries += 1
        for which in self._missing:
            self._ask_for(which)

    def _ask_for(self, which: int) -> None:
        """Our own share is the successor's REPLICA; our copy, the predecessor's
        PRIMARY."""
        holder = self.successor if which == REPLICA else self.predecessor
        self._send(post_request(Request(Op.RECOVER, 0, amount=which), None, holder))

    def _send_store(self, which: int, server: int) -> None:
        if self._missing:
            # Both copies of a share were lost (two servers side by side at once).
            empty = Request(Op.SNAPSHOT, 0, amount=which, extra=1)
            self._send(post_request(empty, None, server))
            return
        store = self.primary if which == PRIMARY else self.replica
        raw = np.frombuffer(store.encode(self.done, self.finished), np.uint8)
        self._send(post_request(Request(Op.SNAPSHOT, 0, amount=which, nbytes=raw.size),
                                raw, server))

    def _install(self, request: Request, payload: np.ndarray | None, server: int) -> None:
        if request.extra:
            # Not recoverable (TotalReduceError's default): no restart brings them back.
            raise TotalReduceError(
                f"server rank {self.rank}: server rank {server} was lost at the same time "
                "and the keys both held are gone (a share survives one server's loss at "
                "a time)")
        assert payload is not None
        store, done, finished = Store.decode(bytes(payload))
        # The successor's REPLICA store is our own share; the predecessor's PRIMARY is
        # the copy we keep of theirs.
        which = request.amount
        if which == REPLICA:
            self.primary = store
        else:
            self.replica = store
        self.done = [max(a, b) for a, b in zip(self.done, done, strict=True)]
        self.finished |= finished
        self._missing.discard(which)
        if not self._missing:
            log.warning("server rank %d: took its share from server rank %d and its copy "
                        "from server rank %d", self.rank, self.successor, self.predecessor)
            deferred, self._deferred = self._deferred, []
            for item in deferred:
                self._take(*item)

    # --- keys --------------------------------------------------------------------------

    def _init(self, store: Store, request: Request, payload: np.ndarray | None,
              worker: int) -> None:
        raw = bytes(payload) if payload is not None else b""
        name = raw[:request.amount].decode(errors="replace")
        dtype = decode_dtype(request.dtype)
        share = store.keys.get(request.key)
        if share is None:
            share = Share(name, dtype, request.size, request.lo, request.hi, worker)
            store.keys[request.key] = share
        elif (share.name, share.dtype, share.size, share.lo, share.hi) != \
                (name, dtype, request.size, request.lo, request.hi):
            text = (f"ps.init({name!r}): worker rank {worker} has {dtype} x {request.size} "
                    f"elements, but worker rank {share.first} made key {share.name!r} "
                    f"{share.dtype} x {share.size}")
            if share.weights is None:
                # Nobody may wait for a value that cannot come: the inits that came first
                # fail too, and the next init starts the key afresh.
                del store.keys[request.key]
                for w in share.waiting:
                    self._refuse(w, text)
            raise RequestError(text)
        if len(raw) > request.amount and share.weights is None:
            share.weights = np.frombuffer(raw[request.amount:], dtype).copy()
        if share.weights is None:
            share.waiting.append(worker)
            return
        for w in [*share.waiting, worker]:
            self._reply(w, Reply(OK))
        share.waiting.clear()

    def _share(self, store: Store, request: Request, what: str) -> Share:
        share = store.keys.get(request.key)
        if share is None or share.weights is None:
            raise RequestError(f"ps.{what}: no key with id {request.key} here (every worker "
                               "must ps.init it first)")
        if not share.lo <= request.lo <= request.hi <= share.hi:
            raise RequestError(f"ps.{what}({share.name!r}): elements [{request.lo}, "
                               f"{request.hi}) are not in this server's [{share.lo}, "
                               f"{share.hi})")
        return share

    def _push(self, store: Store, request: Request, payload: np.ndarray | None,
              worker: int) -> None:
        share = self._share(store, request, "push")
        if decode_dtype(request.dtype) != share.dtype:
            raise RequestError(f"ps.push({share.name!r}): rank {worker} pushed "
                               f"{decode_dtype(request.dtype)}, the key holds {share.dtype}")
        if request.seq and share.last.get(worker, 0) >= request.seq:
            self._reply(worker, Reply(OK))  # sent again after a rebuild: taken already
            return
        grad = self._decode(share, request, payload)
        if request.extra:  # the iteration + 1, when held
            # max_delay=0: every worker's iteration t must see the weights after iteration
            # t - 1 and nothing of t, so a push waits until every worker has finished.
            store.held.append(Held(request.key, grad.copy(), request.extra - 1, worker))
        else:
            self._apply(share, grad)
        if request.seq:
            share.last[worker] = request.seq
        self._reply(worker, Reply(OK))

    def _apply(self, share: Share, grad: np.ndarray) -> None:
        assert share.weights is not None
        try:
            self.updater(share.name, share.weights, grad, share.state)
        except Exception as exc:
            log.exception("server rank %d: the updater failed on %r", self.rank, share.name)
            raise RequestError(f"ps.push({share.name!r}): the updater raised "
                               f"{type(exc).__name__}: {exc}") from exc

    def _decode(self, share: Share, request: Request, payload: np.ndarray | None
                ) -> np.ndarray:
        """The pushed gradient over the whole share (zero outside the pushed elements)."""
        n, itemsize = request.hi - request.lo, share.dtype.itemsize
        raw = payload if payload is not None else np.empty(0, np.uint8)
        codec, count = request.codec, request.amount
        sizes = {Codec.RAW: n * itemsize, Codec.FP16: n * 2, Codec.TOPK: count * (8 + itemsize)}
        if raw.size != sizes.get(codec, -1):  # type: ignore[call-overload]
            raise RequestError(f"ps.push({share.name!r}): {raw.size} bytes do not make "
                               f"{n} elements of {share.dtype} in encoding {codec}")
        whole = request.lo == share.lo and request.hi == share.hi
        if codec == Codec.RAW and whole:
            return raw.view(share.dtype)
        if share.scratch is None:
            share.scratch = np.zeros(share.hi - share.lo, share.dtype)
        grad = share.scratch
        grad.fill(0)
        part = grad[request.lo - share.lo:request.hi - share.lo]
        if codec == Codec.TOPK:
            offsets = raw[:count * 8].view(np.int64)
            if count and not (offsets.min() >= 0 and offsets.max() < n):
                raise RequestError(f"ps.push({share.name!r}): top-k offsets outside the "
                                   f"{n} pushed elements")
            part[offsets] = raw[count * 8:].view(share.dtype)
        else:
            part[...] = raw.view(np.float16 if codec == Codec.FP16 else share.dtype)
        return grad

    # --- clocks ------------------------------------------------------------------------

    def _slowest(self) -> int:
        """Iterations every worker still running has finished."""
        live = [d for w, d in enumerate(self.done) if w not in self.finished]
        return min(live) if live else max(self.done)

    def _clock(self, request: Request, worker: int) -> None:
        self.done[worker] = max(self.done[worker], request.amount)
        self.lead = max(self.lead, request.amount - self._slowest())
        if request.extra < 0:
            self._reply(worker, Reply(OK, self._slowest()))
            return
        # Iteration t may start once every worker has finished t - max_delay - 1, i.e.
        # has finished t - max_delay iterations; this clock starts t = count.
        self.waiters.append((worker, request.amount - request.extra))
        self._release()

    def _release(self) -> None:
        slowest = self._slowest()
        for store in (self.primary, self.replica):
            self._apply_held(store, slowest)
        still = []
        for worker, needed in self.waiters:
            if needed <= slowest:
                self._reply(worker, Reply(OK, slowest))
            else:
                still.append((worker, needed))
        self.waiters = still
        if len(self.finished) == self.roles.workers:
            # A worker's finish returns once every worker has finished: until then a
            # server that is lost can still be replaced (every rank must meet it).
            for worker in self.finishing:
                self._reply(worker, Reply(OK))
            self.finishing.clear()

    @staticmethod
    def _sum_held(store: Store, slowest: int) -> dict[int, np.ndarray]:
        sums: dict[int, np.ndarray] = {}
        for held in store.held:
            if held.t >= slowest:
                continue
            if held.key in sums:
                np.add(sums[held.key], held.grad, out=sums[held.key])
            else:
                sums[held.key] = held.grad
        store.held = [held for held in store.held if held.t >= slowest]
        return sums

    def _apply_held(self, store: Store, slowest: int) -> None:
        # One step per key on the sum of the iteration's pushes (the built-in updaters
        # scale it to the average), before any clock returns: pulls must see it.
        for key, total in self._sum_held(store, slowest).items():
            share = store.keys.get(key)
            if share is not None:
                try:
                    self._apply(share, total)
                except RequestError:
                    if store is self.primary:
                        raise
