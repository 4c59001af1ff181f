"""Joining a job over sockets: find the peers through the rendezvous store, connect the
mesh (mesh.py), and learn which ranks share this host."""

from __future__ import annotations

import errno
import os
import socket
import time

from ..config import Config
from ..rendezvous import KVClient, KVServer, LaunchInfo
from .mesh import Cancelled, WorldMoved, connect_mesh
from .registry import Connected

# TOTALREDUCE_CONNECT_TIMEOUT=0: as good as no limit (a year), as 0 means for the other
# timeouts.
_NO_LIMIT = 365 * 24 * 3600.0


def _route_ip(host: str) -> str:
    """The local address the kernel would use to reach ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def connect_job(launch: LaunchInfo, config: Config, ring_bytes: int,
                world: int | str = 0, cancelled: Cancelled | None = None) -> Connected:
    """Connect to every other rank of ``launch``'s job (rank 0 also serves the store when
    its launcher says so); same-host peers get rings of ``ring_bytes`` (0: none).

    ``world`` counts this process's earlier ``init()`` calls.  Every key it publishes is
    the world's own: after a shutdown() and a new init(), the store still holds the old
    world's addresses (the launcher's store outlives them), and a rank that looked
    those up would dial listeners that are closed, or about to be.  With recovery on,
    ``world`` names the restart generation instead, and ``cancelled()`` says when the
    job has moved on to a newer one (:class:`.mesh.WorldMoved` is raised then)."""
    kv: KVClient | None = None
    server: KVServer | None = None
    local = launch.launcher == "totalrun"
    rank = launch.rank
    timeout = config.connect_timeout or _NO_LIMIT
    try:
        assert launch.rendezvous is not None
        host, _, port = launch.rendezvous.rpartition(":")
        if launch.serve_rendezvous:
            server = _serve_store(int(port), launch)
        kv = KVClient(launch.rendezvous, launch.secret, launch.job_id, timeout)
        me = "127.0.0.1" if local else _route_ip(host)
        keys = world_keys(launch.job_id, world)

        def lookup(peer: int, timeout: float) -> str:
            assert kv is not None
            key = f"{keys}/addr/{peer}"
            if cancelled is None:
                return kv.get(key, timeout).decode()
            deadline = time.monotonic() + timeout
            while True:
                try:
                    return kv.get(key, min(0.5, max(0.0, deadline - time.monotonic()))).decode()
                except TimeoutError:
                    if cancelled():
                        raise WorldMoved(f"rank {rank}: the job moved to a newer world") \
                            from None
                    if time.monotonic() >= deadline:
                        raise

        def publish(addr: str) -> None:
            assert kv is not None
            kv.set(f"{keys}/addr/{rank}", addr.encode())

        transport = connect_mesh(rank, launch.size, launch.secret, launch.job_id,
                                 "127.0.0.1" if local else "0.0.0.0", me, publish, lookup,
                                 timeout, ring_bytes, config.lend_bytes, world, cancelled,
                                 config.host_id, config.slow_ring_gbps * 1e9)
        local_rank, local_size = _locality(launch, transport.hosts)
        return Connected(transport, local_rank, local_size,
                         server.close if server is not None else None)
    except BaseException as exc:
        if server is not None:
            server.close()
        if isinstance(exc, OSError) and not isinstance(exc, WorldMoved) and \
                not _port_in_use(exc):
            exc.add_note(f"rank {rank} had TOTALREDUCE_CONNECT_TIMEOUT="
                         f"{config.connect_timeout:g} s to reach the rendezvous and every "
                         "other rank (0: no limit); a rank that started late or not at all "
                         "shows here first")
        raise
    finally:
        if kv is not None:
            kv.close()


def _port_in_use(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE


def _serve_store(port: int, launch: LaunchInfo) -> KVServer:
    """Rank 0's rendezvous store, or an error that says which port is taken and why we
    wanted it (Errno 98 alone does not)."""
    try:
        return KVServer("0.0.0.0", port, launch.secret, launch.job_id)
    except OSError as exc:
        if not _port_in_use(exc):
            raise
        if os.environ.get("TOTALREDUCE_RENDEZVOUS"):
            where = (f"port {port}, from TOTALREDUCE_RENDEZVOUS, is in use by another "
                     "process: set TOTALREDUCE_RENDEZVOUS=host:port to a free port on "
                     "every rank")
        else:
            where = (f"port {port} (MASTER_PORT + 1: {launch.launcher}'s own store has "
                     "MASTER_PORT) is in use by another process: start the job with "
                     "another MASTER_PORT (torchrun --master-port), or set "
                     "TOTALREDUCE_RENDEZVOUS=host:port to a free port on every rank")
        error = OSError(f"rank 0 cannot serve the rendezvous store: {where}")
        error.errno = exc.errno
        raise error from None


def world_keys(job_id: str, world: int | str) -> str:
    """The prefix of a world's keys in the rendezvous store (the first world's is the job
    id alone)."""
    return job_id if world == 0 else f"{job_id}/world{world}"


def _locality(launch: LaunchInfo, hosts: tuple[int, ...] | None) -> tuple[int, int]:
    """The launcher's local rank and size, else those among the ranks that published
    this host's identity."""
    if launch.local_rank is not None and launch.local_size is not None:
        return launch.local_rank, launch.local_size
    assert hosts is not None
    same = [r for r in range(launch.size) if hosts[r] == hosts[launch.rank]]
    return same.index(launch.rank), len(same)
