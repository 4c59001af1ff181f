"""A checkpoint's state as bytes and back, without pickle: a JSON manifest of the keys,
dtypes and shapes (plain scalars inline) followed by the arrays' raw bytes.

State is what Rabit's ``CheckPoint`` takes: a dict of numpy arrays and plain scalars
(bool, int, float, str, None), keys being strings.  Anything else is refused with the
key that holds it, so nothing that would need pickling ever reaches the wire.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..transport.wire import DTYPE_CODES, DTYPES

_LENGTH = struct.Struct("<Q")
_SCALARS = (bool, int, float, str, type(None))


def check_state(state: Mapping[str, Any]) -> None:
    """Raise TypeError naming the first key whose value cannot be checkpointed."""
    if not isinstance(state, Mapping):
        raise TypeError(f"checkpoint state must be a dict of numpy arrays and plain "
                        f"scalars, got {type(state).__name__}")
    for key, value in state.items():
        if not isinstance(key, str):
            raise TypeError(f"checkpoint state keys must be str, got {key!r}")
        if isinstance(value, np.ndarray):
            if value.dtype not in DTYPE_CODES and \
                    value.dtype.newbyteorder("=") not in DTYPE_CODES:
                raise TypeError(f"checkpoint state {key!r}: dtype {value.dtype} is not one "
                                "totalreduce moves")
        elif isinstance(value, np.generic):
            continue
        elif not isinstance(value, _SCALARS):
            raise TypeError(f"checkpoint state {key!r} is a {type(value).__name__}: only "
                            "numpy arrays and bool, int, float, str or None are kept "
                            "(no pickling)")


def copy_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A copy that later changes to the caller's arrays do not reach."""
    check_state(state)
    return {k: (np.array(v, copy=True) if isinstance(v, np.ndarray | np.generic) else v)
            for k, v in state.items()}


def split(state: Mapping[str, Any] | None) -> tuple[bytes, list[np.ndarray]]:
    """``state`` (already checked) as a JSON manifest and its arrays, in the manifest's
    order: what travels in pieces, each array as itself (no copy into a buffer)."""
    if state is None:
        return json.dumps({"none": True}).encode(), []
    entries: list[list[Any]] = []
    arrays: list[np.ndarray] = []
    for key, value in state.items():
        if isinstance(value, np.ndarray | np.generic):
            arr = np.asarray(value)
            if not arr.flags.c_contiguous or not arr.dtype.isnative:
                arr = np.ascontiguousarray(arr, arr.dtype.newbyteorder("=")).reshape(arr.shape)
            entries.append([key, "array", int(DTYPE_CODES[arr.dtype]), list(arr.shape),
                            isinstance(value, np.generic)])
            arrays.append(arr)
        else:
            entries.append([key, "scalar", value])
    return json.dumps({"entries": entries}).encode(), arrays


def blanks(manifest: bytes) -> list[np.ndarray]:
    """Arrays to receive a state of ``manifest`` into."""
    entries = json.loads(manifest).get("entries", [])
    return [np.empty(tuple(e[3]), DTYPES[e[2]]) for e in entries if e[1] == "array"]


def join(manifest: bytes, arrays: list[np.ndarray]) -> dict[str, Any] | None:
    """The state of ``manifest`` and its ``arrays`` (taken, not copied)."""
    head = json.loads(manifest)
    if head.get("none"):
        return None
    state: dict[str, Any] = {}
    it = iter(arrays)
    for entry in head["entries"]:
        if entry[1] == "scalar":
            state[entry[0]] = entry[2]
            continue
        arr = next(it).reshape(tuple(entry[3]))
        state[entry[0]] = arr[()] if entry[4] else arr
    return state


def encode(state: Mapping[str, Any] | None) -> bytes:
    """``state`` (already checked) as one buffer: manifest length, manifest, array bytes."""
    head, arrays = split(state)
    return _LENGTH.pack(len(head)) + head + b"".join(a.tobytes() for a in arrays)


def decode(buf: bytes | memoryview) -> dict[str, Any] | None:
    view = memoryview(buf)
    (n,) = _LENGTH.unpack(view[:_LENGTH.size])
    head = bytes(view[_LENGTH.size:_LENGTH.size + n])
    at = _LENGTH.size + n
    arrays = []
    for blank in blanks(head):
        arrays.append(np.frombuffer(view[at:at + blank.nbytes], blank.dtype).copy())
        at += blank.nbytes
    return join(head, arrays)
