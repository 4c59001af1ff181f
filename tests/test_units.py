"""Pure logic in one process: wire format, handshake, config, launcher environments, and
the world-of-one API including local misuse errors."""

from __future__ import annotations

import contextlib
import pickle
import selectors
import socket
import threading
import time

import numpy as np
import pytest

import totalreduce as tr
from totalreduce import runtime as tr_runtime
from totalreduce.config import Config
from totalreduce.exceptions import (
    AuthenticationError,
    MismatchError,
    OpTimeoutError,
    PeerFailureError,
)
from totalreduce.rendezvous.auth import client_handshake, server_handshake
from totalreduce.rendezvous.env import detect_launch
from totalreduce.scheduling.selfguided import SelfGuided
from totalreduce.scheduling.slow_rings import SlowRingChoice
from totalreduce.transport.poller import GIVE_WAY_EVERY, POLL_SLOT, WAIT_SLOT, GiveWay, Poller
from totalreduce.transport.wire import HEADER_SIZE, Header, Kind, WireError, unpack_header


def test_header_round_trip_and_rejects_garbage() -> None:
    h = Header(Kind.DATA, 6, 1, 3, 2**64 - 1, 12345, 99, 7, 1 << 40, 5, 17)
    packed = h.pack()
    assert len(packed) == HEADER_SIZE
    assert unpack_header(packed) == h
    framed = b"\x07" * 5 + packed  # read in place, as a ring's reader does
    assert unpack_header(framed, 5) == h
    assert type(unpack_header(framed, 5)) is Header
    assert unpack_header(framed, 5).nbytes == 1 << 40
    with pytest.raises(WireError, match="bad magic"):
        unpack_header(b"\0" * HEADER_SIZE)
    bad_kind = bytearray(packed)
    bad_kind[2] = 200
    with pytest.raises(WireError, match="unknown message kind"):
        unpack_header(bytes(bad_kind))


def test_a_wake_before_select_ends_the_next_select_at_once_without_a_wakeup_byte() -> None:
    poller = Poller([])
    try:
        poller.wake()
        t0 = time.monotonic()
        assert poller.select(30.0) == []
        assert time.monotonic() - t0 < 5.0  # a ceiling: the defect is waiting out 30 s
        with pytest.raises(BlockingIOError):  # nobody slept: no byte was sent
            poller._wake_r.recv(1)
    finally:
        poller.close()


def test_a_wake_reaches_a_thread_asleep_in_select() -> None:
    poller = Poller([])
    returned = threading.Event()

    def sleeper() -> None:
        poller.select(30.0)
        returned.set()

    thread = threading.Thread(target=sleeper, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10.0
        while not poller._asleep[POLL_SLOT]:  # past its spin, blocked in the selector
            assert time.monotonic() < deadline
            time.sleep(0.001)
        poller.wake()
        assert returned.wait(10.0)
    finally:
        thread.join(10.0)
        poller.close()


def test_a_short_nap_waits_to_the_microsecond_and_still_sees_the_sockets(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import totalreduce.transport.poller as poller_module

    # epoll rounds a timeout up to whole milliseconds; a nap shorter than _FINE_NAP asks
    # select() on the epoll descriptor for the exact time instead.
    asked: list[float] = []
    real_select = poller_module.select.select

    def recording(r: list[int], w: list[int], x: list[int], timeout: float) -> object:
        asked.append(timeout)
        return real_select(r, w, x, timeout)

    monkeypatch.setattr(poller_module.select, "select", recording)
    poller = Poller([])
    a, b = socket.socketpair()
    try:
        poller.selector.register(a, selectors.EVENT_READ, "peer")
        assert poller.select(250e-6, WAIT_SLOT) == []  # nothing came: the nap ran out
        assert asked and 0 < asked[-1] <= 250e-6
        b.send(b"x")
        events = poller.select(250e-6, WAIT_SLOT)
        assert [(key.data, mask) for key, mask in events] == [("peer", selectors.EVENT_READ)]
        assert a.recv(1) == b"x"
        asked.clear()
        poller.wake()  # a wake before the nap: no nap at all
        assert poller.select(250e-6, WAIT_SLOT) == [] and not asked
    finally:
        a.close()
        b.close()
        poller.close()


def _pair(server_secret: bytes, client_secret: bytes) -> tuple[object, object]:
    a, b = socket.socketpair()
    out: dict[str, object] = {}

    def serve() -> None:
        try:
            out["server"] = server_handshake(a, server_secret, {"rank": 0}, 5)
        except Exception as exc:
            out["server"] = exc
            a.close()  # as the acceptor closes a refused connection (mesh._authenticate)

    t = threading.Thread(target=serve)
    t.start()
    try:
        client: object = client_handshake(b, client_secret, {"rank": 1}, 5)
    except Exception as exc:
        client = exc
    finally:
        b.close()
    t.join()
    with contextlib.suppress(OSError):
        a.close()
    return out["server"], client


def test_the_loop_gives_its_core_away_now_and_then_only_where_ranks_have_cores(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import totalreduce.transport.poller as poller_module

    yields: list[float] = []
    clock = [0.0]
    monkeypatch.setattr(poller_module.os, "sched_yield", lambda: yields.append(clock[0]))
    step = GIVE_WAY_EVERY * 0.26
    on, off = GiveWay(True), GiveWay(False)
    for i in range(40):
        clock[0] = 100.0 + i * step
        on.now_and_then(clock[0])
        off.now_and_then(clock[0])
    # The first look yields, then one look in four: never two within GIVE_WAY_EVERY.
    assert yields[0] == 100.0 and len(yields) == 10
    assert all(b - a >= GIVE_WAY_EVERY - 1e-12 for a, b in zip(yields, yields[1:], strict=False))
    alone, crowded = Poller([], local=1), Poller([], local=10 ** 6)
    try:
        assert alone.give_way.on
        assert not crowded.give_way.on  # more ranks here than cores
    finally:
        alone.close()
        crowded.close()


def test_handshake_accepts_the_secret_and_refuses_others() -> None:
    server, client = _pair(b"s3cret", b"s3cret")
    assert server == {"rank": 1} and client == {"rank": 0}
    server, client = _pair(b"s3cret", b"wrong")
    assert isinstance(server, AuthenticationError)
    assert isinstance(client, AuthenticationError | OSError)


def test_config_precedence_and_typos() -> None:
    env = {"TOTALREDUCE_SEGMENT_BYTES": "4096", "TOTALREDUCE_OP_TIMEOUT": "5"}
    cfg = Config.from_env(env, op_timeout=7.0)
    assert cfg.segment_bytes == 4096 and cfg.op_timeout == 7.0
    with pytest.raises(TypeError, match="segmnt_bytes"):
        Config.from_env({}, segmnt_bytes=1)
    with pytest.raises(ValueError, match="TOTALREDUCE_SEGMENT_BYTES"):
        Config.from_env({"TOTALREDUCE_SEGMENT_BYTES": "big"})
    with pytest.raises(ValueError, match="op_timeout"):
        Config(op_timeout=-1)


def test_ring_size_follows_the_segment_unless_set() -> None:
    # Auto: two segment records (each segment plus its 64-byte header) fit, with room left.
    cfg = Config.from_env({"TOTALREDUCE_SEGMENT_BYTES": str(1 << 20)})
    assert cfg.ring_bytes // 2 - 64 >= 1 << 20
    assert cfg.ring_bytes < 3 << 20
    assert Config.from_env({"TOTALREDUCE_SHM_BYTES": "0"}).ring_bytes == 0
    assert Config(shm_bytes=65536).ring_bytes == 65536
    with pytest.raises(ValueError, match="shm_bytes"):
        Config(shm_bytes=-2)


def test_the_slow_ring_speed_is_measured_unless_set() -> None:
    assert Config().slow_ring_gbps == -1  # auto: transport/cma.py read_rate()
    assert Config.from_env({"TOTALREDUCE_SLOW_RING_GBPS": "0"}).slow_ring_gbps == 0
    assert Config.from_env({"TOTALREDUCE_SLOW_RING_GBPS": "12.5"}).slow_ring_gbps == 12.5
    with pytest.raises(ValueError, match="slow_ring_gbps"):
        Config(slow_ring_gbps=-2)


@pytest.mark.parametrize("env,launcher,rank,size,address", [
    ({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
      "MASTER_ADDR": "node1", "MASTER_PORT": "29500"}, "torchrun", 2, 4, "node1:29501"),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
      "TOTALREDUCE_RENDEZVOUS": "h:5"}, "slurm", 1, 2, "h:5"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "3",
      "TOTALREDUCE_RENDEZVOUS": "h:6"}, "openmpi", 0, 3, "h:6"),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "TOTALREDUCE_RENDEZVOUS": "h:7"}, "mpich", 1, 2,
     "h:7"),
])
def test_external_launchers(env: dict, launcher: str, rank: int, size: int,
                            address: str) -> None:
    info = detect_launch(dict(env, TOTALREDUCE_SECRET="abc"))
    assert (info.launcher, info.rank, info.size, info.rendezvous) == (launcher, rank, size,
                                                                      address)
    assert info.serve_rendezvous == (rank == 0)
    with pytest.raises(ValueError, match="TOTALREDUCE_SECRET"):
        detect_launch(env)


def test_missing_rendezvous_address_says_what_to_set() -> None:
    with pytest.raises(ValueError, match="TOTALREDUCE_RENDEZVOUS=host:port"):
        detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "TOTALREDUCE_SECRET": "x"})


def test_ray_workers_win_over_the_launcher_that_started_the_cluster() -> None:
    """A Ray actor inherits the variables of whatever started its node (here SLURM); the
    executor's say who it is, and the driver, not rank 0, serves the store."""
    info = detect_launch({
        "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "TOTALREDUCE_RAY_RANK": "0",
        "TOTALREDUCE_RAY_SIZE": "2", "TOTALREDUCE_RAY_LOCAL_RANK": "0",
        "TOTALREDUCE_RAY_LOCAL_SIZE": "1", "TOTALREDUCE_RENDEZVOUS": "driver:9",
        "TOTALREDUCE_SECRET": "s"})
    assert (info.launcher, info.rank, info.size, info.local_rank, info.local_size,
            info.rendezvous, info.serve_rendezvous) == ("ray", 0, 2, 0, 1, "driver:9", False)
    with pytest.raises(ValueError, match="RayExecutor"):
        detect_launch({"TOTALREDUCE_RAY_RANK": "0", "TOTALREDUCE_RAY_SIZE": "2"})


@pytest.mark.parametrize("error", [
    PeerFailureError(3, "rank 0: rank 3 failed", orderly=True),
    MismatchError("grad", "shapes differ"), OpTimeoutError("grad", "waited 60 s")])
def test_errors_survive_pickling(error: Exception) -> None:
    # Ray and multiprocessing bring a worker's error back by pickle.
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error)
    assert vars(back) == vars(error)


@pytest.fixture
def world_of_one(monkeypatch: pytest.MonkeyPatch):
    for var in ("TOTALREDUCE_RANK", "RANK", "SLURM_PROCID", "PMI_RANK",
                "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)
    tr.init()
    yield
    tr.shutdown()


def test_world_of_one(world_of_one: None) -> None:
    assert (tr.rank(), tr.size(), tr.local_rank(), tr.local_size()) == (0, 1, 0, 1)
    x = np.arange(6, dtype=np.int32).reshape(2, 3)
    assert np.array_equal(tr.allreduce(x), x)
    assert np.array_equal(tr.allgather(x), x)
    out, splits = tr.alltoall(x)
    assert np.array_equal(out, x) and splits.tolist() == [2]
    assert np.array_equal(tr.reducescatter(x, op=tr.Sum), x)
    assert tr.allreduce(np.float64(3.5)).shape == ()
    tr.barrier()


def test_local_misuse_is_a_plain_error(world_of_one: None) -> None:
    with pytest.raises(TypeError, match="object arrays"):
        tr.allreduce(np.array([object()]))
    with pytest.raises(TypeError, match="dtype <U1 is not supported"):
        tr.allreduce(np.array(["a"]))
    with pytest.raises(TypeError, match="dtype complex64 is not supported"):
        tr.allreduce(np.ones(2, np.complex64))
    with pytest.raises(TypeError, match="Average of a bool array is not defined"):
        tr.allreduce(np.array([True]))
    with pytest.raises(TypeError, match="name must be a str or None, got int 123"):
        tr.allreduce(np.ones(2), name=123)
    with pytest.raises(TypeError, match="name must be a str"):
        tr.grouped_allreduce([np.ones(2)], name=5)
    with pytest.raises(TypeError, match="op must be one of .* got bool True"):
        tr.allreduce(np.ones(2), op=True)
    with pytest.raises(TypeError, match="unknown totalreduce setting.*bogus"):
        tr.init(bogus=1)
    with pytest.raises(ValueError, match="already initialized with segment_bytes"):
        tr.init(segment_bytes=12345)
    tr.init(segment_bytes=tr_runtime.current().config.segment_bytes)  # same: a no-op
    with pytest.raises(ValueError, match="root_rank 3 is not a rank"):
        tr.broadcast(np.ones(2), root_rank=3)
    with pytest.raises(ValueError, match="splits"):
        tr.alltoall(np.ones(4), splits=[1, 2])
    with pytest.raises(ValueError, match="unknown reduction op"):
        tr.allreduce(np.ones(2), op=42)
    with pytest.raises(ValueError, match="at least one dimension"):
        tr.allgather(np.float32(1))


def test_calls_before_init_and_after_shutdown() -> None:
    assert not tr.is_initialized()
    with pytest.raises(tr.ShutdownError, match="init"):
        tr.allreduce(np.ones(2))


def test_handshake_names_mixed_installs() -> None:
    from totalreduce.transport.mesh import _check_hello

    mine = {"protocol": 4, "version": "0.1.0", "job": "j", "rank": 0, "size": 2}
    other = dict(mine, version="0.2.0", rank=1)
    problem = _check_hello(other, mine)
    assert problem is not None and "runs totalreduce '0.2.0'" in problem \
        and "install the same version on every host" in problem
    assert _check_hello(dict(mine, rank=1), mine) is None
    assert "size differs" in (_check_hello(dict(mine, size=3), mine) or "")


def test_ctrl_c_while_starting_a_second_phase_is_kept_for_the_application() -> None:
    # A two-phase op (allgather: sizes, then data) whose first phase is done already
    # starts its second on the application's thread; a Ctrl-C landing there must not
    # become that op's error and vanish.
    from types import SimpleNamespace

    from totalreduce.engine.payload import OpFuture
    from totalreduce.interrupts import deferred
    from totalreduce.scheduling.selfguided import SelfGuided

    first = OpFuture()
    first.resolve(None)

    def second() -> OpFuture:
        raise KeyboardInterrupt

    ops = SelfGuided.__new__(SelfGuided)
    ops._engine = SimpleNamespace(wait=lambda f, t: f.wait_event(t))  # type: ignore[assignment]
    try:
        outer = ops._two_phase(first, second)
        assert outer.done() and isinstance(outer.error(), KeyboardInterrupt)
        assert deferred.pending  # raised at the application's next call
    finally:
        deferred.pending = False


def test_address_store_client_follows_a_store_replaced_on_its_address() -> None:
    """Rank 0's store is replaced after a shutdown() and init(): a rank already waiting
    on the old one moves to the new one, with the keys it had set."""
    from totalreduce.rendezvous.kvstore import KVClient, KVServer

    old = KVServer("127.0.0.1", 0, b"s", "job")
    port = int(old.address.rpartition(":")[2])
    early = KVClient(old.address, b"s", "job", timeout=10)
    early.set("job/world1/addr/1", b"one")
    got: list[bytes] = []
    waiter = threading.Thread(target=lambda: got.append(early.get("job/world1/addr/0", 10)))
    waiter.start()
    old.close()
    new = KVServer("127.0.0.1", port, b"s", "job")
    try:
        late = KVClient(new.address, b"s", "job", timeout=10)
        late.set("job/world1/addr/0", b"zero")
        assert late.get("job/world1/addr/1", 10) == b"one"
        waiter.join(15)
        assert got == [b"zero"]
        late.close()
    finally:
        early.close()
        new.close()


def test_config_errors_name_the_variable_and_say_why(tmp_path) -> None:
    from totalreduce.config import ConfigError, horovod_notices

    with pytest.raises(ConfigError) as info:
        Config.from_env({"HOROVOD_FUSION_THRESHOLD": "-5", "TOTALREDUCE_OP_TIMEOUT": "x"})
    assert info.value.problems == [
        "TOTALREDUCE_OP_TIMEOUT=x: not a number; must be >= 0 (seconds; 0 = never)",
        "HOROVOD_FUSION_THRESHOLD=-5: must be >= 0 (bytes; 0 = no fusion)"]
    with pytest.raises(ConfigError, match=r"^fusion_threshold=-5: must be >= 0"):
        Config.from_env({}, fusion_threshold=-5)
    assert Config.from_env({"TOTALREDUCE_CONNECT_TIMEOUT": "0"}).connect_timeout == 0
    timeline = tmp_path / "new" / "folder" / "t.json"
    assert Config.from_env({"TOTALREDUCE_TIMELINE": str(timeline)}).timeline == str(timeline)
    assert timeline.parent.is_dir()
    assert horovod_notices({"TOTALREDUCE_FUSION_TRESHOLD": "5", "TOTALREDUCE_RANK": "0"}) == [
        "totalreduce: TOTALREDUCE_FUSION_TRESHOLD=5: not a totalreduce setting, ignored "
        "(did you mean TOTALREDUCE_FUSION_THRESHOLD?)"]


def test_rendezvous_port_in_use_says_which_and_what_to_do(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's rank 0 serves the store at MASTER_PORT + 1; something else has it."""
    import os

    for var in list(os.environ):
        if var.startswith(("TOTALREDUCE_", "SLURM_", "PMI_", "OMPI_")):
            monkeypatch.delenv(var)
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for var, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                           "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(port - 1), "TOTALREDUCE_SECRET": "x"}.items():
            monkeypatch.setenv(var, value)
        with pytest.raises(OSError) as info:
            tr.init()
    assert str(info.value) == (
        f"rank 0 cannot serve the rendezvous store: port {port} (MASTER_PORT + 1: "
        "torchrun's own store has MASTER_PORT) is in use by another process: start the job "
        "with another MASTER_PORT (torchrun --master-port), or set "
        "TOTALREDUCE_RENDEZVOUS=host:port to a free port on every rank")
    assert not tr.is_initialized()


@pytest.mark.parametrize("n", [0, 1, 65_535, 65_536 + 7, 200_003])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("alias", [False, True])
def test_add_select_matches_its_three_passes(n: int, dtype: type, alias: bool) -> None:
    from totalreduce.compression.sparse import add_select, select

    rng = np.random.default_rng(n)
    acc = rng.standard_normal(n).astype(dtype)
    inp = rng.standard_normal(n).astype(dtype)
    want_acc = acc + inp
    threshold = 2.5
    want = select(want_acc, threshold)
    out = inp if alias else np.full(n, 7, dtype)
    got = add_select(acc, inp, threshold, out)
    np.testing.assert_array_equal(acc, want_acc)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, np.flatnonzero(np.abs(want_acc) >= threshold))
    assert not out.any()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_reductions_overflow_to_inf_whatever_the_callers_error_mode(dtype: type) -> None:
    # The small path reduces on the caller's thread, where the caller's np.seterr holds.
    from totalreduce.engine.reducer import reduce_into

    big = np.finfo(dtype).max
    dest = np.array([big, 1, -big], dtype)
    incoming = np.array([big, 2, -big], dtype)
    with np.errstate(all="raise"):
        reduce_into(np.add, dest, incoming.tobytes())
        assert np.geterr()["over"] == "raise"  # the caller's mode is back
    np.testing.assert_array_equal(dest, np.array([np.inf, 3, -np.inf], dtype))


def test_the_slow_ring_choice_tries_both_ways_then_keeps_the_faster_and_looks_again() -> None:
    choice = SlowRingChoice()
    key = SlowRingChoice.key("broadcast", 1 << 20)
    assert key == SlowRingChoice.key("broadcast", (2 << 20) - 1)  # one power-of-two class
    assert key != SlowRingChoice.key("alltoall", 1 << 20)
    # Learning: the loop first, then whichever way has fewer times, until each has two;
    # each way's time is the least of its last five, so the loop's cold first op (2 ms)
    # does not decide: 100 us against the caller's thread's 200.
    ways = []
    for t in (2e-3, 200e-6, 100e-6, 250e-6):
        left = choice.leave(key)
        ways.append(left)
        choice.took(key, left, t)
    assert ways == [True, False, True, False]
    # Then the faster way, and the slower one twice in a row after 32 choices; while it
    # stays three times slower, after twice as many each time.
    ways = []
    for _ in range(257):
        left = choice.leave(key)
        ways.append(left)
        choice.took(key, left, 100e-6 if left else 300e-6)
    assert [i for i, left in enumerate(ways) if not left] == [31, 32, 64, 65, 129, 130]
    # The first of the two is not timed: a slow change of way does not count, the time
    # after it does, and a faster caller's thread wins from then on.
    assert choice.leave(key)  # the 127th choice since the last pair
    choice.took(key, True, 100e-6)
    assert not choice.leave(key)
    choice.took(key, False, 10e-3)
    assert not choice.leave(key)
    choice.took(key, False, 50e-6)
    assert not choice.leave(key) and not choice.leave(key)
    # Ways close in time (within 1.5x) are tried every 32 choices, however long that lasts.
    close = SlowRingChoice.key("alltoall", 1 << 20)
    ways = []
    for _ in range(4 + 130):
        left = choice.leave(close)
        ways.append(left)
        choice.took(close, left, 100e-6 if left else 120e-6)
    assert [i for i, left in enumerate(ways[4:]) if not left] == [31, 32, 64, 65, 97, 98]
    # An op that left is timed through its finish, which still returns its result.
    other = SlowRingChoice.key("allgather", 4 << 20)
    assert choice.leave(other)
    assert choice.timed(lambda: "result", other)() == "result"
    assert not choice.leave(other)  # the loop has a time now, the caller's thread none
    # Whether an op on the loop lends is a choice of its own, timed either way.
    lending = SlowRingChoice.key("broadcast", 1 << 20, lending=True)
    assert lending not in (key, SlowRingChoice.key("broadcast", 1 << 20))
    assert choice.leave(lending)
    assert choice.timed(lambda: 1, lending, True)() == 1
    assert not choice.leave(lending)  # lent once: now copied through the ring
    choice.timed(lambda: 2, lending, False)()
    assert choice.leave(lending)  # one time each: lent again
    # The choices made since a count, oldest first, as far back as the last 64.
    count = choice.choices
    assert choice.made_since(count) == []
    choice.leave(other)
    assert choice.made_since(count) == [(other, False)]
    # Bounded: one entry per (kind, size class), the stalest forgotten.
    for size in range(1, 400):
        choice.leave(SlowRingChoice.key(f"op{size}", size))
    assert len(choice) == 128
    made = choice.made_since(count)
    assert len(made) == 64 and made[-1] == (SlowRingChoice.key("op399", 399), True)


def test_reductions_lend_from_a_size_that_depends_on_whether_the_host_is_crowded() -> None:
    from types import SimpleNamespace

    asked: list[np.ndarray] = []

    def lends(nbytes: int, crowded: bool, cma_bytes: int = -1, share: float | None = 1.0,
              source: np.ndarray | None = None, slow: bool = True, size: int = 3,
              ) -> tuple[bool, ...]:
        """``slow``: most rings copy slowly now; ``size``: ranks.  The first two values;
        at 2 ranks also the third (whether the ranks agree on lending while slow)."""
        def huge_share(buf: np.ndarray) -> float | None:
            asked.append(buf)
            return share

        me = SimpleNamespace(_config=SimpleNamespace(cma_bytes=cma_bytes), _peers=[1],
                             size=size,
                             _engine=SimpleNamespace(crowded=lambda: crowded,
                                                     huge_share=huge_share,
                                                     lends=lambda peers: slow))
        work = np.empty(nbytes, np.uint8)  # never touched: no pages behind it
        got = SelfGuided._reduction_lends(me, work, source)  # type: ignore[arg-type]
        return got if size == 2 else got[:2]

    # (lend, lend while a ring is slow), by size and host, out of huge pages.
    assert lends(4 << 20, True) == (False, False) and lends(8 << 20, True) == (True, True)
    assert lends(16 << 20, False) == (False, True) and lends(32 << 20, False) == (True, True)
    # Out of small pages, neither; where the kernel cannot say, by size as before.
    assert lends(32 << 20, False, share=0.5) == (False, False)
    assert lends(8 << 20, True, share=0.0) == (False, False)
    assert lends(16 << 20, False, share=0.0) == (False, False)
    assert lends(32 << 20, False, share=None) == (True, True)
    # Below the crowded bound neither, even while the rings copy slowly, and the pages are
    # not asked about (a small op's every call); nor for one the size would not lend
    # while the rings copy fast: neither way turns on them then.  One the size would lend
    # asks all the same.
    asked.clear()
    assert lends(4 << 20, False, share=1.0) == (False, False) and not asked
    assert lends(1 << 20, True, share=1.0) == (False, False) and not asked
    assert lends(16 << 20, False, share=0.0, slow=False) == (False, True) and not asked
    assert lends(32 << 20, False, share=0.0, slow=False) == (False, False) and asked
    assert lends(8 << 20, True, share=0.0, slow=False) == (False, False)
    # The buffer asked about is the caller's: the source, where the op reads one.
    source = np.ones(8 << 20, np.uint8)
    assert lends(8 << 20, True, source=source) == (True, True) and asked[-1] is source
    # CMA_BYTES set: as the user says, whatever the pages.
    assert lends(1 << 20, False, cma_bytes=0, share=0.0) == (True, True)
    # At 2 ranks, where a rank's choice for 8-32 MiB turned on its own pages or its rings'
    # pace, its Repeats lend while slow only where the peer would too; not where the size
    # alone decides (crowded, 32 MiB and up), nor below 8 MiB, nor where CMA_BYTES is set.
    assert lends(16 << 20, False, size=2) == (False, True, True)
    assert lends(16 << 20, False, share=0.0, size=2) == (False, False, True)
    assert lends(16 << 20, False, slow=False, size=2) == (False, True, True)
    assert lends(32 << 20, False, size=2) == (True, True, False)
    assert lends(8 << 20, True, size=2) == (True, True, False)
    assert lends(4 << 20, False, size=2) == (False, False, False)
    assert lends(16 << 20, False, cma_bytes=0, size=2) == (True, True, False)
