"""A server: holds its share of every key, applies pushes in arrival order, answers
pulls, and holds back each worker's clock until the delay bound allows it to go on."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import totalreduce as tr

from .keys import Roles
from .messages import (
    ERROR,
    OK,
    Codec,
    Op,
    Reply,
    Request,
    as_bytes,
    decode_dtype,
    next_request,
    post_reply,
)
from .updaters import Updater

log = logging.getLogger(__name__)
_SENDS_AHEAD = 64  # replies in flight before the server waits for the oldest


class RequestError(Exception):
    """A request the server refuses, with nothing changed; the worker raises it."""


@dataclass
class Share:
    """This server's elements [lo, hi) of one key."""
    name: str
    dtype: np.dtype
    size: int
    lo: int
    hi: int
    first: int  # the worker whose init made the key here
    weights: np.ndarray | None = None  # until worker 0's init brings the value
    waiting: list[int] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)
    scratch: np.ndarray | None = None


class Server:
    def __init__(self, roles: Roles, rank: int, updater: Updater) -> None:
        self.roles, self.rank, self.updater = roles, rank, updater
        self.keys: dict[int, Share] = {}
        self.done = [0] * roles.workers      # iterations each worker has finished
        self.finished: set[int] = set()
        self.waiters: list[tuple[int, int]] = []  # (worker, iterations it waits for)
        # max_delay=0: pushes of the iteration under way, with it
        self.held: list[tuple[Share, np.ndarray, int]] = []
        self.lead = 0  # the most iterations a worker was seen ahead of the slowest
        self._sends: deque[tr.Handle] = deque()

    def serve(self) -> None:
        """Answer requests until every worker has finished."""
        while len(self.finished) < self.roles.workers:
            request, payload, worker = next_request()
            try:
                self._handle(request, payload, worker)
            except RequestError as exc:
                self._refuse(worker, str(exc))
        for handle in self._sends:
            handle.wait()

    def _reply(self, worker: int, reply: Reply, payload: np.ndarray | None = None) -> None:
        self._sends.extend(post_reply(reply, payload, worker))
        while self._sends and (len(self._sends) > _SENDS_AHEAD or self._sends[0].done()):
            self._sends.popleft().wait()

    def _refuse(self, worker: int, why: str) -> None:
        text = np.frombuffer(f"server rank {self.rank}: {why}".encode(), np.uint8)
        self._reply(worker, Reply(ERROR, 0, text.size), text)

    def _handle(self, request: Request, payload: np.ndarray | None, worker: int) -> None:
        op = request.op
        if op == Op.INIT:
            self._init(request, payload, worker)
        elif op == Op.PUSH:
            self._push(request, payload, worker)
        elif op == Op.PULL:
            share = self._share(request, "pull")
            a, b = request.lo - share.lo, request.hi - share.lo
            assert share.weights is not None
            data = as_bytes(share.weights[a:b])
            self._reply(worker, Reply(OK, 0, data.size), data)
        elif op == Op.CLOCK:
            self._clock(request, worker)
        elif op == Op.FINISH:
            self.finished.add(worker)
            self._reply(worker, Reply(OK))
            self._release()
        else:
            raise RequestError(f"unknown request {op} from rank {worker}")

    # --- keys --------------------------------------------------------------------------

    def _init(self, request: Request, payload: np.ndarray | None, worker: int) -> None:
        raw = bytes(payload) if payload is not None else b""
        name = raw[:request.amount].decode(errors="replace")
        dtype = decode_dtype(request.dtype)
        share = self.keys.get(request.key)
        if share is None:
            share = Share(name, dtype, request.size, request.lo, request.hi, worker)
            self.keys[request.key] = share
        elif (share.name, share.dtype, share.size, share.lo, share.hi) != \
                (name, dtype, request.size, request.lo, request.hi):
            text = (f"ps.init({name!r}): worker rank {worker} has {dtype} x {request.size} "
                    f"elements, but worker rank {share.first} made key {share.name!r} "
                    f"{share.dtype} x {share.size}")
            if share.weights is None:
                # Nobody may wait for a value that cannot come: the inits that came first
                # fail too, and the next init starts the key afresh.
                del self.keys[request.key]
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

    def _share(self, request: Request, what: str) -> Share:
        share = self.keys.get(request.key)
        if share is None or share.weights is None:
            raise RequestError(f"ps.{what}: no key with id {request.key} here (every worker "
                               "must ps.init it first)")
        if not share.lo <= request.lo <= request.hi <= share.hi:
            raise RequestError(f"ps.{what}({share.name!r}): elements [{request.lo}, "
                               f"{request.hi}) are not in this server's [{share.lo}, "
                               f"{share.hi})")
        return share

    def _push(self, request: Request, payload: np.ndarray | None, worker: int) -> None:
        share = self._share(request, "push")
        if decode_dtype(request.dtype) != share.dtype:
            raise RequestError(f"ps.push({share.name!r}): rank {worker} pushed "
                               f"{decode_dtype(request.dtype)}, the key holds {share.dtype}")
        grad = self._decode(share, request, payload)
        if request.extra:  # the iteration + 1, when held
            # max_delay=0: every worker's iteration t must see the weights after iteration
            # t - 1 and nothing of t, so a push waits until every worker has finished.
            self.held.append((share, grad.copy(), request.extra - 1))
        else:
            self._apply(share, grad)
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
        self.done[worker] = request.amount
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
        if self.held:
            # One step per key on the sum of the iteration's pushes (the built-in updaters
            # scale it to the average), before any clock returns: pulls must see it.
            sums: dict[int, tuple[Share, np.ndarray]] = {}
            for share, grad, t in self.held:
                if t >= slowest:
                    continue
                if id(share) in sums:
                    np.add(sums[id(share)][1], grad, out=sums[id(share)][1])
                else:
                    sums[id(share)] = (share, grad)
            self.held = [entry for entry in self.held if entry[2] >= slowest]
            for share, total in sums.values():
                self._apply(share, total)
        still = []
        for worker, needed in self.waiters:
            if needed <= slowest:
                self._reply(worker, Reply(OK, slowest))
            else:
                still.append((worker, needed))
        self.waiters = still
