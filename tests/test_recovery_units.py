"""Recovery's pure parts in one process: the round's plan, the result log, the
checkpoint codec."""

from __future__ import annotations

import numpy as np
import pytest

from totalreduce.recovery.codec import check_state, copy_state, decode, encode
from totalreduce.recovery.log import PRELUDE, ResultLog
from totalreduce.recovery.plan import Statement, decide, wanted

X = (3, "grad", 7)
Y = (3, "grad", 8)
C = (2, "~checkpoint", 0)


def test_a_replacement_gets_the_newest_checkpoint_and_then_logged_results() -> None:
    # Rank 1 restarted; 0 and 2 wait in X, which nobody finished: it waits for rank 1.
    said = [Statement(3, False, (X,)), Statement(0, True, ()), Statement(3, False, (X,))]
    plan = decide(said, [set(), set(), set()])
    assert plan.checkpoint_from == 0 and plan.serve == () and plan.run == ()
    assert not plan.final and plan.progress()
    # It replays: W is logged on the survivors, so it is sent, not recomputed.
    w = (3, "grad", 6)
    said = [Statement(3, False, (X,)), Statement(3, False, (w,)), Statement(3, False, (X,))]
    held = [{w}, set(), {w}]
    assert wanted(said) == [w, X]
    plan = decide(said, held)
    assert plan.serve == ((w, 0),) and plan.run == () and not plan.final
    # Everyone waits for X now, and nobody has it: run it anew, and recovery is over.
    said = [Statement(3, False, (X,))] * 3
    plan = decide(said, [set()] * 3)
    assert plan.run == (X,) and plan.serve == () and plan.final


def test_a_result_finished_on_one_survivor_is_served_to_the_others() -> None:
    said = [Statement(3, False, (X, Y)), Statement(3, False, (Y,)),
            Statement(3, False, (X, Y))]
    held = [set(), {X}, set()]  # rank 1 finished X before the failure
    plan = decide(said, held)
    assert plan.serve == ((X, 1),) and plan.run == (Y,) and plan.final


def test_a_checkpoint_interrupted_half_way_is_completed_from_a_rank_that_made_it() -> None:
    said = [Statement(3, False, (X,)), Statement(2, False, (C,)), Statement(0, True, ())]
    held = [{C}, set(), set()]
    plan = decide(said, held)
    assert plan.checkpoint_from == 0 and plan.serve == ((C, 0),) and not plan.final


def test_nothing_to_send_when_no_checkpoint_was_taken_and_everyone_restarted() -> None:
    plan = decide([Statement(0, True, ())] * 2, [set(), set()])
    assert plan.checkpoint_from is None and plan.final and not plan.progress()


def test_result_log_is_bounded_and_cleared_by_a_checkpoint_but_for_the_prelude() -> None:
    log = ResultLog(cap_bytes=100)
    setup = (PRELUDE, "broadcast_parameters.w", 0)
    log.add(setup, "broadcast", [np.zeros(2, np.float32)])
    log.add(X, "allreduce", [np.zeros(10, np.float32)])
    log.add(Y, "allreduce", [np.zeros(20, np.float32)])  # 8 + 40 + 80 > 100: not kept
    assert X in log and Y not in log and log.overflowed and log.bytes == 48
    kind, [got] = log.get(X)
    assert kind == "allreduce" and got.shape == (10,)
    log.commit(C, {"w": np.ones(2)})
    assert log.version == 1 and len(log) == 1 and not log.overflowed and C in log
    assert setup in log and X not in log and log.bytes == 8


def test_result_log_keeps_copies() -> None:
    log = ResultLog(cap_bytes=1 << 20)
    a = np.arange(4.0)
    log.add(X, "allreduce", [a])
    a[:] = -1
    np.testing.assert_array_equal(log.get(X)[1][0], [0, 1, 2, 3])


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.uint8, np.bool_,
                                   np.float16, np.int16])
def test_checkpoint_state_round_trips_without_pickle(dtype: type) -> None:
    state = {"w": np.arange(12).reshape(3, 4).astype(dtype), "empty": np.zeros((0, 5), dtype),
             "zero_d": np.array(7).astype(dtype), "lr": 0.1, "epoch": 3, "tag": "x",
             "none": None, "flag": True, "np_scalar": np.float32(2.5)}
    back = decode(encode(copy_state(state)))
    assert back is not None and set(back) == set(state)
    for key in ("w", "empty", "zero_d"):
        assert back[key].dtype == state[key].dtype and back[key].shape == state[key].shape
        np.testing.assert_array_equal(back[key], state[key])
    assert back["lr"] == 0.1 and back["epoch"] == 3 and back["tag"] == "x"
    assert back["none"] is None and back["flag"] is True and back["np_scalar"] == 2.5
    assert decode(encode(None)) is None


def test_checkpoint_state_refuses_what_would_need_pickle() -> None:
    with pytest.raises(TypeError, match="'model' is a list"):
        check_state({"model": [1, 2]})
    with pytest.raises(TypeError, match="keys must be str"):
        check_state({1: np.zeros(1)})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="dict of numpy arrays"):
        check_state([np.zeros(1)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="complex128 is not one"):
        check_state({"z": np.zeros(2, np.complex128)})


def test_result_log_keeps_nothing_it_could_confuse_after_a_name_was_forgotten() -> None:
    log = ResultLog(cap_bytes=1 << 20)
    setup = (PRELUDE, "setup", 0)
    log.add(setup, "broadcast", [np.zeros(2)])
    log.add(X, "allreduce", [np.zeros(2)])
    log.lose()
    assert X not in log and setup in log and log.overflowed
    log.add(Y, "allreduce", [np.zeros(2)])
    assert Y not in log  # not until the next checkpoint
    log.commit(C, None)
    log.add(Y, "allreduce", [np.zeros(2)])
    assert Y in log and not log.overflowed
