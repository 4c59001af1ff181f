"""Each part of the engine alone, in one process, its collaborators replaced by fakes that
record what they are asked (no transport, no other rank).  The whole engine over the
in-process transport is test_engine_inproc.py's."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import threading
from collections import deque
from typing import Any

import numpy as np
import pytest

import totalreduce
from totalreduce.config import Config
from totalreduce.engine.algorithms import (
    chain_broadcast,
    doubling_allgather,
    doubling_allreduce,
    pairwise_alltoallv,
)
from totalreduce.engine.applier import Applier
from totalreduce.engine.departures import Departures
from totalreduce.engine.driving import Driver
from totalreduce.engine.floating import Floating, Watch
from totalreduce.engine.handler import Handler
from totalreduce.engine.inbox import Inbox
from totalreduce.engine.job import JobState
from totalreduce.engine.ledger import CreditLedger
from totalreduce.engine.loop import Loop
from totalreduce.engine.mismatch_tracker import MismatchTracker, read_view
from totalreduce.engine.opstate import FloatingBody, LiveOp
from totalreduce.engine.optable import OpTable
from totalreduce.engine.outbox import Outbox
from totalreduce.engine.payload import OpFuture, OpSpec, copied_last
from totalreduce.engine.peers import PeerEvents
from totalreduce.engine.reducer import ReduceThread, ScratchPool
from totalreduce.engine.schedule import COPY, Recv, Schedule, Send
from totalreduce.engine.serving import JoinServer
from totalreduce.engine.starter import Starter
from totalreduce.exceptions import (
    MismatchError,
    OpTimeoutError,
    PeerFailureError,
    TotalReduceError,
    TransportClosedError,
)
from totalreduce.transport.wire import (
    FLAG_CREDITED,
    FLAG_READY,
    Header,
    Kind,
    dtype_code,
    unpack_header,
)

# --- fakes and makers ------------------------------------------------------------------


class Fake:
    """Records every method called on it, as (name, args); ``returns`` gives a method's
    return value (a callable is called with the arguments).  Plain attributes may be set
    as keywords."""

    def __init__(self, returns: dict[str, Any] | None = None, **attrs: Any) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self._returns = returns or {}
        for name, value in attrs.items():
            setattr(self, name, value)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def method(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args + tuple(kwargs.values())))
            value = self._returns.get(name)
            return value(*args) if callable(value) else value
        return method

    def __len__(self) -> int:
        return int(self._returns.get("len", 0))

    def __contains__(self, item: object) -> bool:
        return bool(self._returns.get("contains", False))

    def named(self, name: str) -> list[tuple[Any, ...]]:
        return [args for called, args in self.calls if called == name]


def spec_of(schedule: Schedule, work: np.ndarray, key: tuple[int, int] = (11, 0),
            priority: int = 0, **describe: Any) -> OpSpec:
    return OpSpec(key=key, label=f"allreduce 'op{key[0]}' (call #{key[1]})", sig=7,
                  dtype=dtype_code(work.dtype), count=work.size,
                  describe={"kind": "allreduce", "dtype": str(work.dtype),
                            "shape": list(work.shape), "name": f"op{key[0]}", **describe},
                  schedule=schedule, work=work, ufunc=np.add, priority=priority)


def allreduce_op(key: tuple[int, int] = (11, 0), count: int = 4, priority: int = 0,
                 rank: int = 0) -> LiveOp:
    """Rank ``rank``'s part of a 2-rank allreduce by recursive doubling: one send to the
    peer, one REDUCE receive from it that must wait for that send."""
    work = np.arange(count, dtype=np.float32) + 1
    return LiveOp(spec_of(doubling_allreduce(rank, 2, count, 1 << 20), work, key, priority),
                  OpFuture())


def data_header(op: LiveOp, src_step: int = 1, piece: int = 0, flags: int = 0,
                **change: Any) -> Header:
    spec = op.spec
    header = Header(Kind.DATA, spec.dtype, flags, src_step, spec.key[0], spec.key[1],
                    spec.sig, piece, spec.work.nbytes, spec.count)
    return header._replace(**change)


# --- the credit ledger -----------------------------------------------------------------


def test_ledger_spends_returns_and_asks_to_send_once_a_quarter_is_owed() -> None:
    wants: list[int] = []
    ledger = CreditLedger([1, 2], 4096, wants.append)
    assert ledger.spend(1, 1000) and ledger.credit(1) == 3096
    assert not ledger.spend(1, 4000)  # not enough: nothing taken
    assert ledger.credit(1) == 3096
    assert ledger.spend(2, 0) and ledger.credit(2) == 4096 - 64  # a header's worth at least
    ledger.grant(1, 1000)
    assert ledger.credit(1) == 4096
    ledger.owe(2, 500)
    assert wants == [] and not ledger.due(2)
    ledger.owe(2, 600)  # 1100 >= 4096 / 4
    assert wants == [2] and ledger.due(2)
    assert ledger.take_owed(2) == 1100 and ledger.take_owed(2) == 0
    ledger.owe(1, 0)
    assert wants == [2]
    ledger.early_ready((5, 0), 1)
    ledger.early_ready((5, 0), 2)
    assert ledger.pop_early((5, 0)) == {1, 2} and ledger.pop_early((5, 0)) == set()


def test_ledger_terms_and_settle_do_what_their_two_calls_each_do() -> None:
    wants: list[int] = []
    ledger = CreditLedger([1, 2], 4096, wants.append)
    ledger.owe(1, 300)
    assert ledger.terms(1, 1000) == 300  # spent 1000, and the 300 owed go on the message
    assert ledger.credit(1) == 3096 and ledger.take_owed(1) == 0
    assert ledger.terms(1, 4000) == -1  # not enough: nothing taken, nothing collected
    ledger.owe(1, 10)
    assert ledger.terms(1, 4000) == -1 and ledger.credit(1) == 3096
    assert ledger.terms(1, -1) == 10  # a ready peer: no credit spent, the owed collected
    assert ledger.credit(1) == 3096
    assert ledger.terms(2, 0) == 0 and ledger.credit(2) == 4096 - 64  # a header's worth
    ledger.settle(1, 1000, 0, 5000)  # not credited: the body cost the peer nothing
    assert ledger.credit(1) == 4096 and wants == [] and ledger.take_owed(1) == 0
    ledger.settle(2, 0, FLAG_CREDITED, 10)  # a body under a header's size costs a header
    assert ledger.take_owed(2) == 64 and wants == []
    ledger.settle(2, 0, FLAG_CREDITED | FLAG_READY, 1100)  # 1100 owed >= 4096 / 4: ask
    assert wants == [2] and ledger.take_owed(2) == 1100


# --- the outbox ------------------------------------------------------------------------


def _outbox(budget: int = 1 << 20) -> tuple[Outbox, Fake, CreditLedger]:
    transport = Fake()
    ledger = CreditLedger([1], budget, transport.want_send)
    return Outbox([1], ledger, transport), transport, ledger  # type: ignore[arg-type]


def test_outbox_sends_control_first_then_the_most_urgent_piece() -> None:
    outbox, transport, _ledger = _outbox()
    big = allreduce_op((1, 0), count=1000, priority=0)
    urgent = allreduce_op((2, 0), count=4, priority=5)
    for op in (big, urgent):
        op.ready_peers.add(1)
    outbox.queue(big, big.spec.schedule.first[0])
    outbox.queue(urgent, urgent.spec.schedule.first[0])
    outbox.control(1, Header(Kind.GOODBYE))
    assert transport.named("want_send") == [(1,), (1,), (1,)]
    kinds = []
    while (out := outbox.next_outgoing(1)) is not None:
        header = unpack_header(out.header)
        kinds.append((Kind(header.kind).name, header.name_key))
    assert kinds == [("GOODBYE", 0), ("DATA", 2), ("DATA", 1)]


def test_outbox_parks_pieces_without_credit_until_the_peer_is_ready() -> None:
    outbox, _transport, ledger = _outbox(budget=64)
    op = allreduce_op(count=100)  # 400 bytes: more than the peer lets us float
    outbox.begin(op)
    assert op.announce == {1}  # our READY would ride on the first DATA ...
    assert outbox.next_outgoing(1) is None  # ... which must wait: parked
    assert op.announce == set() and outbox.parks == 1
    out = outbox.next_outgoing(1)  # so the READY goes alone
    assert out is not None and Kind(unpack_header(out.header).kind) == Kind.READY
    assert outbox.next_outgoing(1) is None
    outbox.peer_ready(op, 1)
    out = outbox.next_outgoing(1)
    assert out is not None
    header = unpack_header(out.header)
    assert header.kind == Kind.DATA and not header.flags & FLAG_CREDITED
    assert outbox.sent(out.token) is op and op.sends_left == 0 and op.left == {(1, 1, 0)}
    assert ledger.credit(1) == 64


def test_outbox_spends_credit_and_flags_ready_on_the_first_data() -> None:
    outbox, _transport, ledger = _outbox()
    op = allreduce_op(count=100)
    outbox.begin(op)
    out = outbox.next_outgoing(1)
    assert out is not None
    header = unpack_header(out.header)
    assert header.flags & FLAG_CREDITED and header.flags & FLAG_READY
    assert ledger.credit(1) == (1 << 20) - 400 and outbox.ready_sent == 0


def test_outbox_skips_the_pieces_of_an_ended_op_and_forgets_what_it_parked() -> None:
    outbox, _transport, _ledger = _outbox(budget=64)
    op = allreduce_op(count=100)
    outbox.queue(op, op.spec.schedule.first[0])
    assert outbox.next_outgoing(1) is None  # parked: no credit
    outbox.drop_op(op.spec.key)
    outbox.unpark(1)
    assert outbox.next_outgoing(1) is None
    done = allreduce_op((3, 0))
    done.ready_peers.add(1)
    outbox.queue(done, done.spec.schedule.first[0])
    done.finished = True
    assert outbox.next_outgoing(1) is None
    assert outbox.sent(object()) is None


# --- the op table ----------------------------------------------------------------------


def test_op_table_completes_fails_once_and_tells_the_parts_that_keep_per_op_state() -> None:
    forgotten: list[Any] = []
    ops = OpTable()
    ops.on_fail(forgotten.append)
    op = allreduce_op((1, 0))
    ops.open(op)
    ops.complete(op)  # its send and receive are still due
    assert not op.future.done()
    op.recvs_left = op.sends_left = 0
    ops.complete(op)
    assert op.future.done() and op.future.error() is None and (1, 0) in ops.done
    other = allreduce_op((2, 0))
    ops.open(other)
    error = TotalReduceError("boom")
    ops.fail(other, error)
    ops.fail(other, TotalReduceError("again"))
    assert other.future.error() is error and forgotten == [(2, 0)]
    assert not ops.active and ops.known((2, 0))
    ops.refuse((9, 4))
    assert (9, 4) in ops.done and (9, 3) not in ops.done


def test_op_table_counts_its_active_ops_by_priority() -> None:
    # What lets the inbox skip its look for ops that may pass a big body (overtaking):
    # the count goes up as an op opens and down once, however it ends.
    ops = OpTable()
    low, high, other = (allreduce_op((k, 0), priority=p) for k, p in ((1, 0), (2, 5), (3, 5)))
    for op in (low, high, other):
        ops.open(op)
    assert ops.priorities == {0: 1, 5: 2}
    high.recvs_left = high.sends_left = 0
    ops.complete(high)
    ops.complete(high)
    assert ops.priorities == {0: 1, 5: 1}
    ops.fail(other, TotalReduceError("boom"))
    ops.fail(other, TotalReduceError("again"))
    assert ops.priorities == {0: 1}
    ops.fail(low, TotalReduceError("boom"))
    assert ops.priorities == {} and not ops.active


def test_op_table_forgets_a_name_even_while_one_of_its_ops_runs() -> None:
    ops = OpTable()
    op = allreduce_op((1, 0))
    ops.open(op)
    ops.done.add((1, 5))
    ops.forget(1)
    assert (1, 5) not in ops.done and op.forgotten
    ops.fail(op, TotalReduceError("x"))
    assert not ops.known((1, 0))  # a later use of the name starts at call 0 again


# --- floating bodies -------------------------------------------------------------------


def test_floating_bodies_are_counted_until_taken_and_their_credit_owed_back() -> None:
    ledger, scratch = Fake(), Fake()
    floating = Floating(ledger, scratch)  # type: ignore[arg-type]
    op = allreduce_op()
    header = data_header(op, flags=FLAG_CREDITED)
    body = memoryview(bytearray(16))
    floating.receiving(100)
    floating.keep(FloatingBody(1, header, body, 100))
    assert op.spec.key in floating and floating.bytes == 100 and floating.peak == 100
    assert floating.first_arrival(op.spec.key) > 0 and floating.first_arrival((0, 0)) == 0
    assert floating.waiting() == [(1, header)]
    items = floating.take(op.spec.key)
    assert [item.buf for item in items] == [body] and floating.bytes == 0
    assert ledger.named("owe") == [(1, 100)]
    floating.receiving(50)
    floating.keep(FloatingBody(1, header, body, 50))
    floating.drop(op.spec.key)
    assert scratch.named("put") == [(body,)] and ledger.named("owe")[-1] == (1, 50)
    floating.receiving(70)
    floating.keep(FloatingBody(1, header, body, 70))
    floating.clear(TotalReduceError("broken"))  # a broken job owes no credit
    assert floating.bytes == 0 and len(ledger.named("owe")) == 2 and floating.peak == 100


def test_a_watch_over_peers_that_left_already_fails_naming_them() -> None:
    # A receive from any rank, asked for after the last rank it could come from has
    # shut down: nothing will ever tell the watch again, so it fails at once.
    floating = Floating(Fake(), Fake())  # type: ignore[arg-type]
    watch = Watch(lambda src, header: True, {1, 2}, OpFuture(), "recv from any rank (tag 0)")
    floating.watch(watch, {1}, 0)
    assert not watch.future.done() and watch.sources == {2}  # rank 2 may still send
    later = Watch(lambda src, header: True, {1}, OpFuture(), "recv from any rank (tag 3)")
    floating.watch(later, {1, 2}, 0)
    error = later.future.error()
    assert isinstance(error, PeerFailureError) and error.orderly, error
    assert str(error) == ("rank 0: recv from any rank (tag 3): rank 1 shut down and no "
                          "other rank it could come from is left")


# --- the mismatch tracker --------------------------------------------------------------


def test_mismatch_tracker_gathers_both_views_and_fails_the_op_naming_each_rank() -> None:
    ops, outbox = OpTable(), Fake()
    tracker = MismatchTracker(0, 2, ops, outbox, grace=5.0)  # type: ignore[arg-type]
    op = allreduce_op()
    ops.open(op)
    fits = data_header(op)
    assert tracker.check(op, 1, fits) is op.spec.schedule.recvs[(1, 1, 0)]
    wrong = data_header(op, dtype=dtype_code(np.dtype(np.float64)), count=5)
    assert tracker.check(op, 1, wrong) is None
    assert op.mismatch is not None and len(tracker) == 1
    assert [h.kind for h, _body, _skip in outbox.named("tell_all")] == [Kind.MISMATCH]
    assert not op.future.done()  # the peer's own view is not in yet
    tracker.heard(1, op.spec.key, {"kind": "allreduce", "dtype": "float64", "shape": [5]})
    error = op.future.error()
    assert isinstance(error, MismatchError)
    text = str(error)
    assert "rank 0: kind=allreduce, dtype=float32, shape=(4,)" in text
    assert "rank 1: kind=allreduce, dtype=float64, shape=(5,)" in text
    assert "(differs: dtype, shape)" in text
    tracker.forget(op.spec.key)
    assert len(tracker) == 0


def test_mismatch_heard_before_the_op_starts_joins_it_at_start() -> None:
    ops, outbox = OpTable(), Fake()
    tracker = MismatchTracker(0, 2, ops, outbox, grace=5.0)  # type: ignore[arg-type]
    op = allreduce_op()
    tracker.heard(1, op.spec.key, {"kind": "broadcast"})
    ops.open(op)
    assert tracker.started(op)
    assert isinstance(op.future.error(), MismatchError)
    assert not tracker.started(allreduce_op((99, 0)))


def test_mismatch_due_after_the_grace_period_with_views_missing() -> None:
    ops, outbox = OpTable(), Fake()
    tracker = MismatchTracker(0, 3, ops, outbox, grace=0.5)  # type: ignore[arg-type]
    op = allreduce_op()
    ops.open(op)
    tracker.heard(1, op.spec.key, {"kind": "broadcast"})
    assert tracker.started(op) and not op.future.done()  # rank 2 not heard from
    assert tracker.due(0.0) == []
    [(due_op, error)] = tracker.due(float("inf"))
    assert due_op is op and "ranks [2]: not heard from" in str(error)


def message_op(rank: int, count: int) -> LiveOp:
    """Rank ``rank``'s side of a 2-rank message from rank 0 to rank 1 (tag 9)."""
    work = np.zeros(count, np.float32)
    if rank == 0:
        schedule = Schedule((Send(1, 0, 0, 0, count),), {}, ())
    else:
        schedule = Schedule((), {(0, 0, 0): Recv(0, count, COPY, True, ())}, ())
    spec = OpSpec(key=(21, 0), label="message", sig=5, dtype=dtype_code(work.dtype),
                  count=count, describe={"kind": "message", "dtype": "float32",
                                         "count": count, "tag": 9, "from": 0, "to": 1},
                  schedule=schedule, work=work, ranks=(0, 1))
    return LiveOp(spec, OpFuture())


def test_a_message_of_another_size_fails_the_receive_at_once_and_never_the_send() -> None:
    # The sender's header is all the receiver will learn of it; the sender ignores the
    # word however far its send got, so which of the two fails never depends on timing.
    ops, outbox = OpTable(), Fake()
    receiver = MismatchTracker(1, 2, ops, outbox, grace=5.0)  # type: ignore[arg-type]
    recv = message_op(1, 11)
    ops.open(recv)
    assert receiver.check(recv, 0, data_header(message_op(0, 10), src_step=0)) is None
    text = str(recv.future.error())
    assert "rank 0: dtype=float32, count=10 (as seen in its message header)" in text, text
    assert "rank 1: kind=message, dtype=float32, count=11" in text, text
    [(_header, body, _skip)] = outbox.named("tell_all")
    sender_ops = OpTable()
    sender = MismatchTracker(0, 2, sender_ops, Fake(), grace=5.0)  # type: ignore[arg-type]
    send = message_op(0, 10)
    sender_ops.open(send)
    sender.heard(1, send.spec.key, read_view(body))
    assert not send.future.done() and len(sender) == 0


# --- serving after join ----------------------------------------------------------------


def test_join_server_serves_only_ops_begun_before_its_round_ended() -> None:
    serving = JoinServer()
    old = Header(Kind.READY, name_key=1, recipe=1, epoch=0)
    assert not serving.serves(old)
    serving.remember(old)
    serving.remember(Header(Kind.READY, name_key=2, recipe=0))  # cannot be served: not kept
    built: list[Header] = []

    def server(header: Header) -> OpSpec | None:
        built.append(header)
        return None

    assert serving.begin(server) == [old]
    assert serving.serves(old)
    assert not serving.serves(old._replace(epoch=1))
    assert serving.spec_for(old) is None and built == [old]
    assert serving.begin(server) == []  # spec_for took it
    serving.joined()
    serving.joined()
    assert serving.epoch == 2


# --- applying pieces -------------------------------------------------------------------


def _applier(ops: OpTable, outbox: Any = None, reducer: Any = None,
             reduce_min: int = 0) -> tuple[Applier, ScratchPool]:
    scratch = ScratchPool(1 << 20)
    mismatches = Fake(returns={
        "check": lambda op, peer, header: op.spec.schedule.recvs.get(
            (peer, header.step, header.piece))})
    outbox = outbox if outbox is not None else Fake()
    return Applier(0, ops, outbox, mismatches, scratch,  # type: ignore[arg-type]
                   reducer, reduce_min), scratch


def test_applier_holds_a_reduction_until_the_send_it_would_overwrite_has_left() -> None:
    ops = OpTable()
    applier, scratch = _applier(ops)
    op = allreduce_op()
    ops.open(op)
    peer_data = np.full(4, 10, np.float32)
    applier.deliver(op, 1, data_header(op), memoryview(peer_data).cast("B"), False)
    assert op.held and op.recvs_left == 1  # our send of the same bytes has not left
    np.testing.assert_array_equal(op.spec.work, [1, 2, 3, 4])
    op.sends_left = 0
    op.left.add((1, 1, 0))
    applier.send_left(op)
    np.testing.assert_array_equal(op.spec.work, [11, 12, 13, 14])
    assert op.future.done() and op.future.error() is None and op.pending_from[1] == 0
    assert scratch.idle_bytes > 0  # the held copy went back to the pool


def test_applier_copies_a_piece_and_queues_the_sends_it_unlocks() -> None:
    ops, outbox = OpTable(), Fake()
    applier, _scratch = _applier(ops, outbox)
    work = np.zeros(4, np.int32)
    op = LiveOp(spec_of(chain_broadcast(1, 2, 0, 4, 1 << 20), work), OpFuture())
    ops.open(op)
    body = np.array([5, 6, 7, 8], np.int32)
    applier.deliver(op, 0, data_header(op, src_step=0), memoryview(body).cast("B"), False)
    np.testing.assert_array_equal(work, body)
    [(queued_op, send)] = outbox.named("queue")
    assert queued_op is op and send.peer == 0  # the broadcast's acknowledgement
    assert not op.future.done()  # until that has left


def test_applier_lands_a_copy_at_once_but_holds_what_it_unlocks_until_its_send_left() -> None:
    # Rank 0 of a 4-rank allgather by recursive doubling, one block each: step 1 swaps
    # blocks with rank 1, step 2 sends blocks 0-1 to rank 2 and gets its 2-3.  Rank 2's
    # message comes first, then rank 1's, before any send of ours has left.
    ops, outbox = OpTable(), Fake()
    applier, _scratch = _applier(ops, outbox)
    work = np.array([1, 0, 0, 0], np.int32)
    op = LiveOp(spec_of(doubling_allgather(0, 4, (0, 1, 2, 3, 4)), work), OpFuture())
    ops.open(op)
    for peer, step, body in ((2, 2, [3, 4]), (1, 1, [2])):
        arr = np.array(body, np.int32)
        applier.deliver(op, peer, data_header(op, src_step=step), memoryview(arr).cast("B"),
                        False)
    np.testing.assert_array_equal(work, [1, 2, 3, 4])  # in place at once
    assert len(op.held) == 2 and op.recvs_left == 2 and outbox.named("queue") == []
    op.left.add((1, 1, 0))  # our step-1 send left: rank 1's block unlocks step 2's
    applier.send_left(op)
    [(queued_op, send)] = outbox.named("queue")
    assert queued_op is op and (send.peer, send.step, send.lo, send.hi) == (2, 2, 0, 2)
    assert len(op.held) == 1 and op.recvs_left == 1
    op.left.add((2, 2, 0))
    op.sends_left = 0
    applier.send_left(op)
    assert not op.held and op.recvs_left == 0
    assert op.future.done() and op.future.error() is None


def test_most_rings_slow_sends_a_blocking_big_op_to_the_loop() -> None:
    # Engine.lends: each ring's copies are timed on their own; one slow ring of many must
    # not take an op off the caller's thread.
    from types import SimpleNamespace

    from totalreduce.engine.engine import Engine

    def lends(slow: set[int], peers: list[int]) -> bool:
        engine = SimpleNamespace(transport=SimpleNamespace(lends=slow.__contains__))
        return Engine.lends(engine, peers)  # type: ignore[arg-type]

    assert lends({1}, [1]) and not lends(set(), [1])
    assert not lends({3}, list(range(1, 16))) and not lends(set(range(1, 8)), list(range(1, 16)))
    assert lends(set(range(1, 9)), list(range(1, 16)))


def test_applier_hands_big_reductions_to_the_reduce_thread_and_fails_on_its_error() -> None:
    ops, reducer = OpTable(), Fake()
    applier, _scratch = _applier(ops, reducer=reducer, reduce_min=1)
    op = allreduce_op()
    ops.open(op)
    op.left.add((1, 1, 0))
    applier.deliver(op, 1, data_header(op), memoryview(bytearray(16)), True)
    [(_ufunc, _dest, _buf, token, _left)] = reducer.named("submit")
    applier.reduced(token, ValueError("bad"))
    error = op.future.error()
    assert isinstance(error, TotalReduceError) and "reduction failed" in str(error)


# --- starting ops ----------------------------------------------------------------------


def _starter(**over: Any) -> tuple[Starter, dict[str, Any]]:
    parts: dict[str, Any] = {
        "job": Fake(rank=0, broken=None), "ops": OpTable(),
        "ledger": Fake(returns={"pop_early": lambda key: {1}}),
        "outbox": Fake(), "floating": Fake(returns={"first_arrival": 0.0, "take": []}),
        "applier": Fake(), "mismatches": Fake(),
        "departures": Fake(returns={"departed": set}), "serving": JoinServer(),
        "scratch": Fake(), "resume": lambda: None}
    parts.update(over)
    return Starter(**parts), parts


def test_starter_starts_an_op_with_its_early_readies_and_hands_it_to_the_outbox() -> None:
    starter, parts = _starter()
    op_future = OpFuture()
    spec = allreduce_op().spec
    starter.start(spec, op_future)
    op = parts["ops"].active[spec.key]
    assert op.ready_peers == {1} and spec.epoch == 0
    assert parts["outbox"].named("begin") == [(op,)]
    starter.start(spec, second := OpFuture())
    assert "submitted twice" in str(second.error())


def test_starter_applies_pieces_that_floated_in_before_the_op() -> None:
    item = FloatingBody(1, Header(Kind.DATA), memoryview(bytearray(16)), 0)
    floating = Fake(returns={"first_arrival": 3.0, "take": [item], "contains": True})
    starter, parts = _starter(floating=floating)
    spec = allreduce_op().spec
    starter.start(spec, OpFuture())
    op = parts["ops"].active[spec.key]
    assert op.t_floated == 3.0
    assert parts["applier"].named("deliver") == [(op, 1, item.header, item.buf, True)]


def test_a_gathering_ops_own_block_is_copied_after_its_last_receive() -> None:
    # Rank 0 of a 2-rank alltoall that copies its own block from its source (``own``):
    # the copy waits for the receive from rank 1, so that its send goes and its peer's
    # body is taken first; then the block is in place before the op can end.
    ops = OpTable()
    applier, _scratch = _applier(ops)
    starter, _parts = _starter(ops=ops, applier=applier)
    bounds = (0, 3, 5)
    schedule = pairwise_alltoallv(0, 2, bounds, bounds, 1 << 20, own=True)
    source = np.arange(5, dtype=np.float32) + 1
    work = np.full(5, np.nan, np.float32)
    spec = dataclasses.replace(spec_of(schedule, work), ufunc=None, source=source, fresh=True)
    starter.start(spec, future := OpFuture())
    op = ops.active[spec.key]
    assert op.local_due and np.isnan(work[0:3]).all()
    body = np.full(2, 9, np.float32)
    header = data_header(op, 0, nbytes=body.nbytes)
    applier.deliver(op, 1, header, memoryview(body).cast("B"), False)
    assert not op.local_due and np.array_equal(work, [1, 2, 3, 9, 9])
    assert not future.done()  # its send has not left
    op.sends_left = 0
    ops.complete(op)
    assert future.done() and future.error() is None


def test_only_a_small_own_block_is_copied_last() -> None:
    bounds = (0, 1 << 20, 2 << 20)  # float32 blocks of 4 MiB
    work = np.empty(2 << 20, np.float32)
    schedule = pairwise_alltoallv(0, 2, bounds, bounds, 1 << 20, own=True)
    spec = dataclasses.replace(spec_of(schedule, work), ufunc=None, source=work.copy(),
                               fresh=True)
    assert copied_last(spec, schedule.local_final)
    assert not copied_last(spec, ((0, (1 << 20) + 1),))
    assert not copied_last(dataclasses.replace(spec, fresh=False), schedule.local_final)
    assert not copied_last(dataclasses.replace(spec, ufunc=np.add), schedule.local_final)


def test_starter_refuses_an_op_that_cannot_run() -> None:
    broken = TotalReduceError("job broken")
    starter, _parts = _starter(job=Fake(rank=0, broken=broken))
    future = OpFuture()
    starter.start(allreduce_op().spec, future)
    assert future.error() is broken

    departures = Fake(returns={"departed": lambda: {1}})
    starter, parts = _starter(departures=departures)
    future = OpFuture()
    spec = allreduce_op().spec
    starter.start(spec, future)
    error = future.error()
    assert isinstance(error, PeerFailureError) and error.rank == 1 and error.orderly
    assert "needs rank 1, which has shut down" in str(error)
    assert departures.named("tell_op_failed")[0][:2] == (spec.key, 1)
    assert spec.key in parts["ops"].done

    starter, parts = _starter()
    early = PeerFailureError(1, "rank 1 left", orderly=True)
    parts["ops"].failed_early.put(spec.key, early)
    future = OpFuture()
    starter.start(spec, future)
    assert future.error() is early


def test_starter_adopts_an_op_whose_departed_peer_sent_everything_first() -> None:
    # Rank 0 of a 4-rank allgather by recursive doubling began off the loop, applied rank
    # 1's piece and sent both its own; rank 2 then shut down, its piece for us floating
    # here (read through the first channel while the op waited on the lane): the op goes
    # on.  Without that piece here, rank 2 is still needed and the op fails.
    sched = doubling_allgather(0, 4, (0, 1, 2, 3, 4))
    spec = spec_of(sched, np.zeros(4, np.int32))
    got = [((1, 1, 0), sched.recvs[(1, 1, 0)])]
    sent = [*sched.first, *sched.recvs[(1, 1, 0)].then]
    for floated, fails in ((1, False), (0, True)):
        floating = Fake(returns={"first_arrival": 0.0, "take": [], "count_from": floated})
        starter, _parts = _starter(job=Fake(rank=0, broken=None, closing=False),
                                   floating=floating,
                                   departures=Fake(returns={"departed": lambda: {2}}))
        future = OpFuture()
        op = starter.adopt(spec, future, set(), set(), sent, [], got, {2})
        assert (op is None) == fails
        if fails:
            assert "needs rank 2, which has shut down" in str(future.error())


def test_starter_refuses_to_serve_what_a_joined_rank_cannot_build() -> None:
    mismatches = Fake()
    starter, parts = _starter(mismatches=mismatches)
    header = Header(Kind.READY, name_key=4, recipe=1)
    assert not starter.try_serve(header)  # not joined
    parts["serving"].begin(lambda header: None)
    assert starter.try_serve(header)
    assert (4, 0) in parts["ops"].done
    [(key, view)] = mismatches.named("tell_view")
    assert key == (4, 0) and "called join()" in view["kind"]


# --- what peers tell us ----------------------------------------------------------------


def _peer_events(**over: Any) -> tuple[PeerEvents, dict[str, Any]]:
    parts: dict[str, Any] = {
        "job": Fake(rank=0, closing=False), "ops": OpTable(), "outbox": Fake(),
        "ledger": Fake(), "mismatches": Fake(), "departures": Fake(bye=set()),
        "serving": Fake(), "starter": Fake(returns={"try_serve": False}),
        "floating": Fake(), "drain_lane": lambda peer, sent: None}
    parts.update(over)
    return PeerEvents(**parts), parts


def test_peer_ready_unparks_a_running_op_or_is_kept_for_a_later_one() -> None:
    events, parts = _peer_events()
    op = allreduce_op()
    parts["ops"].active[op.spec.key] = op
    events.ready(1, Header(Kind.READY, name_key=11))
    assert parts["outbox"].named("peer_ready") == [(op, 1)]
    later = Header(Kind.READY, name_key=12, recipe=1)
    events.control(1, later, b"")
    assert parts["ledger"].named("early_ready") == [((12, 0), 1)]
    assert parts["serving"].named("remember") == [(later,)]


def test_peer_abort_and_a_lost_link_break_the_job_naming_the_lost_rank() -> None:
    events, parts = _peer_events()
    events.control(2, Header(Kind.ABORT, step=2), b"rank 1 failed: ValueError")
    [(error, lost)] = parts["job"].named("break_job")
    assert isinstance(error, PeerFailureError) and lost == 1
    assert "reported by rank 2" in str(error)
    events.lost(3, "connection reset", orderly=False)
    error, lost = parts["job"].named("break_job")[-1]
    assert lost == 3 and "lost rank 3: connection reset" in str(error)
    assert parts["outbox"].named("close") == [(3,)]

    events, parts = _peer_events(job=Fake(rank=0, closing=True))
    events.lost(3, "eof", orderly=False)
    assert parts["job"].named("break_job") == []  # we are leaving anyway


def test_peer_goodbye_takes_what_its_lane_holds_before_failing_ops() -> None:
    # The op's last message from rank 1 came through rank 1's lane, still unread when its
    # GOODBYE is read: taken first, it is not counted as missing.
    drained: list[int] = []
    waiting = allreduce_op((1, 0))
    waiting.sends_left = 0
    waiting.left.add((1, 1, 0))

    def drain(peer: int, sent: int) -> None:
        assert peer not in parts["departures"].bye
        drained.append((peer, sent))
        waiting.got.add((1, 1, 0))  # as the applier takes the piece
        waiting.pending_from[1] = 0

    events, parts = _peer_events(drain_lane=drain)
    parts["ops"].active[waiting.spec.key] = waiting
    events.control(1, Header(Kind.GOODBYE, seq=5), b"")
    assert drained == [(1, 5)] and 1 in parts["departures"].bye
    assert not waiting.future.done()


def test_peer_goodbye_fails_only_the_ops_that_still_need_it() -> None:
    events, parts = _peer_events()
    ops = parts["ops"]
    needs = allreduce_op((1, 0))
    spared = allreduce_op((2, 0))
    spared.pending_from[1] = 0
    spared.sends_left = 0
    spared.left.add((1, 1, 0))
    for op in (needs, spared):
        ops.open(op)
    events.control(1, Header(Kind.GOODBYE), b"")
    assert 1 in parts["departures"].bye
    error = needs.future.error()
    assert isinstance(error, PeerFailureError) and error.orderly
    assert not spared.future.done()
    assert [args[:2] for args in parts["departures"].named("tell_op_failed")] == \
        [((1, 0), 1)]
    events.control(2, Header(Kind.OP_FAILED, step=2, name_key=2), b"rank 1 shut down")
    assert isinstance(spared.future.error(), PeerFailureError)
    events.control(2, Header(Kind.OP_FAILED, step=2, name_key=3), b"rank 1 shut down")
    assert ops.failed_early.get((3, 0)) is not None


# --- routing arriving bodies -----------------------------------------------------------


def _inbox(**over: Any) -> tuple[Inbox, dict[str, Any]]:
    ops = OpTable()
    parts: dict[str, Any] = {
        "job": Fake(rank=0, broken=None, returns={"usable": True}), "ops": ops,
        "ledger": Fake(), "outbox": Fake(),
        "mismatches": Fake(returns={"check": lambda op, peer, h: op.spec.schedule.recvs.get(
            (peer, h.step, h.piece))}),
        "floating": Fake(), "applier": Fake(), "starter": Fake(returns={"try_serve": False}),
        "peers": Fake(), "scratch": ScratchPool(1 << 20), "use_in_place": True}
    parts.update(over)
    return Inbox(**parts), parts


def test_inbox_routes_by_header_alone() -> None:
    inbox, parts = _inbox()
    ops = parts["ops"]
    work = np.zeros(4, np.int32)
    op = LiveOp(spec_of(chain_broadcast(1, 2, 0, 4, 1 << 20), work), OpFuture())
    ops.open(op)
    header = data_header(op, src_step=0, flags=FLAG_CREDITED)
    buf = inbox.body_buffer(0, header)
    assert np.shares_memory(np.frombuffer(buf, np.int32), work)  # straight into place
    inbox.received(0, header, buf)
    assert parts["applier"].named("applied")[0][0] is op
    assert parts["ledger"].named("owe") == [(0, 64)]  # a header's worth at least

    unknown = header._replace(name_key=99)
    buf = inbox.body_buffer(0, unknown)
    inbox.received(0, unknown, buf)
    assert parts["floating"].named("receiving") == [(64,)]
    [(item,)] = parts["floating"].named("keep")
    assert item.header == unknown

    ops.refuse((98, 0))
    late = header._replace(name_key=98)
    inbox.received(0, late, inbox.body_buffer(0, late))
    assert parts["ledger"].named("owe")[-1] == (0, 64)  # discarded, credit returned

    note = Header(Kind.GOODBYE, nbytes=3)
    inbox.body_buffer(0, note)[:] = b"bye"
    inbox.received(0, note, memoryview(b"bye"))
    assert parts["peers"].named("control") == [(0, note, b"bye")]


def test_inbox_passes_on_credit_and_readies_carried_on_headers() -> None:
    inbox, parts = _inbox()
    op = allreduce_op()
    parts["ops"].active[op.spec.key] = op
    header = data_header(op, flags=FLAG_READY, credit=500)
    inbox.received_view(1, header, memoryview(bytearray(16)))
    assert parts["ledger"].named("grant") == [(1, 500)]
    assert parts["outbox"].named("unpark") == [(1,)]
    assert parts["peers"].named("ready") == [(1, header)]
    assert parts["applier"].named("deliver")[0][0] is op
    assert inbox.can_defer(1, header._replace(name_key=5)) is False  # an op runs


# --- the job's state -------------------------------------------------------------------


def test_breaking_the_job_fails_every_op_and_tells_every_peer_still_there() -> None:
    ops = OpTable()
    outbox = Fake(peers=[1, 2, 3], closed={3})
    floating, resumed = Fake(), []
    job = JobState(0, 4, outbox, ops, floating, lambda: resumed.append(1))  # type: ignore
    op = allreduce_op()
    ops.open(op)
    error = PeerFailureError(2, "rank 0: lost rank 2")
    job.break_job(error, lost=2)
    job.break_job(TotalReduceError("later"))
    assert job.broken is error and not job.usable() and op.future.error() is error
    assert [args[0] for args in outbox.named("control")] == [1]  # not 2 (lost), not 3
    header = outbox.named("control")[0][1]
    assert header.kind == Kind.ABORT and header.step == 3
    assert floating.named("clear") == [(error,)] and resumed == [1]


def test_departures_are_closed_links_and_goodbyes() -> None:
    outbox = Fake(closed={2})
    departures = Departures(outbox)  # type: ignore[arg-type]
    departures.bye.add(3)
    assert departures.departed() == {2, 3}
    departures.tell_op_failed((5, 1), 3, "rank 3 shut down")
    [(header, body, skip)] = outbox.named("tell_all")
    assert header.kind == Kind.OP_FAILED and header.step == 4 and header.op_key == (5, 1)
    assert body == b"rank 3 shut down" and skip == {3}


# --- the loop, the handler, the driver -------------------------------------------------


def _loop(config: Config | None = None, **over: Any) -> tuple[Loop, dict[str, Any]]:
    ops = OpTable()
    parts: dict[str, Any] = {
        "job": JobState(0, 2, Fake(peers=[1], closed=set()), ops, Fake(), lambda: None),
        "config": config or Config(), "transport": Fake(returns={
            "has_backlog": False, "pending_output": False, "close_writes": True,
            "lane_sent": lambda peer: 7}),
        "ops": ops, "outbox": Fake(peers=[1], closed=set(), returns={"has_control": False,
                                                                    "reachable": [1]}),
        "applier": Fake(), "mismatches": Fake(returns={"due": []}), "starter": Fake(),
        "serving": Fake(), "completions": deque(), "floating": Fake()}
    parts.update(over)
    return Loop(**parts), parts


def test_loop_runs_queued_commands_and_reduce_results_in_order() -> None:
    loop, parts = _loop()
    spec, future = allreduce_op().spec, OpFuture()
    loop.commands.extend([("submit", spec, future), ("forget", 11, None),
                          ("join", "server", None), ("joined", None, None)])
    parts["completions"].append(("token", None))
    assert loop.wanted()
    loop.step(None)
    assert parts["starter"].calls == [("start", (spec, future)), ("begin_join", ("server",))]
    assert parts["serving"].named("joined") == [()]
    assert parts["applier"].named("reduced") == [("token", None)]
    assert parts["transport"].named("flush") == [()]  # a submit's turn reads nothing


def test_loop_housekeeping_fails_overdue_ops_and_shutdown_says_goodbye() -> None:
    loop, parts = _loop(Config(op_timeout=1e-9))
    ops = parts["ops"]
    op = allreduce_op()
    ops.open(op)
    loop._next_check = 0.0
    loop.step(0)
    assert isinstance(op.future.error(), OpTimeoutError)
    assert "TOTALREDUCE_OP_TIMEOUT" in str(op.future.error())

    waiting = allreduce_op((2, 0))
    ops.open(waiting)
    loop.commands.append(("shutdown", None, None))
    loop.step(0)
    assert isinstance(waiting.future.error(), TransportClosedError)
    # Each peer's goodbye says how many messages went through its lane before it.
    assert [(peer, h.kind, h.seq) for peer, h, *_ in parts["outbox"].named("control")] == \
        [(1, Kind.GOODBYE, 7)]
    assert loop.leaving() and not loop.ended
    parts["outbox"].closed.add(1)  # the peer read our end and closed its own
    loop.step(0)
    assert loop.ended and loop.closed.is_set() and parts["transport"].named("abort")


def test_loop_breaks_the_job_on_an_internal_error_instead_of_hanging() -> None:
    loop, parts = _loop(starter=Fake(returns={"start": _raise}))
    future = OpFuture()
    loop.commands.append(("submit", allreduce_op().spec, future))
    loop.step(0)
    assert loop.ended and "internal error in the progress loop" in str(parts["job"].broken)


def _raise(*args: Any) -> None:
    raise RuntimeError("bug")


def test_handler_sends_each_event_to_its_part() -> None:
    op = allreduce_op()
    outbox, inbox, applier, peers = Fake(returns={"sent": op}), Fake(), Fake(), Fake()
    handler = Handler(outbox, inbox, applier, peers, lambda: False)  # type: ignore[arg-type]
    handler.sent(1, "token")
    assert outbox.named("sent") == [("token",)] and applier.named("send_left") == [(op,)]
    handler.peer_lost(1, "eof", True)
    assert inbox.named("lost") == [(1,)] and peers.named("lost") == [(1, "eof", True)]


def test_driver_drives_the_loop_on_the_waiting_thread_until_the_future_resolves() -> None:
    future = OpFuture()
    turns: list[Any] = []

    class FakeLoop:
        ended = False

        def step(self, timeout: float | None, until: OpFuture | None = None,
                 top: bool = False) -> None:
            turns.append((timeout, until, top))
            if len(turns) == 3:
                future.resolve(None)

        def wanted(self) -> bool:
            return False

        def idle_for(self) -> float | None:
            return 0.0

        def leaving(self) -> bool:
            return False

    driver = Driver(0, Fake(), FakeLoop(), threading.Event())  # type: ignore[arg-type]
    assert driver.wait(future, timeout=5.0)
    assert len(turns) == 3 and all(until is future for _t, until, _top in turns)
    assert all(top for *_k, top in turns)  # its own turns: it may run queued calls
    assert turns[0][0] is not None  # a waiting turn may block in poll
    assert not driver.wait(OpFuture(), timeout=0.0)


def test_reduce_thread_reduces_in_order_and_reports_each_result() -> None:
    done: deque[Any] = deque()
    woken = threading.Semaphore(0)
    reducer = ReduceThread(done.append, woken.release)
    dest = np.ones(3, np.float32)
    reducer.submit(np.add, dest, memoryview(np.full(3, 2, np.float32)).cast("B"), "a")
    reducer.submit(np.add, dest[:0], memoryview(b""), "b")
    for _ in range(2):
        assert woken.acquire(timeout=30)
    reducer.stop()
    assert list(done) == [("a", None), ("b", None)]
    np.testing.assert_array_equal(dest, [3, 3, 3])


# --- who writes a live op's fields -----------------------------------------------------

_ENGINE_DIR = pathlib.Path(totalreduce.__file__).parent / "engine"

_OWNERS = {
    "ready_peers": {"outbox"}, "announce": {"outbox"}, "sends_left": {"outbox"},
    "left": {"outbox"}, "got": {"applier"}, "held": {"applier"}, "done_recvs": {"applier"},
    "recvs_left": {"applier"}, "pending_from": {"applier"}, "t_first": {"applier"},
    "mismatch": {"mismatch_tracker"}, "warned": {"stall"},
    "finished": {"optable"}, "forgotten": {"optable"},
    "local_due": {"starter", "applier"},
}
_MUTATORS = {"add", "discard", "append", "pop", "clear", "update", "remove"}


def _writes(tree: ast.AST) -> set[str]:
    """Fields of any object written in ``tree``: assigned, augmented, subscripted or
    changed through a mutating method."""
    fields: set[str] = set()
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets
                       for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in _MUTATORS:
            targets = [node.func.value]
        for target in targets:
            while isinstance(target, ast.Subscript):
                target = target.value
            if isinstance(target, ast.Attribute) and not (
                    isinstance(target.value, ast.Name) and target.value.id == "self"):
                fields.add(target.attr)
    return fields


def test_each_live_op_field_is_written_only_by_the_part_that_owns_its_phase() -> None:
    engine_dir = _ENGINE_DIR
    strays = []
    for path in sorted(engine_dir.glob("*.py")):
        if path.stem == "opstate":
            continue  # the constructor
        for field in _writes(ast.parse(path.read_text())) & set(_OWNERS):
            if path.stem not in _OWNERS[field]:
                strays.append(f"{path.name} writes LiveOp.{field}")
    assert strays == []
    assert set(_OWNERS) | {"spec", "future", "t_start", "t_floated", "itemsize",
                           "work_bytes", "source_bytes"} == set(LiveOp.__slots__)


@pytest.mark.parametrize("part", ["applier", "departures", "floating", "handler", "inbox",
                                  "job", "loop", "mismatch_tracker", "optable", "outbox",
                                  "peers", "serving", "starter", "driving", "stall"])
def test_no_part_holds_the_engine(part: str) -> None:
    path = _ENGINE_DIR / f"{part}.py"
    reaches = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "engine":
            reaches.append(f"imports from .engine (line {node.lineno})")
        elif isinstance(node, ast.Attribute) and node.attr in ("engine", "_engine"):
            reaches.append(f".{node.attr} (line {node.lineno})")
        elif isinstance(node, ast.Name) and node.id in ("engine", "Engine"):
            reaches.append(f"{node.id} (line {node.lineno})")
    assert reaches == []
