"""The engine's bookkeeping records: a live op, a queued message, where an arriving body
goes, and a body that came before its op."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..transport.wire import Header
from .mismatch import MismatchRecord
from .payload import OpFuture, OpSpec
from .schedule import Recv, Send


class LiveOp:
    """Live state of one submitted op, and the one place its state machine can be read.

    An op is *started* (starter.py builds it, with the READYs and floating pieces that came
    before it), then *runs* while two sides advance independently, and *ends* once, by
    completing or failing.  Each field is written by the one part that owns its phase
    (test_engine_parts.py checks this):

    ==========================  ==============  ==========================================
    field                       written by      meaning
    ==========================  ==============  ==========================================
    ready_peers, t_floated      starter (init)  who said READY early; when pieces floated
    local_due                   starter,        its own regions are still to be copied from
                                applier         its source, after its last receive
    ready_peers, announce,      outbox          who said READY; whose READY rides on our
    sends_left, left                            first DATA; sends still due; sends gone
    got, held, done_recvs,      applier         pieces arrived; reductions waiting for a
    recvs_left, pending_from,                   send to leave or a piece to be applied;
    t_first                                     pieces applied (Schedule.waits only);
                                                pieces due (per peer)
    mismatch                    mismatch        the ranks' views once they disagree
                                tracker
    warned                      stall           a stall warning was logged
    finished, forgotten         optable         ended (completed or failed); its name was
                                                forgotten while it ran
    ==========================  ==============  ==========================================

    It completes when ``recvs_left == sends_left == 0`` (OpTable.complete), and fails at
    most once (OpTable.fail); after either, ``finished`` is set and pieces still arriving
    for it are discarded.
    """

    __slots__ = ("spec", "future", "recvs_left", "sends_left", "got", "pending_from",
                 "ready_peers", "t_start", "warned", "finished", "mismatch", "work_bytes",
                 "source_bytes", "itemsize", "left", "held", "done_recvs", "announce",
                 "t_first", "t_floated", "forgotten", "local_due")

    def __init__(self, spec: OpSpec, future: OpFuture, ready_peers: set[int] | None = None,
                 t_floated: float = 0.0) -> None:
        self.spec = spec
        self.future = future
        self.recvs_left = len(spec.schedule.recvs)
        self.sends_left = spec.schedule.n_sends
        self.got: set[tuple[int, int, int]] = set()
        self.pending_from = spec.schedule.expected_from()
        self.ready_peers: set[int] = ready_peers if ready_peers is not None else set()
        self.announce: set[int] = set()  # peers whose READY rides on our first DATA to them
        self.t_start = time.monotonic()
        self.t_first = 0.0  # when the first piece from a peer was applied (timeline)
        self.t_floated = t_floated  # when the first piece that came before the op arrived
        self.warned = False
        self.finished = False
        self.forgotten = False  # its name was forgotten while it ran (OpTable.forget)
        self.mismatch: MismatchRecord | None = None
        self.itemsize = spec.work.itemsize
        self.work_bytes = bytes_view(spec.work)
        self.source_bytes = bytes_view(spec.source)
        self.left: set[tuple[int, int, int]] = set()  # sends gone: (peer, step, piece)
        self.held: list[tuple[tuple[int, int, int], Recv, Any, bool]] = []
        self.done_recvs: set[tuple[int, int, int]] = set()
        self.local_due = False

    def awaits_from(self, peer: int) -> bool:
        """Whether some message of this op from ``peer`` has not arrived yet.  A piece that
        arrived but is still being reduced (reduce thread) or held back counts as arrived:
        ``pending_from`` drops only once it is applied (rare path: it counts)."""
        if self.pending_from.get(peer, 0) <= 0:
            return False
        expected = sum(1 for key in self.spec.schedule.recvs if key[0] == peer)
        return sum(1 for key in self.got if key[0] == peer) < expected

    def sends_owed_to(self, peer: int) -> bool:
        """Whether some message of this op to ``peer`` has not left yet (rare path: it
        counts the sends gone)."""
        total = self.spec.schedule.sends_to(peer)
        return total > 0 and sum(1 for key in self.left if key[0] == peer) < total

    def region(self, lo: int, hi: int, from_source: bool = False) -> memoryview:
        if from_source:  # OpSpec.source_part
            at = self.spec.source_at
            return self.source_bytes[(lo - at) * self.itemsize:(hi - at) * self.itemsize]
        return self.work_bytes[lo * self.itemsize:hi * self.itemsize]


def bytes_view(arr: np.ndarray | None) -> memoryview:
    # An empty writable view for empty arrays, so zero-byte pieces need no special case.
    if arr is None or arr.size == 0:
        return memoryview(bytearray(0))
    return arr.data.cast("B")


class QueuedMsg:
    __slots__ = ("op", "send")

    def __init__(self, op: LiveOp, send: Send) -> None:
        self.op = op
        self.send = send


class LentSend:
    """A send lent from the caller's thread (express.py): the peer's kernel copies its
    body out of this process, which must leave it as it is until the peer says so
    (``acked``, set by Outbox.sent).  ``op``: the live op it is a send of, once the general
    path has taken the op over before then (the op ends only after it)."""

    __slots__ = ("send", "op", "acked")

    def __init__(self, send: Send) -> None:
        self.send = send
        self.op: LiveOp | None = None
        self.acked = False


class Route:
    """Where the body of the message being received from one peer is going."""

    __slots__ = ("what", "op", "recv", "buf", "charge")

    def __init__(self, what: str, op: LiveOp | None = None, recv: Recv | None = None,
                 buf: Any = None, charge: int = 0) -> None:
        self.what = what
        self.op = op
        self.recv = recv
        self.buf = buf
        self.charge = charge


class FloatingBody:
    __slots__ = ("src", "header", "buf", "charge", "t")

    def __init__(self, src: int, header: Header, buf: memoryview, charge: int) -> None:
        self.src = src
        self.header = header
        self.buf = buf
        self.charge = charge
        self.t = time.monotonic()
