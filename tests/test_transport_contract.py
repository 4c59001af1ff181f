"""Every transport passes the same contract (contract.py): inproc, tcp and shm with their
ranks as threads of this process, mpi with real ranks under mpiexec."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from contract import PORT_SIZES, check_rank
from harness import mpiexec, run_ok
from totalreduce.transport import poller as poller_module
from totalreduce.transport.base import Transport
from totalreduce.transport.cma import cma_works
from totalreduce.transport.inproc import InprocWorld
from totalreduce.transport.mesh import _LOCAL_SNDBUF, connect_mesh
from totalreduce.transport.shmring import shm_available
from totalreduce.transport.tcp import TcpTransport


def _in_threads(n: int, make: Callable[[int], Transport]) -> list[dict[str, int]]:
    """Build rank r's transport with ``make(r)`` and run the contract, each rank in its
    own thread; re-raise the first rank's failure."""
    results: list[dict[str, int] | BaseException | None] = [None] * n

    def rank(r: int) -> None:
        try:
            results[r] = check_rank(make(r), timeout=60)
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    for r, res in enumerate(results):
        if isinstance(res, BaseException):
            raise AssertionError(f"rank {r} failed the contract") from res
        assert res is not None, f"rank {r} hung"
    return [res for res in results if isinstance(res, dict)]


def _socket_mesh(n: int, ring_bytes: int, lend_bytes: int,
                 hosts: tuple[str, ...] | None = None) -> Callable[[int], TcpTransport]:
    secret = secrets.token_bytes(32)
    addrs: dict[int, str] = {}
    cond = threading.Condition()

    def publish_for(r: int) -> Callable[[str], None]:
        def publish(addr: str) -> None:
            with cond:
                addrs[r] = addr
                cond.notify_all()
        return publish

    def lookup(peer: int, timeout: float) -> str:
        with cond:
            assert cond.wait_for(lambda: peer in addrs, timeout)
            return addrs[peer]

    return lambda r: connect_mesh(r, n, secret, "contract", "127.0.0.1", "127.0.0.1",
                                  publish_for(r), lookup, 30.0, ring_bytes, lend_bytes,
                                  host=hosts[r] if hosts else "")


@pytest.mark.parametrize("n", [2, 3])
def test_inproc(n: int) -> None:
    world = InprocWorld(n)
    _in_threads(n, lambda r: world.transports[r])


@pytest.mark.parametrize("n", [2, 3])
def test_inproc_seeded(n: int) -> None:
    world = InprocWorld(n, seed=n, link_messages=2)
    _in_threads(n, lambda r: world.transports[r])


@pytest.mark.parametrize("n", [2, 3])
def test_tcp(n: int) -> None:
    stats = _in_threads(n, _socket_mesh(n, 0, 0))
    # Sockets have ports too: the first rank to post was shown every message posted to it.
    assert all(s["ported"] for s in stats), stats
    assert sum(s["shown"] for s in stats) >= (n - 1) * len(PORT_SIZES), stats


@contextlib.contextmanager
def _connected(make: Callable[[int], TcpTransport], n: int) -> Iterator[list[TcpTransport]]:
    """``n`` ranks' transports, connected each in its own thread; aborted after."""
    transports: list[TcpTransport | None] = [None] * n

    def build(r: int) -> None:
        transports[r] = make(r)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        built = [t for t in transports if t is not None]
        assert len(built) == n, "a rank did not connect"
        yield built
    finally:
        for t in transports:
            if t is not None:
                t.abort()


def test_sockets_between_ranks_of_one_host_keep_a_short_send_queue() -> None:
    # Ranks 0 and 1 on host "a", rank 2 on "b": a socket between ranks of one host gets a
    # small send buffer (its queue is all latency), one to another host the kernel's own.
    probe = socket.socket()
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _LOCAL_SNDBUF)
    local = probe.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)  # as the kernel keeps it
    probe.close()
    with _connected(_socket_mesh(3, 0, 0, ("a", "a", "b")), 3) as transports:
        sizes = {(r, peer): link.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
                 for r, t in enumerate(transports) for peer, link in t._links.items()}
        assert sizes[(0, 1)] == sizes[(1, 0)] == local, sizes
        assert all(sizes[pair] != local for pair in [(0, 2), (2, 0), (1, 2), (2, 1)]), sizes


def test_every_connection_and_lane_sends_at_once() -> None:
    # TCP_NODELAY on both ends of every connection, lanes included: with Nagle's rule a
    # lone small message waited for the peer's delayed ACK (up to 40 ms) while one sent
    # before it was unacknowledged, which held urgent ops behind a big op's whole time.
    with _connected(_socket_mesh(3, 0, 0), 3) as transports:
        socks = {(r, peer, kind): sock for r, t in enumerate(transports)
                 for kind, ends in (("link", t._links), ("lane", t._lane_ends))
                 for peer, sock in ((p, end.sock) for p, end in ends.items())}
        assert len(socks) == 3 * 2 * 2, sorted(socks)
        delayed = [key for key, sock in socks.items()
                   if not sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)]
        assert delayed == [], delayed


@pytest.mark.parametrize(("n", "cores", "crowded"), [(3, 2, True), (3, 3, False)])
def test_ranks_of_one_host_on_sockets_count_for_crowding(monkeypatch: pytest.MonkeyPatch,
                                                        n: int, cores: int,
                                                        crowded: bool) -> None:
    # Where a host's ranks outnumber its cores, a waiting thread gives its core away
    # between looks, on sockets as on rings: the caller's thread and the loop's waits.
    monkeypatch.setattr(poller_module, "cores", lambda: cores)
    with _connected(_socket_mesh(n, 0, 0), n) as transports:
        for t in transports:
            assert t.crowded() is crowded
            assert t._poller.crowded is crowded, t._poller.spin


@pytest.mark.skipif(not shm_available(), reason="no /dev/shm here")
@pytest.mark.parametrize("n", [2, 3])
def test_shm(n: int) -> None:
    # Small rings: the 3 MiB body goes in chunks and fills the ring again and again.
    stats = _in_threads(n, _socket_mesh(n, 64 << 10, 0))
    assert all(s["bodies_lent"] == 0 for s in stats)
    # Every pair has a ring; the first rank to post was shown every message posted to it.
    assert all(s["ported"] for s in stats), stats
    assert sum(s["shown"] for s in stats) >= (n - 1) * len(PORT_SIZES), stats


@pytest.mark.skipif(not shm_available(), reason="no /dev/shm here")
def test_peers_keep_to_sockets_when_dev_shm_has_no_room(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture
                                                       ) -> None:
    # A ring whose memory cannot be had is refused at set-up, with a warning, and the
    # pair talks over its socket instead.
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with caplog.at_level(logging.WARNING, logger="totalreduce"):
        stats = _in_threads(2, _socket_mesh(2, 64 << 10, 0))
    assert all(s["shm_messages_received"] == 0 < s["tcp_messages_received"]
               for s in stats), stats
    assert "no shared-memory ring to rank" in caplog.text


@pytest.mark.skipif(not (shm_available() and cma_works()), reason="no cross-memory attach")
def test_shm_lending() -> None:
    stats = _in_threads(2, _socket_mesh(2, 64 << 10, 24 << 20))
    # The three bodies of 64 KiB and more whose op claims 40 MiB (two of the script's,
    # the port's big one) are lent, to each peer.
    assert all(s["bodies_lent"] == 3 and s["ported"] for s in stats), stats


@pytest.mark.skipif(mpiexec() is None, reason="needs mpi4py and mpiexec")
def test_mpi() -> None:
    result = run_ok(3, "workers:transport_contract", {}, timeout=120, transport="mpi")
    for r in range(3):
        kept = result.report(r)["contract_kept"]
        assert kept["messages_sent"] > 0 and kept["ported"], result.explain()
    shown = sum(result.report(r)["contract_kept"]["shown"] for r in range(3))
    assert shown >= 2 * len(PORT_SIZES), result.explain()
