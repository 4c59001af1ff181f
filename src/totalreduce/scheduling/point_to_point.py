"""Point-to-point messages: ``send`` and ``recv`` between two ranks, carried by the
engine's self-guided headers like any collective.

A message is an op of two ranks.  Its identity is (hash of ``sender>receiver:tag``, n),
where n counts the earlier messages of that tag from the sender to the receiver; both
sides count.  So messages of one tag between two ranks are received in the order they
were sent (MPI's non-overtaking rule), messages of different tags are independent, and a
message sent before its receive is posted floats, under the floating cap, until it is.

A receive from any source does not know the identity in advance: it watches the bodies
that float here (``Engine.watch``) for the next message of its tag from any rank, claims
that sender's count, and then runs as a receive from that rank.  A receive from a named
source claims its count when it is posted; one from any source when a message is there.

The counters are a table of one entry per (peer, tag) in use, which cannot forget an
entry without the peer forgetting it too: tags are limited to ``0..TAG_UB`` (the range
MPI guarantees), which bounds the table to 2 x (size - 1) x (TAG_UB + 1) entries.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ..config import Config
from ..engine.engine import Engine
from ..engine.payload import OpFuture, OpSpec
from ..engine.schedule import COPY, Recv, Schedule, Send, piece_count, pieces
from ..lru import LRU
from ..transport.wire import Header, dtype_code
from .call_names import hash64
from .checks import check_array
from .handle import DoneHandle, FutureHandle, Handle

TAG_UB = 32767
_SCHEDULES = 256  # (peer, elements, itemsize, direction) -> schedule: sizes repeat


def _stream(src: int, dst: int, tag: int) -> int:
    """The name hash of the messages of ``tag`` from ``src`` to ``dst``."""
    return hash64(f"\x00message\x00{src}>{dst}\x00{tag}")


class PointToPoint:
    def __init__(self, engine: Engine, config: Config) -> None:
        self._engine = engine
        self.rank, self.size = engine.rank, engine.size
        self._seg_bytes = config.segment_bytes
        self._direct_bytes = config.direct_limit
        self._lock = threading.Lock()
        self._sent: dict[tuple[int, int], int] = {}      # (dest, tag) -> messages sent
        self._received: dict[tuple[int, int], int] = {}  # (source, tag) -> claimed
        self._schedules: LRU[tuple[int, int, int, bool], Schedule] = LRU(_SCHEDULES)

    def caller_waits(self) -> Any:
        """``with caller_waits():`` this thread waits for what it sends or receives
        inside, driving the engine itself meanwhile."""
        return self._engine.caller_waits()

    # --- checks ---------------------------------------------------------------------------

    def _peer(self, peer: Any, what: str, role: str) -> int:
        if not isinstance(peer, int | np.integer) or isinstance(peer, bool) \
                or not 0 <= peer < self.size:
            raise ValueError(f"rank {self.rank}: {what}: {role} {peer!r} is not a rank of "
                             f"this job (0..{self.size - 1})")
        if peer == self.rank:
            raise ValueError(f"rank {self.rank}: {what}: {role} is this rank itself; a "
                             "rank cannot send to itself (copy the array instead)")
        return int(peer)

    def _tag(self, tag: Any, what: str) -> int:
        if not isinstance(tag, int | np.integer) or isinstance(tag, bool) \
                or not 0 <= tag <= TAG_UB:
            raise ValueError(f"rank {self.rank}: {what}: tag must be an int in "
                             f"0..{TAG_UB}, got {tag!r}")
        return int(tag)

    # --- ops ------------------------------------------------------------------------------

    def _schedule(self, peer: int, count: int, itemsize: int, sending: bool) -> Schedule:
        key = (peer, count, itemsize, sending)
        schedule = self._schedules.get(key)
        if schedule is None:
            parts = pieces(0, count, piece_count(count, self._seg_bytes // itemsize))
            if sending:
                schedule = Schedule(tuple(Send(peer, 0, j, lo, hi)
                                          for j, (lo, hi) in enumerate(parts)), {}, ())
            else:
                schedule = Schedule((), {(peer, 0, j): Recv(lo, hi, COPY, True, ())
                                         for j, (lo, hi) in enumerate(parts)}, ())
            self._schedules.put(key, schedule)
        return schedule

    def _spec(self, src: int, dst: int, tag: int, seq: int, work: np.ndarray,
              label: str) -> OpSpec:
        # What the two ranks must agree on: the sig is the hash of the view (the engine
        # compares it), so a size or dtype that differs is a mismatch naming both ranks.
        view = {"kind": "message", "dtype": str(work.dtype), "count": int(work.size),
                "tag": tag, "from": src, "to": dst}
        sending = src == self.rank
        peer = dst if sending else src
        schedule = self._schedule(peer, work.size, work.dtype.itemsize, sending)
        sig = hash64(f"{work.dtype}\x00{work.size}\x00{tag}")
        return OpSpec((_stream(src, dst, tag), seq), label, sig, dtype_code(work.dtype),
                      work.size, view, schedule, work, ranks=(min(src, dst), max(src, dst)))

    def _launch(self, spec: OpSpec, finish: Any) -> Handle:
        engine = self._engine
        if self._direct_bytes and spec.work.nbytes <= self._direct_bytes \
                and engine.waits_here():
            ran = engine.run_now(spec)
            if ran is True:
                return DoneHandle(finish(), spec.label)
            if ran is not False:
                return FutureHandle([ran], finish, spec.label)
        return FutureHandle([engine.submit(spec)], finish, spec.label)

    def send(self, x: Any, dest: Any, tag: Any) -> Handle:
        """Send ``x`` to ``dest``; the handle is done once ``x`` may be reused."""
        what = "send"
        arr = check_array(x, what, None)
        dest = self._peer(dest, what, "dest")
        tag = self._tag(tag, what)
        if self._engine.waits_here() and arr.flags.c_contiguous:
            work = arr.reshape(-1)  # the caller blocks: the message may read its array
        else:
            work = np.array(arr, copy=True, order="C").reshape(-1)
        with self._lock:
            seq = self._sent.get((dest, tag), 0)
            self._sent[(dest, tag)] = seq + 1
        label = f"send to rank {dest} (tag {tag}, message #{seq})"
        return self._launch(self._spec(self.rank, dest, tag, seq, work, label), lambda: None)

    def recv(self, buf: Any, source: Any, tag: Any) -> Handle:
        """Receive into ``buf`` (an array, or ``(shape, dtype)`` to allocate one) from
        ``source`` (None: any rank).  The handle's ``wait()`` returns the array, or
        ``(array, source)`` when the source was not named."""
        what = "recv"
        out = self._buffer(buf)
        tag = self._tag(tag, what)
        if out.flags.c_contiguous and out.flags.writeable:
            work, copy_back = out.reshape(-1), False
        else:
            if not out.flags.writeable:
                raise ValueError(f"rank {self.rank}: recv: the buffer is read-only")
            work, copy_back = np.empty(out.size, out.dtype), True

        def finish() -> np.ndarray:
            if copy_back:
                out[...] = work.reshape(out.shape)
            return out

        if source is not None:
            src = self._peer(source, what, "source")
            with self._lock:
                seq = self._received.get((src, tag), 0)
                self._received[(src, tag)] = seq + 1
            return self._launch(self._recv_spec(src, tag, seq, work), finish)
        return self._recv_any(tag, work, finish)

    def _recv_spec(self, src: int, tag: int, seq: int, work: np.ndarray) -> OpSpec:
        return self._spec(src, self.rank, tag, seq, work,
                          f"recv from rank {src} (tag {tag}, message #{seq})")

    def _buffer(self, buf: Any) -> np.ndarray:
        if isinstance(buf, tuple) and len(buf) == 2 and not isinstance(buf[0], np.ndarray):
            shape, dtype = buf
            try:
                out = np.empty(shape, dtype)
            except (TypeError, ValueError) as exc:
                raise TypeError(f"rank {self.rank}: recv: (shape, dtype) {buf!r} does not "
                                f"describe an array: {exc}") from None
            return check_array(out, "recv", None)
        if not isinstance(buf, np.ndarray):
            raise TypeError(f"rank {self.rank}: recv: buf must be a numpy array or a "
                            f"(shape, dtype) pair, got {type(buf).__name__}")
        return check_array(buf, "recv", None)

    def _recv_any(self, tag: int, work: np.ndarray, finish: Any) -> Handle:
        """Wait for the next message of ``tag`` from any rank, then receive it."""
        rank = self.rank
        streams = {_stream(src, rank, tag): src for src in range(self.size) if src != rank}
        found: list[tuple[int, int]] = []

        def match(sender: int, header: Header) -> bool:
            if streams.get(header.name_key) != sender:
                return False
            with self._lock:
                if header.seq != self._received.get((sender, tag), 0):
                    return False  # a later message, or one a named receive claimed
                self._received[(sender, tag)] = header.seq + 1
            found.append((sender, header.seq))
            return True

        label = f"recv from any rank (tag {tag})"
        engine = self._engine
        watch = engine.watch(match, streams.values(), label)

        def result() -> tuple[np.ndarray, int]:
            return finish(), found[0][0]

        if engine.waits_here():
            FutureHandle([watch], lambda: None, label).wait()
            src, seq = found[0]
            return self._launch(self._recv_spec(src, tag, seq, work), result)
        outer = OpFuture(engine.wait)

        def start(f: OpFuture) -> None:
            if f.error() is not None:
                outer.resolve(f.error())
                return
            src, seq = found[0]
            try:
                op = engine.submit(self._recv_spec(src, tag, seq, work))
            except BaseException as exc:  # Ctrl-C on a callback's thread: the op cannot go on
                outer.resolve(exc)
                return
            op.add_done_callback(lambda s: outer.resolve(s.error()))

        watch.add_done_callback(start)
        return FutureHandle([outer], result, label)
