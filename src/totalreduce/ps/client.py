"""A worker's side: the keys it has initialized, pushes and pulls cut into one request
per server holding a part of them, its clock, and the residuals of top-k pushes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

import totalreduce as tr

from .. import runtime as _runtime
from ..exceptions import PeerFailureError
from .keys import Key, Roles, key_id, shares
from .messages import (
    ERROR,
    Codec,
    Op,
    Reply,
    Request,
    as_bytes,
    data_from,
    encode_dtype,
    error_text,
    post_request,
    reply_from,
)


class TopK:
    """Push only the ``density`` share of largest magnitudes of each server's part; the
    rest is kept on the worker and added to the next push of the same key (residuals)."""

    def __init__(self, density: float) -> None:
        if not 0 < density <= 1:
            raise ValueError(f"TopK density must be in (0, 1], got {density!r}")
        self.density = density


class Client:
    def __init__(self, roles: Roles, rank: int, max_delay: int | None) -> None:
        self.roles, self.rank, self.max_delay = roles, rank, max_delay
        self.keys: dict[str, Key] = {}
        self.done = 0
        self.pushes = 0  # numbers each push, so that one sent twice is applied once
        self.finished = False

    # --- requests ----------------------------------------------------------------------

    def _exchange(self, what: str, posts: Sequence[tuple[int, Request, np.ndarray | None]],
                  data: Sequence[np.ndarray] | None = None) -> list[tuple[int, Reply]]:
        """Send one request to each server named, then take every reply (and, with
        ``data``, the bytes that follow each accepted one, into ``data[i]``); a refusal is
        raised after all replies are in, so no reply is left for the next request.

        With recovery on, a rank lost meanwhile takes every request of the lost world
        with it: once its replacement has joined, all are sent again (a server that
        holds a push already only acknowledges it)."""
        while True:
            try:
                return self._exchange_once(what, posts, data)
            except PeerFailureError as exc:
                _runtime.current().meet_replacement(exc)

    def _exchange_once(self, what: str,
                       posts: Sequence[tuple[int, Request, np.ndarray | None]],
                       data: Sequence[np.ndarray] | None) -> list[tuple[int, Reply]]:
        handles: list[tr.Handle] = []
        for server, request, payload in posts:
            handles += post_request(request, payload, self.roles.server_rank(server))
        replies, errors = [], []
        for i, (server, _, _) in enumerate(posts):
            rank = self.roles.server_rank(server)
            reply = reply_from(rank)
            if reply.status == ERROR:
                errors.append(error_text(reply, rank))
            elif data is not None:
                data_from(rank, data[i])
            replies.append((server, reply))
        for handle in handles:
            handle.wait()
        if errors:
            raise ValueError(f"rank {self.rank}: {what}: " + "; ".join(errors))
        return replies

    def _key(self, name: Any, what: str) -> Key:
        key = self.keys.get(name) if isinstance(name, str) else None
        if key is None:
            raise ValueError(f"rank {self.rank}: ps.{what}: no key named {name!r} on this "
                             "worker; ps.init(name, array) it first")
        return key

    def _range(self, key: Key, lo: Any, hi: Any, what: str) -> tuple[int, int]:
        lo = 0 if lo is None else lo
        hi = key.size if hi is None else hi
        for bound in (lo, hi):
            if not isinstance(bound, int | np.integer) or isinstance(bound, bool):
                raise TypeError(f"rank {self.rank}: ps.{what}({key.name!r}): lo and hi "
                                f"must be ints, got {bound!r}")
        if not 0 <= lo <= hi <= key.size:
            raise ValueError(f"rank {self.rank}: ps.{what}({key.name!r}): elements [{lo}, "
                             f"{hi}) are outside the key's [0, {key.size})")
        return int(lo), int(hi)

    # --- the API -----------------------------------------------------------------------

    def init(self, name: str, array: Any) -> np.ndarray:
        if not isinstance(name, str) or not name:
            raise ValueError(f"rank {self.rank}: ps.init: name must be a non-empty "
                             f"string, got {name!r}")
        array = np.asarray(array)
        if array.dtype.kind not in "biuf":
            raise TypeError(f"rank {self.rank}: ps.init({name!r}): dtype {array.dtype} is "
                            "not a number type")
        key = Key(name, key_id(name), array.shape, array.dtype, array.size,
                  shares(array.size, self.roles.servers))
        old = self.keys.get(name)
        if old is not None and (old.shape, old.dtype) != (key.shape, key.dtype):
            raise ValueError(f"rank {self.rank}: ps.init({name!r}): already a key of "
                             f"{old.dtype} {old.shape}, now {array.dtype} {array.shape}")
        encoded = name.encode()
        flat = array.reshape(-1)
        posts = []
        for server, lo, hi in key.shares:
            # One value wins: worker 0's; the others' inits wait until it is there.
            value = as_bytes(flat[lo:hi]) if self.rank == 0 else np.empty(0, np.uint8)
            payload = np.concatenate([np.frombuffer(encoded, np.uint8), value])
            posts.append((server, Request(Op.INIT, key.id, lo, hi, key.size,
                                          encode_dtype(key.dtype), 0, len(encoded),
                                          payload.size), payload))
        self._exchange(f"ps.init({name!r})", posts)
        self.keys[name] = key
        return self.pull(name)

    def push(self, name: str, grad: Any, lo: Any, hi: Any, compression: Any) -> None:
        key = self._key(name, "push")
        lo, hi = self._range(key, lo, hi, "push")
        grad = np.asarray(grad)
        what = f"ps.push({name!r})"
        if grad.dtype != key.dtype:
            raise TypeError(f"rank {self.rank}: {what}: gradient dtype {grad.dtype}, but "
                            f"the key holds {key.dtype}")
        if grad.size != hi - lo:
            raise ValueError(f"rank {self.rank}: {what}: {grad.size} values for elements "
                             f"[{lo}, {hi}) ({hi - lo})")
        if compression == "fp16" and key.dtype.kind != "f":
            raise TypeError(f"rank {self.rank}: {what}: fp16 compression needs a float "
                            f"key, not {key.dtype}")
        if not (compression in (None, "none", "fp16") or isinstance(compression, TopK)):
            raise ValueError(f"rank {self.rank}: {what}: compression must be None, 'fp16' "
                             f"or ps.TopK(density), got {compression!r}")
        flat = grad.reshape(-1)
        self.pushes += 1
        # Synchronous (max_delay=0): the servers hold the push until the iteration ends.
        held = self.done + 1 if self.max_delay == 0 else 0
        posts = []
        for server, a, b in key.overlapping(lo, hi):
            part = flat[a - lo:b - lo]
            codec, count = Codec.RAW, 0
            if compression == "fp16":
                codec, payload = Codec.FP16, as_bytes(part.astype(np.float16))
            elif isinstance(compression, TopK):
                codec, count, payload = Codec.TOPK, *self._top_k(key, a, b, part,
                                                                 compression.density)
            else:
                payload = as_bytes(part)
            posts.append((server, Request(Op.PUSH, key.id, a, b, key.size,
                                          encode_dtype(key.dtype), codec, count,
                                          payload.size, held, self.pushes), payload))
        self._exchange(what, posts)

    def _top_k(self, key: Key, a: int, b: int, part: np.ndarray, density: float
               ) -> tuple[int, np.ndarray]:
        if key.residual is None:
            key.residual = np.zeros(key.size, key.dtype)
        residual = key.residual[a:b]
        residual += part
        k = min(b - a, max(1, math.ceil(density * (b - a))))
        offsets = np.argpartition(np.abs(residual), (b - a) - k)[(b - a) - k:]
        values = residual[offsets].copy()
        residual[offsets] = 0
        return k, np.concatenate([as_bytes(offsets.astype(np.int64)), as_bytes(values)])

    def pull(self, name: str, lo: Any = None, hi: Any = None) -> np.ndarray:
        key = self._key(name, "pull")
        whole = lo is None and hi is None
        lo, hi = self._range(key, lo, hi, "pull")
        out = np.empty(hi - lo, key.dtype)
        parts = key.overlapping(lo, hi)
        posts: list[tuple[int, Request, np.ndarray | None]] = [
            (s, Request(Op.PULL, key.id, a, b, key.size, encode_dtype(key.dtype)), None)
            for s, a, b in parts]
        self._exchange(f"ps.pull({name!r})", posts,
                       [as_bytes(out[a - lo:b - lo]) for _, a, b in parts])
        return out.reshape(key.shape) if whole else out

    def clock(self) -> int:
        self.done += 1
        delay = -1 if self.max_delay is None else self.max_delay
        posts: list[tuple[int, Request, np.ndarray | None]] = [
            (s, Request(Op.CLOCK, 0, amount=self.done, extra=delay), None)
            for s in range(self.roles.servers)]
        return min(reply.value for _, reply in self._exchange("ps.clock", posts))

    def resume(self) -> None:
        """A replacement's start: go on from where the lost worker stopped (its clock and
        its pushes' numbers, which the servers know)."""
        posts: list[tuple[int, Request, np.ndarray | None]] = [
            (s, Request(Op.RESUME, 0), None) for s in range(self.roles.servers)]
        replies = self._exchange("ps.start", posts)
        self.done = max(reply.value for _, reply in replies)
        self.pushes = max(reply.extra for _, reply in replies)

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        posts: list[tuple[int, Request, np.ndarray | None]] = [
            (s, Request(Op.FINISH, 0), None) for s in range(self.roles.servers)]
        self._exchange("ps.finish", posts)
