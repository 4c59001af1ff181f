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


def encode(state: Mapping[str, Any] | None) -> bytes:
    """``state`` (already checked) as one buffer: manifest length, manifest, array bytes."""
    if state is None:
        manifest: dict[str, Any] = {"none": True}
        blobs: list[bytes] = []
    else:
        entries = []
        blobs = []
        for key, value in state.items():
            if isinstance(value, np.ndarray | np.generic):
                arr = np.asarray(value)  # tobytes() writes C order whatever the layout
                entries.append([key, "array", int(DTYPE_CODES[arr.dtype.newbyteorder("=")]),
                                list(arr.shape), isinstance(value, np.generic)])
                blobs.append(arr.astype(arr.dtype.newbyteorder("="), copy=False).tobytes())
            else:
                entries.append([key, "scalar", value])
        manifest = {"entries": entries}
    head = json.dumps(manifest).encode()
    return _LENGTH.pack(len(head)) + head + b"".join(blobs)


def decode(buf: bytes | memoryview) -> dict[str, Any] | None:
    view = memoryview(buf)
    (n,) = _LENGTH.unpack(view[:_LENGTH.size])
    manifest = json.loads(bytes(view[_LENGTH.size:_LENGTH.size + n]))
    if manifest.get("none"):
        return None
    at = _LENGTH.size + n
    state: dict[str, Any] = {}
    for entry in manifest["entries"]:
        if entry[1] == "scalar":
            state[entry[0]] = entry[2]
            continue
        key, _kind, code, shape, scalar = entry
        dtype = DTYPES[code]
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        arr = np.frombuffer(view[at:at + nbytes], dtype=dtype).reshape(tuple(shape)).copy()
        at += nbytes
        state[key] = arr[()] if scalar else arr
    return state
