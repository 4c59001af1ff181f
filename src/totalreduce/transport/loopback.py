"""The transport of a world of one: there is nobody to talk to.

Every schedule at size 1 has no messages, so the engine never calls into this; it exists
so that a single process runs the same code path as a job (scripts work unchanged with
``python train.py``)."""

from __future__ import annotations

import socket

from .base import MessageHandler, Transport


class LoopbackTransport(Transport):
    rank = 0
    size = 1

    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)

    def start(self, handler: MessageHandler) -> None:
        pass

    def want_send(self, peer: int) -> None:
        raise AssertionError("a world of one has no peers")

    def poll(self, timeout: float | None) -> None:
        import select

        ready, _, _ = select.select([self._r], [], [], timeout)
        if ready:
            try:
                self._r.recv(4096)
            except BlockingIOError:
                pass

    def wake(self) -> None:
        try:
            self._w.send(b"\0")
        except OSError:
            pass

    def pending_output(self) -> bool:
        return False

    def abort(self) -> None:
        for s in (self._r, self._w):
            try:
                s.close()
            except OSError:
                pass
