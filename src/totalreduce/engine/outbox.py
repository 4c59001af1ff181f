"""The outbox: what each peer gets next, most urgent first.

Per peer there is a control queue (READY, MISMATCH, ABORT, ...: always first) and a heap
of data pieces keyed by op priority, so a small urgent op overtakes a big one between
pieces: that is the preemption.  The transport pulls from here (:meth:`next_outgoing`)
whenever a link can take a message.  A piece for an op the peer has not announced needs
credit (ledger.py); without enough it is *parked* here, a view of this rank's own array
and no copy, until credit or the peer's READY comes.

The sending side of an op's state is this part's: which peers have said READY, which are
told READY on our first DATA, and which sends have left.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import TYPE_CHECKING

from ..transport.base import Outgoing
from ..transport.wire import FLAG_CREDITED, FLAG_READY, Header, Kind, pack_header
from .ledger import CreditLedger
from .opstate import LentSend, LiveOp, QueuedMsg
from .payload import OpKey
from .schedule import Send

if TYPE_CHECKING:
    from ..transport.base import Transport


class Outbox:
    def __init__(self, peers: list[int], ledger: CreditLedger, transport: Transport) -> None:
        self._ledger = ledger
        self._transport = transport
        self._heaps: dict[int, list[tuple[int, int, QueuedMsg]]] = {p: [] for p in peers}
        self._parked: dict[int, dict[OpKey, list[QueuedMsg]]] = {p: {} for p in peers}
        self._control: dict[int, deque[tuple[Header, bytes | None]]] = {
            p: deque() for p in peers}
        self._tiebreak = itertools.count()
        self.closed: set[int] = set()  # peers we can no longer write to
        self.ready_sent = 0  # READY control messages (most ride on DATA instead)
        self.parks = 0  # pieces that waited for credit or a READY

    @property
    def peers(self) -> list[int]:
        return list(self._heaps)

    # --- filling it --------------------------------------------------------------------

    def begin(self, op: LiveOp) -> None:
        """``op`` was submitted here: queue its first sends, and tell each peer it still
        expects data from that it is ready.  A peer we send to right away learns that from
        that DATA message (FLAG_READY): one message fewer per op and peer."""
        schedule = op.spec.schedule
        first_to = schedule.first_peers
        for peer, left in op.pending_from.items():
            if left <= 0:
                continue
            if peer in first_to:
                op.announce.add(peer)
            else:
                self.announce(op, peer)
        for send in schedule.first:
            self.queue(op, send)

    def adopt(self, op: LiveOp, told: set[int], sent: list[Send], unsent: list[Send]) -> None:
        """``op`` began on the small path: ``sent`` left, ``unsent`` are due now, and the
        peers it expects data from but has not ``told`` get a READY, on the first DATA
        that is due to them or on its own."""
        for send in sent:
            op.sends_left -= 1
            op.left.add((send.peer, send.step, send.piece))
        due = {send.peer for send in unsent}
        for peer in op.spec.schedule.sources - told:
            if peer in due:
                op.announce.add(peer)
            else:
                self.announce(op, peer)
        for send in unsent:
            self.queue(op, send)

    def peer_ready(self, op: LiveOp, peer: int) -> None:
        """``peer`` has submitted ``op``: its pieces go to it without credit from now on."""
        op.ready_peers.add(peer)
        self.unpark(peer, op.spec.key)

    def queue(self, op: LiveOp, send: Send) -> None:
        heapq.heappush(self._heaps[send.peer],
                       (-op.spec.priority, next(self._tiebreak), QueuedMsg(op, send)))
        self._transport.want_send(send.peer)

    def control(self, peer: int, header: Header, body: bytes | None = None) -> None:
        self._control[peer].append((header, body))
        self._transport.want_send(peer)

    def reachable(self) -> list[int]:
        """The peers whose links have not closed."""
        return [peer for peer in self._heaps if peer not in self.closed]

    def tell_all(self, header: Header, body: bytes | None = None,
                 skip: set[int] | None = None) -> None:
        """A control message to every peer still reachable (and not in ``skip``)."""
        for peer in self.reachable():
            if skip is None or peer not in skip:
                self.control(peer, header, body)

    def announce(self, op: LiveOp, peer: int) -> None:
        """Tell ``peer`` this rank has submitted ``op`` (a READY)."""
        self.ready_sent += 1
        spec = op.spec
        key = spec.key
        self.control(peer, Header(Kind.READY, spec.dtype, name_key=key[0], seq=key[1],
                                  sig=spec.sig, count=spec.count, recipe=spec.recipe,
                                  epoch=spec.epoch))

    def unpark(self, peer: int, key: OpKey | None = None) -> None:
        """Back into the heap: the pieces of op ``key`` (its READY came), or all of them
        (credit came)."""
        parked = self._parked[peer]
        if not parked:  # asked on every credit that comes, nearly always with none
            return
        if key is not None:
            msgs = parked.pop(key, ())
        else:
            msgs = [m for lst in parked.values() for m in lst]
            parked.clear()
        heap = self._heaps[peer]
        for msg in msgs:
            heapq.heappush(heap, (-msg.op.spec.priority, next(self._tiebreak), msg))
        if msgs:
            self._transport.want_send(peer)

    # --- emptying it -------------------------------------------------------------------

    def next_outgoing(self, peer: int) -> Outgoing | None:
        ledger = self._ledger
        control = self._control[peer]
        if control:
            note, text = control.popleft()
            note = note._replace(credit=ledger.take_owed(peer))
            return Outgoing(note.pack(), memoryview(text) if text else None, None)
        heap = self._heaps[peer]
        while heap:
            _prio, _tie, msg = heapq.heappop(heap)
            op = msg.op
            if op.finished:
                continue
            send = msg.send
            body = op.region(send.lo, send.hi, send.from_source)
            flags = 0
            if peer not in op.ready_peers:
                if not ledger.spend(peer, body.nbytes):
                    self._parked[peer].setdefault(op.spec.key, []).append(msg)
                    self.parks += 1
                    if peer in op.announce:
                        # Our DATA waits for the peer's READY: ours must not wait on it.
                        op.announce.discard(peer)
                        self.announce(op, peer)
                    continue
                flags = FLAG_CREDITED
            if peer in op.announce:
                op.announce.discard(peer)
                flags |= FLAG_READY
            spec = op.spec
            key = spec.key
            header = pack_header(Kind.DATA, spec.dtype, flags, send.step, key[0], key[1],
                                 spec.sig, send.piece, body.nbytes, spec.count,
                                 ledger.take_owed(peer), spec.recipe, spec.epoch)
            return Outgoing(header, body, msg, spec.lend, spec.lend_slow, spec.spread)
        if ledger.due(peer):
            return Outgoing(Header(Kind.CREDIT, credit=ledger.take_owed(peer)).pack(), None,
                            None)
        return None

    def sent(self, token: object) -> LiveOp | None:
        """The transport has sent the message of ``token`` (``Outgoing.token``); returns
        its op if that is still running (a send of it has left)."""
        if type(token) is LentSend:
            token.acked = True
        elif not isinstance(token, QueuedMsg):
            return None
        op = token.op
        if op is None or op.finished:
            return None
        op.sends_left -= 1
        send = token.send
        op.left.add((send.peer, send.step, send.piece))
        return op

    def has_control(self) -> bool:
        """Whether a control message waits for a peer still reachable."""
        return any(self._control[p] for p in self._control if p not in self.closed)

    # --- dropping ----------------------------------------------------------------------

    def drop_op(self, key: OpKey) -> None:
        """The op ended: its parked pieces will never go (queued ones are skipped)."""
        for parked in self._parked.values():
            parked.pop(key, None)

    def drop_data(self, peer: int) -> None:
        """Nothing but control messages go to ``peer`` any more (the job is broken)."""
        self._heaps[peer].clear()
        self._parked[peer].clear()

    def close(self, peer: int) -> None:
        """``peer``'s link is gone: forget everything meant for it."""
        self.closed.add(peer)
        self.drop_data(peer)
        self._control[peer].clear()
