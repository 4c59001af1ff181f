"""The inbox: where each arriving body goes.

Every body is routed by its self-guided header alone: straight into the destination array
when the op is running here (a COPY piece) or into a pooled buffer to be reduced (a
REDUCE piece); into a *floating* buffer when the op has not been submitted here yet
(floating.py), applied when it is; into a discard buffer when the op is over.  Applying a
piece is the applier's (applier.py); control messages go to peers.py.
"""

from __future__ import annotations

from ..memcopy import copy_bytes
from ..transport.wire import FLAG_CREDITED, FLAG_READY, HEADER_SIZE, Header, Kind
from .applier import Applier
from .floating import Floating
from .job import JobState
from .ledger import CreditLedger, charged
from .mismatch_tracker import MismatchTracker
from .opstate import FloatingBody, Route
from .optable import OpTable
from .outbox import Outbox
from .payload import OpKey
from .peers import PeerEvents
from .reducer import ScratchPool
from .schedule import COPY
from .smallpath import SmallPath
from .starter import Starter

_CONTROL_MAX = 64 << 10  # control bodies are small JSON or text: bigger is not ours to keep
_URGENT_BYTES = 256 << 10  # ops up to this size may overtake big bodies (overtaking())


class Inbox:
    def __init__(self, job: JobState, ops: OpTable, ledger: CreditLedger, outbox: Outbox,
                 mismatches: MismatchTracker, floating: Floating, applier: Applier,
                 starter: Starter, peers: PeerEvents, scratch: ScratchPool,
                 use_in_place: bool) -> None:
        """``use_in_place``: a piece of a running op may be applied straight out of the
        transport's buffer (no reduce thread that would need it after the call)."""
        self._job = job
        self._ops = ops
        self._ledger = ledger
        self._outbox = outbox
        self._mismatches = mismatches
        self._floating = floating
        self._applier = applier
        self._starter = starter
        self._peers = peers
        self._scratch = scratch
        self._use_in_place = use_in_place
        self._routes: dict[int, Route] = {}
        self._discard = bytearray(1 << 16)
        self.small: SmallPath | None = None  # set by the engine (it is built after us)
        # The urgent lane's ops running now (UrgentLane.running, set by the engine): a
        # message of one that comes through a ring means the peer runs it on the loop.
        self.urgent: dict[OpKey, bool] = {}

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
        small = self.small
        running = None if small is None else small.current
        if running is not None and key == (running.key0, running.key1):
            # A body that does not arrive whole in a ring slot (lent, or in chunks) of the
            # op a caller's thread runs: straight into place if it can go there now (its
            # peer lent an exchange's big piece: express.py), else the general path takes
            # the op over and routes it.
            assert small is not None
            recv = small.placeable(running, peer, header)
            if recv is not None:
                self._routes[peer] = Route("small", recv=recv, charge=charge)
                return running.spec.work[recv.lo:recv.hi].data.cast("B")
            small.hand_over()
        op = self._ops.active.get(key)
        if op is not None:
            recv = self._mismatches.check(op, peer, header)
            if recv is None:
                self._routes[peer] = Route("discard", charge=charge)
                return self._discard_view(n)
            if recv.mode == COPY:
                self._routes[peer] = Route("direct", op, recv, charge=charge)
                return op.region(recv.lo, recv.hi)
            buf = self._scratch.get(n)
            self._routes[peer] = Route("reduce", op, recv, buf, charge)
            return buf
        if key in self._ops.done or self._job.broken is not None:
            self._routes[peer] = Route("discard", charge=charge)
            return self._discard_view(n)
        if self._starter.try_serve(header):
            return self.body_buffer(peer, header)  # now active, or refused (done)
        buf = self._scratch.get(n)  # pooled: a fresh 1 MiB bytearray costs page faults
        self._routes[peer] = Route("float", buf=buf, charge=charge)
        self._floating.receiving(charge)
        return buf

    def received(self, peer: int, header: Header, body: memoryview) -> None:
        route = self._routes.pop(peer)
        what = route.what
        if what == "small":
            self._placed(peer, header, route)
            return
        self._header_news(peer, header)
        if what in ("direct", "reduce"):
            self._ledger.owe(peer, route.charge)
            op = route.op
            assert op is not None and route.recv is not None
            rkey = (peer, header.step, header.piece)
            if op.finished:  # failed while the body was arriving
                if what == "reduce":
                    self._scratch.put(route.buf)
            elif what == "direct":
                self._applier.applied(op, rkey, route.recv)
            else:
                self._applier.reduce(op, rkey, route.recv, route.buf, True)
        elif what == "float":
            item = FloatingBody(peer, header, route.buf, route.charge)
            key = header.op_key
            op = self._ops.active.get(key)
            if op is None and self._starter.unqueue(key):  # queued while it arrived
                op = self._ops.active.get(key)
            if op is None and key not in self._ops.done:
                self._floating.keep(item)
                return
            # The op was submitted (or even failed) while this body was still arriving.
            self._floating.release(item)
            if op is not None and not op.finished:
                self._applier.deliver(op, item.src, item.header, item.buf, True)
        elif what == "discard":
            self._ledger.owe(peer, route.charge)
        else:
            self._peers.control(peer, header, bytes(route.buf))

    def received_view(self, peer: int, header: Header, body: memoryview) -> None:
        small = self.small
        if small is not None and small.current is not None and header.kind == Kind.DATA:
            running = small.current
            if header.name_key == running.key0 and header.seq == running.key1:
                if header.credit:
                    self._ledger.grant(peer, header.credit)
                    self._outbox.unpark(peer)
                small.received(running, peer, header, body)
                return
        if header.kind == Kind.DATA and self._use_in_place:
            op = self._ops.active.get((header.name_key, header.seq))
            if op is not None:
                # The usual case, without a Route: a piece of an op we run, used straight
                # out of the sender's slot (one pass over the bytes, no copy).
                self._header_news(peer, header)
                if header.flags & FLAG_CREDITED:
                    self._ledger.owe(peer, max(header.nbytes, HEADER_SIZE))
                self._applier.deliver(op, peer, header, body, False)
                return
        dest = self.body_buffer(peer, header)  # floating, or for the reduce thread: a copy
        if body.nbytes:
            copy_bytes(dest, body)
        self.received(peer, header, dest)

    def _placed(self, peer: int, header: Header, route: Route) -> None:
        """A body body_buffer put straight into place for the op a caller's thread runs."""
        small = self.small
        running = None if small is None else small.current
        recv = route.recv
        assert recv is not None
        if running is not None and header.op_key == (running.key0, running.key1):
            assert small is not None
            if header.credit:
                self._ledger.grant(peer, header.credit)
                self._outbox.unpark(peer)
            small.placed(running, peer, header, recv)
            return
        # The op went on on the general path while its body arrived (a lent body is
        # copied in slices, over several turns): it is in place all the same.
        self._header_news(peer, header)
        self._ledger.owe(peer, route.charge)
        op = self._ops.active.get(header.op_key)
        if op is not None and not op.finished:
            self._applier.applied(op, (peer, header.step, header.piece), recv)

    def can_defer(self, peer: int, header: Header) -> bool:
        # Only with no op in flight here: then nothing behind this message (another op's
        # data, credit, READY) can be what this rank waits for, and the next submit
        # resumes reading.
        return not self._ops.active and self._job.usable() and not self._floating.watched() \
            and (self.small is None or self.small.current is None) \
            and header.op_key not in self._ops.done and not self.urgent

    def lane_claims(self, peer: int, header: Header, behind: bool) -> bool:
        # Not one a thread here runs on the lane now: it takes it.  Else the loop takes an
        # op's it runs, has ended or serves.  One of an op not called here yet is left for
        # the thread that will call it (urgent.py), unless others wait behind it, which
        # another op may need: then it floats (a lane holds few: UrgentLane.chain), as it
        # does while a receive from any source waits (Floating.watch), which learns its
        # op from the bodies that float.  Its thread then finds it floating and hands the
        # op to the loop.
        key = header.op_key
        if key in self.urgent:
            return False
        ops = self._ops
        small = self.small
        return (behind or key in ops.active or key in ops.done or not self._job.usable()
                or (small is not None and small.current is not None
                    and key == (small.current.key0, small.current.key1))
                or self._starter.serves(header) or self._floating.watched())

    def overtaking(self, peer: int, front: Header) -> frozenset[OpKey] | None:
        # Only pieces of a small op running here, of a higher priority than front's (which
        # runs here too): a body for an op not submitted yet floats either way, between ops
        # of one priority the order of arrival stands, and a big op gains little by
        # passing another big one while the looking costs every big body (the
        # optimizer's buckets have priorities of their own: 1-2% of a training step).
        ops = self._ops
        active = ops.active
        slow = active.get((front.name_key, front.seq))
        if slow is None or len(active) < 2:
            return None
        floor = slow.spec.priority
        if all(priority <= floor for priority in ops.priorities):
            return None
        urgent = frozenset(key for key, op in active.items()
                           if op.spec.priority > floor and not op.finished
                           and op.spec.work.nbytes <= _URGENT_BYTES)
        return urgent or None

    def received_ahead(self, peer: int, header: Header, body: memoryview) -> None:
        # The route of a body still arriving from this peer stays for it.
        pending = self._routes.pop(peer, None)
        try:
            self.received_view(peer, header, body)
        finally:
            if pending is not None:
                self._routes[peer] = pending

    def lost(self, peer: int) -> None:
        """The link to ``peer`` ended: a body it was sending will never finish."""
        self._routes.pop(peer, None)

    # --- helpers -----------------------------------------------------------------------

    def _header_news(self, peer: int, header: Header) -> None:
        """What any header may carry besides its body: credit, and the sender's READY."""
        if header.credit:
            self._ledger.grant(peer, header.credit)
            self._outbox.unpark(peer)
        if header.flags & FLAG_READY:
            self._peers.ready(peer, header)
        urgent = self.urgent
        if urgent and header.op_key in urgent:
            urgent[header.op_key] = True  # the caller's thread hands it to us

    def _discard_view(self, n: int) -> memoryview:
        if len(self._discard) < n:
            self._discard = bytearray(n)
        return memoryview(self._discard)[:n]
