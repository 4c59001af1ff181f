"""Fuzzing what strangers (or corrupted streams) can put in front of our parsers.

Every input must end in a clean rejection (WireError / AuthenticationError / OSError from
a bounded read), never another exception or a hang, and the parties must stay unharmed:
the address store keeps serving its real clients.  Bounded by example counts, so the
suite's time stays fixed (``FUZZ_EXAMPLES`` raises them for a longer hunt).
"""

from __future__ import annotations

import os
import socket
import struct
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import run_ok, send_and_drain
from totalreduce.exceptions import AuthenticationError
from totalreduce.rendezvous import KVClient, KVServer
from totalreduce.rendezvous.auth import client_handshake, server_handshake
from totalreduce.transport.wire import HEADER_SIZE, MAGIC, Header, WireError, unpack_header

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])
SECRET = b"fuzz-secret"
PREAMBLE = b"TRAUTH1\n"


@FUZZ
@given(st.binary(min_size=HEADER_SIZE, max_size=HEADER_SIZE))
def test_header_parser_accepts_or_rejects_cleanly(raw: bytes) -> None:
    try:
        header = unpack_header(raw)
    except WireError:
        return
    assert header.pack() == raw  # every byte of an accepted header is a field


@FUZZ
@given(st.binary(min_size=HEADER_SIZE - 2, max_size=HEADER_SIZE - 2))
def test_header_parser_with_our_magic(rest: bytes) -> None:
    """Past the magic every field is arbitrary: still a Header or a WireError."""
    raw = struct.pack("<H", MAGIC) + rest
    try:
        header = unpack_header(raw)
    except WireError:
        return
    assert isinstance(header, Header) and unpack_header(header.pack()) == header


def _serve_once(peer_bytes: bytes, role: str) -> BaseException | None:
    """Run our side of the handshake against a peer that sends ``peer_bytes`` then closes
    its write side; return what our side raised (None: it accepted)."""
    ours, theirs = socket.socketpair()

    t = threading.Thread(target=send_and_drain, args=(theirs, peer_bytes, 10.0),
                         daemon=True)
    t.start()
    try:
        if role == "server":
            server_handshake(ours, SECRET, {"job": "j"}, timeout=2.0)
        else:
            client_handshake(ours, SECRET, {"job": "j"}, timeout=2.0)
        return None
    except BaseException as exc:
        return exc
    finally:
        ours.close()
        t.join(5)
        theirs.close()


@FUZZ
@given(st.binary(max_size=600), st.sampled_from(["server", "client"]),
       st.booleans())
def test_handshake_rejects_garbage_cleanly(noise: bytes, role: str, preamble: bool) -> None:
    error = _serve_once((PREAMBLE if preamble else b"") + noise, role)
    assert isinstance(error, AuthenticationError | OSError), repr(error)


@pytest.fixture(scope="module")
def store() -> KVServer:
    server = KVServer("127.0.0.1", 0, SECRET, "fuzzjob")
    yield server
    server.close()


@FUZZ
@given(st.binary(max_size=400), st.booleans())
def test_address_store_survives_strangers(store: KVServer, noise: bytes,
                                          preamble: bool) -> None:
    host, _, port = store.address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=2) as s:
        send_and_drain(s, (PREAMBLE if preamble else b"") + noise, 2.0)


@FUZZ
@given(st.binary(min_size=1, max_size=200))
def test_address_store_survives_garbage_from_an_authenticated_client(
        store: KVServer, noise: bytes) -> None:
    """A client that passed the handshake and then sends garbage is cut off; the store
    keeps its data and keeps serving others."""
    host, _, port = store.address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=2) as s:
        client_handshake(s, SECRET, {"protocol": 1, "job": "fuzzjob", "role": "kv-client"},
                         timeout=2)
        send_and_drain(s, noise, 2.0)


def test_address_store_still_serves_after_the_fuzzing(store: KVServer) -> None:
    client = KVClient(store.address, SECRET, "fuzzjob", timeout=5)
    try:
        client.set("after", b"fuzz")
        assert client.get("after", timeout=5) == b"fuzz"
    finally:
        client.close()


def test_a_running_job_survives_garbage_at_its_listener() -> None:
    result = run_ok(2, "workers:fuzz_acceptor", {"seed": 7, "inputs": 150}, timeout=90)
    assert result.report(0).get("fuzzed") == 150, result.explain()
    for r in range(2):
        assert result.report(r).get("finished"), result.explain()
