"""Point-to-point messages on tensors: the numpy API's ``send`` and ``recv``
(``totalreduce.send``), staged like every collective (tensors.py)."""

from __future__ import annotations

from typing import Any

import torch

import totalreduce as _tr

from .collectives import TorchHandle
from .tensors import stage


def send_async(tensor: torch.Tensor, dest: int, tag: int = 0) -> TorchHandle:
    """Start sending ``tensor`` to rank ``dest``; ``wait()`` returns None once it is sent.
    Messages of one tag between two ranks arrive in the order they were sent."""
    staged = stage(tensor, "send")
    return TorchHandle(_tr.send_async(staged.array, dest, tag), lambda _none: None)


def send(tensor: torch.Tensor, dest: int, tag: int = 0) -> None:
    """Send ``tensor`` to rank ``dest`` and return once it is sent."""
    _tr.send(stage(tensor, "send").array, dest, tag)


def recv_async(tensor: torch.Tensor, source: int | None = None, tag: int = 0
               ) -> TorchHandle:
    """Start receiving the next message of ``tag`` from ``source`` (None: any rank) into
    ``tensor`` (same dtype and number of elements as the message); ``wait()`` returns
    ``tensor``, or ``(tensor, source)`` when ``source`` is None."""
    staged = stage(tensor, "recv")

    def finish(result: Any) -> Any:
        staged.write_back()
        return (tensor, result[1]) if source is None else tensor

    return TorchHandle(_tr.recv_async(staged.array, source, tag), finish)


def recv(tensor: torch.Tensor, source: int | None = None, tag: int = 0) -> Any:
    """Receive into ``tensor`` (see :func:`recv_async`): ``tensor``, or ``(tensor,
    source)`` when ``source`` is None."""
    staged = stage(tensor, "recv")
    got = _tr.recv(staged.array, source, tag)
    staged.write_back()
    return (tensor, int(got[1])) if source is None else tensor


__all__ = ["recv", "recv_async", "send", "send_async"]
