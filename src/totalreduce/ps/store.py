"""What a server holds of the keys: a store of shares (its own range of every key, or its
predecessor's copy of theirs), the pushes held until their iteration ends, and the
store as bytes for a replacement server (through the checkpoint codec: no pickle)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..recovery.codec import check_state, decode, encode


@dataclass
class Share:
    """One server's elements [lo, hi) of one key."""
    name: str
    dtype: np.dtype
    size: int
    lo: int
    hi: int
    first: int  # the worker whose init made the key here
    weights: np.ndarray | None = None  # until worker 0's init brings the value
    waiting: list[int] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)
    scratch: np.ndarray | None = None
    # Each worker's last push (Request.seq) taken here: one sent again is not applied.
    last: dict[int, int] = field(default_factory=dict)


@dataclass
class Held:
    """A push taken at max_delay=0 and applied when every worker has finished ``t``."""
    key: int
    grad: np.ndarray
    t: int
    worker: int


class Store:
    def __init__(self) -> None:
        self.keys: dict[int, Share] = {}
        self.held: list[Held] = []

    def encode(self, done: list[int], finished: set[int]) -> bytes:
        """The store (without who waits for what: waiters ask again after a rebuild),
        and the server's clocks."""
        state: dict[str, Any] = {"done": np.array(done, np.int64),
                                 "finished": np.array(sorted(finished), np.int64),
                                 "keys": len(self.keys), "held": len(self.held)}
        for i, (key, share) in enumerate(self.keys.items()):
            p = f"k{i}."
            state.update({p + "key": key, p + "name": share.name, p + "dtype": share.dtype.str,
                          p + "size": share.size, p + "lo": share.lo, p + "hi": share.hi,
                          p + "first": share.first, p + "weights": share.weights,
                          p + "last": np.array(sorted(share.last.items()),
                                               np.int64).reshape(-1, 2),
                          p + "state": ",".join(sorted(share.state))})
            for name, value in share.state.items():
                state[f"{p}s.{name}"] = value
        for j, held in enumerate(self.held):
            state.update({f"h{j}.key": held.key, f"h{j}.grad": held.grad,
                          f"h{j}.t": held.t, f"h{j}.worker": held.worker})
        try:
            check_state(state)
        except TypeError as exc:
            raise TypeError(f"a parameter server's state cannot be copied to a replacement: "
                            f"{exc} (an updater's state must hold numpy arrays and plain "
                            "scalars)") from None
        return encode(state)

    @classmethod
    def decode(cls, data: bytes) -> tuple[Store, list[int], set[int]]:
        """A store, the clocks (iterations each worker had finished) and the workers that
        had finished, from :meth:`encode`'s bytes."""
        state = decode(data)
        assert state is not None
        store = cls()
        for i in range(state["keys"]):
            p = f"k{i}."
            weights = state[p + "weights"]
            share = Share(state[p + "name"], np.dtype(state[p + "dtype"]), state[p + "size"],
                          state[p + "lo"], state[p + "hi"], state[p + "first"],
                          None if weights is None else np.array(weights))
            share.last = {int(w): int(s) for w, s in state[p + "last"]}
            names = state[p + "state"]
            share.state = {name: state[f"{p}s.{name}"] for name in names.split(",") if name}
            store.keys[state[p + "key"]] = share
        for j in range(state["held"]):
            store.held.append(Held(state[f"h{j}.key"], np.array(state[f"h{j}.grad"]),
                                   state[f"h{j}.t"], state[f"h{j}.worker"]))
        return store, [int(d) for d in state["done"]], {int(w) for w in state["finished"]}

    def forget_unfinished(self, worker: int, done: int) -> int:
        """A lost ``worker``'s replacement goes on after its ``done`` iterations: the
        pushes held from the iteration it did not finish go (it pushes them again).
        Returns its last push's number, which the replacement counts on from."""
        self.held = [h for h in self.held if h.worker != worker or h.t < done]
        return max((share.last.get(worker, 0) for share in self.keys.values()), default=0)
