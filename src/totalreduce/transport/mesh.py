"""Setting up the TCP mesh: listen, dial, authenticate, share the shared-memory rings.

Rank ``i`` dials every rank below it and accepts every rank above it; each connection
begins with the mutual HMAC handshake of :mod:`..rendezvous.auth`, so a process without
the job secret is logged and dropped while the job carries on.  The hello names the
world (how many times this job's processes have called ``init()`` before): a process
that shuts down and initializes again is a new world, and a connection left over from
an older one is refused without a warning, as a matter of course.  Peers on the same host
then agree on a shared-memory ring per direction over their fresh sockets; a pair left
with no rings dials a second connection, a *lane* for urgent messages (socket_lane.py;
ringed pairs have theirs in shared memory).  The result is a :class:`.tcp.TcpTransport`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from ..exceptions import AuthenticationError
from ..rendezvous.auth import client_handshake, recv_exact, server_handshake
from ..threads import start_daemon
from ..version import __version__
from . import cma
from .shmring import LANE_BYTES, RingReader, RingWriter, ring_capacity, shm_available
from .tcp import TcpTransport
from .wire import PROTOCOL_VERSION

logger = logging.getLogger(__name__)


class WorldMoved(OSError):
    """The job moved on to a newer world while this rank was joining one (a rank died and
    was restarted meanwhile): join the newer one instead."""


Cancelled = Callable[[], bool]


# The send buffer of a socket to a rank on this host.  The kernel sizes a socket's buffer
# by the network it must keep busy (up to 4 MiB here); between two processes of one host
# there is no network, only a queue that everything sent later waits behind: an urgent
# small op during a 64 MB allreduce over loopback took 12.6 ms with the kernel's size and
# 2.1 ms with this one (bench preempt -n 2, tcp), and the 16-64 MB allreduces ran faster
# too (64 MB: 45 -> 29 ms).  Between hosts the kernel's sizing stays: at 256 KiB a 64 MB
# allreduce across two simulated hosts behind a 10 Gbit/s link ran 3x slower.
_LOCAL_SNDBUF = 256 << 10


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    # A peer whose host vanishes (no FIN, no RST) is noticed within ~25 s.
    for opt, val in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)


class _Acceptor:
    """Accepts on the listening socket for the transport's whole life.

    Each connection is authenticated on its own short-lived thread, so a stranger that
    connects and says nothing cannot delay real peers.  Connections that fail the
    handshake, or claim a rank we do not expect, are logged and closed.
    """

    def __init__(self, listener: socket.socket, rank: int, size: int, secret: bytes,
                 hello: dict[str, Any], timeout: float) -> None:
        self._listener = listener
        self._rank = rank
        self._size = size
        self._secret = secret
        self._hello = hello
        self._timeout = timeout
        self._cond = threading.Condition()
        # By (rank, lane): a lane is a second connection (socket_lane.py).
        self._accepted: dict[tuple[int, bool], socket.socket] = {}
        self._stopped = False
        self._thread = start_daemon(self._run, "totalreduce-accept")

    def _run(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return
            start_daemon(self._authenticate, "totalreduce-handshake", (sock, addr))

    def _authenticate(self, sock: socket.socket, addr: Any) -> None:
        try:
            peer = server_handshake(sock, self._secret, self._hello, self._timeout)
            prank = peer.get("rank")
            problem = _check_hello(peer, self._hello)
            if problem is not None and _other_world(peer, self._hello):
                logger.debug("rank %d: refused a connection from %s: %s", self._rank, addr,
                             problem)
                with contextlib.suppress(OSError):
                    sock.close()
                return
            if problem is None and not (isinstance(prank, int) and self._rank < prank
                                        < self._size):
                problem = f"rank {prank!r} is not one that dials rank {self._rank}"
            key = (prank if isinstance(prank, int) else -1, peer.get("lane") is True)
            with self._cond:
                if problem is None and (key in self._accepted or self._stopped):
                    problem = f"rank {prank} is already connected"
                if problem is None and isinstance(prank, int):
                    sock.settimeout(None)
                    self._accepted[key] = sock
                    self._cond.notify_all()
                    return
            raise AuthenticationError(problem)
        except (AuthenticationError, OSError, ValueError) as exc:
            logger.warning("rank %d: refused connection from %s: %s", self._rank, addr, exc)
            with contextlib.suppress(OSError):
                sock.close()

    def wait_for(self, ranks: set[int], deadline: float, cancelled: Cancelled | None = None,
                 lane: bool = False) -> dict[int, socket.socket]:
        """The connections (``lane``: the lanes) of ``ranks``, once each has come."""
        want = {(r, lane) for r in ranks}
        with self._cond:
            while not want <= set(self._accepted):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(r for r, _lane in want - set(self._accepted))
                    raise TimeoutError(f"rank {self._rank}: ranks {missing} did not connect "
                                       "in time")
                self._cond.wait(min(left, 0.5))
                if cancelled is not None and cancelled():
                    raise WorldMoved(f"rank {self._rank}: the job moved to a newer world")
            return {r: self._accepted[r, lane] for r in ranks}

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._listener.close()


def _check_hello(peer: dict[str, Any], mine: dict[str, Any]) -> str | None:
    if peer.get("version") != mine.get("version") or \
            peer.get("protocol") != mine.get("protocol"):
        return (f"rank {peer.get('rank')!r} runs totalreduce {peer.get('version')!r} "
                f"(wire protocol {peer.get('protocol')!r}), this rank "
                f"{mine.get('version')!r} (protocol {mine.get('protocol')!r}): install "
                "the same version on every host")
    for key in ("job", "size"):
        if peer.get(key) != mine.get(key):
            return f"{key} differs: peer has {peer.get(key)!r}, we have {mine.get(key)!r}"
    if peer.get("world", 0) != mine.get("world", 0):
        return (f"rank {peer.get('rank')!r} is in world {peer.get('world', 0)!r} of this job, "
                f"this rank in world {mine.get('world', 0)!r} (a connection from before a "
                "shutdown() and init())")
    return None


def _other_world(peer: dict[str, Any], mine: dict[str, Any]) -> bool:
    return peer.get("job") == mine.get("job") and peer.get("world", 0) != mine.get("world", 0)


def _dial(address: str, secret: bytes, hello: dict[str, Any], expect_rank: int,
          deadline: float, cancelled: Cancelled | None = None) -> socket.socket:
    host, _, port = address.rpartition(":")
    attempt = 0
    last: BaseException | None = None
    while True:
        if attempt and cancelled is not None and cancelled():
            raise WorldMoved(f"rank {hello['rank']}: the job moved to a newer world")
        left = deadline - time.monotonic()
        if left <= 0:
            raise OSError(f"could not connect to rank {expect_rank} at {address} in time") \
                from last
        try:
            sock = socket.create_connection((host, int(port)), timeout=min(left, 10.0))
        except OSError as exc:
            last = exc
            # Full-jitter backoff: many ranks dialling one that is not up yet spread out.
            time.sleep(random.uniform(0, min(1.0, 0.01 * 2 ** attempt)))
            attempt += 1
            continue
        try:
            _tune(sock)
            peer = client_handshake(sock, secret, hello, min(max(left, 1.0), 30.0))
        except BaseException:
            sock.close()
            raise
        problem = _check_hello(peer, hello)
        if problem is None and peer.get("rank") != expect_rank:
            problem = f"expected rank {expect_rank}, found rank {peer.get('rank')!r}"
        if problem is not None:
            sock.close()
            raise AuthenticationError(f"rank {hello['rank']}: {address}: {problem}")
        sock.settimeout(None)
        return sock


def host_identity(override: str = "") -> str:
    """What two ranks compare to learn whether they share a host (and so memory): the
    hostname and the kernel's boot id, which containers of one machine share; or
    ``override`` (TOTALREDUCE_HOST_ID), for hosts whose names repeat, or to make one
    machine's ranks act as several hosts'."""
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _send_json(sock: socket.socket, obj: dict[str, Any]) -> None:
    body = json.dumps(obj).encode()
    sock.sendall(struct.pack("<I", len(body)) + body)


def _recv_json(sock: socket.socket) -> dict[str, Any]:
    (n,) = struct.unpack("<I", recv_exact(sock, 4))
    if n > 4096:
        raise AuthenticationError(f"set-up message of {n} bytes is too long")
    obj = json.loads(recv_exact(sock, n))
    if not isinstance(obj, dict):
        raise AuthenticationError("set-up message is not a JSON object")
    return obj


Rings = dict[int, tuple[RingWriter | None, RingReader | None]]


def _share_rings(rank: int, socks: dict[int, socket.socket], ring_bytes: int,
                 lend: bool = False, host: str = "") -> tuple[Rings, dict[int, str]]:
    """Set up shared-memory rings with every peer on ``host`` (this host's identity),
    over the fresh sockets; also return every peer's host identity.

    Three rounds, each "send to all, then read from all" so none can deadlock: host
    identities, ring names, and whether the name could be opened.  The writer unlinks its
    file after the last round whatever happened, so nothing outlives the set-up in
    /dev/shm.  A pair that fails any step falls back to the socket, with a warning.

    With ``lend``, each writer also offers its pid and a random token in its memory; a
    reader that can read the token back with :func:`.cma.probe` says so, and large bodies
    in that direction are then lent instead of copied into the ring.
    """
    want = ring_capacity(ring_bytes) if ring_bytes > 0 and shm_available() else 0
    me = {"host": host or host_identity(), "ring_bytes": want}
    for sock in socks.values():
        _send_json(sock, me)
    theirs = {p: _recv_json(sock) for p, sock in socks.items()}
    peer_hosts = {p: str(msg.get("host")) for p, msg in theirs.items()}
    local = [p for p, msg in theirs.items() if msg == me and want]
    writers: dict[int, RingWriter] = {}
    readers: dict[int, RingReader] = {}
    acks: dict[int, dict[str, Any]] = {}
    token = secrets.token_bytes(16)
    probe_buf = bytearray(token)  # alive until every reader has tried it
    offer = {"pid": os.getpid(), "probe": cma.address_of(probe_buf), "token": token.hex()} \
        if lend else {}
    try:
        for peer in local:
            try:
                writers[peer] = RingWriter(want, LANE_BYTES)
            except OSError as exc:
                logger.warning("rank %d: no shared-memory ring to rank %d: %s", rank, peer, exc)
            _send_json(socks[peer], {"ring": writers[peer].name if peer in writers else "",
                                     **offer})
        for peer in local:
            msg = _recv_json(socks[peer])
            name = msg.get("ring")
            if name:
                try:
                    readers[peer] = RingReader(str(name), want, LANE_BYTES)
                except (OSError, ValueError) as exc:
                    logger.warning("rank %d: cannot open rank %d's shared-memory ring: %s",
                                   rank, peer, exc)
            can_read = peer in readers and lend and _probe(msg)
            if can_read:
                readers[peer].lender_pid = int(msg["pid"])
            _send_json(socks[peer], {"ok": peer in readers, "read": can_read})
        for peer in local:
            acks[peer] = _recv_json(socks[peer])
    except BaseException:
        for writer in writers.values():
            writer.close()
        for reader in readers.values():
            reader.close()
        raise
    finally:
        for writer in writers.values():
            writer.unlink()
    rings: Rings = {}
    for peer in local:
        mine = writers.get(peer)
        if mine is not None and acks[peer].get("ok") is not True:
            mine.close()
            mine = None
        if mine is not None:
            mine.lend = acks[peer].get("read") is True
        rings[peer] = (mine, readers.get(peer))
    return rings, peer_hosts


def _probe(offer: dict[str, Any]) -> bool:
    """Whether we can read the writer's memory (see :mod:`.cma`)."""
    try:
        pid, address, token = int(offer["pid"]), int(offer["probe"]), bytes.fromhex(
            str(offer["token"]))
    except (KeyError, TypeError, ValueError):
        return False
    return len(token) == 16 and cma.probe(pid, address, token)


def connect_mesh(rank: int, size: int, secret: bytes, job_id: str, bind_host: str,
                 advertise_host: str, publish: Callable[[str], None],
                 lookup: Callable[[int, float], str], timeout: float,
                 ring_bytes: int = 0, lend_bytes: int = 0, world: int | str = 0,
                 cancelled: Cancelled | None = None, host: str = "",
                 slow_ring_rate: float = 0.0) -> TcpTransport:
    """Connect this rank to every other rank and return the transport.

    ``publish(address)`` announces our listening address; ``lookup(rank, timeout)``
    returns another rank's (both come from the rendezvous store).  Peers on this host get
    shared-memory rings of ``ring_bytes`` per direction (0: sockets only), and the pieces
    of ops of ``lend_bytes`` or more are lent to them rather than copied through a ring,
    where the kernel allows it (:mod:`.cma`; 0: never), as is every body of 64 KiB or
    more while a ring's big copies run slower than ``slow_ring_rate`` bytes per second
    (:mod:`.copy_pace`; 0: never; negative: the speed of a lent body's copy here,
    :func:`.cma.read_rate`).  ``world`` counts the earlier
    ``init()`` calls of this job's processes (or names the restart generation it meets
    in, with recovery on); peers of another world are refused.  ``cancelled()`` is asked
    while waiting for peers: True raises :class:`WorldMoved`.  ``host`` overrides this
    host's identity (:func:`host_identity`); the transport's ``hosts`` say where every
    rank runs.

    Raises:
        OSError / TimeoutError: a peer could not be reached before ``timeout``.
        AuthenticationError: a peer did not prove the job secret.
    """
    deadline = time.monotonic() + timeout
    hello = {"protocol": PROTOCOL_VERSION, "version": __version__, "job": job_id,
             "rank": rank, "size": size, "world": world}
    listener = socket.create_server((bind_host, 0), backlog=max(16, size))
    acceptor = _Acceptor(listener, rank, size, secret, hello, min(timeout, 10.0))
    try:
        publish(f"{advertise_host}:{listener.getsockname()[1]}")
        socks: dict[int, socket.socket] = {}
        addresses: dict[int, str] = {}
        for peer in range(rank):
            addresses[peer] = address = lookup(peer, max(0.0, deadline - time.monotonic()))
            socks[peer] = _dial(address, secret, hello, peer, deadline, cancelled)
        accepted = acceptor.wait_for(set(range(rank + 1, size)), deadline, cancelled)
        for peer, sock in accepted.items():
            _tune(sock)
            socks[peer] = sock
        for sock in socks.values():
            sock.settimeout(max(1.0, deadline - time.monotonic()))
        mine = host or host_identity()
        rings, peer_hosts = _share_rings(rank, socks, ring_bytes, lend_bytes > 0, mine)
        for peer, sock in socks.items():
            sock.settimeout(None)
            if peer_hosts.get(peer) == mine:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _LOCAL_SNDBUF)
        # Peers with no rings each way (both ends agree which) get a lane of their own.
        unringed = {p for p in socks
                    if rings.get(p, (None, None))[0] is None or rings[p][1] is None}
        lanes: dict[int, socket.socket] = {}
        lane_hello = dict(hello, lane=True)
        for peer in sorted(p for p in unringed if p < rank):
            lanes[peer] = _dial(addresses[peer], secret, lane_hello, peer, deadline,
                                cancelled)
        accepted_lanes = acceptor.wait_for({p for p in unringed if p > rank}, deadline,
                                           cancelled, lane=True)
        for sock in accepted_lanes.values():
            # TCP_NODELAY above all: a lane carries lone small messages, which Nagle's
            # rule held back until the peer's delayed ACK (up to 40 ms) whenever one of
            # ours was still unacknowledged.
            _tune(sock)
        lanes.update(accepted_lanes)
    except BaseException:
        acceptor.stop()
        raise
    peer_hosts[rank] = mine
    return TcpTransport(rank, size, socks, acceptor, rings, lend_bytes,
                        number_hosts([peer_hosts[r] for r in range(size)]), slow_ring_rate,
                        lanes)


def number_hosts(identities: list[str]) -> tuple[int, ...]:
    """Each rank's host as a small number: hosts in the order their first rank comes."""
    seen: dict[str, int] = {}
    return tuple(seen.setdefault(ident, len(seen)) for ident in identities)
