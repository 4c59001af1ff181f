"""A tiny authenticated key-value store for swapping addresses at start-up.

The server runs in totalrun (or in rank 0 under an external launcher).  Every connection
first passes the HMAC handshake of :mod:`.auth`; after that a client may ``set`` a key and
``get`` one, waiting until some other rank has set it.  Frames are fixed binary headers
plus bytes; values are opaque bytes, never unpickled.  Strangers are logged and dropped.
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
_OK, _MISSING = 1, 2
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
                        if found is None:
                            sock.sendall(_RESP.pack(_MISSING, 0))
                        else:
                            sock.sendall(_RESP.pack(_OK, len(found)) + found)
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


class KVClient:
    """A connection to a :class:`KVServer`; one request at a time (not thread-safe)."""

    def __init__(self, address: str, secret: bytes, job_id: str, timeout: float) -> None:
        host, _, port = address.rpartition(":")
        deadline = time.monotonic() + timeout
        attempt = 0
        while True:
            try:
                self._sock = socket.create_connection((host, int(port)), timeout=10.0)
                break
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise OSError(f"cannot reach the rendezvous store at {address} within "
                                  f"{timeout:.0f} s; is rank 0 / totalrun running?") from exc
                time.sleep(random.uniform(0, min(1.0, 0.01 * 2 ** attempt)))
                attempt += 1
        try:
            client_handshake(self._sock, secret, {"protocol": 1, "job": job_id, "role": "kv"},
                             _HANDSHAKE_TIMEOUT)
        except BaseException:
            self._sock.close()
            raise
        self._sock.settimeout(None)

    def set(self, key: str, value: bytes) -> None:
        k = key.encode()
        self._sock.sendall(_REQ.pack(_SET, len(k), len(value), 0.0) + k + value)
        status, _ = _RESP.unpack(recv_exact(self._sock, _RESP.size))
        if status != _OK:
            raise OSError(f"rendezvous store refused to set {key!r}")

    def get(self, key: str, timeout: float) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds for someone to set it.

        Raises:
            TimeoutError: nobody set the key in time.
        """
        k = key.encode()
        self._sock.settimeout(timeout + 30.0)
        self._sock.sendall(_REQ.pack(_GET, len(k), 0, timeout) + k)
        status, vlen = _RESP.unpack(recv_exact(self._sock, _RESP.size))
        value = recv_exact(self._sock, vlen)
        self._sock.settimeout(None)
        if status != _OK:
            raise TimeoutError(f"rendezvous key {key!r} was not set within {timeout:.0f} s")
        return value

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
