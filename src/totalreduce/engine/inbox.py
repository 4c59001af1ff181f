"""The inbox: where each arriving body goes, and what applying it unlocks.

Every body is routed by its self-guided header alone: straight into the destination array
when the op is running here (a COPY piece) or into a pooled buffer to be reduced (a
REDUCE piece); into a *floating* buffer when the op has not been submitted here yet,
applied when it is; into a discard buffer when the op is over.  Applying a piece, by
copy or reduction (inline, or on the reduce thread for big pieces), may unlock sends,
which go to the outbox.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..config import Config
from ..exceptions import TotalReduceError
from ..transport.wire import FLAG_CREDITED, FLAG_READY, HEADER_SIZE, Header, Kind
from .ledger import CreditLedger, charged
from .opstate import FloatingBody, LiveOp, Route
from .payload import OpKey
from .reducer import ReduceThread, ScratchPool, reduce_into
from .schedule import COPY, Recv

if TYPE_CHECKING:
    from .engine import Engine

PieceKey = tuple[int, int, int]  # (peer, step, piece)
_CONTROL_MAX = 64 << 10  # control bodies are small JSON or text: bigger is not ours to keep


class Inbox:
    def __init__(self, engine: Engine, config: Config, ledger: CreditLedger,
                 reducer: ReduceThread | None) -> None:
        self._engine = engine
        self._ops = engine.ops
        self._ledger = ledger
        self._reducer = reducer
        self._reduce_min = config.reduce_thread_bytes
        self._routes: dict[int, Route] = {}
        self.floating: dict[OpKey, list[FloatingBody]] = {}  # bodies before their op
        self.floating_bytes = 0
        self.floating_peak = 0
        self.scratch = ScratchPool(config.scratch_bytes)
        self._discard = bytearray(1 << 16)

    # --- the transport's side (MessageHandler) -------------------------------------------

    def body_buffer(self, peer: int, header: Header) -> memoryview:
        n = header.nbytes
        if header.kind != Kind.DATA:
            if n > _CONTROL_MAX:
                self._routes[peer] = Route("discard")
                return self._discard_view(n)
            control = bytearray(n)
            self._routes[peer] = Route("control", buf=control)
            return memoryview(control)
        charge = charged(header)
        key = header.op_key
        engine = self._engine
        op = self._ops.active.get(key)
        if op is not None:
            recv = engine.mismatches.check(op, peer, header)
            if recv is None:
                self._routes[peer] = Route("discard", charge=charge)
                return self._discard_view(n)
            if recv.mode == COPY:
                self._routes[peer] = Route("direct", op, recv, charge=charge)
                return op.region(recv.lo, recv.hi)
            buf = self.scratch.get(n)
            self._routes[peer] = Route("reduce", op, recv, buf, charge)
            return buf
        if key in self._ops.done or engine.broken is not None:
            self._routes[peer] = Route("discard", charge=charge)
            return self._discard_view(n)
        if engine.serving.serves(header):
            engine.serving.serve(header)
            return self.body_buffer(peer, header)  # now active, or refused (done)
        buf = self.scratch.get(n)  # pooled: a fresh 1 MiB bytearray costs page faults
        self._routes[peer] = Route("float", buf=buf, charge=charge)
        self.floating_bytes += charge
        self.floating_peak = max(self.floating_peak, self.floating_bytes)
        return buf

    def received(self, peer: int, header: Header, body: memoryview) -> None:
        self._header_news(peer, header)
        route = self._routes.pop(peer)
        what = route.what
        if what in ("direct", "reduce"):
            self._settle(peer, route.charge)
            op = route.op
            assert op is not None and route.recv is not None
            rkey = (peer, header.step, header.piece)
            if op.finished:  # failed while the body was arriving
                if what == "reduce":
                    self.scratch.put(route.buf)
            elif what == "direct":
                self._applied(op, rkey, route.recv)
            else:
                self._reduce(op, rkey, route.recv, route.buf, True)
        elif what == "float":
            item = FloatingBody(peer, header, route.buf, route.charge)
            key = header.op_key
            op = self._ops.active.get(key)
            if op is None and key not in self._ops.done:
                self.floating.setdefault(key, []).append(item)
                return
            # The op was submitted (or even failed) while this body was still arriving.
            self._unfloat(item)
            if op is not None and not op.finished:
                self.deliver(op, item.src, item.header, item.buf, True)
        elif what == "discard":
            self._settle(peer, route.charge)
        else:
            self._engine.peers.control(peer, header, bytes(route.buf))

    def received_view(self, peer: int, header: Header, body: memoryview) -> None:
        if header.kind == Kind.DATA and self._reducer is None:
            op = self._ops.active.get((header.name_key, header.seq))
            if op is not None:
                # The usual case, without a Route: a piece of an op we run, used straight
                # out of the sender's slot (one pass over the bytes, no copy).
                self._header_news(peer, header)
                if header.flags & FLAG_CREDITED:
                    self._settle(peer, max(header.nbytes, HEADER_SIZE))
                self.deliver(op, peer, header, body, False)
                return
        dest = self.body_buffer(peer, header)  # floating, or for the reduce thread: a copy
        if body.nbytes:
            dest[:] = body
        self.received(peer, header, dest)

    def can_defer(self, peer: int, header: Header) -> bool:
        # Only with no op in flight here: then nothing behind this message (another op's
        # data, credit, READY) can be what this rank waits for, and the next submit
        # resumes reading.
        engine = self._engine
        return not self._ops.active and not engine.closing and engine.broken is None \
            and header.op_key not in self._ops.done

    def lost(self, peer: int) -> None:
        """The link to ``peer`` ended: a body it was sending will never finish."""
        self._routes.pop(peer, None)

    # --- floating bodies ---------------------------------------------------------------

    def take_floating(self, key: OpKey) -> list[FloatingBody]:
        """The bodies of op ``key`` that came before it was submitted here, no longer
        counted as floating (their credit now owed back)."""
        items = self.floating.pop(key, [])
        for item in items:
            self._unfloat(item)
        return items

    def drop_floating(self, key: OpKey | None = None) -> None:
        """Throw away the floating bodies of op ``key`` (None: of every op)."""
        keys = list(self.floating) if key is None else [key]
        for k in keys:
            for item in self.take_floating(k):
                self.scratch.put(item.buf)

    def clear_floating(self) -> None:
        """The job is broken: every floating body goes, and no credit is owed for it."""
        for items in self.floating.values():
            for item in items:
                self.floating_bytes -= item.charge
        self.floating.clear()

    def waiting(self) -> list[tuple[int, Header]]:
        """The first floating message of each op not submitted here: (sender, header)."""
        return [(items[0].src, items[0].header) for items in self.floating.values() if items]

    def _unfloat(self, item: FloatingBody) -> None:
        self.floating_bytes -= item.charge
        self._settle(item.src, item.charge)

    # --- applying a piece --------------------------------------------------------------

    def deliver(self, op: LiveOp, peer: int, header: Header, body: memoryview,
                pooled: bool) -> None:
        """Apply one arrived piece of ``op`` by copy or reduction.  ``pooled``: ``body``
        is a scratch buffer this call now owns; else it is only valid during the call."""
        recv = self._engine.mismatches.check(op, peer, header)
        if recv is None:  # dropped: a mismatch is under way
            if pooled:
                self.scratch.put(body)
            return
        rkey = (peer, header.step, header.piece)
        if recv.mode == COPY:
            if body.nbytes:
                op.region(recv.lo, recv.hi)[:] = body
            if pooled:
                self.scratch.put(body)
            self._applied(op, rkey, recv)
        else:
            self._reduce(op, rkey, recv, body, pooled)

    def _reduce(self, op: LiveOp, rkey: PieceKey, recv: Recv, buf: memoryview,
                pooled: bool) -> None:
        op.got.add(rkey)
        if recv.after and not op.left.issuperset(recv.after):
            # This body would overwrite bytes that a send of ours has yet to read.
            if not pooled:
                copy = self.scratch.get(buf.nbytes)  # a ring slot is only ours during
                copy[:] = buf                         # this call
                buf, pooled = copy, True
            op.held.append((rkey, recv, buf, pooled))
            return
        spec = op.spec
        assert spec.ufunc is not None
        dest = spec.work[recv.lo:recv.hi]
        token = (op, rkey, recv, buf if pooled else None)
        if self._reducer is not None and dest.nbytes >= self._reduce_min:
            self._reducer.submit(spec.ufunc, dest, buf, token)
            return
        reduce_into(spec.ufunc, dest, buf)
        self.reduced(token, None)

    def reduced(self, token: Any, error: BaseException | None) -> None:
        """A reduction finished (inline, or on the reduce thread)."""
        op, rkey, recv, pooled = token
        if pooled is not None:
            self.scratch.put(pooled)
        if op.finished:
            return
        if error is not None:
            self._engine.fail(op, TotalReduceError(
                f"rank {self._engine.rank}: reduction failed in {op.spec.label}: {error!r}"))
            return
        self._after_recv(op, rkey, recv)

    def release_held(self, op: LiveOp) -> None:
        """A send of ``op`` left: the pieces that waited for it may be reduced now."""
        held, op.held = op.held, []
        for item in held:
            self._reduce(op, *item)

    def _applied(self, op: LiveOp, rkey: PieceKey, recv: Recv) -> None:
        op.got.add(rkey)
        self._after_recv(op, rkey, recv)

    def _after_recv(self, op: LiveOp, rkey: PieceKey, recv: Recv) -> None:
        if not op.t_first:
            op.t_first = time.monotonic()
        spec = op.spec
        if recv.final and spec.finalize is not None and recv.hi > recv.lo:
            spec.finalize(spec.work[recv.lo:recv.hi])
        op.recvs_left -= 1
        op.pending_from[rkey[0]] -= 1
        outbox = self._engine.outbox
        for send in recv.then:
            outbox.queue(op, send)
        self._ops.complete(op)

    # --- helpers -----------------------------------------------------------------------

    def _header_news(self, peer: int, header: Header) -> None:
        """What any header may carry besides its body: credit, and the sender's READY."""
        if header.credit:
            self._ledger.grant(peer, header.credit)
            self._engine.outbox.unpark(peer)
        if header.flags & FLAG_READY:
            self._engine.peers.ready(peer, header)

    def _settle(self, peer: int, charge: int) -> None:
        if charge and self._ledger.owe(peer, charge):
            self._engine.transport.want_send(peer)

    def _discard_view(self, n: int) -> memoryview:
        if len(self._discard) < n:
            self._discard = bytearray(n)
        return memoryview(self._discard)[:n]
