"""A tiny authenticated key-value store for swapping addresses at start-up.

The server runs in totalrun (or in rank 0 under an external launcher).  Every connection
first passes the HMAC handshake of :mod:`.auth`; after that a client may ``set`` a key and
``get`` one, waiting until some other rank has set it.  Frames are fixed binary headers
plus bytes; values are opaque bytes, never unpickled.  Strangers are logged and dropped.

A store served by rank 0 lives as long as rank 0's ``init()``: after ``shutdown()`` and a
new ``init()`` there is a new store on the same port.  A client whose store closes under
it (a rank that started its new ``init()`` before rank 0 left the old world) connects
again, to the new store, and sets its keys there again.
"""

from __future__ import annotations

import contextlib
import logging
import random
import socket
import struct
import threading
import time

from ..exceptions import AuthenticationError
from ..threads import start_daemon
from .auth import client_handshake, recv_exact, server_handshake

logger = logging.getLogger(__name__)

_REQ = struct.Struct("<BHId")   # op, key length, value length, wait timeout
_RESP = struct.Struct("<BI")    # status, value length
_SET, _GET = 1, 2
_OK, _MISSING, _CLOSING = 1, 2, 3
_MAX_KEY = 1024
_MAX_VALUE = 1 << 20
_HANDSHAKE_TIMEOUT = 10.0


class KVServer:
    """Serve the store on ``(host, port)`` (port 0 picks a free one) until :meth:`close`."""

    def __init__(self, host: str, port: int, secret: bytes, job_id: str) -> None:
        self._secret = secret
        self._hello = {"protocol": 1, "job": job_id, "role": "kv-server"}
        self._job = job_id
        self._data: dict[bytes, bytes] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._listener = socket.create_server((host, port), backlog=128)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._thread = start_daemon(self._accept, "totalreduce-kv")

    def set_generation(self, generation: int) -> None:
        """Publish how many workers the launcher has restarted (key ``JOB/generation``):
        the ranks meet again under each new generation (recovery/rendezvous.py)."""
        with self._cond:
            self._data[f"{self._job}/generation".encode()] = str(generation).encode()
            self._cond.notify_all()

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return
            start_daemon(self._serve, "totalreduce-kv-conn", (sock, addr))

    def _serve(self, sock: socket.socket, addr: object) -> None:
        with sock:
            try:
                hello = server_handshake(sock, self._secret, self._hello, _HANDSHAKE_TIMEOUT)
                if hello.get("job") != self._job:
                    raise AuthenticationError(f"job id {hello.get('job')!r} is not ours")
            except (AuthenticationError, OSError, ValueError) as exc:
                logger.warning("rendezvous: refused connection from %s: %s", addr, exc)
                return
            sock.settimeout(None)
            try:
                while True:
                    op, klen, vlen, wait = _REQ.unpack(recv_exact(sock, _REQ.size))
                    if klen > _MAX_KEY or vlen > _MAX_VALUE or op not in (_SET, _GET):
                        logger.warning("rendezvous: bad request from %s", addr)
                        return
                    key = recv_exact(sock, klen)
                    value = recv_exact(sock, vlen)
                    if op == _SET:
                        with self._cond:
                            self._data[key] = value
                            self._cond.notify_all()
                        sock.sendall(_RESP.pack(_OK, 0))
                    else:
                        found = self._wait(key, wait)
                        if found is not None:
                            sock.sendall(_RESP.pack(_OK, len(found)) + found)
                        else:
                            sock.sendall(_RESP.pack(_CLOSING if self._closed else _MISSING,
                                                    0))
            except (OSError, AuthenticationError, struct.error):
                return

    def _wait(self, key: bytes, timeout: float) -> bytes | None:
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            while key not in self._data and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._data.get(key)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._listener.close()


class _StoreGone(Exception):
    """The store closed our connection, or said it is closing."""


class KVClient:
    """A connection to a :class:`KVServer`; one request at a time (not thread-safe).

    If the store goes away, the client connects again (until the deadline of the call at
    hand) and repeats every ``set`` it made, so a store that was replaced by a new one on
    the same address (rank 0's, after a ``shutdown()`` and ``init()``) ends up with them.
    """

    def __init__(self, address: str, secret: bytes, job_id: str, timeout: float) -> None:
        self._address = address
        self._secret = secret
        self._job = job_id
        self._timeout = timeout
        self._sets: dict[bytes, bytes] = {}
        self._sock = self._connect(time.monotonic() + timeout)

    def _connect(self, deadline: float) -> socket.socket:
        host, _, port = self._address.rpartition(":")
        attempt = 0
        while True:
            try:
                sock = socket.create_connection((host, int(port)), timeout=10.0)
                break
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise OSError(f"cannot reach the rendezvous store at {self._address} "
                                  f"within {self._timeout:.0f} s; is rank 0 / totalrun "
                                  "running?") from exc
                time.sleep(random.uniform(0, min(1.0, 0.01 * 2 ** attempt)))
                attempt += 1
        try:
            client_handshake(sock, self._secret, {"protocol": 1, "job": self._job,
                                                  "role": "kv"}, _HANDSHAKE_TIMEOUT)
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        return sock

    def _reconnect(self, deadline: float, why: BaseException) -> None:
        self.close()
        if time.monotonic() >= deadline:
            raise OSError(f"the rendezvous store at {self._address} went away") from why
        logger.debug("rendezvous: the store at %s went away (%s); connecting again",
                     self._address, why)
        self._sock = self._connect(deadline)
        for key, value in self._sets.items():
            self._set(key, value)

    def _set(self, key: bytes, value: bytes) -> None:
        try:
            self._sock.sendall(_REQ.pack(_SET, len(key), len(value), 0.0) + key + value)
            status, _ = _RESP.unpack(recv_exact(self._sock, _RESP.size))
        except (OSError, AuthenticationError) as exc:
            raise _StoreGone(str(exc)) from exc
        if status != _OK:
            raise OSError(f"rendezvous store refused to set {key.decode()!r}")

    def set(self, key: str, value: bytes) -> None:
        k = key.encode()
        self._sets[k] = value
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                self._set(k, value)
                return
            except _StoreGone as exc:
                self._reconnect(deadline, exc)

    def get(self, key: str, timeout: float) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds for someone to set it.

        Raises:
            TimeoutError: nobody set the key in time.
        """
        k = key.encode()
        deadline = time.monotonic() + timeout
        while True:
            left = max(0.0, deadline - time.monotonic())
            try:
                self._sock.settimeout(left + 30.0)
                self._sock.sendall(_REQ.pack(_GET, len(k), 0, left) + k)
                status, vlen = _RESP.unpack(recv_exact(self._sock, _RESP.size))
                value = recv_exact(self._sock, vlen)
                self._sock.settimeout(None)
            except (OSError, AuthenticationError) as exc:
                self._reconnect(deadline, exc)
                continue
            if status == _CLOSING:
                self._reconnect(deadline, _StoreGone("the store is closing"))
                continue
            if status != _OK:
                raise TimeoutError(f"rendezvous key {key!r} was not set within "
                                   f"{timeout:.0f} s")
            return value

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
