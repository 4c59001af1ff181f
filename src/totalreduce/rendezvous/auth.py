"""Mutual HMAC challenge-response over a blocking socket, before anything else is read.

Both sides prove they hold the job secret without sending it: each sends a fresh nonce and
answers the other's with HMAC-SHA256(secret, role || nonce_peer || nonce_own || hello).
The hello (JSON: protocol version, job id, rank, world size) is covered by the MAC, so a
stranger can neither join nor replay a recorded handshake.  Every read is bounded in size
and time: garbage or silence ends in :class:`AuthenticationError`, never a hang.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
from typing import Any

from ..exceptions import AuthenticationError

_NONCE = 32
_MAC = 32
_MAX_HELLO = 4096
_PREAMBLE = b"TRAUTH1\n"


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Read exactly ``n`` bytes.

    Raises:
        AuthenticationError: the peer closed the connection first.
    """
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise AuthenticationError("connection closed by peer")
        buf += chunk
    return bytes(buf)


def _mac(secret: bytes, role: bytes, nonce_peer: bytes, nonce_own: bytes, hello: bytes) -> bytes:
    return hmac.new(secret, role + nonce_peer + nonce_own + hello, hashlib.sha256).digest()


def _hello(secret: bytes, role: bytes, nonce_peer: bytes, nonce_own: bytes,
           hello: dict[str, Any]) -> bytes:
    body = json.dumps(hello, sort_keys=True).encode()
    mac = _mac(secret, role, nonce_peer, nonce_own, body)
    return struct.pack("<I", len(body)) + body + mac


def _recv_hello(sock: socket.socket, secret: bytes, role: bytes, nonce_own: bytes,
                nonce_peer: bytes) -> dict[str, Any]:
    (length,) = struct.unpack("<I", recv_exact(sock, 4))
    if length > _MAX_HELLO:
        raise AuthenticationError(f"handshake hello of {length} bytes is too long")
    body = recv_exact(sock, length)
    mac = recv_exact(sock, _MAC)
    if not hmac.compare_digest(mac, _mac(secret, role, nonce_own, nonce_peer, body)):
        raise AuthenticationError("peer does not hold the job secret (HMAC mismatch)")
    try:
        hello = json.loads(body)
    except ValueError:
        raise AuthenticationError("handshake hello is not JSON") from None
    if not isinstance(hello, dict):
        raise AuthenticationError("handshake hello is not a JSON object")
    return hello


def client_handshake(sock: socket.socket, secret: bytes, hello: dict[str, Any],
                     timeout: float) -> dict[str, Any]:
    """Authenticate a connection we dialled; return the server's hello.

    Raises:
        AuthenticationError: the server failed the challenge or spoke garbage.
        OSError: the connection broke or timed out.
    """
    sock.settimeout(timeout)
    sock.sendall(_PREAMBLE)
    if recv_exact(sock, len(_PREAMBLE)) != _PREAMBLE:
        raise AuthenticationError("peer did not answer with the totalreduce preamble")
    nonce_server = recv_exact(sock, _NONCE)
    nonce_client = os.urandom(_NONCE)
    # One write per turn of the exchange: two small writes before a read wait out the
    # peer's delayed acknowledgement (Nagle's algorithm), 40 ms on Linux.
    sock.sendall(nonce_client + _hello(secret, b"client", nonce_server, nonce_client, hello))
    return _recv_hello(sock, secret, b"server", nonce_client, nonce_server)


def server_handshake(sock: socket.socket, secret: bytes, hello: dict[str, Any],
                     timeout: float) -> dict[str, Any]:
    """Authenticate a connection we accepted; return the client's hello.

    The server checks the client's MAC before it sends anything that depends on the
    secret, so a stranger learns nothing but the preamble and a nonce.

    Raises:
        AuthenticationError: the client failed the challenge or spoke garbage.
        OSError: the connection broke or timed out.
    """
    sock.settimeout(timeout)
    if recv_exact(sock, len(_PREAMBLE)) != _PREAMBLE:
        raise AuthenticationError("client did not start with the totalreduce preamble")
    nonce_server = os.urandom(_NONCE)
    sock.sendall(_PREAMBLE + nonce_server)  # one write: see client_handshake
    nonce_client = recv_exact(sock, _NONCE)
    peer = _recv_hello(sock, secret, b"client", nonce_server, nonce_client)
    sock.sendall(_hello(secret, b"server", nonce_client, nonce_server, hello))
    return peer
